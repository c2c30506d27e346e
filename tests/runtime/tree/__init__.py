"""Tests of kvtier.runtime.tree: the unified radix tree, through the tree API alone."""
