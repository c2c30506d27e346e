"""The unified radix tree: FULL, SWA and MAMBA components on one prefix tree, with pins,
eviction, host-tier books and integrity checks."""
