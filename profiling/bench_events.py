"""KV events: their cost per scheduler step, and the event rates publisher and indexer sustain.

Step overhead: two caches built alike (FULL layers, P = 16, write_through, host pool twice the
device pool), one publishing events and one not, are filled with the same requests to ~1,000
and ~100,000 cached device pages (as many again on host); then each runs the same steady-state
steps, interleaved: a new 128-token request (8 pages: match, reserve, computed, insert, backed
up at once), the eviction that makes room for it (device pages demoted, host pages dropped), and
``poll()`` (which acknowledges the backup and, with events, queues the step's batch for the
publisher thread). Between steps, untimed, the publisher thread is let run until it has sent the
batch (``drain``): in an engine it runs while the GPU computes the next step; in the last row
(``concurrent``) it competes with the steps for the GIL instead (its 5 ms wake-ups included).
Reported:

- the step's median time with and without events, and ``poll()``'s median without events;
- the events' own time per step on the scheduler thread, measured inside the sink (every hook
  and the flush, timed directly: an A/B difference of whole steps is too noisy for
  microseconds), raw (the timer's own share counted in) and net of the timer's share measured
  on an empty hook, of which page hashing done there;
- the publisher thread's CPU time per step (resolve against the mirror, hash what the hooks
  deferred, build, encode, send), of which page hashing: off the scheduler thread, but CPU all
  the same, and under the GIL;
- an idle step: ``poll()`` with nothing to report, with and without events.

Throughput: the publisher thread (resolve the hooks' records against the mirror, build, encode,
send) over batches of 64 BlockStored events of 4 pages each, and a subscribing ``Indexer`` in the
same process (receive, decode, apply), in events and pages per second.

    python3 -m profiling.bench_events --out profiling/results
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import threading
import time
import warnings
from collections import defaultdict

import torch

from kvtier.events import EventsConfig, Indexer
from kvtier.events import nodes as nodes_module
from kvtier.events.mirror import STORED
from kvtier.events.sink import EventSink
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, KVTierConfigWarning
from profiling.common import environment, header_lines

P = 16
REQ_TOKENS = 128
HOOKS = (
    "device_stored",
    "device_loaded",
    "device_removed",
    "backup_started",
    "backup_done",
    "host_grafted",
    "host_removed",
    "storage_stored",
    "flush",
)


def make_cache(pages: int, events: bool) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=("full", "full"),
        kv_heads=1,
        head_dim=8,
        page_size=P,
        device_tokens=(pages + 2 * REQ_TOKENS // P) * P,
        dtype=torch.bfloat16,
        host_ratio=2.0,
        write_policy="write_through",
        model_id="bench-events",
    )
    ev = None
    if events:
        ev = EventsConfig(
            endpoint="tcp://127.0.0.1:0", snapshot_endpoint="tcp://127.0.0.1:0", instance_id="b"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KVTierConfigWarning)
        return TieredKVCache(cfg, events=ev)


def request(cache: TieredKVCache, tokens: list[int]) -> None:
    req = cache.match(tokens)
    cache.reserve(req, len(tokens))
    cache.computed(req, len(tokens))
    cache.cache_finished_req(req)


class HookClock:
    """Wraps every sink hook and the flush with a timer. The timer's own share of each call
    (``bias_us``: an empty hook timed the same way, warm) is counted in ``total``: the raw figure
    is an upper bound, the figure net of ``calls * bias_us`` an estimate."""

    def __init__(self, sink: EventSink) -> None:
        self.total = 0.0
        self.calls = 0
        self.hashing = 0.0  # inside the hooks: computing page hashes (L3 would anyway)
        for name in HOOKS:
            setattr(sink, name, self._timed(getattr(sink, name)))
        nodes = sink.nodes
        hashes = nodes.hashes

        def timed_hashes(node):
            if node.page_hashes is not None:
                return node.page_hashes
            t0 = time.perf_counter()
            try:
                return hashes(node)
            finally:
                self.hashing += time.perf_counter() - t0

        nodes.hashes = timed_hashes
        self.thread = 0.0  # the publisher thread's CPU time (build, encode, send)
        thread = sink.thread
        send = thread.send_batch

        def timed_send(*a):
            t0 = time.thread_time()
            try:
                return send(*a)
            finally:
                self.thread += time.thread_time() - t0

        thread.send_batch = timed_send
        # Deferred page hashing on the publisher thread (the scheduler thread's is timed above).
        self.thread_hashing = 0.0
        chain = self._chain = nodes_module.chain_hashes
        ident = thread._thread.ident

        def timed_chain(*a):
            if threading.get_ident() != ident:
                return chain(*a)
            t0 = time.thread_time()
            try:
                return chain(*a)
            finally:
                self.thread_hashing += time.thread_time() - t0

        nodes_module.chain_hashes = timed_chain
        self.bias_us = self._bias_us()

    def close(self) -> None:
        nodes_module.chain_hashes = self._chain

    def _bias_us(self, n: int = 20000) -> float:
        probe = HookClock.__new__(HookClock)
        probe.total, probe.calls = 0.0, 0
        empty = probe._timed(lambda *a: None)
        for _ in range(n):
            empty(None)
        return 1e6 * probe.total / n

    def _timed(self, fn):
        def timed(*a, **kw):
            self.calls += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def step_rows(pages: int, steps: int, seed: int, drain: bool = True) -> dict:
    rnd = random.Random(seed)
    plain, evented = make_cache(pages, False), make_cache(pages, True)
    fill = pages * P // 1024
    for _ in range(fill):  # 64-page requests until the device pool is full
        tokens = [rnd.randrange(32000) for _ in range(1024)]
        for c in (plain, evented):
            request(c, tokens)
            c.poll()
    gc.collect()
    gc.freeze()  # the fill's objects stay out of the timed steps' collections
    evented.events.drain()  # the fill's batches are not the timed steps' work
    clock = HookClock(evented.events)
    t: dict[str, list[float]] = defaultdict(list)
    ev_us: list[float] = []
    net_us: list[float] = []
    hash_us: list[float] = []
    thread_us: list[float] = []
    thread_hash_us: list[float] = []
    for i in range(steps):
        tokens = [rnd.randrange(32000) for _ in range(REQ_TOKENS)]
        order = (plain, evented) if i % 2 else (evented, plain)
        for c in order:
            name = "events" if c is evented else "plain"
            before, hashed, calls = clock.total, clock.hashing, clock.calls
            t0 = time.perf_counter()
            request(c, tokens)
            t1 = time.perf_counter()
            c.poll()
            t2 = time.perf_counter()
            t[f"step.{name}"].append(t2 - t0)
            t[f"poll.{name}"].append(t2 - t1)
            if c is evented:
                ev_us.append((clock.total - before) * 1e6)
                net_us.append(ev_us[-1] - (clock.calls - calls) * clock.bias_us)
                hash_us.append((clock.hashing - hashed) * 1e6)
                # Untimed: the publisher thread sends the batch between steps, as it would
                # while the GPU runs the model (its CPU time is reported on its own).
                on_thread, on_thread_hash = clock.thread, clock.thread_hashing
                if drain:
                    c.events.drain()
                    thread_us.append((clock.thread - on_thread) * 1e6)
                    thread_hash_us.append((clock.thread_hashing - on_thread_hash) * 1e6)
    idle: dict[str, list[float]] = defaultdict(list)
    for _ in range(2000):
        for name, c in (("plain", plain), ("events", evented)):
            t0 = time.perf_counter()
            c.poll()
            idle[name].append(time.perf_counter() - t0)
    sink = evented.events
    if not drain:  # the thread's CPU over every step (it sends several steps per wake-up)
        sink.drain()
        thread_total, thread_hash_total = clock.thread, clock.thread_hashing
    clock.close()
    row = {
        "pages_device": len(sink.held("GPU")),
        "pages_host": len(sink.held("CPU")),
        "steps": steps,
        "step_us_plain": 1e6 * statistics.median(t["step.plain"]),
        "step_us_events": 1e6 * statistics.median(t["step.events"]),
        "poll_us_plain": 1e6 * statistics.median(t["poll.plain"]),
        "poll_us_events": 1e6 * statistics.median(t["poll.events"]),
        "events_us_per_step": statistics.median(ev_us),
        "events_us_per_step_p90": sorted(ev_us)[int(0.9 * len(ev_us))],
        "events_us_per_step_net": statistics.median(net_us),
        "timer_bias_us_per_call": clock.bias_us,
        "idle_poll_us_plain": 1e6 * statistics.median(idle["plain"]),
        "idle_poll_us_events": 1e6 * statistics.median(idle["events"]),
        "events_per_step": sink.counters["events"] / max(1, sink.counters["batches"]),
        # The quietest block of 25 steps (mean): less sensitive to other load on the machine.
        "events_us_best_block": _best_block(ev_us),
        "hashing_us_per_step": statistics.median(hash_us),
        "thread_us_per_step": statistics.median(thread_us) if thread_us else float("nan"),
        "thread_hashing_us_per_step": (
            statistics.median(thread_hash_us) if thread_hash_us else float("nan")
        ),
        "drained": drain,
        "poll_us_plain_best_block": _best_block([1e6 * x for x in t["poll.plain"]]),
        "step_us_plain_best_block": _best_block([1e6 * x for x in t["step.plain"]]),
    }
    if not drain:
        row["thread_us_per_step"] = 1e6 * thread_total / steps
        row["thread_hashing_us_per_step"] = 1e6 * thread_hash_total / steps
    gc.unfreeze()
    for c in (plain, evented):
        c.close()
    return row


def _best_block(xs: list[float], block: int = 25) -> float:
    means = [statistics.mean(xs[i : i + block]) for i in range(0, len(xs) - block + 1, block)]
    return min(means)


def throughput(batches: int, seed: int) -> dict:
    """Publisher flush and indexer apply rates over synthetic records."""
    from kvtier.events.keys import KeySeed

    rnd = random.Random(seed)
    seed_ = KeySeed("bench-events", "bfloat16", P, "page_first", 1, "")
    cfg = EventsConfig(
        endpoint="tcp://127.0.0.1:0", snapshot_endpoint=None, instance_id="t", hwm=10 * batches
    )
    sink = EventSink(cfg, seed_, 4096, lambda: (0.0, 0.0))
    ix = Indexer()
    ix.add_instance("t", sink.endpoint)
    # Connect first (a SUB misses what is sent before it is connected).
    deadline = time.monotonic() + 10
    while ix.seq("t") is None:
        if time.monotonic() > deadline:
            raise RuntimeError("subscriber did not connect")
        sink.cleared()
        sink.flush()
        ix.poll(0.05)
        if ix.seq("t") is not None and ix.seq("t") != sink.seq:
            ix.sync("t", sink.seq, 5)
    ix.sync("t", sink.seq, 5)
    first, gaps = sink.seq + 1, ix.counters["gaps"]
    per_batch, pages_per_event = 64, 4
    ops = []
    for _ in range(batches):
        batch = []
        for _ in range(per_batch):  # one node of 4 fresh pages under the root
            hashes = [rnd.randbytes(32).hex() for _ in range(pages_per_event)]
            key = [rnd.randrange(32000) for _ in range(pages_per_event * P)]
            batch.append((STORED, "GPU", [(hashes, 0, None, key, None)]))
        ops.append(batch)
    t0 = time.perf_counter()
    for batch in ops:
        sink._ops.extend(batch)
        sink.flush()
    flush_s = time.perf_counter() - t0
    if not sink.drain(60):  # the publisher thread has built, encoded and sent every batch
        raise RuntimeError("publisher thread stuck")
    pub_s = time.perf_counter() - t0
    events = batches * per_batch
    t0 = time.perf_counter()
    if not ix.sync("t", sink.seq, 60):
        raise RuntimeError(f"indexer stuck at {ix.seq('t')} of {sink.seq}")
    sub_s = time.perf_counter() - t0
    assert ix.counters["gaps"] == gaps and sink.seq - first + 1 >= batches
    sink.close()
    ix.close()
    return {
        "batches": batches,
        "events_per_batch": per_batch,
        "pages_per_event": pages_per_event,
        "publisher_events_per_s": events / pub_s,
        "flush_events_per_s": events / flush_s,
        "publisher_pages_per_s": events * pages_per_event / pub_s,
        # The indexer was not polled while the publisher ran: it drains what was queued.
        "indexer_events_per_s": events / sub_s,
        "indexer_pages_per_s": events * pages_per_event / sub_s,
    }


def report(info: dict, rows: list[dict], tp: dict) -> str:
    lines = [
        "# bench_events: KV event overhead per scheduler step, publisher and indexer rates",
        "",
    ]
    lines += header_lines(info)
    lines += [
        f"- load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"({os.cpu_count()} cores)",
        "",
        "Steady-state step: a new 128-token request (8 pages) inserted and backed up, the "
        "eviction making room for it, then `poll()`; two caches alike, with and without events, "
        "steps interleaved. Events' own time = every sink hook + the flush on the scheduler "
        "thread, timed inside the sink (raw: the timer's own share counted in, an upper bound; "
        "net: less that share, measured on an empty hook timed the same way: "
        f"{rows[0]['timer_bias_us_per_call']:.2f} µs a call). "
        "Publisher thread = its CPU time per step (resolve, "
        "deferred hashing, build, encode, send), off the scheduler thread. Between steps: "
        "`drained` = the publisher thread ran between steps (untimed; in an engine, while the "
        "GPU computes), `concurrent` = it competed with the steps for the GIL.",
        "",
        "| cached pages (device / host) | between steps | events per step "
        "| step µs without / with events "
        "| poll() µs without / with | events' own µs per step, raw: median, p90, quietest 25 "
        "steps | net median | of which page hashing (median) "
        "| events' own raw / poll() without (quietest blocks) "
        "| publisher thread CPU µs per step (of which page hashing) "
        "| idle poll() µs without / with |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        frac = r["events_us_best_block"] / r["poll_us_plain_best_block"]
        mode = "drained" if r["drained"] else "concurrent"
        lines.append(
            f"| {r['pages_device']:,} / {r['pages_host']:,} | {mode} "
            f"| {r['events_per_step']:.1f} "
            f"| {r['step_us_plain']:.0f} / {r['step_us_events']:.0f} "
            f"| {r['poll_us_plain']:.1f} / {r['poll_us_events']:.1f} "
            f"| {r['events_us_per_step']:.1f}, {r['events_us_per_step_p90']:.1f}, "
            f"{r['events_us_best_block']:.1f} | {r['events_us_per_step_net']:.1f} "
            f"| {r['hashing_us_per_step']:.1f} "
            f"| {r['events_us_best_block']:.1f} / {r['poll_us_plain_best_block']:.1f} "
            f"= {100 * frac:.0f}% | {r['thread_us_per_step']:.1f} "
            f"({r['thread_hashing_us_per_step']:.1f}) "
            f"| {r['idle_poll_us_plain']:.1f} / {r['idle_poll_us_events']:.1f} |"
        )
    lines += [
        "",
        f"Throughput ({tp['batches']} batches of {tp['events_per_batch']} BlockStored events of "
        f"{tp['pages_per_event']} pages, loopback TCP, one process):",
        "",
        "| side | events/s | pages/s |",
        "|---|---|---|",
        f"| publisher thread (resolve + build + encode + send) "
        f"| {tp['publisher_events_per_s']:,.0f} "
        f"| {tp['publisher_pages_per_s']:,.0f} |",
        f"| indexer (receive + decode + apply) | {tp['indexer_events_per_s']:,.0f} "
        f"| {tp['indexer_pages_per_s']:,.0f} |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="profiling/results")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sizes", default="1000,100000", help="cached device pages per row")
    ap.add_argument("--batches", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    sizes = [int(x) for x in args.sizes.split(",")]
    for pages in sizes:
        rows.append(step_rows(pages, args.steps, args.seed))
        print(json.dumps(rows[-1]), flush=True)
    # The same steps with the publisher thread competing for the GIL (smallest size: the cost
    # does not depend on it).
    rows.append(step_rows(min(sizes), args.steps, args.seed, drain=False))
    print(json.dumps(rows[-1]), flush=True)
    tp = throughput(args.batches, args.seed)
    print(json.dumps(tp), flush=True)
    info = environment()
    text = report(info, rows, tp)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_events.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
