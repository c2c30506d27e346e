"""Page keys as an instance and its subscribers compute them: the L3 chain hashes.

``key_namespace`` is the seed ``kvtier.runtime.l3.pools.namespace_for`` gives a request (the
deployment salt's and the request namespace's canonical encodings back to back), rebuilt from the
fields an instance publishes (``InstanceInfo``), so that a router hashes a prompt exactly as the
instance and its L3 store do, also on instances without L3 (tests/events check both agree).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Hashable, Sequence

from kvtier.storage.keys import Namespace, canonical_namespace, page_hashes

__all__ = ["KeySeed", "chain_hashes", "key_namespace", "prompt_hashes"]

# Keys are little-endian int64 in the page-hash format; "<q" packs that on any platform, but
# the fallback (numpy) is kept for big-endian hosts, where nothing here was measured.
_NATIVE_LE = sys.byteorder == "little"
_PACKERS: dict[int, struct.Struct] = {}  # key length -> its packer
_MAX_PACKERS = 4096  # distinct key lengths packed this way (beyond: page_hashes)


class KeySeed:
    """The instance-wide part of the page-key seed (``InstanceInfo`` carries the same fields).

    Caches one ``Namespace`` per request namespace: the digest is computed once.
    """

    __slots__ = (
        "_cache",
        "digests",
        "dtype",
        "layout",
        "model_id",
        "page_size",
        "salt",
        "tp_size",
    )

    def __init__(
        self, model_id: str, dtype: str, page_size: int, layout: str, tp_size: int | None, salt: str
    ) -> None:
        if not model_id:
            raise ValueError(
                "model_id: needed for KV events (page hashes name the checkpoint), got ''"
            )
        self.model_id, self.dtype, self.page_size = model_id, dtype, page_size
        self.layout, self.tp_size, self.salt = layout, tp_size, salt
        self._cache: dict[Hashable, Namespace] = {}
        self.digests: dict[Hashable, str] = {}  # filled by digest_hex

    @classmethod
    def of(cls, info) -> KeySeed:
        """From an ``InstanceInfo`` (or anything with its key fields)."""
        return cls(info.model_id, info.dtype, info.page_size, info.layout, info.tp_size, info.salt)

    def namespace(self, request_namespace: Hashable) -> Namespace:
        ns = self._cache.get(request_namespace)
        if ns is None:
            ns = key_namespace(self, request_namespace)
            self._cache[request_namespace] = ns
        return ns

    def digest_hex(self, request_namespace: Hashable) -> str:
        """The chain's seed (the namespace digest) as ``page_hashes``' ``prev_hash``."""
        d = self.digests.get(request_namespace)
        if d is None:
            d = self.digests[request_namespace] = self.namespace(request_namespace).digest().hex()
        return d


def key_namespace(seed: KeySeed, request_namespace: Hashable) -> Namespace:
    """The L3 ``Namespace`` of a request (see ``namespace_for``)."""
    joined = bytes.fromhex(seed.salt) + canonical_namespace(request_namespace)
    return Namespace(
        model_id=seed.model_id,
        dtype=seed.dtype,
        page_size=seed.page_size,
        layout=seed.layout,
        namespace_key=joined.hex(),
        tp_size=seed.tp_size,
    )


def prompt_hashes(seed: KeySeed, tokens: Sequence[int], request_namespace: Hashable) -> list[str]:
    """Hex page hashes of the whole pages of ``tokens``."""
    return page_hashes(tokens, seed.namespace(request_namespace))


def chain_hashes(tokens: list[int], namespace: Namespace, prev_hex: str) -> list[str]:
    """``page_hashes(tokens, namespace, prev_hex)`` for a list of token ids, without numpy: the
    sink hashes a few pages per step, where numpy's conversion of a short list costs more than
    the hashing itself (tests/events check both agree)."""
    n = len(tokens)
    packer = _PACKERS.get(n)
    if packer is None:
        if not _NATIVE_LE or len(_PACKERS) >= _MAX_PACKERS:
            return page_hashes(tokens, namespace, prev_hex)
        packer = _PACKERS[n] = struct.Struct(f"<{n}q")
    try:
        # One C call for the whole key (a cached Struct per length): half of array('q')'s cost.
        raw = packer.pack(*tokens)
    except struct.error:
        return page_hashes(tokens, namespace, prev_hex)  # raises as the L3 keys do
    step = namespace.page_size * 8
    prev = bytes.fromhex(prev_hex)
    sha = hashlib.sha256
    digests = []
    for start in range(0, len(raw) - step + 1, step):
        prev = sha(prev + raw[start : start + step]).digest()
        digests.append(prev)
    return [d.hex() for d in digests]
