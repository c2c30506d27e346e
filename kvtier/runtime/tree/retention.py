"""Retention pins: keep a cached prefix (an agent session's) alive across a pause, until a TTL.

A retention pin is not a reference count like a request's device pin (``pins.py``): it never
stops device eviction, it changes the order and the manner of it.

- **Marks.** Every node on a retained path (root .. the pin's anchor) carries
  ``node.retention``: the highest priority of the pins covering it, or None. The marks are
  recomputed from the live handles after every change (pins are few, paths are short), and a
  split copies them to the upper piece, which is covered by exactly the pins covering the node.
- **Device.** Retained leaves sort after every unretained one; among themselves by pin priority,
  then last access (``Eviction._leaf_order``). A retained leaf leaves the device only demoted: it
  must have a host copy or get one from the write-back hook; without one it stays. SWA and Mamba
  data of a retained node leave the device only when that data has a host copy.
- **Host.** A retained node is never a host leaf, and its SWA and Mamba host data are not
  evicted: a pinned prefix is lost by no tier while its pin lives.
- **Budget.** A retained token can sit on either tier (device pressure demotes it, a hit loads
  it back), so each tier's budget bounds the union of all retained tokens (FULL tokens, counted
  once however many pins cover them). Over the budget a new pin is refused, or, with
  ``"evict_lowest"``, pins of lower priority than the new one are dropped, lowest first (then
  the soonest to expire), until it fits; if even dropping all of them would not make it fit,
  it is refused and nothing is dropped.
- **What is pinned.** The longest cached prefix of the tokens (usable from device or host, as a
  match finds it): ``RetentionHandle.tokens`` reports its length. A part only on host is pinned
  there and not loaded back (the next match loads it like any host hit). Nothing cached at all:
  the pin is refused (``ValueError``).
- **L3.** The facade backs a pin's device-only part up to host at once, under every write
  policy; the L3 backup writer (``l3/backup.py``) takes jobs covering a retained node first.
- **Time.** The part keeps no clock: the caller passes ``now`` (seconds, any monotonic origin).
  A hit (a match whose prefix covers a pin's whole prefix) moves its expiry to ``now + ttl_s``;
  ``expire(now)`` releases pins whose expiry has passed. The facade reads ``now`` from a
  :class:`RetentionClock`: under TP an agreed one, so that every rank pins, refreshes and
  expires on the same values and the trees stay identical.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from kvtier.checks import is_finite
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.types import TreeIntegrityError

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = [
    "Retention",
    "RetentionBudget",
    "RetentionClock",
    "RetentionHandle",
    "RetentionRefused",
    "check_priority",
    "check_ttl",
]

_ids = itertools.count(1)


class RetentionRefused(RuntimeError):
    """A pin over the retention budget was refused (nothing changed)."""


class RetentionClock:
    """The ``now`` retention pins are taken, refreshed and expired on.

    One rank (``agreed=False``): the cache's clock, read at each use. Under TP ranks' clocks
    differ (origin, rate, when each reads it), and a pin expiring on one rank a step before
    another would make the trees diverge. So each rank reports the milliseconds since its cache
    was built (``local_ms``, a slot of the poll vector); the least over ranks is agreed in every
    ``poll`` (``agree``), and ``now`` is that value, in seconds, on every rank. Pins taken and
    refreshed between two polls read the last agreed value, which lags by however long the
    scheduler went without a poll; they are stamped again from the next poll's value before
    anything expires (``Retention.restamp_at_poll``).
    """

    def __init__(self, clock: Callable[[], float], agreed: bool) -> None:
        self._clock = clock
        self._agreed = agreed
        self._origin = clock()
        self._now = 0.0

    def local_ms(self) -> int:
        """This rank's milliseconds since the cache was built (what it adds to the vote)."""
        return int((self._clock() - self._origin) * 1000)

    def agree(self, ms: int) -> None:
        """The least ``local_ms`` over the ranks, from the poll's all-reduce."""
        self._now = ms / 1000

    def now(self) -> float:
        return self._now if self._agreed else self._clock()


class RetentionBudget(NamedTuple):
    """Tokens pins may hold per tier, and what happens to a pin over them."""

    device_tokens: int
    host_tokens: int
    overflow: str  # "refuse" or "evict_lowest" (``config.RETENTION_OVERFLOW``)

    @property
    def limit(self) -> int:
        return min(self.device_tokens, self.host_tokens)


class RetentionHandle:
    """A retention pin, as ``TieredKVCache.pin`` returns it; pass it back to ``unpin``.

    Attributes:
        tokens: length of the pinned prefix (the cached part of the tokens asked for).
        priority: eviction priority among retained prefixes (higher stays longer).
        namespace: the namespace the prefix was matched in.
        ttl_s: seconds the pin lives after it is taken or last hit.
        expires_at: when it expires, on the cache's clock (under TP: on the agreed clock,
            seconds since the cache was built; see ``RetentionClock``).
        released: ``""`` while live; ``"unpinned"``, ``"expired"`` or ``"dropped"`` (by a
            higher-priority pin over the budget) once released.
    """

    __slots__ = (
        "_node",
        "_owner",
        "expires_at",
        "id",
        "namespace",
        "priority",
        "released",
        "tokens",
        "ttl_s",
    )

    def __init__(
        self,
        owner: Retention,
        node: TreeNode,
        priority: int,
        namespace: Hashable,
        ttl_s: float,
        expires_at: float,
    ) -> None:
        self._owner = owner
        self._node = node
        self.id = next(_ids)
        self.tokens = node.end
        self.priority = priority
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.expires_at = expires_at
        self.released = ""

    def __repr__(self) -> str:
        state = self.released or f"expires_at={self.expires_at:.3f}"
        return (
            f"RetentionHandle(id={self.id}, tokens={self.tokens}, priority={self.priority}, "
            f"{state})"
        )


def check_ttl(ttl_s: object) -> float:
    """``ttl_s`` as a float: a finite number of seconds > 0 (a forgotten pin must end)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, numbers.Real):
        raise TypeError(f"ttl_s: expected a number of seconds, got {ttl_s!r}")
    if not is_finite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"ttl_s: must be finite and > 0 seconds, got {ttl_s!r}")
    return float(ttl_s)


def check_priority(priority: object) -> int:
    if type(priority) is not int:
        raise TypeError(f"priority: expected an int, got {priority!r}")
    return priority


def _path(node: TreeNode) -> list[TreeNode]:
    """Nodes from ``node`` up to (not including) the root."""
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def _tokens(nodes: Iterable[TreeNode]) -> int:
    return sum(len(x.key) for x in nodes)


class Retention:
    """The retention pins of a tree, and the marks they leave on its nodes."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree
        self.handles: dict[int, RetentionHandle] = {}  # live pins, oldest first
        self._anchored: dict[TreeNode, list[RetentionHandle]] = {}
        # Under an agreed clock (TP) ``now`` between two polls is the last poll's: after an
        # idle spell (no polls) it lags by the spell. Pins taken or refreshed since the last
        # poll are then stamped again from the next poll's agreed time (``expire``), before
        # anything expires: a pin taken after ten idle minutes expired at the next poll (a TP
        # trial). Every rank makes the same calls, so every rank stamps the same pins.
        self.restamp_at_poll = False
        self._fresh: dict[int, RetentionHandle] = {}

    # -- books ---------------------------------------------------------------------------------

    def retained_nodes(self, handles: Iterable[RetentionHandle] | None = None) -> set[TreeNode]:
        """Nodes covered by ``handles`` (default: every live pin)."""
        out: set[TreeNode] = set()
        for h in self.handles.values() if handles is None else handles:
            x = h._node
            while x.parent is not None and x not in out:
                out.add(x)
                x = x.parent
        return out

    @property
    def retained_tokens(self) -> int:
        """FULL tokens covered by live pins, each counted once."""
        return _tokens(self.retained_nodes())

    def _remark(self, before: set[TreeNode]) -> None:
        """Recompute ``node.retention`` on the nodes retained ``before`` the change and now,
        and redo their leaf books (a mark decides whether a node is a host leaf)."""
        marks: dict[TreeNode, int] = {}
        for h in self.handles.values():
            for x in _path(h._node):
                if marks.get(x, h.priority - 1) < h.priority:
                    marks[x] = h.priority
        for x in before | marks.keys():
            mark = marks.get(x)
            if x.retention != mark:
                x.retention = mark
                self.tree._update_leaf(x)

    # -- pin, unpin, expire, refresh -----------------------------------------------------------

    def pin_prefix(
        self,
        tokens: list[int],
        namespace: Hashable,
        *,
        ttl_s: float,
        priority: int,
        now: float,
        budget: RetentionBudget,
    ) -> tuple[RetentionHandle, list[RetentionHandle]]:
        """Pin the longest cached prefix of ``tokens`` (see the module docstring); returns the
        handle and the pins dropped for it. Raises ``ValueError`` when nothing is cached and
        ``RetentionRefused`` over the budget, changing nothing either way."""
        tree = self.tree
        # Read-only first: a refused pin must not split or refresh anything.
        m = tree.match_prefix(tokens, namespace, read_only=True)
        if m.best_match_node is tree.root:
            raise ValueError(
                f"prefix: no whole page of its {len(tokens)} tokens is cached (page size "
                f"{tree.page_size}); nothing to pin"
            )
        end = m.matched_len  # not device_len + host_hit_length: see MatchResult (a soak trial)
        drop = self.admit(m.best_match_node, end, priority, budget)
        node = tree.match_prefix(tokens[:end], namespace).best_match_node
        if node.end != end:  # the same walk as the read-only one, now splitting at ``end``
            raise TreeIntegrityError(f"pin: the match ended at {node.end}, not at {end}")
        handle = self.pin(
            node, ttl_s=ttl_s, priority=priority, namespace=namespace, now=now, drop=drop
        )
        return handle, drop

    def backup_targets(self, handle: RetentionHandle) -> list[TreeNode]:
        """The nodes to back up (``backup``, top-down) so that the pinned path's device part
        has a host copy: it may then be demoted under pressure, and it survives on host."""
        x = handle._node
        while x.parent is not None and x.value[0] is None:
            x = x.parent  # the device part is a top-anchored prefix of the path
        path = [y for y in reversed(_path(x)) if self.tree.backup_chain(y)]
        # With backup continuity a backup of the bottom node takes its ancestors along.
        return path[-1:] if self.tree.backup_continuity else path

    def admit(
        self, node: TreeNode, end: int, priority: int, budget: RetentionBudget
    ) -> list[RetentionHandle]:
        """Whether a pin of the path root..``end`` fits the budget; ``node`` is the node on
        which the prefix ends (``end`` may fall inside it: a read-only match does not split).

        Returns the pins to drop to make room (``"evict_lowest"``; empty when it fits as is).
        Raises ``RetentionRefused`` when it cannot fit. Changes nothing either way.
        """
        new = set(_path(node))
        limit = budget.limit

        def need(keep: Iterable[RetentionHandle]) -> int:
            held = self.retained_nodes(keep)
            # The part of ``node`` past ``end`` is not pinned, unless another pin holds it.
            return _tokens(held | new) - (0 if node in held else node.end - end)

        if need(self.handles.values()) <= limit:
            return []
        if budget.overflow == "evict_lowest":
            victims = sorted(
                (h for h in self.handles.values() if h.priority < priority),
                key=lambda h: (h.priority, h.expires_at, h.id),
            )
            keep = dict(self.handles)
            for i, v in enumerate(victims):
                del keep[v.id]
                if need(keep.values()) <= limit:
                    return victims[: i + 1]
        lowest = budget.overflow == "evict_lowest"
        why = "no pin of lower priority frees enough" if lowest else "refused"
        raise RetentionRefused(
            f"prefix: pinning {end} tokens would exceed the retention budget of {limit} tokens "
            f"(device {budget.device_tokens}, host {budget.host_tokens}); pins hold "
            f"{self.retained_tokens} (retention_overflow={budget.overflow!r}: {why})"
        )

    def pin(
        self,
        node: TreeNode,
        *,
        ttl_s: float,
        priority: int,
        namespace: Hashable,
        now: float,
        drop: Iterable[RetentionHandle] = (),
    ) -> RetentionHandle:
        """Retain the path root..``node`` until ``now + ttl_s``, after releasing the pins in
        ``drop`` (what ``admit`` asked for) as ``"dropped"``."""
        if node.parent is None or not node.attached:
            raise ValueError(f"node: {node} is not a cached node")
        before = self.retained_nodes()
        for h in drop:
            self._forget(h, "dropped")
        handle = RetentionHandle(self, node, priority, namespace, ttl_s, now + ttl_s)
        if self.restamp_at_poll:
            self._fresh[handle.id] = handle
        self.handles[handle.id] = handle
        self._anchored.setdefault(node, []).append(handle)
        self._remark(before)
        return handle

    def unpin(self, handle: RetentionHandle) -> None:
        """Release a live pin; refuses (``TypeError``/``ValueError``, nothing changed) anything
        else: another cache's handle, a released one, an unknown one."""
        self.check_handle(handle)
        before = self.retained_nodes()
        self._forget(handle, "unpinned")
        self._remark(before)

    def check_handle(self, handle: object) -> None:
        if not isinstance(handle, RetentionHandle):
            raise TypeError(f"handle: expected a RetentionHandle from pin(), got {handle!r}")
        if handle._owner is not self:
            raise ValueError(f"handle: {handle!r} was pinned by another cache")
        if handle.released:
            raise ValueError(f"handle: {handle!r} was already released ({handle.released})")
        if self.handles.get(handle.id) is not handle:
            raise ValueError(f"handle: {handle!r} is not a live pin of this cache")

    def _forget(self, handle: RetentionHandle, why: str) -> None:
        del self.handles[handle.id]
        anchored = self._anchored[handle._node]
        anchored.remove(handle)
        if not anchored:
            del self._anchored[handle._node]
        handle.released = why

    def expire(self, now: float) -> list[RetentionHandle]:
        """Release every pin whose expiry is at or before ``now``; returns them. Under
        ``restamp_at_poll`` (the poll's agreed time), pins taken or refreshed since the last
        call first expire ``ttl_s`` from ``now``."""
        if self._fresh:
            for h in self._fresh.values():
                if not h.released:
                    h.expires_at = now + h.ttl_s
            self._fresh.clear()
        if not self.handles:
            return []
        gone = [h for h in self.handles.values() if h.expires_at <= now]
        if gone:
            before = self.retained_nodes()
            for h in gone:
                self._forget(h, "expired")
            self._remark(before)
        return gone

    def refresh(self, node: TreeNode, clock: Callable[[], float]) -> int:
        """A match reached ``node``: every pin whose whole prefix it covers (anchored on the
        path root..``node``) expires ``ttl_s`` from now. Returns how many were refreshed."""
        if not self._anchored:
            return 0
        now, n = None, 0
        while node.parent is not None:
            for h in self._anchored.get(node, ()):
                if now is None:
                    now = clock()
                h.expires_at = now + h.ttl_s
                if self.restamp_at_poll:
                    self._fresh[h.id] = h
                n += 1
            node = node.parent
        return n

    # -- integrity -----------------------------------------------------------------------------

    def check(self, budget: RetentionBudget | None = None) -> None:
        """Recount the marks from the live pins and check that no retained node was lost."""
        retained = self.retained_nodes()
        for h in self.handles.values():
            x = h._node
            if not x.attached or x.end != h.tokens:
                raise TreeIntegrityError(f"{h!r}: its anchor {x} left the tree or moved")
        for x in retained:
            if not x.attached:
                raise TreeIntegrityError(f"retained {x} was deleted")
            if x.value[0] is None and x.host_value[0] is None:
                raise TreeIntegrityError(f"retained {x} has no FULL data on any tier")
        stack = [self.tree.root]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            want = None
            if x in retained:
                want = max(h.priority for h in self.handles.values() if x in _path(h._node))
            if x.retention != want:
                raise TreeIntegrityError(f"{x}: retention mark {x.retention}, pins say {want}")
            if want is not None and x in self.tree.host_leaves:
                raise TreeIntegrityError(f"retained {x} is in the host leaf set")
        if budget is not None and _tokens(retained) > budget.limit:
            raise TreeIntegrityError(
                f"pins hold {_tokens(retained)} tokens, over the budget of {budget.limit}"
            )
        for node, hs in self._anchored.items():
            for h in hs:
                if self.handles.get(h.id) is not h or h._node is not node:
                    raise TreeIntegrityError(f"{h!r}: anchored on {node} but not live there")
        if sum(len(hs) for hs in self._anchored.values()) != len(self.handles):
            raise TreeIntegrityError("retention: anchored handles differ from live handles")
