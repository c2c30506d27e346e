"""CPU µs to enqueue a layer's copy of a few large contiguous chunks (a 7K-token load of one
page run: one 14 MiB chunk per K and V buffer), by each call that can enqueue it: one
``cudaMemcpyBatchAsync`` of the chunks, a ``cudaMemcpyAsync`` per chunk (ctypes into torch's
libcudart), and torch's ``copy_(non_blocking=True)`` per chunk. Hot (back to back, each copy
waited for untimed) and after the CPU's caches were flushed (a 256 MiB pass between calls).

    python3 -m profiling.copy_call_cpu        # needs a CUDA GPU
"""

from __future__ import annotations

import ctypes
import statistics
import time

import numpy as np
import torch

from kvtier.kernels import copy_engine as ce
from profiling.common import environment, header_lines


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("copy_call_cpu needs a CUDA GPU")
    chunk, n = 14 << 20, 2
    host = torch.empty(n * chunk, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n * chunk, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    sid = stream.cuda_stream
    src = np.array([host.data_ptr() + i * chunk for i in range(n)], dtype=np.int64)
    dst = np.array([dev.data_ptr() + i * chunk for i in range(n)], dtype=np.int64)
    sizes = np.full(n, chunk, dtype=np.int64)
    lib, _ = ce._torch_cudart()
    one = lib.cudaMemcpyAsync
    one.restype = ctypes.c_int
    one.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    pairs = [(int(d), int(s), int(z)) for d, s, z in zip(dst, src, sizes)]
    host_parts = [host[i * chunk : (i + 1) * chunk] for i in range(n)]
    dev_parts = [dev[i * chunk : (i + 1) * chunk] for i in range(n)]
    junk = np.ones(32 << 20)

    def batch() -> None:
        ce.memcpy_batch(dst, src, sizes, sid)

    def per_chunk() -> None:
        for d, s, z in pairs:
            if one(d, s, z, 4, sid):
                raise RuntimeError("cudaMemcpyAsync failed")

    def torch_copy() -> None:
        with torch.cuda.stream(stream):
            for d, s in zip(dev_parts, host_parts):
                d.copy_(s, non_blocking=True)

    rows = []
    for name, fn in (
        ("cudaMemcpyBatchAsync, 2 descriptors", batch),
        ("cudaMemcpyAsync x 2 (ctypes)", per_chunk),
        ("torch copy_(non_blocking) x 2", torch_copy),
    ):
        for cold in (False, True):
            ts = []
            for _ in range(40):
                stream.synchronize()
                if cold:
                    junk.sum()
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            stream.synchronize()
            assert torch.equal(dev[:: 1 << 20].cpu(), host[:: 1 << 20])
            rows.append((name, "cold" if cold else "hot", statistics.median(ts[2:]) * 1e6))
    lines = ["# CPU to enqueue one layer's copy of 2 contiguous 14 MiB chunks", "",
             *header_lines(environment()), "", "| call | caches | µs (median of 38) |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c:.1f} |" for a, b, c in rows]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
