"""Shared set-up for the radix tree tests: configs, token sequences, slot accounting."""

from __future__ import annotations

import torch

from kvtier.runtime import CacheRequest, TreeConfig, UnifiedRadixTree, build_tree

# (id, page_size, swa_window, mamba) — the configurations of issue 4.
CONFIGS = [
    *[(f"full-p{p}", p, None, False) for p in (1, 4, 16, 64)],
    *[(f"full+mamba-p{p}", p, None, True) for p in (1, 16)],
    *[
        (f"full+swa-p{p}-w{w}", p, w, False)
        for p, w in ((1, 4), (4, 4), (4, 2), (16, 16), (64, 64), (128, 4), (1, 128))
    ],
    ("full+swa+mamba-p1-w128", 1, 128, True),
    ("full+swa+mamba-p64-w64", 64, 64, True),
]
CONFIG_IDS = [c[0] for c in CONFIGS]


class Harness:
    """A tree plus the slots requests hold, so ``check`` can prove every slot is accounted for."""

    def __init__(
        self,
        page_size: int,
        swa_window: int | None = None,
        mamba: bool = False,
        pages: int = 64,
        host: bool = False,
        host_pages: int | None = None,
        mamba_slots: int = 16,
        **kw,
    ) -> None:
        self.P = page_size
        if swa_window is not None:
            pages = max(pages, 12 * -(-swa_window // page_size))
        cfg = TreeConfig(
            page_size=page_size,
            kv_size=pages * page_size,
            swa_window=swa_window,
            mamba_size=mamba_slots if mamba else None,
            host_kv_size=(host_pages or pages) * page_size if host else None,
            **kw,
        )
        self.tree: UnifiedRadixTree = build_tree(cfg)
        self.kv = self.tree.full.device_alloc
        self.requests: list[CacheRequest] = []
        self._seq = 1000

    @property
    def window(self) -> int:
        return self.tree.swa.window if self.tree.swa is not None else 0

    @property
    def tail(self) -> int:
        """One page-aligned window (the SWA leaf cap); P when there is no SWA."""
        return self.tree.swa.tail if self.tree.swa is not None else self.P

    def tokens(self, n_pages: int) -> list[int]:
        """Fresh token ids no other sequence shares."""
        out = list(range(self._seq, self._seq + n_pages * self.P))
        self._seq += n_pages * self.P
        return out

    def alloc(self, n_tokens: int) -> torch.Tensor:
        slots = self.kv.alloc(n_tokens)
        assert slots is not None, f"pool exhausted allocating {n_tokens}"
        return slots

    def mamba_slot(self) -> torch.Tensor | None:
        if self.tree.mamba is None:
            return None
        slot = self.tree.mamba.device_alloc.alloc(1)
        assert slot is not None
        return slot

    def insert(self, tokens: list[int], **kw):
        """Insert a fresh sequence as a finished request would (new slots, own state)."""
        slots = self.alloc(len(tokens) // self.P * self.P)
        mamba = self.mamba_slot()
        res = self.tree.insert(tokens, slots, mamba_value=mamba, **kw)
        if mamba is not None and not res.mamba_adopted:
            self.tree.mamba.device_alloc.free(mamba)
        self.check()
        return res

    def request_owned(self) -> dict[str, int]:
        owned = {"kv": 0, "swa": 0, "mamba": 0}
        own = [req.kv_slots[req.cache_protected_len :] for req in self.requests]
        if own:
            slots = torch.cat(own)
            owned["kv"] = slots.numel()
            if self.tree.swa is not None:
                owned["swa"] = int((self.kv.translate(slots) >= 0).sum())
        owned["mamba"] = sum(req.mamba_slot is not None for req in self.requests)
        return owned

    def check(self) -> None:
        self.tree.check_integrity(self.request_owned())

    def device_len(self, tokens: list[int]) -> int:
        return self.tree.match_prefix(tokens).device_len
