"""Tests of kvtier.runtime.tree.components: SWA and MAMBA behaviour on the tree."""
