"""Benchmarks and profiling sessions; run each as a module from the repository root
(``python3 -m profiling.bench_tree``). Shared timing and reporting live in ``common.py``."""
