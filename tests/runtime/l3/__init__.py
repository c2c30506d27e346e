"""Tests of kvtier.runtime.l3: backup to and prefetch from a storage backend, with TP agreement."""
