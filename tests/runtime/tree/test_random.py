"""Seeded randomized test: requests, evictions, backups, load-backs, pins, host eviction.

After every step ``check_integrity`` recounts the tree and every pool, with the slots the live
requests hold, so a leaked or doubly freed slot fails at the step that caused it.

The device pool is small and the host pool large: eviction demotes backed-up nodes all the
time, so the tree keeps hundreds of nodes (most of them host-only) and matches keep finding
host hits to load back, in every configuration. Every match is also run read-only first and
must agree with the regular match.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.runtime import CacheRequest, MatchResult
from tests.runtime.tree.harness import Harness

CASES = [
    ("full-p1", 1, None, False),
    ("full-p4", 4, None, False),
    ("swa-p4-w8", 4, 8, False),
    ("swa-p1-w4", 1, 4, False),
    ("mamba-p4", 4, None, True),
    ("mamba-p1", 1, None, True),
    ("swa+mamba-p4-w8", 4, 8, True),
]
STEPS = 2500
DEVICE_PAGES, HOST_PAGES = 256, 2048
MAMBA_SLOTS, HOST_MAMBA_SLOTS = 48, 512
VOCAB = 4  # few symbols: sequences share prefixes and split nodes, yet branch a lot


class Sim:
    def __init__(self, P: int, window: int | None, mamba: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.h = Harness(
            P,
            window,
            mamba,
            pages=DEVICE_PAGES,
            host=True,
            host_pages=HOST_PAGES,
            host_swa_size=HOST_PAGES * P,
            mamba_slots=MAMBA_SLOTS,
            host_mamba_size=HOST_MAMBA_SLOTS if mamba else None,
        )
        self.tree, self.kv, self.P = self.h.tree, self.h.kv, P
        self.corpus: list[list[int]] = []
        self.backups, self.loads, self.pins = [], [], []
        self.counts: dict[str, int] = {}
        self.max_nodes = 0

    def tokens(self) -> list[int]:
        rng, P = self.rng, self.P
        toks: list[int] = []
        if self.corpus and rng.random() < 0.85:
            base = rng.choice(self.corpus)
            # Half the time the whole sequence: deep matches reach demoted leaves and states.
            cut = len(base) // P if rng.random() < 0.5 else rng.randint(0, len(base) // P)
            toks = base[: cut * P]
        toks += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4) * P)]
        # An unaligned tail sometimes: it is never cached, and a Mamba state past it never is.
        return toks + [9] * rng.randrange(P) * (rng.random() < 0.3)

    def alloc(self, n: int) -> torch.Tensor | None:
        slots = self.kv.alloc(n)
        if slots is None:
            self.tree.evict(full=n, swa=n)
            slots = self.kv.alloc(n)
        return slots

    def match(self, toks: list[int], cow: bool = False) -> MatchResult:
        """A read-only match, then the regular one; both must report the same prefix."""
        ro = self.tree.match_prefix(toks, read_only=True)
        m = self.tree.match_prefix(toks, cow_mamba=cow)
        assert torch.equal(ro.device_indices, m.device_indices), (ro, m)
        for field in (
            "host_hit_length",
            "swa_host_hit_length",
            "mamba_host_hit_length",
            "mamba_branching_seqlen",
            "matched_len",
        ):
            assert getattr(ro, field) == getattr(m, field), (field, ro, m)
        assert m.matched_len == m.best_match_node.end, (m.matched_len, m.best_match_node)
        # Same anchor, or the read-only one is the node the regular match split (a node keeps
        # its identity as the lower piece, so the new upper piece is its parent).
        assert m.best_match_node in (ro.best_match_node, ro.best_match_node.parent)
        return m

    def load(self, anchor) -> bool:
        lb = self.tree.load_back(anchor)
        if lb is None:
            return False
        self.loads.append(lb)
        self.bump("load_back")
        return True

    def start(self) -> None:
        toks = self.tokens()
        m = self.match(toks)
        hit = m.host_hit_length or m.swa_host_hit_length or m.mamba_host_hit_length
        if hit and self.rng.random() < 0.8 and self.load(m.best_match_node):
            m = self.tree.match_prefix(toks)
            assert m.last_device_node is m.best_match_node
        cow = self.tree.mamba is not None and self.rng.random() < 0.5
        if cow:
            m = self.match(toks, cow=True)
        handle = self.tree.pin(m.last_device_node)
        need = -(-(len(toks) - m.device_len) // self.P) * self.P
        slots = self.alloc(need)
        mamba_slot = m.mamba_cow.dst if m.mamba_cow is not None else None
        if slots is None:
            self.tree.unpin(handle)
            if mamba_slot is not None:
                self.tree.mamba.device_alloc.free(mamba_slot)
            return
        if self.tree.mamba is not None and mamba_slot is None:
            mamba_slot = self.tree.mamba.device_alloc.alloc(1)
            if mamba_slot is None:
                self.tree.evict(mamba=1)
                mamba_slot = self.tree.mamba.device_alloc.alloc(1)
        if m.mamba_cow is not None:
            self.bump("cow")
        req = CacheRequest(
            toks, torch.cat([m.device_indices, slots]), m.device_len, handle, mamba_slot=mamba_slot
        )
        self.h.requests.append(req)
        self.bump("start")

    def bump(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def backup(self) -> None:
        tree, rng = self.tree, self.rng
        nodes = [n for n in sorted(tree.device_leaves) if not n.backed_up]
        if not nodes or rng.random() < 0.3:
            nodes = [n for n in tree.all_nodes()[1:] if not n.evicted and not n.backed_up]
        if tree.mamba is not None and rng.random() < 0.7:
            # States sit at sequence ends: back those up so demoted nodes keep host states.
            nodes = [n for n in nodes if n.value[tree.mamba.slot] is not None] or nodes
        if nodes:
            b = tree.backup(rng.choice(nodes))
            if b is not None:
                self.backups.append(b)
                self.bump("backup")

    def step(self) -> None:
        rng, tree, reqs = self.rng, self.tree, self.h.requests
        op = rng.random()
        if op < 0.22 or not reqs:
            self.start()
        elif op < 0.38:
            req = reqs.pop(rng.randrange(len(reqs)))
            (tree.cache_finished_req if rng.random() < 0.9 else tree.release_req)(req)
            self.corpus.append(req.token_ids)
            self.bump("finish")
        elif op < 0.46:
            req = rng.choice(reqs)
            if len(req.token_ids) % self.P == 0 and rng.random() < 0.7:
                more = self.alloc(self.P)
                if more is not None:
                    req.token_ids = req.token_ids + [rng.randrange(VOCAB) for _ in range(self.P)]
                    req.kv_slots = torch.cat([req.kv_slots, more])
            tree.cache_unfinished_req(req, donate_mamba=rng.random() < 0.7)
            self.bump("unfinished")
        elif op < 0.50 and tree.swa is not None:
            req = rng.choice(reqs)
            tree.free_out_of_window(req)
            if req.pin is not None and rng.random() < 0.5:
                req.pin = tree.unpin_swa(req.pin)
            self.bump("swa_release")
        elif op < 0.52:
            tree.evict(
                full=rng.randint(1, 16) * self.P,
                swa=rng.randint(0, 8) * self.P,
                mamba=rng.randint(0, 3),
            )
            self.bump("evict")
        elif op < 0.72:
            self.backup()
        elif op < 0.79:
            # Copies complete out of order; pending backups pin device data, so most finish.
            for pending, finish in (
                (self.backups, tree.finish_backup),
                (self.loads, tree.finish_load_back),
                (self.pins, tree.unpin_host),
            ):
                for item in [x for x in pending if rng.random() < 0.7]:
                    pending.remove(item)
                    finish(item)
            self.bump("finish_async")
        elif op < 0.81:
            tree.evict_host(
                full=rng.randint(1, 16) * self.P,
                swa=rng.randint(0, 8) * self.P,
                mamba=rng.randint(0, 3),
            )
            self.bump("evict_host")
        elif op < 0.84:
            nodes = [n for n in tree.all_nodes()[1:] if n.backed_up]
            if nodes:
                self.pins.append(tree.pin_host(rng.choice(nodes)))
                self.bump("pin_host")
        elif op < 0.94:
            # Load back a host-only node directly (the anchor a prefetch would give).
            nodes = [n for n in tree.all_nodes()[1:] if n.evicted]
            if nodes:
                self.load(rng.choice(nodes))
        else:
            self.match(self.tokens())
            self.bump("match")
        self.max_nodes = max(self.max_nodes, len(tree.all_nodes()))

    def drain(self) -> None:
        tree = self.tree
        for req in self.h.requests:
            tree.cache_finished_req(req)
        self.h.requests.clear()
        for b in self.backups:
            tree.finish_backup(b)
        for lb in self.loads:
            tree.finish_load_back(lb)
        for pin in self.pins:
            tree.unpin_host(pin)
        tree.evict(full=10**9, swa=10**9, mamba=10**9)
        tree.evict_host(full=10**9, swa=10**9, mamba=10**9)


@pytest.mark.parametrize("P,window,mamba", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0])
def test_randomized_interleaving_keeps_books(
    P: int, window: int | None, mamba: bool, seed: int
) -> None:
    sim = Sim(P, window, mamba, seed)
    for i in range(STEPS):
        sim.step()
        try:
            sim.h.check()
        except Exception as e:
            raise AssertionError(f"step {i}: {e}") from e
    # Every kind of operation ran, so the books were exercised, not just checked.
    for op in ("start", "finish", "unfinished", "evict", "backup", "finish_async", "evict_host"):
        assert sim.counts.get(op, 0) > 0, f"{op} never ran: {sim.counts}"
    # ... and the run never stalled (pins starving the device pool), grew a big tree and
    # loaded back often.
    assert sim.counts["start"] >= STEPS // 6, sim.counts
    assert sim.counts.get("load_back", 0) >= 100, sim.counts
    assert sim.max_nodes >= 120, f"tree peaked at {sim.max_nodes} nodes"
    if mamba:
        assert sim.counts.get("cow", 0) >= 20, sim.counts
    sim.drain()
    sim.h.check()
    assert not sim.tree.root.children
    assert sim.tree.full.device_alloc.used_size() == 0
    assert sim.tree.full.host_alloc.used_size() == 0
