"""Pools hold memory: device and pinned-host KV, Mamba state and sidecar pools (the DSA indexer,
DeepSeek V4's compressed KV and compressor states), the index-only logical FULL pool, and the page
allocators whose books the tree keeps."""
