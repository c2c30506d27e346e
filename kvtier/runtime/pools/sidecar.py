"""Sidecar pools: byte pools whose pages are addressed through an anchor pool's pages.

A sidecar has no slots and no tree component of its own. Page ``p`` of a sidecar belongs to page
``p`` of its anchor (the FULL pool ``"kv"`` or the SWA pool ``"swa"``): the tokens of anchor slots
``[p * P, p * P + P)``. It holds ``P / ratio`` entries of ``entry_bytes`` per page and per layer,
as opaque bytes; what they mean is the model's business. Examples (DeepSeek V3.2 and V4)::

    sidecar          anchor  ratio  entry bytes            L3 hit policy
    DSA indexer      kv      1      128 fp8 key + 4 scale  ALL_PAGES
    V4 C4 KV         kv      4      one compressed entry   ALL_PAGES
    V4 C128 KV       kv      128    one compressed entry   ALL_PAGES
    V4 C4 state      swa     4      compressor state       TRAILING_PAGES (the SWA window)

Because a sidecar page moves whenever its anchor page moves, its device and host pools move
whole pages as raw bytes: the copy kernels see one buffer whose "slot" is a page (``page_size``
1 for them) and whose item is the page's bytes of one layer. No kernel of its own is needed.

:class:`LogicalDevicePool` / :class:`LogicalHostPool` are the other half of DeepSeek V4's cache:
a FULL pool of index-only pages. Its slots are the tree's identity and are counted by the tree's
allocators; it holds no bytes, so there is nothing to copy for it.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

import torch

from kvtier.runtime.pools.device import DevicePool

__all__ = [
    "SIDECAR_ANCHORS",
    "SIDECAR_HIT_POLICIES",
    "LogicalDevicePool",
    "LogicalHostPool",
    "SidecarDevicePool",
    "SidecarSpec",
]

SIDECAR_ANCHORS = ("kv", "swa")
SIDECAR_HIT_POLICIES = ("all_pages", "trailing_pages")
# The anchor's own hit policy: a KV page needs every page before it, SWA only its window.
_POLICY_OF_ANCHOR = {"kv": "all_pages", "swa": "trailing_pages"}
_NAME = re.compile(r"[a-z0-9_]{1,32}")
_RESERVED = ("kv", "swa", "mamba")


@dataclass(frozen=True)
class SidecarSpec:
    """One sidecar pool of a cache (``CacheConfig.sidecars``).

    Attributes:
        name: its pool name, also its L3 key suffix: ``[a-z0-9_]``, 1 to 32 characters, not
            ``kv``, ``swa`` or ``mamba``.
        anchor: ``"kv"`` (every FULL page has one) or ``"swa"`` (pages of the SWA window).
        ratio: tokens per entry; a page of ``P`` tokens holds ``P / ratio`` entries (the cache
            refuses a page size that ``ratio`` does not divide).
        entry_bytes: bytes of one entry in one layer.
        layers: the model layers it holds (its own layer count is ``len(layers)``), ascending.
        hit_policy: ``"all_pages"`` or ``"trailing_pages"``; it must be its anchor's (KV pages
            need every page of a prefix, SWA pages only the window). None: the anchor's.
    """

    name: str
    anchor: str
    ratio: int
    entry_bytes: int
    layers: tuple[int, ...]
    hit_policy: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {self.name!r} ({type(self.name).__name__})")
        if not _NAME.fullmatch(self.name) or self.name in _RESERVED:
            raise ValueError(
                f"name: {self.name!r} must be 1-32 characters of [a-z0-9_] and not one of "
                f"{_RESERVED}"
            )
        if self.anchor not in SIDECAR_ANCHORS:
            raise ValueError(f"anchor: unknown {self.anchor!r}; choose from {SIDECAR_ANCHORS}")
        for field in ("ratio", "entry_bytes"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{field}: expected an int, got {v!r} ({type(v).__name__})")
            if v < 1:
                raise ValueError(f"{field} must be >= 1, got {v!r} (sidecar {self.name!r})")
            object.__setattr__(self, field, int(v))
        layers = self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list, range)):
            raise TypeError(f"layers: expected a tuple of model layers, got {layers!r}")
        if not layers:
            raise ValueError(f"layers: sidecar {self.name!r} holds at least one layer")
        for v in layers:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"layers: expected ints, got {v!r} ({type(v).__name__})")
        layers = tuple(int(v) for v in layers)
        if list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise ValueError(f"layers: expected ascending distinct layers >= 0, got {layers}")
        object.__setattr__(self, "layers", layers)
        policy = _POLICY_OF_ANCHOR[self.anchor] if self.hit_policy is None else self.hit_policy
        if policy not in SIDECAR_HIT_POLICIES:
            raise ValueError(f"hit_policy: unknown {policy!r}; choose from {SIDECAR_HIT_POLICIES}")
        if policy != _POLICY_OF_ANCHOR[self.anchor]:
            raise ValueError(
                f"hit_policy: {policy!r} for sidecar {self.name!r} anchored on {self.anchor!r}; "
                f"its pages exist where its anchor's do, so it must be "
                f"{_POLICY_OF_ANCHOR[self.anchor]!r}"
            )
        object.__setattr__(self, "hit_policy", policy)

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page in one layer: ``page_size / ratio`` entries."""
        return page_size // self.ratio * self.entry_bytes


class SidecarDevicePool(DevicePool):
    """Per layer ``[num_pages, P / ratio * entry_bytes]`` uint8 on the device.

    Args:
        spec: what the sidecar holds.
        num_pages: pages, one per anchor page (the anchor pool's size / ``page_size``).
        page_size: the anchor's tokens per page P; ``spec.ratio`` must divide it.
        device: where the buffer lives.
    """

    kind = "sidecar"

    def __init__(
        self,
        spec: SidecarSpec,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        if page_size % spec.ratio:
            raise ValueError(
                f"page_size: {page_size} is not a multiple of the ratio {spec.ratio} of "
                f"sidecar {spec.name!r} (a page holds whole entries)"
            )
        self.spec = spec
        self.token_page_size = page_size
        self.entries_per_page = page_size // spec.ratio
        self.buffer = torch.zeros(
            (len(spec.layers), num_pages, spec.page_bytes(page_size)),
            dtype=torch.uint8,
            device=device,
        )
        super().__init__([list(self.buffer.unbind(0))], page_size=1, name=spec.name)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer."""
        return self.buffer.shape[-1]

    def layer_of(self, model_layer: int) -> int:
        """This pool's layer holding ``model_layer``; ``ValueError`` if it holds none."""
        try:
            return self.spec.layers.index(model_layer)
        except ValueError:
            raise ValueError(
                f"model_layer: sidecar {self.spec.name!r} holds layers {self.spec.layers}, "
                f"not {model_layer!r}"
            ) from None

    def entries(self, model_layer: int) -> torch.Tensor:
        """``[num_pages, P / ratio, entry_bytes]`` uint8 view of a model layer's entries."""
        return self.buffer[self.layer_of(model_layer)].view(
            -1, self.entries_per_page, self.spec.entry_bytes
        )


class LogicalDevicePool:
    """A FULL pool of index-only pages: ``size`` token slots that hold no bytes.

    The tree allocates and evicts its slots like any FULL pool's, so capacity and eviction count
    them; the data of a position lives in the sidecars of its page.
    """

    kind = "logical"
    num_layers = 0
    bytes_per_token = 0
    nbytes = 0

    def __init__(self, size: int, page_size: int) -> None:
        if size < 1 or page_size < 1 or size % page_size:
            raise ValueError(f"size: {size} must be a positive multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size


class LogicalHostPool:
    """Host side of a :class:`LogicalDevicePool`: ``size`` index-only slots, no tensor.

    It has no copy methods: a cache skips the copy of a logical pool (and copies its sidecars).
    """

    nbytes = 0

    def __init__(self, device_pool: LogicalDevicePool, size: int) -> None:
        P = device_pool.page_size
        if size < P:
            raise ValueError(f"size: host pool would hold {size} slots, less than one page of {P}")
        self.device_pool = device_pool
        self.page_size = P
        self.size = size // P * P
