"""The frozen, validated configuration of a tiered KV cache (what a model runner builds once).

Both configs refuse bad input on construction (and so on ``dataclasses.replace``): a field of the
wrong type raises ``TypeError``, a value out of range ``ValueError``; each message names the field
and shows the value. A configuration that is valid but works against itself (see
``KVTierConfigWarning``) is built, with a warning.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.checks import is_finite
from kvtier.kernels.dispatch import check_io_backend
from kvtier.kernels.kv_transfer import TransferKnobs
from kvtier.kernels.layout import HostLayout
from kvtier.runtime.pools.indexer import INDEXER, indexer_spec
from kvtier.runtime.pools.mamba import MambaStateSpec
from kvtier.runtime.pools.sidecar import SidecarSpec
from kvtier.storage.base import backend_config
from kvtier.storage.keys import canonical_namespace

__all__ = [
    "FULL_POOLS",
    "LAYER_KINDS",
    "PREFETCH_POLICIES",
    "RETENTION_OVERFLOW",
    "WRITE_POLICIES",
    "CacheConfig",
    "KVTierConfigWarning",
    "SidecarSpec",
    "StorageConfig",
]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LAYER_KINDS = ("full", "swa", "mamba")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
RETENTION_OVERFLOW = ("refuse", "evict_lowest")
FULL_POOLS = ("kv", "logical")


class KVTierConfigWarning(UserWarning):
    """A configuration that is valid but defeats one of its own tiers."""


# -- field checks: each raises naming the field and showing the value ------------------------


def _number(obj: object, name: str, kind: type, what: str, optional: bool) -> object:
    """The field's value if it is a ``kind`` (bools refused), else None when optional and None;
    raises TypeError naming the field otherwise."""
    v = getattr(obj, name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise TypeError(
            f"{name}: expected {what}{' or None' if optional else ''}, got {v!r} "
            f"({type(v).__name__})"
        )
    return v


def _int(obj: object, name: str, *, optional: bool = False, minimum: int | None = None) -> None:
    """Check an int field (bools and floats refused, integral numpy scalars stored as int)."""
    v = _number(obj, name, numbers.Integral, "an int", optional)
    if v is None:
        return
    object.__setattr__(obj, name, int(v))
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v!r}")


def _real(obj: object, name: str, *, optional: bool = False) -> None:
    """Check a finite real field: nan and inf would turn comparisons (timeouts, limits) off."""
    v = _number(obj, name, numbers.Real, "a number", optional)
    if v is not None and not is_finite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")


def _typed(obj: object, name: str, types: type | tuple[type, ...], what: str) -> None:
    v = getattr(obj, name)
    if not isinstance(v, types):
        raise TypeError(f"{name}: expected {what}, got {v!r} ({type(v).__name__})")


def _dtype(value: object, name: str) -> None:
    if isinstance(value, torch.dtype):
        return
    hint = ""
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        hint = f"; pass torch.{value}"
    raise TypeError(f"{name}: expected a torch.dtype, got {value!r} ({type(value).__name__}){hint}")


def _device(value: object) -> None:
    """The pools live on CPU or on an existing CUDA device."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(
            f"device: expected a str or torch.device, got {value!r} ({type(value).__name__})"
        )
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device: cannot parse {value!r} as a torch device ({e})") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"device: pools live on 'cpu' or 'cuda', got {value!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {value!r} requested, but CUDA is not available here")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device: {value!r} names CUDA device {dev.index}, but {count} exist")


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier: which backend, and how prefetch and backup use it.

    Attributes:
        backend: a registered backend name (``kvtier.storage.available_backends()``).
        backend_config: keyword arguments of that backend's ``Config`` (e.g. ``root`` for
            ``"file"``, ``master_address`` for ``"mooncake"``).
        namespace_key: a deployment-wide salt folded into every page key (with each request's
            own namespace: LoRA id, cache salt); processes share L3 pages only if it matches.
        prefetch_policy: when a prefetch may stop and hand over what arrived:
            ``"best_effort"`` (at the next step), ``"wait_complete"`` (only when every hit page
            arrived or the read failed) or ``"timeout"`` (complete, or after
            ``prefetch_timeout_base_s + prefetch_timeout_per_ki_token_s * tokens / 1024``).
        prefetch_min_tokens: prefetches shorter than this (or than one page) are not started,
            and ones whose agreed hit is shorter are revoked.
        host_occupancy_limit: in-flight prefetches may hold at most this fraction of the FULL
            host pool (tokens); more are not started.
        write_to_storage: back host pages up to L3 after each device→host copy.
        rank_replicated: every TP rank holds the same bytes (MLA-style caches): only rank 0
            writes, under rank-free keys. Otherwise pages are per-rank head shards.
        prefill_tokens_per_s: the model's prefill rate; an L3 hit whose load (at the measured
            storage bandwidth) would take longer than recomputing it is skipped. None: always load.
        assumed_storage_gbps: storage read GB/s to assume before any read was measured.
        backup_retries: extra attempts for pages whose L3 write failed, before counting them.
        batch_pages: pages per backend call.
    """

    backend: str = "file"
    backend_config: Mapping[str, Any] = field(default_factory=dict)
    namespace_key: str = ""
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    prefetch_min_tokens: int = 256
    host_occupancy_limit: float = 0.8
    write_to_storage: bool = True
    rank_replicated: bool = False
    prefill_tokens_per_s: float | None = None
    assumed_storage_gbps: float | None = None
    backup_retries: int = 2
    batch_pages: int = 128

    def __post_init__(self) -> None:
        _typed(self, "backend", str, "a backend name (str)")
        if not self.backend:
            raise ValueError(f"backend: expected a registered backend name, got {self.backend!r}")
        _typed(self, "backend_config", Mapping, "a mapping of backend Config arguments")
        # The backend's name, keys and values now, not in TieredKVCache (required keys only
        # there: a cache can be given its backend built, with no backend_config).
        backend_config(self.backend, self.backend_config, complete=False)
        _typed(self, "namespace_key", str, "a str")
        _typed(self, "prefetch_policy", str, f"one of {PREFETCH_POLICIES}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch_policy: unknown {self.prefetch_policy!r}; choose from {PREFETCH_POLICIES}"
            )
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_ki_token_s"):
            _real(self, name)
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        _int(self, "prefetch_min_tokens", minimum=0)
        _real(self, "host_occupancy_limit")
        if not 0 < self.host_occupancy_limit <= 1:
            raise ValueError(
                f"host_occupancy_limit must be in (0, 1], got {self.host_occupancy_limit!r}"
            )
        for name in ("write_to_storage", "rank_replicated"):
            _typed(self, name, bool, "a bool")
        for name in ("prefill_tokens_per_s", "assumed_storage_gbps"):
            _real(self, name, optional=True)
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or None, got {v!r}")
        _int(self, "backup_retries", minimum=0)
        _int(self, "batch_pages", minimum=1)


@dataclass(frozen=True)
class CacheConfig:
    """Model shape, pool sizes and policies.

    Attributes:
        layer_kinds: one of "full", "swa", "mamba" per model layer, in model order.
        kv_heads, head_dim, dtype: attention K/V shape per token per layer (full and SWA).
        mla_dim: MLA latent width: "full" layers keep one ``[1, mla_dim]`` latent per token
            (``MLADevicePool``) instead of K/V, and ``kv_heads``/``head_dim`` are unused. MLA
            caches are the same on every TP rank: their L3 pages get rank-free keys and only
            rank 0 writes them. None: MHA/GQA K/V.
        indexer: keep the DSA indexer's per-token 128-byte fp8 key and 4-byte fp32 scale of every
            full layer (``IndexerDevicePool``, stored per page). It has no slots of its own:
            its pages are the FULL pool's pages, and move (D→H, H→D, to and from L3) and are
            evicted with them. It is the sidecar ``"indexer"`` (see ``sidecars``).
        sidecars: byte pools addressed through the pages of an anchor pool (``SidecarSpec``:
            anchor ``"kv"`` or ``"swa"``, tokens per entry, bytes per entry and layer, model
            layers); each moves with its anchor's pages through every tier.
        full_pool: ``"kv"``: the FULL pool holds the full layers' K/V (or MLA latents);
            ``"logical"``: index-only FULL pages (DeepSeek V4): the tree's identity and
            capacity, no bytes on device or host, nothing copied; the data is in KV-anchored
            sidecars (at least one), and no layer is "full".
        page_size: tokens per page P.
        device_tokens: FULL device token slots.
        swa_window: sliding window in tokens (needed when a layer is "swa").
        swa_tokens: SWA device token slots (default: ``device_tokens``); at least the window
            rounded up to pages plus one page, what one request may hold.
        mamba: per-layer Mamba state (needed when a layer is "mamba").
        mamba_slots: device Mamba state slots.
        host_tokens / host_ratio: FULL host slots, or their ratio to ``device_tokens``; exactly
            one. SWA and Mamba host pools take the same ratio of their device pools.
        host_layout: KV/SWA host layout; "layer_first", "page_first" or "page_first_direct".
        mamba_host_layout: Mamba host pools hold one flat page per slot: only "flat".
        write_policy: "write_through" (back up new nodes at once), "write_through_selective"
            (back up on the second hit) or "write_back" (back up on device eviction).
        load_back_min_tokens: host hits shorter than this are recomputed instead of loaded.
        load_back_max_tokens: a load larger than this is refused (recomputed); None: no limit.
        knobs: copy-kernel launch knobs (grid cap, tile bytes, warps).
        io_backend: how KV/SWA pages move between device and host: "copy_engine"
            (``cudaMemcpyBatchAsync``, no SMs; needs CUDA >= 12.8 and ``kvtier[cuda]``), "kernel"
            (the Triton copy kernel), "staged" (a device gather/scatter through a small ring
            plus contiguous copy-engine transfers: every host layout, few descriptors;
            ``kvtier.kernels.staged``) or "auto" (the copy engine where it wins, per transfer,
            weighing chunk size and descriptors per call:
            ``kvtier.kernels.dispatch.CROSSOVERS``). Where the copy engine cannot run (no CUDA,
            no cuda-bindings, an old driver, a ``page_first`` host layout) the kernel runs, and
            the reason is counted (``controller.stats.route_reasons``).
        device: where device pools live: "cpu" or an available CUDA device.
        model_id: checkpoint identity (name and revision); seeds every L3 page key.
        storage: the L3 tier, or None for none (needs ``model_id``).
        retention_device_tokens, retention_host_tokens: what retention pins
            (``TieredKVCache.pin``) may hold, in FULL tokens, per tier; each bounds the union of
            all retained tokens, since a retained prefix can sit on either tier. None: half the
            tier's pool; 0: no pins.
        retention_overflow: a pin over the budget is ``"refuse"``d, or (``"evict_lowest"``)
            pins of lower priority are dropped, lowest first, to make room.
        retention_refresh_on_hit: a match covering a pinned prefix restarts its TTL.
    """

    layer_kinds: tuple[str, ...]
    kv_heads: int
    head_dim: int
    page_size: int
    device_tokens: int
    dtype: torch.dtype = torch.bfloat16
    mla_dim: int | None = None
    indexer: bool = False
    sidecars: tuple[SidecarSpec, ...] = ()
    full_pool: str = "kv"
    swa_window: int | None = None
    swa_tokens: int | None = None
    mamba: MambaStateSpec | None = None
    mamba_slots: int | None = None
    host_tokens: int | None = None
    host_ratio: float | None = None
    host_layout: str = "page_first"
    mamba_host_layout: str = "flat"
    write_policy: str = "write_through"
    load_back_min_tokens: int = 1
    load_back_max_tokens: int | None = None
    knobs: TransferKnobs | None = field(default=None, compare=False)
    io_backend: str = "auto"
    device: str | torch.device = "cpu"
    model_id: str = ""
    storage: StorageConfig | None = None
    retention_device_tokens: int | None = None
    retention_host_tokens: int | None = None
    retention_overflow: str = "refuse"
    retention_refresh_on_hit: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        self._check_layers()
        self._check_sidecars()
        self._check_sizes()
        self._check_policies()
        self._check_host()
        self._check_retention()
        if self.storage is not None and not self.model_id:
            raise ValueError(
                "model_id: needed with storage (L3 keys must name the checkpoint, or two models "
                "would read each other's pages)"
            )
        self._warn_self_defeating()

    def _check_types(self) -> None:
        kinds = self.layer_kinds
        # A str is a sequence too: "full" would be read as the layers 'f', 'u', 'l', 'l'.
        if isinstance(kinds, (str, bytes)) or not isinstance(kinds, Sequence):
            raise TypeError(
                f"layer_kinds: expected a sequence of layer kinds such as ('full', 'swa'), got "
                f"{kinds!r} ({type(kinds).__name__})"
            )
        for i, k in enumerate(kinds):
            if not isinstance(k, str):
                raise TypeError(f"layer_kinds[{i}]: expected a str, got {k!r} ({type(k).__name__})")
        object.__setattr__(self, "layer_kinds", tuple(kinds))
        for name in ("kv_heads", "head_dim", "page_size", "device_tokens", "load_back_min_tokens"):
            _int(self, name)
        for name in (
            "mla_dim",
            "swa_window",
            "swa_tokens",
            "mamba_slots",
            "host_tokens",
            "load_back_max_tokens",
        ):
            _int(self, name, optional=True)
        _real(self, "host_ratio", optional=True)
        _dtype(self.dtype, "dtype")
        _typed(self, "indexer", bool, "a bool")
        _typed(self, "full_pool", str, f"one of {FULL_POOLS}")
        cars = self.sidecars
        if isinstance(cars, SidecarSpec) or not isinstance(cars, (tuple, list)):
            raise TypeError(f"sidecars: expected a tuple of SidecarSpec, got {cars!r}")
        for i, c in enumerate(cars):
            if not isinstance(c, SidecarSpec):
                raise TypeError(f"sidecars[{i}]: expected a SidecarSpec, got {c!r}")
        object.__setattr__(self, "sidecars", tuple(cars))
        _typed(self, "mamba", (MambaStateSpec, type(None)), "a MambaStateSpec or None")
        _typed(self, "host_layout", str, "a host layout name (str)")
        _typed(self, "mamba_host_layout", str, "a str")
        _typed(self, "write_policy", str, f"one of {WRITE_POLICIES}")
        _typed(self, "knobs", (TransferKnobs, type(None)), "a TransferKnobs or None")
        _typed(self, "model_id", str, "a str")
        _typed(self, "storage", (StorageConfig, type(None)), "a StorageConfig or None")
        _device(self.device)

    def _check_layers(self) -> None:
        kinds = self.layer_kinds
        if not kinds:
            raise ValueError("layer_kinds: a model has at least one layer")
        bad = [k for k in kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer_kinds: unknown kind {bad[0]!r}; choose from {LAYER_KINDS}")
        if self.full_pool not in FULL_POOLS:
            raise ValueError(f"full_pool: unknown {self.full_pool!r}; choose from {FULL_POOLS}")
        if self.full_pool == "logical":
            if "full" in kinds:
                raise ValueError(
                    "layer_kinds: a logical full_pool holds no bytes, so no layer can be 'full' "
                    "(the data of its positions lives in KV-anchored sidecars)"
                )
            if self.mla_dim is not None or self.indexer:
                raise ValueError("full_pool: 'logical' has no full layers for mla_dim or indexer")
        elif "full" not in kinds:
            raise ValueError("layer_kinds: at least one full-attention layer anchors the cache")
        if self.mla_dim is not None:
            if self.mla_dim < 1:
                raise ValueError(f"mla_dim must be >= 1, got {self.mla_dim!r}")
            # Their pages are per-rank head shards under TP, MLA pages are rank-replicated:
            # one cache cannot key both ways.
            other = sorted(set(kinds) - {"full"})
            if other:
                raise ValueError(
                    f"mla_dim: MLA caches hold only 'full' layers, got {other[0]!r} layers"
                )
        if "swa" in kinds and self.swa_window is None:
            raise ValueError("swa_window: needed (positive) when a layer is 'swa'")
        if "mamba" in kinds and (self.mamba is None or self.mamba_slots is None):
            raise ValueError("mamba, mamba_slots: needed when a layer is 'mamba'")

    def _check_sidecars(self) -> None:
        names: set[str] = set()
        for i, c in enumerate(self.all_sidecars):
            if c.name in names:
                hint = " (indexer=True adds one)" if c.name == INDEXER else ""
                raise ValueError(f"sidecars[{i}]: duplicate sidecar name {c.name!r}{hint}")
            names.add(c.name)
            if c.anchor == "swa" and "swa" not in self.layer_kinds:
                raise ValueError(
                    f"sidecars[{i}]: {c.name!r} is anchored on 'swa', but no layer is 'swa'"
                )
            if self.page_size % c.ratio:
                raise ValueError(
                    f"sidecars[{i}]: page_size={self.page_size!r} is not a multiple of the "
                    f"ratio {c.ratio} of sidecar {c.name!r} (a page holds whole entries)"
                )
            if c.layers[-1] >= len(self.layer_kinds):
                raise ValueError(
                    f"sidecars[{i}]: {c.name!r} holds layer {c.layers[-1]}, but the model has "
                    f"{len(self.layer_kinds)} layers"
                )
        if self.full_pool == "logical" and not any(c.anchor == "kv" for c in self.sidecars):
            raise ValueError(
                "sidecars: a logical full_pool needs at least one KV-anchored sidecar to hold "
                "the data of its pages"
            )

    def _check_sizes(self) -> None:
        P = self.page_size
        if not 1 <= P <= 256:
            raise ValueError(f"page_size must be in [1, 256], got {P!r}")
        if self.device_tokens <= 0 or self.device_tokens % P:
            raise ValueError(
                f"device_tokens={self.device_tokens!r} must be a positive multiple of page_size={P}"
            )
        if self.mla_dim is None:
            for name in ("kv_heads", "head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.dtype is torch.bool or not (
            self.dtype.is_floating_point or self.dtype.itemsize == 1
        ):
            raise ValueError(f"dtype: KV must be a float or 8-bit type, got {self.dtype}")
        if self.swa_tokens is not None and (self.swa_tokens <= 0 or self.swa_tokens % P):
            raise ValueError(
                f"swa_tokens={self.swa_tokens!r} must be a positive multiple of page_size={P}"
            )
        if self.swa_window is not None and self.swa_window < 1:
            raise ValueError(f"swa_window must be >= 1, got {self.swa_window!r}")
        if "swa" in self.layer_kinds:
            # A running request holds its window (in whole pages), the page being filled and
            # the tokens of one step: a pool smaller than window + page cannot run one request.
            need = -(-self.swa_window // P) * P + P
            if self.swa_device_tokens < need:
                raise ValueError(
                    f"swa_tokens: the SWA pool of {self.swa_device_tokens} tokens (swa_tokens="
                    f"{self.swa_tokens!r}, default device_tokens) cannot hold one request's "
                    f"swa_window={self.swa_window!r} rounded up to pages of {P} plus one page: "
                    f"need swa_tokens >= {need}"
                )
        if self.mamba_slots is not None and self.mamba_slots < 1:
            raise ValueError(f"mamba_slots must be >= 1, got {self.mamba_slots!r}")
        if self.load_back_min_tokens < 0:
            raise ValueError(
                f"load_back_min_tokens must be >= 0, got {self.load_back_min_tokens!r}"
            )
        if self.load_back_max_tokens is not None and (
            self.load_back_max_tokens < max(self.load_back_min_tokens, 1)
        ):
            raise ValueError(
                f"load_back_max_tokens={self.load_back_max_tokens} is below load_back_min_tokens="
                f"{self.load_back_min_tokens}: every load-back would be refused"
            )

    def _check_policies(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: unknown {self.write_policy!r}; choose from {WRITE_POLICIES}"
            )
        HostLayout.parse(self.host_layout, arg="host_layout")
        check_io_backend(self.io_backend)
        if self.mamba_host_layout != "flat":
            raise ValueError(
                f"mamba_host_layout: Mamba host pools support only 'flat' (one contiguous page "
                f"per slot), not {self.mamba_host_layout!r}"
            )

    def _check_host(self) -> None:
        if (self.host_tokens is None) == (self.host_ratio is None):
            raise ValueError(
                f"give exactly one of host_tokens, host_ratio; got host_tokens="
                f"{self.host_tokens!r}, host_ratio={self.host_ratio!r}"
            )
        if self.host_ratio is not None and self.host_ratio <= 0:
            raise ValueError(f"host_ratio must be > 0, got {self.host_ratio!r}")
        host = self.host_kv_tokens
        if host < self.device_tokens:
            raise ValueError(
                f"host_tokens: host pool of {host} tokens is smaller than the device pool of "
                f"{self.device_tokens}; the host tier must be able to hold what the device holds"
            )

    def _check_retention(self) -> None:
        for name, pool in (
            ("retention_device_tokens", self.device_tokens),
            ("retention_host_tokens", self.host_kv_tokens),
        ):
            _int(self, name, optional=True, minimum=0)
            v = getattr(self, name)
            if v is not None and v > pool:
                raise ValueError(f"{name}={v!r} is larger than the tier's pool of {pool} tokens")
        _typed(self, "retention_overflow", str, f"one of {RETENTION_OVERFLOW}")
        if self.retention_overflow not in RETENTION_OVERFLOW:
            raise ValueError(
                f"retention_overflow: unknown {self.retention_overflow!r}; choose from "
                f"{RETENTION_OVERFLOW}"
            )
        _typed(self, "retention_refresh_on_hit", bool, "a bool")

    def _warn_self_defeating(self) -> None:
        if (
            self.write_policy == "write_through"
            and self.storage is not None
            and self.host_kv_tokens <= self.device_tokens
        ):
            warnings.warn(
                f"host_ratio: under write_through the host pool mirrors the device pool, and a "
                f"host pool of {self.host_kv_tokens} tokens for a device pool of "
                f"{self.device_tokens} leaves no room for pages prefetched from storage, so L3 "
                f"can almost never serve a hit; use host_ratio >= 2",
                KVTierConfigWarning,
                stacklevel=4,
            )

    # -- derived sizes -------------------------------------------------------------------------

    @property
    def rank_replicated(self) -> bool:
        """Every TP rank holds the same cache bytes (MLA, or ``storage.rank_replicated``)."""
        return self.mla_dim is not None or (
            self.storage is not None and self.storage.rank_replicated
        )

    @property
    def all_sidecars(self) -> tuple[SidecarSpec, ...]:
        """``sidecars``, after the DSA indexer's when ``indexer``."""
        if not self.indexer:
            return self.sidecars
        return (indexer_spec(self.layers_of("full")), *self.sidecars)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    def books_digest(self) -> int:
        """A 62-bit digest of what decides the cache's books on a TP rank: every field but where
        the pools live and how copies run (``device``, ``knobs``, ``io_backend``) and the L3
        store's own settings. Ranks whose digests differ would drift apart (another host pool
        size, say): the poll's control header compares them (``Control.in_step``)."""
        skip = {"device", "knobs", "io_backend", "storage"}
        fields = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        parts = [(n, repr(v)) for n, v in fields if n not in skip]
        st = self.storage
        if st is not None:  # how prefetch and backup decide, not where the store is
            parts.append(("storage", repr(dataclasses.replace(st, backend_config={}))))
        return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 2

    def key_salt(self, namespace_key: str) -> bytes:
        """What L3 page keys (and routers' prompt hashes) fold in beside the request's own
        namespace: the deployment salt's canonical encoding, then ``key_shape``."""
        return canonical_namespace(namespace_key) + self.key_shape()

    def key_shape(self) -> bytes:
        """16 bytes that L3 page keys fold in beside ``model_id``, dtype, page size and layout:
        what else gives a page's bytes their meaning (which model layer each pool layer is, the
        item shapes, the sidecars, the Mamba state). Two caches of one ``model_id`` whose pools
        differ (an engine upgrade that changed a sidecar's layers) then miss each other's pages
        instead of reading them as their own."""
        m = self.mamba
        # MLA ignores kv_heads and head_dim (and is shared across TP sizes): left out there.
        heads = (self.kv_heads, self.head_dim) if self.mla_dim is None else None
        parts = (
            tuple(self.layer_kinds),
            heads,
            self.mla_dim,
            self.full_pool,
            tuple(
                (s.name, s.anchor, s.ratio, s.entry_bytes, tuple(s.layers))
                for s in self.all_sidecars
            ),
            None
            if m is None
            else (m.temporal_shape, m.conv_shapes, str(m.temporal_dtype), str(m.conv_dtypes)),
            self.mamba_host_layout,
        )
        return hashlib.sha256(repr(parts).encode()).digest()[:16]

    @property
    def host_kv_tokens(self) -> int:
        P = self.page_size
        n = (
            self.host_tokens
            if self.host_tokens is not None
            else int(self.device_tokens * self.host_ratio)
        )
        return n // P * P

    @property
    def ratio(self) -> float:
        return self.host_kv_tokens / self.device_tokens

    @property
    def retention_budget(self) -> tuple[int, int]:
        """Retained FULL tokens allowed on (device, host); None fields resolved."""
        dev, host = self.retention_device_tokens, self.retention_host_tokens
        return (
            self.device_tokens // 2 if dev is None else dev,
            self.host_kv_tokens // 2 if host is None else host,
        )

    @property
    def swa_device_tokens(self) -> int:
        return self.swa_tokens or self.device_tokens

    @property
    def host_swa_tokens(self) -> int:
        P = self.page_size
        return max(P, int(self.swa_device_tokens * self.ratio) // P * P)

    @property
    def host_mamba_slots(self) -> int:
        return max(1, int((self.mamba_slots or 0) * self.ratio))
