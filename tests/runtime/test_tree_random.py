"""Seeded randomized test: requests, evictions, backups, load-backs, pins, host eviction.

After every step ``check_integrity`` recounts the tree and every pool, with the slots the live
requests hold, so a leaked or doubly freed slot fails at the step that caused it.
"""

from __future__ import annotations

import random

import pytest
import torch
from tree_harness import Harness

from kvtier.runtime import CacheRequest

CASES = [
    ("full-p1", 1, None, False),
    ("full-p4", 4, None, False),
    ("swa-p4-w8", 4, 8, False),
    ("swa-p1-w4", 1, 4, False),
    ("mamba-p4", 4, None, True),
    ("swa+mamba-p4-w8", 4, 8, True),
]
STEPS = 500


class Sim:
    def __init__(self, P: int, window: int | None, mamba: bool, seed: int) -> None:
        self.rng = random.Random(seed)
        self.h = Harness(P, window, mamba, pages=40, host=True, host_swa_size=24 * P)
        self.tree, self.kv, self.P = self.h.tree, self.h.kv, P
        self.corpus: list[list[int]] = []
        self.backups, self.loads, self.pins = [], [], []
        self.counts: dict[str, int] = {}

    def tokens(self) -> list[int]:
        rng, P = self.rng, self.P
        toks: list[int] = []
        if self.corpus and rng.random() < 0.8:
            base = rng.choice(self.corpus)
            toks = base[: rng.randint(0, len(base) // P) * P]
        toks += [rng.randrange(3) for _ in range(rng.randint(1, 4) * P)]
        return toks + [9] * rng.randrange(P)

    def alloc(self, n: int) -> torch.Tensor | None:
        slots = self.kv.alloc(n)
        if slots is None:
            self.tree.evict(full=n, swa=n)
            slots = self.kv.alloc(n)
        return slots

    def start(self) -> None:
        toks = self.tokens()
        m = self.tree.match_prefix(toks)
        hit = m.host_hit_length or m.swa_host_hit_length or m.mamba_host_hit_length
        if hit and self.rng.random() < 0.7:
            lb = self.tree.load_back(m.best_match_node)
            if lb is not None:
                self.loads.append(lb)
                self.bump("load_back")
                m = self.tree.match_prefix(toks)
        handle = self.tree.lock(m.last_device_node)
        need = -(-(len(toks) - m.device_len) // self.P) * self.P
        slots = self.alloc(need)
        if slots is None:
            self.tree.unlock(handle)
            return
        mamba_slot = None
        if self.tree.mamba is not None:
            mamba_slot = self.tree.mamba.device_alloc.alloc(1)
            if mamba_slot is None:
                self.tree.evict(mamba=1)
                mamba_slot = self.tree.mamba.device_alloc.alloc(1)
        req = CacheRequest(toks, torch.cat([m.device_indices, slots]), m.device_len, handle,
                           mamba_slot=mamba_slot)
        self.h.requests.append(req)
        self.bump("start")

    def bump(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def step(self) -> None:
        rng, tree, reqs = self.rng, self.tree, self.h.requests
        op = rng.random()
        if op < 0.25 or not reqs:
            self.start()
        elif op < 0.42:
            req = reqs.pop(rng.randrange(len(reqs)))
            tree.cache_finished_req(req, is_insert=rng.random() < 0.9)
            self.corpus.append(req.token_ids)
            self.bump("finish")
        elif op < 0.52:
            req = rng.choice(reqs)
            if len(req.token_ids) % self.P == 0 and rng.random() < 0.7:
                more = self.alloc(self.P)
                if more is not None:
                    req.token_ids = req.token_ids + [rng.randrange(3) for _ in range(self.P)]
                    req.kv_slots = torch.cat([req.kv_slots, more])
            tree.cache_unfinished_req(req)
            self.bump("unfinished")
        elif op < 0.57 and tree.swa is not None:
            req = rng.choice(reqs)
            tree.free_out_of_window(req)
            if req.lock is not None and rng.random() < 0.5:
                req.lock = tree.unlock_swa(req.lock)
            self.bump("swa_release")
        elif op < 0.67:
            tree.evict(full=rng.randint(1, 16) * self.P, swa=rng.randint(0, 8) * self.P,
                       mamba=rng.randint(0, 2))
            self.bump("evict")
        elif op < 0.77:
            nodes = [n for n in tree.all_nodes()[1:] if not n.evicted and not n.backed_up]
            if nodes:
                b = tree.backup(rng.choice(nodes))
                if b is not None:
                    self.backups.append(b)
                    self.bump("backup")
        elif op < 0.85:
            for pending, finish in ((self.backups, tree.finish_backup), (self.loads, tree.finish_load_back),
                                    (self.pins, tree.unpin_host)):
                while pending and rng.random() < 0.6:
                    finish(pending.pop(rng.randrange(len(pending))))
            self.bump("finish_async")
        elif op < 0.92:
            tree.evict_host(full=rng.randint(1, 16) * self.P, swa=rng.randint(0, 8) * self.P,
                            mamba=rng.randint(0, 2))
            self.bump("evict_host")
        elif op < 0.96:
            nodes = [n for n in tree.all_nodes()[1:] if n.backed_up]
            if nodes:
                self.pins.append(tree.pin_host(rng.choice(nodes)))
                self.bump("pin_host")
        else:
            tree.match_prefix(self.tokens(), read_only=rng.random() < 0.5)
            self.bump("match")

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
@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_interleaving_keeps_books(P: int, window: int | None, mamba: bool, seed: int) -> None:
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
    sim.drain()
    sim.h.check()
    assert not sim.tree.root.children
    assert sim.tree.full.device_alloc.used_size() == 0
    assert sim.tree.full.host_alloc.used_size() == 0
