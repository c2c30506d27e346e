"""Result and handle types of the unified radix tree.

Results and the device ``PinHandle`` are NamedTuples (cheap on the scheduler's hot path); other
handles and transfer descriptors are frozen dataclasses. Handles are opaque to callers: pass back
exactly what ``pin``/``pin_host`` returned.

Token positions (``end``, ``boundary``, skipped ranges) count tokens from the root. They are used
instead of node ids because a split or a load-back never moves a token position, whereas a split
creates new nodes: a handle taken before a split therefore still releases exactly what it pinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

if TYPE_CHECKING:
    from kvtier.runtime.tree.node import TreeNode

__all__ = [
    "Backup",
    "EvictResult",
    "HostPinHandle",
    "InsertResult",
    "LoadBack",
    "MambaCopy",
    "MatchResult",
    "PinHandle",
    "Transfer",
    "TreeIntegrityError",
]


class TreeIntegrityError(RuntimeError):
    """A tree invariant or a pool's books do not hold."""


@dataclass(frozen=True)
class Transfer:
    """One copy the controller must issue; the tree has already updated its books.

    Attributes:
        pool: pool name ("kv", "swa", "mamba").
        device_indices: int64 ``[n]`` slots in the device pool.
        host_indices: int64 ``[n]`` slots in the host pool, same order.
        direction: ``"d2h"`` (backup) or ``"h2d"`` (load back).
    """

    pool: str
    device_indices: torch.Tensor
    host_indices: torch.Tensor
    direction: Literal["d2h", "h2d"]


class MambaCopy(NamedTuple):
    """A Mamba state copy the controller must issue (``MambaDevicePool.copy_slots(src, dst)``).

    Attributes:
        src: int64 ``[1]`` state slot to copy from.
        dst: int64 ``[1]`` state slot to copy into.
    """

    src: torch.Tensor
    dst: torch.Tensor


class MatchResult(NamedTuple):
    """What ``match_prefix`` found.

    Attributes:
        device_indices: int64 ``[device_len]`` FULL slots from the root to ``last_device_node``.
        last_device_node: deepest node where every component is on the device; pin this one.
        best_match_node: deepest node where every component is usable on device or host; the
            anchor for ``load_back``. Equals ``last_device_node`` when nothing is host-only.
        host_hit_length: FULL tokens between the two anchors that are only on host.
        swa_host_hit_length: SWA tokens ``load_back`` would restore from host.
        mamba_host_hit_length: 1 when the anchor's Mamba state is only on host, else 0.
        mamba_branching_seqlen: MAMBA without a host tier: the FULL match reaches past the
            Mamba anchor, and this is the last position within it aligned to the Mamba
            checkpoint grid; the request should checkpoint its state there and insert it, so
            later requests can branch at it. None otherwise.
        mamba_cow: with ``cow_mamba``: the request's own state slot and where to copy it from.
        matched_len: tokens of the usable prefix, root to ``best_match_node`` (within it where
            a read-only match ends inside a node). Not ``device_len + host_hit_length`` in a
            hybrid tree: FULL tokens on device between the anchors (their SWA window or Mamba
            state is on host) are in neither.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    best_match_node: TreeNode
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    mamba_cow: MambaCopy | None = None
    matched_len: int = 0

    @property
    def device_len(self) -> int:
        return int(self.device_indices.numel())


class InsertResult(NamedTuple):
    """What ``insert`` did.

    Attributes:
        prefix_len: tokens of the key that were already in the tree (device or host).
        total_len: page-aligned key length.
        cached_len: leading tokens now owned by the tree (``total_len`` unless an unfinished
            insert stopped at an SWA tombstone it could not restore; see ``insert``).
        last_node: the node ending at ``cached_len``.
        mamba_exist: the end node already had a device Mamba state; the caller keeps its slot.
        mamba_adopted: the tree took ownership of the caller's Mamba slot.
    """

    prefix_len: int
    total_len: int
    cached_len: int
    last_node: TreeNode
    mamba_exist: bool = False
    mamba_adopted: bool = False


class EvictResult(NamedTuple):
    """Amounts freed on one tier: tokens for FULL and SWA, slots for Mamba."""

    full: int = 0
    swa: int = 0
    mamba: int = 0


class PinHandle(NamedTuple):
    """A device pin (reference count) taken by ``pin``; release it with ``unpin``.

    Attributes:
        node: the node that was locked.
        node_end: token position where ``node`` ends.
        full_end: FULL is pinned on the path root..``full_end``; nodes below it were evicted
            (host-only) when the pin was taken and were skipped.
        swa_boundary: SWA is pinned on nodes ending in ``(swa_boundary, node_end]`` (the window),
            or None when no SWA pin is held (no SWA component, or released early).
        swa_skipped: ``(start, end)`` token ranges inside the window that had no SWA data on
            device when the pin was taken (tombstones, evicted nodes); never decremented.
        mamba: whether ``node``'s Mamba state is pinned.
        delta: FULL tokens that went from evictable to protected.
    """

    node: TreeNode
    node_end: int
    full_end: int
    swa_boundary: int | None = None
    swa_skipped: tuple[tuple[int, int], ...] = ()
    mamba: bool = False
    delta: int = 0


@dataclass(frozen=True)
class HostPinHandle:
    """A host pin (reference count) taken by ``pin_host``; release it with ``unpin_host``.

    Attributes:
        node: the pinned node.
        node_end: token position where ``node`` ends.
        full: whether ``node``'s FULL host data is pinned.
        swa_boundary, swa_skipped: the SWA host window, as in ``PinHandle``.
        mamba: whether ``node``'s Mamba host state is pinned.
    """

    node: TreeNode
    node_end: int
    full: bool = False
    swa_boundary: int | None = None
    swa_skipped: tuple[tuple[int, int], ...] = ()
    mamba: bool = False


@dataclass(frozen=True)
class Backup:
    """A device→host backup whose books are committed; the copies are still to be done.

    The nodes stay device-locked until ``finish_backup`` so that no source slot of the copy can
    be evicted mid-transfer: ``pin`` pins FULL on the whole path plus the last node's SWA window
    and Mamba state; ``chain_pins`` pin the SWA window and Mamba state of every other node
    whose data the copy reads.
    """

    nodes: tuple[TreeNode, ...]
    transfers: tuple[Transfer, ...]
    pin: PinHandle
    chain_pins: tuple[PinHandle, ...] = ()


@dataclass(frozen=True)
class LoadBack:
    """A host→device load whose books are committed; the copies are still to be done.

    ``pin`` pins the loaded path on device and ``host_pin`` the anchor's host data until
    ``finish_load_back``, so neither side of an in-flight copy can be freed. ``l3_tokens``: of
    ``loaded_tokens``, those a prefetch read from L3 and that reach the device for the first time.
    """

    anchor: TreeNode
    transfers: tuple[Transfer, ...]
    pin: PinHandle
    host_pin: HostPinHandle
    loaded_tokens: int
    l3_tokens: int = 0
