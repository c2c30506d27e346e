"""Pools hold memory: device and pinned-host KV, Mamba state and DSA indexer pools, and the page
allocators whose books the tree keeps."""
