"""Tests of kvtier.runtime.pools: device, host, Mamba and indexer pools, and the allocators."""
