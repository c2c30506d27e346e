"""Page keys for L3: a namespaced SHA-256 chain over token ids, and per-rank object names.

A page's hash identifies the whole prefix that ends with it: page ``i`` hashes its own token ids
together with page ``i - 1``'s hash, and page 0 hashes them together with the namespace digest.
Two processes (or two restarts) that agree on the namespace and the tokens therefore agree on every
key, and the same tokens under another model, salt, dtype, page size, layout or TP shape share no
key at all. Nothing here depends on Python's ``hash()`` or on ``PYTHONHASHSEED``: a request's own
namespace (LoRA id, cache salt, tenant) enters the key through ``canonical_namespace``, a typed,
length-prefixed encoding that sorts set members by their encodings rather than by hash order.

Object names add the pool and, for caches sharded across TP ranks, the rank::

    <page hash (64 hex)>.<pool>          rank-replicated caches (MLA, indexer): written by rank 0 only
    <page hash (64 hex)>.<pool>.r<rank>  sharded caches (MHA/GQA heads split over TP ranks)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["KEY_FORMAT_VERSION", "KeyScope", "Namespace", "canonical_namespace", "page_hashes"]

KEY_FORMAT_VERSION = 2
"""Bumped whenever the byte encoding below changes, so old objects can never match new keys.

2: request namespaces are folded in by ``canonical_namespace`` (1 used ``repr``, which depends on
``PYTHONHASHSEED`` for sets and lets look-alike namespaces share pages).
"""

_POOL_NAME = re.compile(r"[a-z0-9_]+")
_HASH_BYTES = 32
_LEN_BYTES = 8
# Deepest container nesting a namespace may have: far below the recursion limit, far above use.
_MAX_DEPTH = 32


def _field(value: str | int) -> bytes:
    """One namespace field as ``type tag, 8-byte length, bytes``: no two field lists share an encoding."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"namespace fields are str or int, got {type(value).__name__}")
    if isinstance(value, int):
        data, tag = str(value).encode("ascii"), b"i"
    else:
        data, tag = value.encode("utf-8"), b"s"
    return tag + len(data).to_bytes(8, "little") + data


def canonical_namespace(value: object) -> bytes:
    """The canonical bytes of a request namespace: equal namespaces alike, all others apart.

    Encoding: every value is ``tag (1 byte), payload length (8 bytes, little-endian), payload``,
    so an encoding is self-delimiting and a container's payload is its members' encodings
    concatenated:

        value                tag  payload
        None                 N    empty
        int, bool            i    two's complement, big-endian, ``n.bit_length() // 8 + 1`` bytes
        str                  s    UTF-8 (lone surrogates kept, as ``surrogatepass``)
        bytes                b    the bytes
        tuple                t    members' encodings, in order
        frozenset, set       f    members' encodings, sorted bytewise

    Why equality decides (``a == b`` exactly when the encodings are equal): the radix tree keys
    namespaces by dict lookup, so it keeps apart exactly the namespaces that compare unequal, and
    the L3 tier caches one key per namespace in a dict too. Equal encodings for unequal values
    would let one tenant read another's pages; unequal encodings for equal values would make the
    key depend on which spelling a process met first. Hence ``True`` is ``1`` and ``False`` is
    ``0`` (also inside tuples and sets, as in Python), and a ``set`` is the ``frozenset`` with the
    same members; ``1``, ``"1"``, ``b"1"`` and ``(1,)`` are all apart. Set members are sorted by
    their encodings, never iterated in hash order, so the bytes are the same in every process
    whatever ``PYTHONHASHSEED`` is.

    Only the exact types above are accepted: a subclass (an enum, a ``str`` subclass) may redefine
    ``==`` and ``hash`` and so split or join namespaces behind the encoding's back; pass its
    ``.value`` instead. Floats (``1.0 == 1``, ``nan != nan``), lists, dicts and other objects have
    no encoding that follows ``==`` and survives a restart, so they are refused.

    Args:
        value: the request namespace.

    Raises:
        TypeError: ``value`` is, or contains, a value of another type (the message names where).
        ValueError: containers nest more than 32 deep (``((x,),)`` nests 2 deep).
    """
    return _encode(value, "namespace", 0)


def _encode(value: object, where: str, depth: int) -> bytes:
    kind = type(value)
    if kind is tuple or kind is frozenset or kind is set:
        if depth >= _MAX_DEPTH:
            raise ValueError(f"namespace: {where} nests containers deeper than {_MAX_DEPTH} levels")
        if kind is tuple:
            tag = b"t"
            members = [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        else:
            # Sorting the encodings, not the values, gives one order for mixed member types.
            tag = b"f"
            members = sorted(_encode(v, f"a member of {where}", depth + 1) for v in value)
        data = b"".join(members)
    elif value is None:
        tag, data = b"N", b""
    elif kind is int or kind is bool:
        n = int(value)
        tag, data = b"i", n.to_bytes(n.bit_length() // 8 + 1, "big", signed=True)
    elif kind is str:
        tag, data = b"s", value.encode("utf-8", "surrogatepass")
    elif kind is bytes:
        tag, data = b"b", value
    else:
        raise TypeError(
            f"namespace: {where} is a {kind.__qualname__}, which has no canonical encoding; "
            "use str, bytes, int, bool, None, or tuples, frozensets and sets of them"
        )
    return tag + len(data).to_bytes(_LEN_BYTES, "little") + data


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two processes to share L3 pages.

    Attributes:
        model_id: checkpoint identity (name plus revision is best).
        dtype: KV dtype name, e.g. ``"bfloat16"``; pages of another dtype are other bytes.
        page_size: tokens per page.
        layout: host page layout, e.g. ``"page_first"``.
        namespace_key: cache salt, LoRA id or tenant; ``""`` for none.
        tp_size: TP degree for caches sharded over ranks (MHA/GQA); ``None`` for rank-replicated
            caches (MLA), whose bytes do not depend on the TP shape.
    """

    model_id: str
    dtype: str
    page_size: int
    layout: str
    namespace_key: str = ""
    tp_size: int | None = None

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be non-empty")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1 or None, got {self.tp_size}")

    def digest(self) -> bytes:
        """32-byte SHA-256 of the length-prefixed fields; seeds every page-hash chain."""
        fields: list[str | int] = [
            "kvtier-namespace",
            KEY_FORMAT_VERSION,
            self.model_id,
            self.namespace_key,
            self.dtype,
            self.page_size,
            self.layout,
            "replicated" if self.tp_size is None else "sharded",
            0 if self.tp_size is None else self.tp_size,
        ]
        return hashlib.sha256(b"".join(_field(f) for f in fields)).digest()


def page_hashes(
    tokens: Sequence[int] | np.ndarray | torch.Tensor,
    namespace: Namespace,
    prev_hash: str | None = None,
) -> list[str]:
    """Chained page hashes (64-char lowercase hex) of the full pages of ``tokens``.

    Args:
        tokens: token ids, 1-D; a trailing partial page is not hashed.
        namespace: seeds the chain when ``prev_hash`` is None.
        prev_hash: hash of the page just before ``tokens[0]``, to continue a chain.

    Each token id is encoded as 8-byte little-endian int64; page ``i``'s hash is
    ``sha256(hash[i-1] || tokens of page i)`` with ``hash[-1]`` the namespace digest.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    ids = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
    if ids.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {ids.shape}")
    raw = ids.tobytes()
    page_bytes = namespace.page_size * 8
    prev = namespace.digest() if prev_hash is None else bytes.fromhex(prev_hash)
    if len(prev) != _HASH_BYTES:
        raise ValueError(f"prev_hash must be {2 * _HASH_BYTES} hex chars, got {prev_hash!r}")
    out: list[str] = []
    for start in range(0, len(raw) - page_bytes + 1, page_bytes):
        prev = hashlib.sha256(prev + raw[start : start + page_bytes]).digest()
        out.append(prev.hex())
    return out


@dataclass(frozen=True)
class KeyScope:
    """How one TP rank names its L3 objects, and whether it writes them.

    Sharded caches (``replicated=False``): every rank holds its own head shard, writes it and names
    it with its rank. Rank-replicated caches (``replicated=True``, e.g. MLA): every rank holds the
    same bytes, so only rank 0 writes and every rank reads the same rank-free objects.
    """

    tp_rank: int = 0
    tp_size: int = 1
    replicated: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, tp_size={self.tp_size})")

    @classmethod
    def for_namespace(cls, namespace: Namespace, tp_rank: int, tp_size: int) -> KeyScope:
        """The scope of ``tp_rank`` under ``namespace`` (replicated iff its ``tp_size`` is None)."""
        if namespace.tp_size is not None and namespace.tp_size != tp_size:
            raise ValueError(f"namespace is sharded over {namespace.tp_size} ranks, not {tp_size}")
        return cls(tp_rank=tp_rank, tp_size=tp_size, replicated=namespace.tp_size is None)

    @property
    def writes(self) -> bool:
        """Whether this rank writes to L3 (always, unless replicated and not rank 0)."""
        return not self.replicated or self.tp_rank == 0

    def object_key(self, page_hash: str, pool: str) -> str:
        """Storage name of ``pool``'s object for the page ``page_hash``."""
        return self.object_keys([page_hash], pool)[0]

    def object_keys(self, page_hashes: Sequence[str], pool: str) -> list[str]:
        """``object_key`` for each of ``page_hashes``, in order."""
        if not _POOL_NAME.fullmatch(pool):
            raise ValueError(f"pool name must match [a-z0-9_]+, got {pool!r}")
        suffix = f".{pool}" if self.replicated else f".{pool}.r{self.tp_rank}"
        return [h + suffix for h in page_hashes]
