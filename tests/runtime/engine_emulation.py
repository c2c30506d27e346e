"""The copy engine emulated on the CPU for runtime tests: batches run as memmoves."""

from __future__ import annotations

import ctypes
import threading

from kvtier.kernels import copier as copier_mod
from kvtier.kernels import dispatch
from kvtier.kernels.copy_engine import EngineSupport


def auto_engine(monkeypatch, inline: int = 0) -> list[str]:
    """The copy engine 'available' (batches run as memmoves) and ``auto`` taking it for any
    size; batches of more than ``inline`` descriptors are enqueued by the worker and loads get
    a kernel lead layer (0: every batch). Call it before the cache is made: its copiers probe
    the engine once. Returns the threads that issued batches."""
    threads: list[str] = []

    def batch(dsts, srcs, sizes, stream):
        threads.append(threading.current_thread().name)
        for d, s, n in zip(dsts, srcs, sizes):
            ctypes.memmove(int(d), int(s), int(n))

    monkeypatch.setattr(copier_mod, "engine_support", lambda device: EngineSupport(True))
    monkeypatch.setattr(copier_mod, "memcpy_batch", batch)
    for d in ("d2h", "h2d"):
        crossover = dispatch.Crossover(1, 1, 10**9, inline_descriptors=inline)
        monkeypatch.setitem(dispatch.CROSSOVERS, d, crossover)
    return threads
