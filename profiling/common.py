"""What every benchmark shares: timing, GB/s, percentiles and the environment header.

- ``median_ms`` / ``samples_ms``: time a callable. On a GPU through ``triton.testing.do_bench``
  (CUDA events, the L2 cache flushed between calls); on a CPU with ``time.perf_counter`` over the
  same warm-up and measuring budgets. ``wall_samples_s`` times whole runs end to end (a CUDA
  synchronize on both sides), for what includes host work.
- ``gbs``: bandwidth from the bytes a call moved and its time.
- ``percentiles``, ``median``: the 20th/50th/80th (or any) percentiles of samples, linearly
  interpolated.
- ``environment`` / ``header_lines``: GPU or CPU name, torch/triton/CUDA/Python versions, the date
  and the command line, as a dict (for JSON) and as the Markdown lines every report starts with.

Run the benchmarks as modules from the repository root (``python3 -m profiling.bench_tree``):
none of them edits ``sys.path``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch

QUANTILES = (20, 50, 80)
# A CPU call too fast for the clock would otherwise be repeated without bound.
MAX_CPU_CALLS = 10_000


def gbs(nbytes: int, ms: float) -> float:
    """GB/s (10^9 bytes a second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def percentiles(samples: Iterable[float], qs: Sequence[float] = QUANTILES) -> dict[float, float]:
    """``{q: value}`` for each percentile ``q`` in [0, 100], interpolated between closest ranks."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("samples: need at least one sample, got none")
    out = {}
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"qs: percentile {q} outside [0, 100]")
        pos = (len(xs) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        out[q] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def median(samples: Iterable[float]) -> float:
    return percentiles(samples, (50,))[50]


def _cuda() -> bool:
    return torch.cuda.is_available()


def samples_ms(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 100) -> list[float]:
    """Per-call times (ms) of ``fn``: ``warmup_ms`` of calls untimed, then ``rep_ms`` of timed ones."""
    if _cuda():
        from triton.testing import do_bench

        return list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
    t0 = time.perf_counter()
    fn()  # the first call also tells how many calls fit the budgets
    est_ms = max((time.perf_counter() - t0) * 1e3, 1e-6)
    for _ in range(min(MAX_CPU_CALLS, max(0, math.ceil(warmup_ms / est_ms) - 1))):
        fn()
    out = []
    for _ in range(min(MAX_CPU_CALLS, max(1, math.ceil(rep_ms / est_ms)))):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def median_ms(fn: Callable[[], object], warmup_ms: float = 10, rep_ms: float = 100) -> float:
    """Median time (ms) of one call of ``fn`` (see ``samples_ms``)."""
    if _cuda():
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return median(samples_ms(fn, warmup_ms, rep_ms))


def sync() -> None:
    """Wait for the GPU, where there is one: wall-clock spans then cover the device work."""
    if _cuda():
        torch.cuda.synchronize()


def wall_samples_s(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall-clock seconds of ``reps`` whole calls of ``fn``, each between two synchronizes."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    """The command as typed (``python3 -m profiling.bench_tree --requests 500``)."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    argv[0] = os.path.basename(argv[0])  # the interpreter's name, not where it is installed
    return shlex.join(argv)


def environment() -> dict:
    """Where and when a benchmark ran: the keys every report's JSON ``info`` holds."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_properties(0).name if _cuda() else None,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if _cuda() else None,
        "cpu": f"{cpu_name()}, {platform.machine()}",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
    }


def header_lines(info: dict) -> list[str]:
    """The Markdown bullet lines of ``environment()``: what ran where, when, and how."""
    gpu = f"{info['gpu']} ({info['sms']} SMs)" if info["gpu"] else "none"
    return [
        f"- GPU: {gpu}; CPU: {info['cpu']}",
        (
            f"- Software: torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, "
            f"Python {info['python']}"
        ),
        f"- Date: {info['date']}",
        f"- Command: `{info['command']}`",
    ]
