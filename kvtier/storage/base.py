"""The L3 storage contract: multi-pool page transfers, hit policies, and the backend registry.

A transfer moves the pages of one pool (``"kv"``, ``"swa"``, ``"mamba"``, ``"indexer"``, ...)
between L3 and host page buffers. Its keys are page hashes (``keys.page_hashes``); the backend
turns each into an object name with the pool suffix and, for sharded caches, the TP rank
(``keys.KeyScope``). A host page is a 1-D uint8 CPU tensor, or a list of them whose
concatenation is the page object (a page_first pool's K range and V range), normally zero-copy
views into the pinned host pool (``HostPool.page_views``).

The public entry points (``exists``, ``get``, ``set``) validate every key before a backend sees
it, so no backend ever turns a caller's string into a path or an object name unchecked. A page
hash must be 64 lowercase hex characters, and the object name built from it must have the form
``keys.KeyScope`` gives (``validate_key``). A malformed key fails its own page only, the way a
miss does: ``exists`` counts it absent, ``get``/``set`` report it ``False`` and count it in
``TierMetrics.add_failed_pages``; the batch's other pages are unaffected. Misuse of a whole
call (a bad pool name, ``keys`` given as one string, mismatched page buffers) raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import operator
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from kvtier.metrics import Direction, Tier, TierMetrics
from kvtier.storage.keys import KeyScope
from kvtier.storage.spans import PageSpans, SpanPages, select_pages

__all__ = [
    "ALL_PAGES",
    "MAX_KEY_LENGTH",
    "MAX_POOL_LENGTH",
    "TRAILING_PAGES",
    "BatchResult",
    "HitPolicy",
    "PageSpans",
    "PoolTransfer",
    "StorageBackend",
    "available_backends",
    "check_modes",
    "create_backend",
    "register_backend",
    "usable_prefix",
    "validate_key",
]

log = logging.getLogger(__name__)
_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")

Page = torch.Tensor | Sequence[torch.Tensor]
"""One host page: a 1-D uint8 tensor, or the parts whose concatenation is the page object."""
Parts = tuple[torch.Tensor, ...]

MAX_POOL_LENGTH = 64
"""Longest pool name a transfer may use."""
MAX_KEY_LENGTH = 160
"""Longest object name: a 64-char hash, a pool name of ``MAX_POOL_LENGTH``, a rank, with room to
spare; a backend's own decorations (the file store's suffix and temp-file tag) must still fit
a 255-byte file name."""

_PAGE_HASH = re.compile(r"[0-9a-f]{64}")
_HEX_DIGITS = b"0123456789abcdef"
_OBJECT_KEY = re.compile(r"[0-9a-f]{64}\.[a-z0-9_]+(?:\.r(?:0|[1-9][0-9]*))?")


def _shown(key: object) -> str:
    """``repr(key)``, cut short so that a huge key cannot flood a message or a log line."""
    text = repr(key)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _key_problem(key: object) -> str | None:
    """Why ``key`` is not a valid object name, or None if it is one."""
    if isinstance(key, str) and len(key) <= MAX_KEY_LENGTH and _OBJECT_KEY.fullmatch(key):
        return None  # the format alone rules out separators, NUL and "..": the common case
    if not isinstance(key, str):
        return f"must be a str, got {type(key).__name__}"
    if not key:
        return "is empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"is {len(key)} chars long, more than {MAX_KEY_LENGTH}"
    if "\0" in key:
        return "contains NUL"
    if "/" in key or "\\" in key:
        return "contains a path separator"
    if ".." in key:
        return "contains '..'"
    return "is not '<64 lowercase hex>.<pool>' or '<64 lowercase hex>.<pool>.r<rank>'"


def _hash_problem(page_hash: object) -> str | None:
    """Why ``page_hash`` is not a page hash, or None if it is one.

    Checked before the pool suffix is added: a "hash" that carries a suffix of its own could
    otherwise name another pool's object (``<hash>.kv`` in pool ``r0`` gives ``<hash>.kv.r0``).
    """
    if not isinstance(page_hash, str):
        return f"must be a str, got {type(page_hash).__name__}"
    if not _PAGE_HASH.fullmatch(page_hash):
        return "is not a page hash (64 lowercase hex chars)"
    return None


def check_modes(cfg: object) -> None:
    """A file store config's ``root`` (a non-empty path, as str or ``os.PathLike``, without NUL),
    and its ``dir_mode`` and ``file_mode``: permission bits within 0o777 that keep the owner's
    access (the root's permissions are the store's security boundary)."""
    root = cfg.root
    path = os.fspath(root) if isinstance(root, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise TypeError(f"root: expected a str or os.PathLike path, got {root!r}")
    if not path or "\0" in path:
        raise ValueError(f"root: expected a non-empty path without NUL, got {path!r}")
    for name, owner in (("dir_mode", 0o700), ("file_mode", 0o600)):
        mode = getattr(cfg, name)
        if isinstance(mode, bool) or not isinstance(mode, int):
            raise TypeError(f"{name} must be an int, got {type(mode).__name__} {mode!r}")
        if not 0 <= mode <= 0o777 or mode & owner != owner:
            raise ValueError(
                f"{name} must be permission bits within 0o777 that include {owner:#o}, "
                f"got {mode:#o}"
            )


def validate_key(key: object) -> str:
    """``key`` itself if it is a valid object name (``<hash>.<pool>`` or ``<hash>.<pool>.r<rank>``,
    at most ``MAX_KEY_LENGTH`` chars); else ``TypeError`` (not a str) or ``ValueError``, naming it.

    Such a name is one plain file name: no path separator, NUL, ``..`` or upper case.
    """
    problem = _key_problem(key)
    if problem is not None:
        error = ValueError if isinstance(key, str) else TypeError
        raise error(f"key {_shown(key)} {problem}")
    return key  # type: ignore[return-value]  # a str, checked above


@dataclass(frozen=True)
class HitPolicy:
    """Which pages of a prefix a pool needs: all of them, or only the last ``trailing``."""

    trailing: int | None = None

    def __post_init__(self) -> None:
        if self.trailing is not None and self.trailing < 1:
            raise ValueError(f"TRAILING_PAGES needs n >= 1, got {self.trailing}")

    def __repr__(self) -> str:
        return "ALL_PAGES" if self.trailing is None else f"TRAILING_PAGES({self.trailing})"


ALL_PAGES = HitPolicy()
"""Every page of the prefix must exist in this pool (KV, DSA indexer, compressed KV)."""


def TRAILING_PAGES(n: int) -> HitPolicy:
    """Only the last ``n`` pages of the prefix must exist (SWA: window pages; Mamba: 1)."""
    return HitPolicy(trailing=n)


@dataclass(frozen=True)
class PoolTransfer:
    """The pages of one pool in one batch call.

    Attributes:
        pool: pool name, ``[a-z0-9_]+``; at most one transfer per pool in a call.
        keys: one page hash per page. For ``exists`` these are the hashes of every page of the
            candidate prefix, whatever the policy; for ``get``/``set`` the pages to move.
        pages: for ``get``/``set``, one host page per key: a 1-D contiguous uint8 CPU tensor, or a
            sequence of them whose concatenation is the page object; or the whole batch as
            ``PageSpans`` (byte ranges of one host buffer, no tensor per page:
            ``HostPool.page_spans``). ``get`` writes into them; ``set`` only reads them. Unused
            by ``exists``.
        policy: the pool's hit policy, used by ``exists``.
    """

    pool: str
    keys: Sequence[str]
    pages: Sequence[Page] | PageSpans = ()
    policy: HitPolicy = field(default=ALL_PAGES)


class BatchResult(NamedTuple):
    """Per pool, per page: whether that page was moved (and, on read, verified)."""

    ok: dict[str, list[bool]]

    def hit_pages(self, pool: str) -> int:
        """Length of the leading run of successful pages of ``pool``."""
        flags = self.ok[pool]
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    @property
    def all_ok(self) -> bool:
        return all(all(flags) for flags in self.ok.values())


def _best_under(flags: Sequence[bool], policy: HitPolicy, bound: int) -> int:
    """Largest prefix length ``l <= bound`` whose pages ``flags`` satisfies under ``policy``."""
    if policy.trailing is None:
        return next((i for i in range(bound) if not flags[i]), bound)
    n, length = policy.trailing, bound
    while length > 0:
        # A missing page j rules out every prefix whose trailing window holds it: j+1..j+n.
        missing = next(
            (j for j in range(length - 1, max(0, length - n) - 1, -1) if not flags[j]), -1
        )
        if missing < 0:
            return length
        length = missing
    return 0


def usable_prefix(present: Sequence[Sequence[bool]], policies: Sequence[HitPolicy]) -> int:
    """Longest prefix (in pages) usable in every pool, given which pages each pool holds.

    ``present[p][i]`` says whether pool ``p`` holds page ``i``. A prefix of ``l`` pages is usable
    by an ``ALL_PAGES`` pool when it holds pages ``0..l-1``, and by a ``TRAILING_PAGES(n)`` pool when
    it holds pages ``max(0, l-n)..l-1``. Iterates to the fixed point: each pool lowers the bound to
    its best prefix under it, until no pool lowers it.
    """
    if not present:
        return 0
    bound = min(len(flags) for flags in present)
    while True:
        lowered = min(_best_under(f, pol, bound) for f, pol in zip(present, policies))
        if lowered == bound:
            return bound
        bound = lowered


class StorageBackend(ABC):
    """An L3 store of page objects, shared by the prefetch and backup threads.

    Rules every backend keeps:

    * Thread-safe: ``exists``, ``get``, ``set``, ``delete`` and ``clear`` may run concurrently
      from any threads.
    * Zero-copy: page bytes go straight between the caller's page buffers and the store (a
      syscall's or the transport's own buffer); no intermediate Python copy on the hot path.
    * Every stored object carries a checksum of its payload, bound to its key: a header with the
      checksum and a digest of the key (``page_format``), or, in the segment store, the journal
      entry that names the key. A read that fails verification is a miss: it is counted in
      ``TierMetrics.add_checksum_miss``, the page is reported as failed, and the stored object
      is dropped so a later backup can rewrite it.
    * Failures are reported per page, never raised: an unreachable or dying store makes the
      affected pages ``False`` in bounded time. Only misuse (bad arguments) raises.
    * ``set`` is idempotent: a key already stored is not rewritten and reports success.
    * Under a rank-replicated ``KeyScope`` only rank 0 writes; ``set`` on another rank writes
      nothing and reports success, since rank 0 stores the same bytes under the same keys.
    """

    name: ClassVar[str]

    def __init__(self, *, scope: KeyScope | None = None, metrics: TierMetrics | None = None):
        self.scope = scope or KeyScope()
        self.metrics = metrics or TierMetrics()

    # -- what a backend implements ------------------------------------------------------------

    @abstractmethod
    def _contains(self, object_keys: list[str]) -> list[bool]:
        """Whether each object exists (a stale ``True`` is allowed; ``get`` will then fail)."""

    @abstractmethod
    def _read(self, object_keys: list[str], pages: Sequence[Parts]) -> list[bool]:
        """Read and verify each object into its page's parts; ``False`` per missing/bad page.

        ``pages`` is a sequence of parts tuples, not always a list: where the caller gave
        ``PageSpans`` it is a ``spans.SpanPages``, whose indexing makes a page's tensors anew
        each time (a backend that reads its arrays, as the segment store does, makes none)."""

    @abstractmethod
    def _write(self, object_keys: list[str], pages: Sequence[Parts]) -> list[bool]:
        """Store each page (its parts, concatenated) under its object key unless stored
        (``pages`` as in ``_read``)."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every object this backend stored."""

    def _delete(self, object_keys: list[str]) -> list[bool]:
        """Remove each object; per key whether it is gone now (removed, or absent already).
        A backend that cannot remove single objects leaves this out (``delete`` then raises
        ``NotImplementedError``)."""
        raise NotImplementedError

    def register_host_buffer(self, buffer: torch.Tensor) -> None:
        """Declare a host memory region (a whole host pool) that page buffers will view.

        Backends that move bytes by DMA or RDMA register it with their transport; page buffers
        passed to ``get``/``set`` must then lie inside a registered region.
        """

    def close(self) -> None:
        """Release connections and registrations; the backend is unusable afterwards."""

    def _check_buffers(self, pages: Sequence[Parts]) -> None:
        """Raise ``ValueError`` for page buffers this backend cannot move (e.g. unregistered)."""

    # -- the batch API ----------------------------------------------------------------------------

    def contains(self, pool: str, hashes: Sequence[str]) -> list[bool]:
        """Whether each of ``pool``'s pages ``hashes`` is in the store, page by page (``exists``
        answers for a prefix). A store error or a malformed key reads as absence (a store
        error also counted in ``failed_pages.read``)."""
        t = PoolTransfer(pool, list(hashes))
        self._check_pools([t])
        names = self._object_keys(t)
        flat = [k for k in names if k is not None]
        try:
            found = iter(self._contains(flat) if flat else [])
        except Exception:
            log.exception("%s: contains failed for %d objects", self.name, len(flat))
            self.metrics.add_failed_pages(Direction.READ, len(flat))
            return [False] * len(names)
        return [k is not None and bool(next(found)) for k in names]

    def exists(self, transfers: Sequence[PoolTransfer]) -> int:
        """Usable prefix length in pages: the minimum over pools under their hit policies.

        Every transfer lists the same number of page hashes (the candidate prefix). A store error
        or a malformed key counts as absence (a store error also in ``failed_pages.read``).
        """
        self._check_pools(transfers)
        if not transfers:
            return 0
        lengths = {len(t.keys) for t in transfers}
        if len(lengths) != 1:
            raise ValueError(
                f"exists needs the same page count in every pool, got {sorted(lengths)}"
            )
        names = [self._object_keys(t) for t in transfers]
        flat = [k for keys in names for k in keys if k is not None]
        try:
            found = iter(self._contains(flat) if flat else [])
        except Exception:
            log.exception("%s: exists failed for %d objects", self.name, len(flat))
            # Counted, so that a store that cannot answer does not pass for a cold cache.
            self.metrics.add_failed_pages(Direction.READ, len(flat))
            return 0
        present = [[k is not None and bool(next(found)) for k in keys] for keys in names]
        return usable_prefix(present, [t.policy for t in transfers])

    def get(self, transfers: Sequence[PoolTransfer]) -> BatchResult:
        """Read every listed page into its page buffer; per-page success.

        A page reported ``False`` was not served: its buffer's contents are then undefined (it may
        hold part of the object or bytes that failed verification) and must not be used.
        """
        return self._move(transfers, Direction.READ)

    def set(self, transfers: Sequence[PoolTransfer]) -> BatchResult:
        """Store every listed page buffer; per-page success. Existing keys are not rewritten."""
        if not self.scope.writes:
            self._check_pages(transfers)
            ok = {t.pool: [k is not None for k in self._object_keys(t)] for t in transfers}
            failed = sum(len(flags) - sum(flags) for flags in ok.values())
            if failed:
                self.metrics.add_failed_pages(Direction.WRITE, failed)
            return BatchResult(ok)
        return self._move(transfers, Direction.WRITE)

    def delete(self, transfers: Sequence[PoolTransfer]) -> BatchResult:
        """Remove every listed page (``keys`` only; ``pages`` are not used); per page whether it
        is gone now: removed, or not stored to begin with. A malformed key fails its own page
        (``False``), as in ``get``/``set``; a page the store could not remove is ``False`` too.
        Writes in flight may land afterwards. Under a rank-replicated ``KeyScope`` only rank 0
        removes (another rank removes nothing and reports success, as ``set`` writes nothing).

        ``NotImplementedError`` where the backend cannot remove single pages (use ``clear``).
        """
        if type(self)._delete is StorageBackend._delete:
            raise NotImplementedError(f"storage backend {self.name!r} cannot delete single pages")
        self._check_pools(transfers)
        names = [k for t in transfers for k in self._object_keys(t)]
        keys = [k for k in names if k is not None]
        gone = iter([True] * len(keys))
        if self.scope.writes and keys:
            try:
                answers = list(self._delete(keys))
                if len(answers) != len(keys):
                    raise RuntimeError(f"{len(answers)} answers for {len(keys)} pages")
                gone = iter(answers)
            except Exception:
                log.exception("%s: delete of %d pages failed", self.name, len(keys))
                gone = iter([False] * len(keys))
        done = [k is not None and bool(next(gone)) for k in names]
        out: dict[str, list[bool]] = {}
        start = 0
        for t in transfers:
            out[t.pool] = done[start : start + len(t.keys)]
            start += len(t.keys)
        return BatchResult(out)

    # -- shared plumbing ---------------------------------------------------------------------------

    def _object_keys(self, t: PoolTransfer) -> list[str | None]:
        """The object name of each page of ``t``; None for a page whose key is malformed."""
        hashes = list(t.keys)
        fast = self._object_keys_valid(hashes, t.pool)
        if fast is not None:
            return fast  # type: ignore[return-value]  # every key valid: the common case
        good = [i for i, h in enumerate(hashes) if _hash_problem(h) is None]
        out: list[str | None] = [None] * len(hashes)
        for i, key in zip(good, self.scope.object_keys([hashes[i] for i in good], t.pool)):
            # A valid hash and pool always give a valid name; checked all the same, because this
            # is the one gate between a caller's strings and a backend's paths and object names.
            out[i] = key if _key_problem(key) is None else None
        if len(good) < len(hashes):
            i = next(i for i, k in enumerate(out) if k is None)
            problem = _hash_problem(hashes[i]) or "gives a malformed object name"
            log.warning(
                "%s: pool %r: %d of %d keys refused, e.g. page %d: key %s %s",
                self.name,
                t.pool,
                out.count(None),
                len(hashes),
                i,
                _shown(hashes[i]),
                problem,
            )
        return out

    def _object_keys_valid(self, hashes: list[object], pool: str) -> list[str] | None:
        """The object names of ``hashes`` when every one is a page hash, else None: the batch's
        check with a few C-speed passes over the joined hashes and one name check for the pool
        suffix, instead of two regexes per page (a regex over the joined text cost ~0.4 us per
        page; these passes ~0.05).

        Why they cover every page: the joined text (``join`` refuses a non-str) must be ASCII,
        exactly ``65 * len(hashes) - 1`` chars long, hold a newline at every 65th place (64,
        129, ...) and nothing but lowercase hex digits besides those ``len(hashes) - 1``
        newlines. Then the newlines are exactly the separators put there, and each hash is one
        run of 64 lowercase hex chars.
        """
        if not hashes:
            return []
        try:
            joined = "\n".join(hashes)  # type: ignore[arg-type]  # TypeError for a non-str
        except TypeError:
            return None
        n = len(hashes)
        if len(joined) != 65 * n - 1 or not joined.isascii():
            return None
        raw = joined.encode("ascii")
        seps = b"\n" * (n - 1)
        if raw[64::65] != seps or raw.translate(None, _HEX_DIGITS) != seps:
            return None
        names = self.scope.object_keys(hashes, pool)  # type: ignore[arg-type]  # all str
        # The names differ only in their hash, so one check covers the pool and rank suffix.
        return names if _key_problem(names[0]) is None else None

    def _move(self, transfers: Sequence[PoolTransfer], direction: Direction) -> BatchResult:
        pages = self._check_pages(transfers)
        names = [k for t in transfers for k in self._object_keys(t)]
        self._check_buffers(pages)
        if None in names:
            todo = [i for i, k in enumerate(names) if k is not None]
            keys, some = [names[i] for i in todo], select_pages(pages, todo)
        else:  # every key valid: the common case
            todo, keys, some = list(range(len(names))), names, pages  # type: ignore[assignment]
        start = time.perf_counter()
        done = [False] * len(names)
        try:
            if todo:
                moved_ok = (
                    self._read(keys, some)
                    if direction is Direction.READ
                    else self._write(keys, some)
                )
                if len(todo) == len(names) == len(moved_ok):  # every key valid: the common case
                    done = list(map(bool, moved_ok))
                else:
                    for i, ok in zip(todo, moved_ok):
                        done[i] = bool(ok)
        except Exception:
            log.exception("%s: %s of %d pages failed", self.name, direction.value, len(keys))
            done = [False] * len(names)
        seconds = time.perf_counter() - start
        if isinstance(pages, SpanPages):
            moved = (
                pages.nbytes() if all(done) else sum(itertools.compress(pages.page_bytes(), done))
            )
        elif all(done):
            moved = sum(map(_NBYTES, itertools.chain.from_iterable(pages)))
        else:
            moved = sum(part.nbytes for parts, ok in zip(pages, done) if ok for part in parts)
        self.metrics.add_transfer(Tier.STORAGE, direction, moved, seconds)
        failed = len(done) - sum(done)
        if failed:
            self.metrics.add_failed_pages(direction, failed)
        out: dict[str, list[bool]] = {}
        start = 0
        for t in transfers:
            out[t.pool] = list(done[start : start + len(t.keys)])
            start += len(t.keys)
        return BatchResult(out)

    @staticmethod
    def _check_pools(transfers: Sequence[PoolTransfer]) -> None:
        pools = [t.pool for t in transfers]
        if len(set(pools)) != len(pools):
            raise ValueError(f"one transfer per pool per call, got pools {pools}")
        for t in transfers:
            if isinstance(t.pool, str) and len(t.pool) > MAX_POOL_LENGTH:
                raise ValueError(
                    f"pool name must be at most {MAX_POOL_LENGTH} chars, got {_shown(t.pool)}"
                )
            if isinstance(t.keys, (str, bytes)):
                raise TypeError(
                    f"pool {t.pool!r}: keys must be a sequence of page hashes, got one "
                    f"{type(t.keys).__name__} {_shown(t.keys)}"
                )

    @classmethod
    def _check_pages(cls, transfers: Sequence[PoolTransfer]) -> Sequence[Parts]:
        """Validate the transfers; every page of every transfer, in order, as a tuple of parts
        (``SpanPages`` where every transfer gives ``PageSpans``: no tensor per page)."""
        cls._check_pools(transfers)
        for t in transfers:
            if len(t.pages) != len(t.keys):
                raise ValueError(
                    f"pool {t.pool!r}: {len(t.keys)} keys but {len(t.pages)} page buffers"
                )
            if isinstance(t.pages, PageSpans):
                t.pages.check(t.pool)
        if transfers and all(isinstance(t.pages, PageSpans) for t in transfers):
            return SpanPages([t.pages for t in transfers])  # type: ignore[misc]
        out: list[Parts] = []
        for t in transfers:
            if isinstance(t.pages, PageSpans):  # mixed with lists of tensors: made into tensors
                out += [t.pages.page(i) for i in range(len(t.pages))]
                continue
            tensor, uint8 = torch.Tensor, torch.uint8
            pages = t.pages
            if (
                isinstance(pages, (list, tuple))
                and set(map(type, pages)) <= {tensor}
                and set(map(_DTYPE, pages)) <= {uint8}
                and set(map(tensor.dim, pages)) <= {1}
                and all(map(tensor.is_contiguous, pages))
                and all(map(_IS_CPU, pages))
            ):
                # The common case (one tensor a page), checked in C loops: the same checks as
                # the loop below at a fraction of its cost per page.
                out += [(page,) for page in pages]
                continue
            for i, page in enumerate(pages):
                if (
                    isinstance(page, tensor)
                    and page.dtype is uint8
                    and page.dim() == 1
                    and page.is_contiguous()
                    and page.is_cpu
                ):
                    out.append((page,))  # the common case, without the loop over parts
                    continue
                parts = (page,) if isinstance(page, tensor) else tuple(page)
                for p in parts:
                    if (
                        not isinstance(p, tensor)
                        or p.dtype is not uint8
                        or p.dim() != 1
                        or not p.is_contiguous()
                        or not p.is_cpu
                    ):
                        got = (
                            f"{p.dtype} shape {tuple(p.shape)} on {p.device}"
                            if isinstance(p, torch.Tensor)
                            else type(p).__name__
                        )
                        raise ValueError(
                            f"pool {t.pool!r} page {i}: need 1-D contiguous uint8 CPU tensors, "
                            f"got {got}"
                        )
                if not parts:
                    raise ValueError(f"pool {t.pool!r} page {i}: no parts")
                out.append(parts)
        return out


# -- registry -------------------------------------------------------------------------------------

_REGISTRY: dict[str, str | type[StorageBackend]] = {
    "file": "kvtier.storage.file_backend:FileBackend",
    "file_per_page": "kvtier.storage.file_backend:FilePerPageBackend",
    "mooncake": "kvtier.storage.mooncake_backend:MooncakeBackend",
}


def register_backend(name: str, backend: str | type[StorageBackend]) -> None:
    """Make ``create_backend(name)`` build ``backend``: a class, or ``"module:Class"`` to import
    lazily on first use (so a backend's third-party package is only needed when chosen)."""
    if name in _REGISTRY:
        raise ValueError(f"storage backend {name!r} is already registered")
    _REGISTRY[name] = backend


def available_backends() -> list[str]:
    """Names ``create_backend`` accepts."""
    return sorted(_REGISTRY)


def _backend_class(name: str) -> type[StorageBackend]:
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"backend: unknown storage backend {name!r}; choose one of {available_backends()}"
        ) from None
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def backend_config(name: str, config: Mapping[str, Any], *, complete: bool = True) -> Any:
    """Backend ``name``'s ``Config`` built from ``config`` (``create_backend``'s keyword
    arguments), with errors that name ``backend`` or ``backend_config``: an unknown backend, a
    key the backend does not take, a required key missing, a value its ``Config`` refuses.
    ``complete=False`` (a config whose backend may come built, as ``TieredKVCache(...,
    storage_backend=)``, or be registered later): a name not registered, a backend that
    cannot be imported here, or a ``Config`` that is not a dataclass pass unchecked, required
    keys may be missing, and what is given is checked; returns None unless it built one."""
    if complete:
        cls = _backend_class(name).Config  # type: ignore[attr-defined]
    else:
        if name not in _REGISTRY:
            return None
        try:
            cls = _backend_class(name).Config  # type: ignore[attr-defined]
        except Exception:  # e.g. its package is not installed here: create_backend will say
            return None
        if not dataclasses.is_dataclass(cls):
            return None
    if not dataclasses.is_dataclass(cls):
        return cls(**config)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = sorted(set(config) - names)
    if unknown:
        raise TypeError(
            f"backend_config: {', '.join(map(repr, unknown))} is not a setting of the {name!r} "
            f"backend; its settings: {sorted(names)}"
        )
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [k for k in required if k not in config]
    if missing:
        if not complete:
            return None
        raise TypeError(f"backend_config: the {name!r} backend needs {', '.join(missing)}")
    try:
        return cls(**config)
    except (TypeError, ValueError) as e:
        raise type(e)(f"backend_config: {e}") from None


def create_backend(
    name: str,
    *,
    scope: KeyScope | None = None,
    metrics: TierMetrics | None = None,
    **config: Any,
) -> StorageBackend:
    """Build backend ``name``; ``config`` goes to its ``Config`` dataclass, which validates it
    (``backend_config``)."""
    cfg = backend_config(name, config)
    return _backend_class(name)(cfg, scope=scope, metrics=metrics)
