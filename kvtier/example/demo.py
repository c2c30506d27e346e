"""``kvtier demo``: a multi-user, multi-turn chat workload through all three tiers.

Users share a system prompt and each holds a conversation of several turns; their turns are
interleaved. The device pool holds a few conversations, the host pool (``host_ratio`` times the
device pool, as a serving deployment sizes it) holds more, and there are enough users that the
host overflows too: a user's earlier turns are then evicted from host and come back from the L3
file store, read to host by a prefetch before the request is matched. Every answer (greedy tokens
and logits) is compared with a cold run of the same model that uses no cache.

Hits are set against the *reusable bound* (:func:`reusable_bound`): what a cache of unlimited
size would have served for the same trace under the same rules of reuse.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from kvtier.example.config import HybridModelConfig
from kvtier.example.model import HybridModel
from kvtier.example.runner import CachedRunner
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import WRITE_POLICIES, CacheConfig, StorageConfig

try:  # an optional nicety: the demo runs the same without it
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

__all__ = ["DemoConfig", "DemoResult", "Turn", "reusable_bound", "run_demo"]

_STEP_WAIT_S = 0.05  # longest a scheduler step blocks on the L3 threads before polling again


class Turn(NamedTuple):
    """One request of a trace: its prompt, the tokens it generated, and its cache namespace."""

    prompt: Sequence[int]
    answer: Sequence[int]
    namespace: Hashable = None


def reusable_bound(trace: Sequence[Turn], page_size: int, mamba: bool) -> list[int]:
    """Per request, the prompt tokens a cache of unlimited size would serve.

    Replays ``trace`` in order against a set of cached ``(namespace, token prefix)`` states,
    under the rules the cache keeps however large it is:

    - the tree keys whole pages, so a hit is a multiple of ``page_size``;
    - at least the last prompt token is recomputed (there must be logits to sample from);
    - a finished request caches its prompt and all but the last generated token (that one was
      never fed back), cut to whole pages;
    - with Mamba layers (``mamba=True``) a prefix is reusable only where a state was kept: the
      cache checkpoints the state at page boundaries and a finished request keeps the one at its
      last page boundary, so each request adds one reusable prefix, not one per page.
    """
    P = page_size
    if P < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    cached: set[tuple[Hashable, tuple[int, ...]]] = set()
    hits = []
    for turn in trace:
        prompt = list(turn.prompt)
        top = max(0, len(prompt) - 1) // P * P
        hit = next(
            (n for n in range(top, 0, -P) if (turn.namespace, tuple(prompt[:n])) in cached), 0
        )
        hits.append(hit)
        seq = prompt + list(turn.answer)[:-1]
        aligned = len(seq) // P * P
        ends = [aligned] if mamba else range(P, aligned + 1, P)
        cached.update((turn.namespace, tuple(seq[:n])) for n in ends if n > 0)
    return hits


def _default_model() -> HybridModelConfig:
    # Wide enough that the model's arithmetic, not the launch of its ~400 small ops per forward,
    # dominates on a CPU core (so a GPU runs the demo faster), yet ~20 s on one CPU core.
    return HybridModelConfig(
        layer_kinds=("full", "swa", "mamba", "full"),
        swa_window=16,
        hidden=512,
        q_heads=8,
        kv_heads=2,
        head_dim=64,
        ffn=1024,
        mamba_heads=8,
        mamba_head_dim=64,
        mamba_state=16,
    )


@dataclass(frozen=True)
class DemoConfig:
    """The workload and the cache around it.

    Attributes:
        users, turns: conversations and turns per conversation (interleaved by turn).
        answer_tokens: greedy tokens generated per turn.
        system_tokens: the shared system prompt's length.
        message_tokens: a user message's length cycles through these.
        model: the example model (its layer kinds pick the cache's components).
        page_size, device_tokens: the cache's page and FULL device pool size (tokens).
        host_ratio: the host pool's size over the device pool's.
        l3: add a file store as L3 (in a temporary directory) and prefetch before each request.
        write_policy: the cache's write policy.
        device: where the model and the device pools live (None: CUDA if available).
        check_integrity: recount the cache's books after every request (slower).
        compare_cold: also run every prompt cold and compare tokens and logits.
    """

    users: int = 24
    turns: int = 4
    answer_tokens: int = 8
    system_tokens: int = 32
    message_tokens: tuple[int, ...] = (16, 24, 32)
    model: HybridModelConfig = field(default_factory=_default_model)
    page_size: int = 16
    device_tokens: int = 512
    host_ratio: float = 2.0
    l3: bool = True
    write_policy: str = "write_through"
    device: str | None = None
    seed: int = 0
    check_integrity: bool = False
    compare_cold: bool = True

    def __post_init__(self) -> None:
        for name in ("users", "turns", "answer_tokens", "page_size", "device_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")
        if not self.message_tokens or min(self.message_tokens) < 1:
            raise ValueError(f"message_tokens: need lengths >= 1, got {self.message_tokens}")
        if self.host_ratio < 1:
            raise ValueError(f"host_ratio must be >= 1, got {self.host_ratio}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: unknown {self.write_policy!r}; choose from {WRITE_POLICIES}"
            )


@dataclass
class DemoResult:
    """What a demo run measured.

    Attributes:
        requests: requests run.
        identical: every answer equalled the cold run's (True when not compared).
        prompt_tokens: prompt tokens over all requests.
        bound_tokens: the reusable bound (:func:`reusable_bound`) of the trace.
        device_hits, host_hits: prompt tokens served from device, and loaded back from host.
        storage_hits: prompt tokens read from L3 to host by a prefetch and then served (they are
            also counted in ``host_hits``: L3 pages reach the device through the host).
        metrics: the cache's ``metrics()`` at the end.
        seconds: wall time of the workload.
    """

    requests: int
    identical: bool
    prompt_tokens: int
    bound_tokens: int
    device_hits: int
    host_hits: int
    storage_hits: int
    metrics: dict
    seconds: float

    @property
    def hit_tokens(self) -> int:
        return self.device_hits + self.host_hits

    @property
    def share_of_bound(self) -> float:
        return self.hit_tokens / self.bound_tokens if self.bound_tokens else 1.0


def run_demo(
    config: DemoConfig | None = None,
    progress: bool = True,
    out: Callable[[str], None] = print,
    **overrides,
) -> DemoResult:
    """Run the workload of ``config`` and print what each tier served (through ``out``).

    ``overrides`` replace fields of ``config`` (or of the default one): ``run_demo(users=3)``.
    """
    config = replace(config or DemoConfig(), **overrides)
    if not config.l3:
        return _run(config, None, progress, out)
    with tempfile.TemporaryDirectory(prefix="kvtier-l3-") as root:
        return _run(config, root, progress, out)


def _cache_config(c: DemoConfig, device: str, l3_root: str | None) -> CacheConfig:
    mc, kinds = c.model, set(c.model.layer_kinds)
    storage = None
    if l3_root is not None:
        storage = StorageConfig(
            backend="file",
            backend_config={"root": l3_root},
            prefetch_min_tokens=c.page_size,
            prefetch_policy="wait_complete",
        )
    return CacheConfig(
        layer_kinds=mc.layer_kinds,
        kv_heads=mc.kv_heads,
        head_dim=mc.head_dim,
        page_size=c.page_size,
        device_tokens=c.device_tokens,
        dtype=mc.dtype,
        swa_window=mc.swa_window if "swa" in kinds else None,
        mamba=mc.mamba_spec() if "mamba" in kinds else None,
        # Each running request holds two state slots (live and checkpoint); the rest cache.
        mamba_slots=max(4, c.device_tokens // (4 * c.page_size)) if "mamba" in kinds else None,
        host_ratio=c.host_ratio,
        write_policy=c.write_policy,
        device=device,
        model_id=f"kvtier-demo-{c.seed}",
        storage=storage,
    )


def _run(c: DemoConfig, l3_root: str | None, progress: bool, out) -> DemoResult:
    device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
    mc = c.model
    model = HybridModel(mc, device=device)
    cfg = _cache_config(c, device, l3_root)
    cache = TieredKVCache(cfg)
    runner = CachedRunner(model, cache)
    gen = torch.Generator().manual_seed(c.seed)
    system = torch.randint(0, mc.vocab, (c.system_tokens,), generator=gen).tolist()
    history = [system + [u % mc.vocab] for u in range(c.users)]
    out(
        f"kvtier demo: {c.users} users x {c.turns} turns, model {'+'.join(mc.layer_kinds)} on "
        f"{device}; page {c.page_size}, device pool {cfg.device_tokens} tokens, host "
        f"{cfg.host_kv_tokens} ({cfg.ratio:g}x), {c.write_policy}, L3 "
        f"{'file store in ' + l3_root if l3_root else 'off'}"
    )
    total = c.users * c.turns
    bar = tqdm(total=total, unit="req", leave=False) if progress and tqdm is not None else None
    trace: list[Turn] = []
    identical = True
    device_hits = host_hits = storage_hits = 0
    t0 = time.perf_counter()
    try:
        turns_done = [0] * c.users
        for u in _schedule(c.users, c.turns, gen):
            turn = turns_done[u]
            turns_done[u] += 1
            n = c.message_tokens[(u + turn) % len(c.message_tokens)]
            prompt = history[u] + torch.randint(0, mc.vocab, (n,), generator=gen).tolist()
            _prefetch(cache, prompt)
            got = runner.generate(prompt, c.answer_tokens)
            req = runner.last_request
            if c.check_integrity:
                cache.check_integrity()
            if c.compare_cold:
                cold = model.generate_cold(prompt, c.answer_tokens)
                identical &= got.tokens == cold.tokens and torch.equal(got.logits, cold.logits)
            device_hits += req.device_hit
            host_hits += req.host_hit
            storage_hits += req.storage_hit  # the part of the L3 read it was served
            trace.append(Turn(prompt, got.tokens))
            history[u] = prompt + got.tokens
            if bar is not None:
                bar.update()
                bar.set_postfix_str(
                    f"user {u} turn {turn}: {req.device_hit}D+{req.host_hit}H/{len(prompt)}"
                )
        cache.drain()
        cache.check_integrity()
        metrics = cache.metrics()
    finally:
        if bar is not None:
            bar.close()
        cache.close()
    seconds = time.perf_counter() - t0
    bound = sum(reusable_bound(trace, c.page_size, "mamba" in mc.layer_kinds))
    res = DemoResult(
        total,
        identical,
        sum(len(t.prompt) for t in trace),
        bound,
        device_hits,
        host_hits,
        storage_hits,
        metrics,
        seconds,
    )
    _report(res, l3_root is not None, c.compare_cold, device, out)
    return res


def _schedule(users: int, turns: int, gen: torch.Generator) -> list[int]:
    """The order users speak in: each next turn goes to a user with turns left, drawn with
    weight ``1 / (rank + 1)``, so a few users chat in bursts (their turns find the device still
    holding them), others come back after a while (host) or much later (L3)."""
    left = torch.full((users,), turns, dtype=torch.int64)
    weight = 1.0 / torch.arange(1, users + 1, dtype=torch.float64)
    order = []
    for _ in range(users * turns):
        u = int(torch.multinomial(weight * (left > 0), 1, generator=gen))
        left[u] -= 1
        order.append(u)
    return order


def _prefetch(cache: TieredKVCache, prompt: list[int]) -> None:
    """Read what only L3 holds of ``prompt`` back to host."""
    pf = cache.prefetch(prompt)
    while pf is not None and not pf.done:
        # One scheduler step: wake when a background L3 step finishes (or after a short wait),
        # then let the cache act on it.
        cache.l3.wait_some(_STEP_WAIT_S)
        cache.poll()


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}%" if whole else "    -"


def _report(r: DemoResult, l3: bool, compared: bool, device: str, out) -> None:
    m, prompt = r.metrics, r.prompt_tokens
    out(f"prompt tokens            {prompt:6d}")
    out(
        f"reusable bound           {r.bound_tokens:6d} {_pct(r.bound_tokens, prompt)} of prompt "
        "tokens (an unlimited cache: whole pages, last token recomputed, Mamba states only "
        "where a request ended)"
    )
    out(f"hit tokens, device       {r.device_hits:6d} {_pct(r.device_hits, prompt)}")
    out(
        f"hit tokens, host         {r.host_hits:6d} {_pct(r.host_hits, prompt)} (loaded back H->D, "
        "storage hits included)"
    )
    out(
        f"hit tokens, storage      {r.storage_hits:6d} {_pct(r.storage_hits, prompt)} (read from "
        "L3 to host by a prefetch, then served; also counted as host hits)"
    )
    out(
        f"hit tokens, all tiers    {r.hit_tokens:6d} {_pct(r.hit_tokens, prompt)} = "
        f"{100 * r.share_of_bound:.1f}% of the reusable bound"
    )
    if l3:
        outcomes = ", ".join(
            f"{int(m[f'tier.prefetch.{o}'])} {o}"
            for o in ("complete", "partial", "revoked", "timed_out")
            if m[f"tier.prefetch.{o}"]
        )
        reasons = ", ".join(
            f"{int(v)} {k.removeprefix('l3.prefetch_revoked_')}"
            for k, v in m.items()
            if k.startswith("l3.prefetch_revoked_") and v
        )
        cut = int(m.get("l3.prefetch_cut_host_capacity", 0))
        out(
            f"L3 prefetches            {outcomes or 'none'}; {cut} cut for host room"
            + (
                f"\n  revoked: {reasons} (below_threshold: L3 held less than a page beyond the "
                "cached prefix, such as a new message)"
                if reasons
                else ""
            )
        )
        wb, rb = m["tier.bytes.storage.write"], m["tier.bytes.storage.read"]
        out(
            f"L3 written / read        {wb / 2**20:.2f} / {rb / 2**20:.2f} MiB, "
            f"{m['tier.gbps.storage.write']:.3g} / {m['tier.gbps.storage.read']:.3g} GB/s"
        )
    out(f"evicted from device      {m['evicted_tokens']} tokens")
    timer = "CUDA events" if torch.device(device).type == "cuda" else "host clock"
    for name, d, ops in (
        ("backed up D->H", "d2h", "backups"),
        ("loaded back H->D", "h2d", "loads"),
    ):
        n = max(1, m[ops])
        out(
            f"{name:<25}{m[f'{d}_bytes'] / 2**20:.2f} MiB in {m[ops]} {ops} "
            f"({m[f'{d}_bytes'] / n / 2**10:.0f} KiB each): copies {m[f'{d}_gbps']:.3g} GB/s over "
            f"their own {1e3 * m[f'{d}_seconds']:.1f} ms ({timer}); submit to ack "
            f"{m[f'{d}_ack_ms_mean']:.2f} ms mean"
        )
    verdict = ("yes" if r.identical else "NO") if compared else "not compared"
    out(
        f"outputs equal a cold run with no cache: {verdict} ({r.requests} requests, tokens and "
        f"logits bit for bit) in {r.seconds:.1f}s"
    )
