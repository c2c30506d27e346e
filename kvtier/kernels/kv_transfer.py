"""Triton kernels that move KV items between device buffers and a host buffer.

One kernel serves every case: MHA (K and V buffers) and MLA (one latent buffer), one layer or all
layers, every host layout, both directions, and both device forms (stacked storage or per-layer
tensors owned by the runner). Work is cut into tiles of ``BLOCK_R`` rows x ``BLOCK_W`` words of
one (buffer, layer), a row being one power-of-two chunk of one token's item (with layer rows, of
one buffer, a row one chunk of one (token, layer) item, layers inner); a grid of
``num_programs`` programs walks the tiles grid-stride, so a transfer occupies a bounded number of SMs whatever its size. A tile's loads are all issued before its
stores: reading host memory is latency-bound and wants many bytes in flight per program.

Words are the widest unsigned type that every address and size allows, and offsets carry their
alignment (``* VEC``) so the compiler emits 16-byte accesses where 16-byte alignment holds.

A launch's CPU cost is kept low: what depends on the pool pair, direction and knobs alone is
cached per pair, and from the second call on the compiled kernel is launched directly, past
``JITFunction.run``'s per-call binding and cache lookup (see ``_launch``).

Indices are int64 tensors on the device pool's device: token slots (in page-aligned runs when
``page_size > 1``) or page ids (``index_unit="page"``). ``-1`` on either side skips the item.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Literal

import torch
import triton
import triton.language as tl

from kvtier.kernels.dispatch import Impl, debug_checks, interpreter_enabled, select_impl
from kvtier.kernels.layout import DeviceBuffers, HostBuffer
from kvtier.kernels.reference import ref_copy_kv
from kvtier.nvtx import copy_range_name, nvtx_range

__all__ = ["DEFAULT_KNOBS", "TransferKnobs", "copy_device_to_host", "copy_host_to_device"]

IndexUnit = Literal["token", "page"]

# Triton's interpreter keeps the running grid in process-wide state, so two threads (the L3
# backup thread packing pages while the scheduler thread loads) must not run kernels at once.
_INTERPRETER_LOCK = threading.Lock()

_WORD_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@triton.jit
def _tile_rows(
    i_tile,
    n_rows,
    layer_start,
    n_sel_layers,
    n_tiles_r,
    num_tiles,
    CHUNKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    LAYER_INNER: tl.constexpr,
):
    """Tile ``i_tile``'s rows: their numbers and mask, each row's logical token, and the
    tile's buffer and layer (each row's layer with LAYER_ROWS).
    A tile is BLOCK_R rows of one (buffer, layer); row r is chunk r % CHUNKS of logical token
    r // CHUNKS, BLOCK_W words wide. Items whose size is not a power of two are cut into equal
    power-of-two chunks rather than padded, so no lane is masked off for width. Tiles are
    numbered row blocks first; with LAYER_INNER (buffer, layer) first, so a program's next
    tile is another layer of the same rows.
    LAYER_ROWS (host layouts that keep a token's layers side by side, all-layer calls): a tile
    is BLOCK_R rows of one buffer, row r chunk r % CHUNKS of layer (r // CHUNKS) % n_sel of
    token r // (CHUNKS * n_sel), so the host side of a tile is one contiguous run per token
    instead of a 2 KiB piece every L items."""
    o_r = tl.arange(0, BLOCK_R)
    if LAYER_INNER and not LAYER_ROWS:
        n_bl = num_tiles // n_tiles_r
        i_t = i_tile // n_bl
        i_bl = (i_tile % n_bl).to(tl.int64)
    else:
        i_t = i_tile % n_tiles_r
        i_bl = (i_tile // n_tiles_r).to(tl.int64)
    o_row = i_t * BLOCK_R + o_r
    m_row = o_row < n_rows
    if LAYER_ROWS:
        i_b = i_bl
        o_kl = o_row // CHUNKS
        o_k = o_kl // n_sel_layers
        i_l = layer_start + (o_kl % n_sel_layers).to(tl.int64)
    else:
        i_b = i_bl // n_sel_layers
        i_l = layer_start + i_bl % n_sel_layers
        o_k = o_row // CHUNKS
    return o_row, m_row, o_k, i_b, i_l


@triton.jit
def _tile_loads(
    i_tile,
    table_ptr,
    dev_idx_ptr,
    host_idx_ptr,
    n_rows,
    num_layers,
    layer_start,
    n_sel_layers,
    n_tiles_r,
    num_tiles,
    TOKENS_PER_INDEX: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    LAYER_INNER: tl.constexpr,
):
    """What tile ``i_tile`` reads from device memory before it can address its rows: each row's
    device and host slot (-1: none) and its (buffer, layer) tensor's table entry."""
    _, m_row, o_k, i_b, i_l = _tile_rows(
        i_tile, n_rows, layer_start, n_sel_layers, n_tiles_r, num_tiles, CHUNKS, BLOCK_R,
        LAYER_ROWS, LAYER_INNER,
    )  # fmt: skip
    if TOKENS_PER_INDEX == 1:
        b_dev = tl.load(dev_idx_ptr + o_k, mask=m_row, other=-1)
        b_host = tl.load(host_idx_ptr + o_k, mask=m_row, other=-1)
    else:
        o_j = o_k // TOKENS_PER_INDEX
        o_in = o_k % TOKENS_PER_INDEX
        b_dev = tl.load(dev_idx_ptr + o_j, mask=m_row, other=-1)
        b_host = tl.load(host_idx_ptr + o_j, mask=m_row, other=-1)
        b_dev = tl.where(b_dev >= 0, b_dev * TOKENS_PER_INDEX + o_in, -1)
        b_host = tl.where(b_host >= 0, b_host * TOKENS_PER_INDEX + o_in, -1)
    dev_base = tl.load(table_ptr + i_b * num_layers + i_l)
    return b_dev, b_host, dev_base


@triton.jit
def _tile_offsets(
    i_tile,
    b_dev,
    b_host,
    dev_base,
    n_rows,
    layer_start,
    n_sel_layers,
    page_size,
    host_s_buf,
    host_s_page,
    host_s_tok,
    host_s_layer,
    dev_s_slot,
    n_tiles_r,
    num_tiles,
    CHUNKS: tl.constexpr,
    VEC: tl.constexpr,
    TABLE_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    LAYER_INNER: tl.constexpr,
):
    """Tile ``i_tile``'s row offsets on the device and on the host (in words) and its row mask,
    from what ``_tile_loads`` read for it (see ``_tile_rows`` for what a tile is)."""
    o_row, m_row, _, i_b, i_l = _tile_rows(
        i_tile, n_rows, layer_start, n_sel_layers, n_tiles_r, num_tiles, CHUNKS, BLOCK_R,
        LAYER_ROWS, LAYER_INNER,
    )  # fmt: skip
    o_c = (o_row % CHUNKS).to(tl.int64)
    m_row = m_row & (b_dev >= 0) & (b_host >= 0)
    o_dev = (dev_base * TABLE_SCALE + b_dev * dev_s_slot) * VEC + o_c * BLOCK_W
    o_host = (
        i_b * host_s_buf
        + (b_host // page_size) * host_s_page
        + (b_host % page_size) * host_s_tok
        + i_l * host_s_layer
    ) * VEC + o_c * BLOCK_W
    return o_dev, o_host, m_row


# Sizes that change from call to call are not specialized (Triton would otherwise compile a
# variant per value that is 1 or a multiple of 16, on the request path); neither are the index
# tensors' addresses, which a caller may slice at any offset. What stays specialized is fixed
# per pool and direction, so a cache compiles every variant it needs in ``warmup``.
@triton.jit(
    do_not_specialize=[
        "dev_idx_ptr",
        "host_idx_ptr",
        "n_rows",
        "layer_start",
        "n_sel_layers",
        "n_tiles_r",
        "num_tiles",
    ]
)
def _kv_copy_kernel(
    dev_ptr,  # word*: the first device tensor; every (buffer, layer) is an offset from it
    table_ptr,  # int64 [B * L]: offset of each (buffer, layer) tensor, in table units
    host_ptr,  # word*: the host tensor
    dev_idx_ptr,  # int64 [n_idx]
    host_idx_ptr,  # int64 [n_idx]
    n_rows,  # tokens x chunks per item (x selected layers with LAYER_ROWS)
    num_layers,
    layer_start,
    n_sel_layers,
    page_size,
    host_s_buf,  # host strides, in vectors
    host_s_page,
    host_s_tok,
    host_s_layer,
    dev_s_slot,  # device slot stride, in vectors
    n_tiles_r,
    num_tiles,
    D2H: tl.constexpr,
    TOKENS_PER_INDEX: tl.constexpr,
    CHUNKS: tl.constexpr,  # BLOCK_W-word chunks per item
    VEC: tl.constexpr,  # words per vector (vector = alignment unit)
    TABLE_SCALE: tl.constexpr,  # vectors per table unit
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    REPS: tl.constexpr,  # pieces per row
    W2: tl.constexpr,  # words per piece (REPS * W2 == BLOCK_W)
    PREFETCH: tl.constexpr,  # the next tile's indices read before this tile's stores
    LAYER_INNER: tl.constexpr,  # a program's next tile: the next (buffer, layer), same rows
):
    # Tiles are walked grid-stride (see _tile_rows for what a tile is and their order); a
    # tile's loads are all issued before its stores, then the next tile's. With PREFETCH only
    # the next tile's indices and table entry are read before this tile's stores. (Issuing the
    # next tile's data loads before this tile's stores, two tiles in flight, was measured
    # slower in every case: H200, D->H at 2 programs 94 -> 59% of the copy engine;
    # bench_small_grid_pipeline.md.)
    i_prog = tl.program_id(0)
    n_prog = tl.num_programs(0)
    # A row's BLOCK_W words as REPS pieces of W2 (one warp-wide access each), the pieces
    # outermost: each warp then holds whole rows, so a thread computes one row's offsets and
    # mask rather than one per row it touches (a 64 KiB tile of 2 KiB items: 62-64 -> 32
    # registers at 32 warps, 103 -> 50 at 16, by ptxas for sm_90a; no change in GB/s on an
    # H200, bench_small_grid.md).
    o_w = tl.arange(0, REPS)[:, None, None] * W2 + tl.arange(0, W2)[None, None, :]
    if D2H:
        src_ptr = dev_ptr
        dst_ptr = host_ptr
    else:
        src_ptr = host_ptr
        dst_ptr = dev_ptr
    if PREFETCH:
        b_dev, b_host, dev_base = _tile_loads(
            i_prog, table_ptr, dev_idx_ptr, host_idx_ptr, n_rows, num_layers, layer_start,
            n_sel_layers, n_tiles_r, num_tiles, TOKENS_PER_INDEX, CHUNKS, BLOCK_R, LAYER_ROWS,
            LAYER_INNER,
        )  # fmt: skip
    for i_tile in range(i_prog, num_tiles, n_prog):
        if not PREFETCH:
            b_dev, b_host, dev_base = _tile_loads(
                i_tile, table_ptr, dev_idx_ptr, host_idx_ptr, n_rows, num_layers, layer_start,
                n_sel_layers, n_tiles_r, num_tiles, TOKENS_PER_INDEX, CHUNKS, BLOCK_R,
                LAYER_ROWS, LAYER_INNER,
            )  # fmt: skip
        o_dev, o_host, m_row = _tile_offsets(
            i_tile, b_dev, b_host, dev_base, n_rows, layer_start, n_sel_layers, page_size,
            host_s_buf, host_s_page, host_s_tok, host_s_layer, dev_s_slot, n_tiles_r,
            num_tiles, CHUNKS, VEC, TABLE_SCALE, BLOCK_R, BLOCK_W, LAYER_ROWS, LAYER_INNER,
        )  # fmt: skip
        if D2H:
            o_src, o_dst = o_dev, o_host
        else:
            o_src, o_dst = o_host, o_dev
        b_x = tl.load(
            src_ptr + (o_src[None, :, None] + o_w),
            mask=m_row[None, :, None],
            cache_modifier=".cg",
        )
        if PREFETCH:
            # The last tile reads its own entries again: every read stays in range.
            b_dev, b_host, dev_base = _tile_loads(
                tl.minimum(i_tile + n_prog, num_tiles - 1), table_ptr, dev_idx_ptr,
                host_idx_ptr, n_rows, num_layers, layer_start, n_sel_layers, n_tiles_r,
                num_tiles, TOKENS_PER_INDEX, CHUNKS, BLOCK_R, LAYER_ROWS, LAYER_INNER,
            )  # fmt: skip
        tl.store(
            dst_ptr + (o_dst[None, :, None] + o_w),
            b_x,
            mask=m_row[None, :, None],
            cache_modifier=".cs",
        )


def _constexpr_names(kernel: object) -> tuple[str, ...]:
    """The kernel's ``tl.constexpr`` parameters in signature order (from its Python function,
    so the JIT and the interpreter agree)."""
    params = inspect.signature(kernel.fn).parameters  # type: ignore[attr-defined]
    return tuple(n for n, p in params.items() if str(p.annotation).endswith("constexpr"))


# The direct launch passes the constexprs' values after the runtime arguments, in this order.
_CONSTEXPRS = _constexpr_names(_kv_copy_kernel)


@dataclass(frozen=True)
class TransferKnobs:
    """Launch knobs for the copy kernels.

    Attributes:
        num_programs: grid size cap: at most this many programs (about one SM each) run a copy.
        tile_bytes: bytes one program moves per step (its bytes in flight).
        num_warps: warps per program; None (the default) follows the grid (``warps``): 16,
            or 32 where ``num_programs`` is 1 or 2 (also after ``dataclasses.replace`` changes
            ``num_programs``): with one program per SM, twice the warps keep twice the
            accesses in flight (H100, P=16, 2 programs: D2H 85 -> 94% of the copy engine, H2D
            one layer 68 -> 86%; at 4 programs 16 and 32 warps are within a point or two,
            profiling/results/gpu_kernel.md).
        small_h2d_bytes: one-layer host->device calls of at most this many bytes use the
            small-call variant below (0: never). Host reads are latency-bound: in a call of a
            few tiles per program the programs wait on their tiles in step and the link idles a
            round trip per tile; half the tile on twice the warps keeps more reads in flight
            per byte (H100: 72 -> 87% of the copy engine at 1.1 MiB in a CUDA graph, 80 -> 94%
            per call) but is slower on large and on all-layer calls, whose programs drift out
            of step anyway (profiling/results/gpu_kernel.md). Device->host stores are posted
            and keep the default.
        small_tile_bytes, small_num_warps: the small-call variant's tile and warps.
        token_d2h_programs, token_h2d_programs: copies with a host pool of page size 1 whose
            items are at most ``token_item_bytes`` (each token's K or V of one layer at its own
            host slot: 2 KiB on Llama-8B shapes) on at most this many programs use the token
            variant below, device->host and host->device (0: never). Scattered small items
            want more bytes in flight per program than pages do (H100, bench_small_grid
            ``--sweep tokens``: 2 programs H->D 81-88 -> 91-94% of the copy engine, 4 programs
            page_first D->H one layer 65 -> 85%; at 4 programs H->D and from 8 programs up
            the default is as good or better, and pages of 16 tokens gain nothing). Mamba
            states and sidecar pages (page size 1, large items) keep the default.
        token_item_bytes: the largest host item the token variant takes.
        token_tile_bytes, token_num_warps: the token variant's tile and warps.
        layer_rows_programs: all-layer calls whose host keeps each token's layers side by side
            (page_first, Mamba slots) walk a token's layers in a tile's rows from this many
            programs up, and at every grid size where the host page size is 1 and its items
            at most ``token_item_bytes`` (0: never), so a tile's host side is one run per token
            instead of a 2 KiB piece every L items (H100, page_first all layers, % of the copy
            engine, bench_small_grid ``--sweep rows``: P=16 D->H at 4 programs 94.1-94.8 ->
            94.8-95.5, at 2 programs 90-91 -> 85, so not there; P=1 D->H 42 -> 59 at 1
            program, 83 -> 95 at 2, 94 -> 95.6 at 4; H->D within a point or two either way).
        layer_inner: all-layer calls whose host keeps each token's layers side by side and
            that do not take layer rows walk layers innermost: a program's next tile is the
            next (buffer, layer) of the same rows, so each row's host writes run along its
            token's layers as a warp of sgl-kernel's all-layer kernel writes them, rather than
            a 2 KiB piece every L items (H200, page_first D->H all layers, P=16, % of the copy
            engine, profiling/kernel_variants.py: 2 programs 90.0-90.9 -> 94.1-94.7, 1 program
            46.7 -> 55.7, 4 programs (layer rows) unchanged). One-layer calls keep the usual
            order: alternating buffers there was slower (H->D 2 programs 86 -> 79).
        prefetch_h2d: host->device calls read the next tile's slot indices and table entry
            while this tile's host reads are in flight, before its stores, so each tile's
            chain is one host round trip rather than an index read and then a host read
            (H200, P=16, % of the copy engine, profiling/kernel_variants.py: page_first one
            layer 2 programs 63 -> 71-73, 1 program 32 -> 37; layer_first all layers 2
            programs 78 -> 81-82; the small variant at 4 MiB 55 -> 61 and 92 -> 95 (2 and 4
            programs); 4 programs otherwise within a few tenths). Not device->host (slower in
            every case measured: page_first all layers 2 programs 90 -> 89, the token variant
            at 4 programs 86 -> 70), not the token variant (92.7 -> 76 at 2 programs), not
            with layers innermost (page_first all layers 2 programs 85.6 -> 83.3).
    """

    num_programs: int = 4
    tile_bytes: int = 65536
    num_warps: int | None = None
    small_h2d_bytes: int = 8 << 20
    small_tile_bytes: int = 32768
    small_num_warps: int = 32
    token_d2h_programs: int = 4
    token_h2d_programs: int = 2
    token_item_bytes: int = 8192
    token_tile_bytes: int = 131072
    token_num_warps: int = 32
    layer_rows_programs: int = 4
    layer_inner: bool = True
    prefetch_h2d: bool = True

    def __post_init__(self) -> None:
        for name in (
            "num_programs",
            "tile_bytes",
            "small_h2d_bytes",
            "small_tile_bytes",
            "small_num_warps",
            "token_d2h_programs",
            "token_h2d_programs",
            "token_item_bytes",
            "token_tile_bytes",
            "token_num_warps",
            "layer_rows_programs",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {v!r}")
        for name in ("layer_inner", "prefetch_h2d"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.num_programs < 1:
            raise ValueError(f"num_programs must be >= 1, got {self.num_programs}")
        for name in (
            "small_h2d_bytes",
            "token_d2h_programs",
            "token_h2d_programs",
            "token_item_bytes",
            "layer_rows_programs",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        w = self.num_warps
        if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
            raise TypeError(f"num_warps: expected an int or None, got {w!r}")
        for tile, warps in (
            ("tile_bytes", "warps"),
            ("small_tile_bytes", "small_num_warps"),
            ("token_tile_bytes", "token_num_warps"),
        ):
            t, w = getattr(self, tile), getattr(self, warps)
            if t < 16 or t & (t - 1):
                raise ValueError(f"{tile} must be a power of two >= 16, got {t}")
            if w not in (1, 2, 4, 8, 16, 32):
                name = "num_warps" if warps == "warps" else warps
                raise ValueError(f"{name} must be a power of two in [1, 32], got {w}")

    @property
    def warps(self) -> int:
        """The warps per program a launch uses: ``num_warps``, or the grid's default."""
        if self.num_warps is not None:
            return self.num_warps
        return 32 if self.num_programs <= 2 else 16

    def small_variant(self) -> TransferKnobs:
        """The knobs of the small host->device call variant (whose own variants are off)."""
        return self._variant("small", self.small_tile_bytes, self.small_num_warps)

    def token_variant(self) -> TransferKnobs:
        """The knobs of the token variant (page size 1 host pools; its own variants are off)."""
        return self._variant("token", self.token_tile_bytes, self.token_num_warps)

    def takes_token_variant(self, page_size: int, item_bytes: int, d2h: bool) -> bool:
        """Whether a copy with this host page size and item takes the token variant."""
        programs = self.token_d2h_programs if d2h else self.token_h2d_programs
        return (
            page_size == 1
            and item_bytes <= self.token_item_bytes
            and (self.num_programs <= programs)
        )

    def _variant(self, kind: str, tile: int, warps: int) -> TransferKnobs:
        key = (self, kind)
        return _VARIANTS.get(key) or _VARIANTS.setdefault(
            key,
            replace(
                self,
                tile_bytes=tile,
                num_warps=warps,
                small_h2d_bytes=0,
                token_d2h_programs=0,
                token_h2d_programs=0,
                # Reading ahead halved the token variant's host->device speed (H200, P=1, 2
                # programs: 92.7 -> 76% of the copy engine one layer, 92.3 -> 56 all layers).
                prefetch_h2d=self.prefetch_h2d and kind != "token",
            ),
        )


_VARIANTS: dict[tuple[TransferKnobs, str], TransferKnobs] = {}


DEFAULT_KNOBS = TransferKnobs()


def _check_index(t: torch.Tensor, name: str, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise ValueError(f"{name}: dtype must be torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: must be 1-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but the device pool is on {device}")
    if t.stride(0) != 1 and t.numel() > 1:
        raise ValueError(f"{name}: must be contiguous (stride {t.stride(0)})")


def _check_index_values(
    t: torch.Tensor, name: str, limit: int, page_size: int, unit: IndexUnit
) -> None:
    """Range and page-alignment checks; reads the indices back (a device sync on GPU)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    bound = limit // page_size if unit == "page" else limit
    if lo < -1 or hi >= bound:
        bad = t[(t < -1) | (t >= bound)][0].item()
        what = "page id" if unit == "page" else "slot"
        raise ValueError(f"{name}: {what} {bad} outside [0, {bound}) (and -1 for skip)")
    if unit == "token" and page_size > 1:
        if t.numel() % page_size:
            raise ValueError(
                f"{name}: {t.numel()} token slots is not a whole number of pages of {page_size}"
            )
        runs = t.view(-1, page_size)
        first = runs[:, :1]
        offs = torch.arange(page_size, device=t.device, dtype=torch.int64)
        skip = (runs == -1).all(dim=1)
        aligned = (first % page_size == 0).squeeze(1) & (runs == first + offs).all(dim=1)
        bad_rows = ~(skip | aligned)
        if bool(bad_rows.any()):
            row = int(bad_rows.nonzero()[0, 0])
            raise ValueError(
                f"{name}: slots {runs[row].tolist()[:4]}... at page {row} are not one "
                f"page-aligned run of {page_size} tokens"
            )


# Pool pairs whose own checks passed, per path: those checks (the pinned-memory one is a CUDA
# call) are paid once per pair, not per copy. Entries hold weak references: a pool is never kept
# alive by them, and an id reused by a new object never matches.
_PAIRS_OK: dict[tuple[int, int, str], tuple[weakref.ref, weakref.ref]] = {}


def _validate_pair(dev: DeviceBuffers, host: HostBuffer, impl: str) -> None:
    key = (id(dev), id(host), impl)
    hit = _PAIRS_OK.get(key)
    if hit is not None and hit[0]() is dev and hit[1]() is host:
        return
    if host.item_shape is not None:
        if dev.dtype != host.dtype:
            raise ValueError(f"host: dtype {host.dtype} differs from the device pool's {dev.dtype}")
        if dev.item_shape != host.item_shape:
            raise ValueError(
                f"host: item shape {host.item_shape} differs from the device pool's {dev.item_shape}"
            )
    if dev.item_bytes != host.item_bytes:
        raise ValueError(
            f"host: items of {host.item_bytes} bytes, the device pool's are {dev.item_bytes}"
        )
    if dev.num_buffers != host.num_buffers or dev.num_layers != host.num_layers:
        raise ValueError(
            f"host: {host.num_buffers} buffers x {host.num_layers} layers, device pool has "
            f"{dev.num_buffers} x {dev.num_layers}"
        )
    if impl == "triton":
        if host.tensor.device.type == "cpu" and not host.tensor.is_pinned():
            raise ValueError("host: host tensor must be pinned memory on the GPU path")
        if dev.base.device.type == "cpu" and not all(t.is_pinned() for b in dev.layers for t in b):
            raise ValueError("dev: host tensors reached from the GPU must be pinned memory")
    if host.tensor.device.type != "cpu" and host.tensor.device != dev.device:
        raise ValueError(f"host: tensor on {host.tensor.device}, kernels run on {dev.device}")
    if len(_PAIRS_OK) >= 256:
        _PAIRS_OK.clear()
    _PAIRS_OK[key] = (weakref.ref(dev), weakref.ref(host))


def _validate(
    dev: DeviceBuffers,
    host: HostBuffer,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    dev_name: str,
    host_name: str,
    layer: int | None,
    unit: IndexUnit,
    check: bool | None,
    impl: str,
) -> None:
    _validate_pair(dev, host, impl)
    if layer is not None and (type(layer) is not int or not 0 <= layer < dev.num_layers):
        if type(layer) is not int:  # 1.0 failed inside the kernel, True passed as layer 1
            raise TypeError(f"layer: expected an int or None, got {layer!r}")
        raise ValueError(f"layer: {layer} outside [0, {dev.num_layers})")
    if unit not in ("token", "page"):
        raise ValueError(f"index_unit: must be 'token' or 'page', got {unit!r}")
    device = dev.device
    for t, name in ((dev_idx, dev_name), (host_idx, host_name)):
        # One combined test on the request path; the detailed checks run (and name what is
        # wrong) only when it fails.
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype is torch.int64
            and t.dim() == 1
            and t.device == device
            and (t.stride(0) == 1 or t.numel() <= 1)
        ):
            _check_index(t, name, device)
    if dev_idx.numel() != host_idx.numel():
        raise ValueError(
            f"{dev_name} has {dev_idx.numel()} entries but {host_name} has {host_idx.numel()}"
        )
    if check if check is not None else debug_checks():
        P = host.page_size
        _check_index_values(dev_idx, dev_name, dev.num_slots, P, unit)
        _check_index_values(host_idx, host_name, host.num_slots, P, unit)


@dataclass
class _Prepared:
    """What a launch derives from its pool pair, direction, index unit, scope and knobs alone:
    the word views and every constant argument. Cached (:func:`_prepared`), so that a call
    only computes its size-dependent arguments and launches. The entry refers to its pair
    weakly and is dropped when either side is collected (its word views would otherwise keep a
    freed pool's memory alive)."""

    dev: weakref.ref
    host: weakref.ref
    dev_words: torch.Tensor
    host_words: torch.Tensor
    chunks: int
    block_r: int
    args: tuple  # host strides and the device slot stride, in vectors
    knobs: TransferKnobs  # the variant's knobs (for the grid cap)
    meta: dict  # the kernel's constexprs and num_warps
    layer_rows: bool  # rows span the selected layers (LAYER_ROWS)
    layer_inner: bool  # a program's next tile: the next (buffer, layer) (LAYER_INNER)
    consts: tuple  # ``meta``'s constexprs in signature order (the compiled launcher's tail)
    compiled: object = None  # the compiled kernel, once a launch through the JIT has made it


_PREPARED: dict[tuple, _Prepared] = {}
_PREPARED_MAX = 256  # pools x directions x scopes of a process: far below this


def _prepared(
    dev: DeviceBuffers,
    host: HostBuffer,
    tpi: int,
    d2h: bool,
    knobs: TransferKnobs,
    layer_rows: bool = False,
    layer_inner: bool = False,
) -> _Prepared:
    key = (id(dev), id(host), tpi, d2h, knobs, layer_rows, layer_inner)
    hit = _PREPARED.get(key)
    if hit is not None and hit.dev() is dev and hit.host() is host:
        return hit
    w = min(dev.table_unit, host.align)
    elem = min(w, 8)
    word = _WORD_DTYPE[elem]
    vec = w // elem
    item_words = host.item_bytes // elem
    # Chunk width: the largest power of two dividing the item, capped by the tile.
    tile_words = max(knobs.tile_bytes // elem, vec)
    block_w = min(item_words & -item_words, tile_words)
    # Rows per tile depend on the item and the knobs only, never on the transfer's size: one
    # compiled variant per pool and direction (a small transfer masks the rows it lacks).
    block_r = max(1, tile_words // block_w)
    piece = min(block_w, 32 * vec)  # a warp's 32 lanes, one vector each
    # Not with layers innermost: measured slower there (TransferKnobs.prefetch_h2d).
    prefetch = knobs.prefetch_h2d and not d2h and not layer_inner

    def as_words(t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        # Bytes first, then whole words: a view of the caller's memory, never a copy.
        raw = t.view(-1).view(torch.uint8)[offset:]
        return raw[: raw.numel() // elem * elem].view(word)

    meta = dict(
        D2H=d2h,
        TOKENS_PER_INDEX=tpi,
        CHUNKS=item_words // block_w,
        VEC=vec,
        TABLE_SCALE=dev.table_unit // w,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        LAYER_ROWS=layer_rows,
        REPS=block_w // piece,
        W2=piece,
        PREFETCH=prefetch,
        LAYER_INNER=layer_inner,
        num_warps=knobs.warps,
    )
    prep = _Prepared(
        dev=weakref.ref(dev),
        host=weakref.ref(host),
        dev_words=as_words(dev.base),
        host_words=as_words(host.tensor, host.offset),
        knobs=knobs,
        chunks=item_words // block_w,
        block_r=block_r,
        args=(
            host.stride_buffer // w,
            host.stride_page // w,
            host.stride_token // w,
            host.stride_layer // w,
            dev.item_bytes // w,
        ),
        layer_rows=layer_rows,
        layer_inner=layer_inner,
        meta=meta,
        consts=tuple(meta[name] for name in _CONSTEXPRS),
    )
    if len(_PREPARED) >= _PREPARED_MAX:
        _PREPARED.clear()
    _PREPARED[key] = prep
    for owner in (dev, host):  # the finalizers hold the key only, never the views
        weakref.finalize(owner, _forget, key, id(prep))
    return prep


def _forget(key: tuple, prep_id: int) -> None:
    if id(_PREPARED.get(key)) == prep_id:
        del _PREPARED[key]


# Varying integer arguments at or above this go through the JIT: Triton types an int argument
# i32 or i64 by its value, so such a value would need another compiled variant.
_I32_MAX = 2**31 - 1

# The running stream of a CUDA device, as Triton's own launch path reads it (set on first use).
_current_stream = None


# Triton's runtime knobs (launch hooks), where this Triton has them (3.4 and later).
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)

# Launch cached compiled kernels directly (CUDA only; never in the interpreter). Tests turn it
# off to compare both paths.
FAST_LAUNCH = _RUNTIME_KNOBS is not None and not interpreter_enabled()


def _hooks_off() -> bool:
    """No launch hooks installed: profilers such as Proton set them, and only the JIT path
    calls them, so a call goes through the JIT while they are on."""
    rt = _RUNTIME_KNOBS
    return _no_hook(rt.launch_enter_hook) and _no_hook(rt.launch_exit_hook)


def _no_hook(hook: object) -> bool:
    # Unset: None (older Triton) or an empty chain of functions (newer Triton's default).
    return hook is None or (type(hook).__name__ == "HookChain" and not getattr(hook, "calls", 1))


def _launch(
    dev: DeviceBuffers,
    host: HostBuffer,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    layer: int | None,
    unit: IndexUnit,
    d2h: bool,
    knobs: TransferKnobs,
) -> None:
    tpi = host.page_size if unit == "page" else 1
    n_tokens = dev_idx.numel() * tpi
    if n_tokens == 0:
        return
    n_sel = 1 if layer is not None else dev.num_layers
    large = knobs
    if knobs.takes_token_variant(host.page_size, host.item_bytes, d2h):
        large = knobs.token_variant()
    sibling = small = None  # the other host->device variant, compiled beside the first
    if not d2h and knobs.small_h2d_bytes:
        small = knobs.small_variant()
        if (
            layer is not None
            and n_tokens * dev.num_buffers * dev.item_bytes <= knobs.small_h2d_bytes
        ):
            knobs, sibling = small, large
        else:
            knobs, sibling = large, small
    else:
        knobs = large
    layer_rows, layer_inner = _all_layer_order(knobs, host) if n_sel > 1 else (False, False)
    prep = _prepared(dev, host, tpi, d2h, knobs, layer_rows, layer_inner)
    if layer_rows and n_tokens * prep.chunks * n_sel > _I32_MAX:
        # The tile index math is i32: rows past 2**31 would wrap. Such a call (millions of
        # tokens) takes one (buffer, layer) per tile, whose rows stay in range, in the order
        # one-layer calls use (compiled already).
        prep = _prepared(dev, host, tpi, d2h, knobs)
    grid0, args = _launch_args(prep, dev, host, dev_idx, host_idx, n_tokens, layer, n_sel)
    compiled = prep.compiled
    if (
        compiled is not None
        and FAST_LAUNCH
        and args[-1] <= _I32_MAX
        and args[5] <= _I32_MAX
        and _hooks_off()
    ):
        # The direct launch: what JITFunction.run ends with, minus its per-call argument
        # binding, specialization key and cache lookup, which cost most of a launch's CPU time.
        # Every argument that is specialized is fixed per prepared entry, so the kernel that
        # the JIT compiled for the entry is the one it would pick again.
        global _current_stream
        if _current_stream is None:
            _current_stream = triton.runtime.driver.active.get_current_stream
        compiled.run(
            grid0,
            1,
            1,
            _current_stream(dev.device.index),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *prep.consts,
        )
        return
    kernel = _kv_copy_kernel[(grid0,)](*args, **prep.meta)
    if (
        FAST_LAUNCH
        and dev.device.type == "cuda"
        and hasattr(kernel, "run")
        and hasattr(kernel, "packed_metadata")
    ):
        prep.compiled = kernel
        # A cache compiles its variants in ``warmup`` with small calls; compile every other
        # variant this pair and direction may take too (no launch): the other host->device
        # size, and where a token's layers are adjacent the other tile orders (one-layer and
        # all-layer calls). No later request waits for a compile.
        for kn in (knobs,) if sibling is None else (knobs, sibling):
            orders = {(False, False)}  # one-layer calls
            if kn is not small:  # the small variant serves one-layer calls only
                orders.add(_all_layer_order(kn, host))
            for rows, inner in sorted(orders):
                other = _prepared(dev, host, tpi, d2h, kn, rows, inner)
                if other.compiled is None:
                    g, a = _launch_args(other, dev, host, dev_idx, host_idx, n_tokens, layer, n_sel)
                    other.compiled = _kv_copy_kernel.warmup(*a, grid=(g,), **other.meta)
                    # Load it onto the GPU now as well: a module's first load waits for the
                    # device to go idle (H100: the first host hit's load blocked the CPU for
                    # the 46 ms the forward pass queued before it still took to run).
                    _ = other.compiled.run


def _all_layer_order(knobs: TransferKnobs, host: HostBuffer) -> tuple[bool, bool]:
    """(layer rows, layers innermost) of an all-layer call with these knobs. Only hosts that
    keep a token's layers side by side (page_first, Mamba slots) take either: layer rows
    (``TransferKnobs.layer_rows_programs``), else layers innermost (``layer_inner``)."""
    if host.num_layers == 1 or host.stride_layer != host.item_bytes:
        return False, False
    rows = knobs.layer_rows_programs > 0 and (
        knobs.layer_rows_programs <= knobs.num_programs
        or (host.page_size == 1 and host.item_bytes <= knobs.token_item_bytes)
    )
    return rows, knobs.layer_inner and not rows


def _launch_args(
    prep: _Prepared,
    dev: DeviceBuffers,
    host: HostBuffer,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    n_tokens: int,
    layer: int | None,
    n_sel: int,
) -> tuple[int, tuple]:
    """The grid and the kernel's runtime arguments in its signature's order (``n_rows`` at
    index 5, ``num_tiles`` last)."""
    if prep.layer_rows:
        n_rows = n_tokens * prep.chunks * n_sel
        n_tiles_r = (n_rows + prep.block_r - 1) // prep.block_r
        num_tiles = dev.num_buffers * n_tiles_r
    else:
        n_rows = n_tokens * prep.chunks
        n_tiles_r = (n_rows + prep.block_r - 1) // prep.block_r
        num_tiles = dev.num_buffers * n_sel * n_tiles_r
    args = (
        prep.dev_words,
        dev.table,
        prep.host_words,
        dev_idx,
        host_idx,
        n_rows,
        dev.num_layers,
        0 if layer is None else layer,
        n_sel,
        host.page_size,
        *prep.args,
        n_tiles_r,
        num_tiles,
    )
    return min(prep.knobs.num_programs, num_tiles), args


# NVTX range names of recent calls: formatting one costs more than the rest of a small call's
# bookkeeping, and a layer-wise load repeats the same few names.
_RANGE_NAMES: dict[tuple, str] = {}


def _range_name(d2h: bool, path: str, layer: int | None, layout: str, nbytes: int) -> str:
    key = (d2h, path, layer, layout, nbytes)
    name = _RANGE_NAMES.get(key)
    if name is None:
        if len(_RANGE_NAMES) >= 4096:
            _RANGE_NAMES.clear()
        name = _RANGE_NAMES[key] = copy_range_name(d2h, path, layer, layout, nbytes)
    return name


def _transfer(
    dev: DeviceBuffers,
    host: HostBuffer,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    *,
    d2h: bool,
    layer: int | None,
    unit: IndexUnit,
    knobs: TransferKnobs | None,
    check: bool | None,
    impl: Impl,
) -> str:
    path = select_impl(dev.device, impl)
    if d2h:
        _validate(
            dev, host, dev_idx, host_idx, "src_indices", "dst_indices", layer, unit, check, path
        )
    else:
        _validate(
            dev, host, dev_idx, host_idx, "dst_indices", "src_indices", layer, unit, check, path
        )
    n_sel = 1 if layer is not None else dev.num_layers
    tpi = host.page_size if unit == "page" else 1
    nbytes = dev_idx.numel() * tpi * dev.num_buffers * n_sel * dev.item_bytes
    layout = host.layout.value if host.layout else "strided"
    with nvtx_range(_range_name(d2h, path, layer, layout, nbytes)):
        if path == "torch":
            ref_copy_kv(dev, host, dev_idx, host_idx, d2h=d2h, layer=layer, index_unit=unit)
        elif path == "interpreter" or dev.device.type != "cuda":
            with _INTERPRETER_LOCK:
                _launch(dev, host, dev_idx, host_idx, layer, unit, d2h, knobs or DEFAULT_KNOBS)
        elif torch.cuda.current_device() == dev.device.index:
            # Already on the pool's device: entering a device guard costs microseconds.
            _launch(dev, host, dev_idx, host_idx, layer, unit, d2h, knobs or DEFAULT_KNOBS)
        else:
            with torch.cuda.device(dev.device):
                _launch(dev, host, dev_idx, host_idx, layer, unit, d2h, knobs or DEFAULT_KNOBS)
    return path


def copy_device_to_host(
    dev: DeviceBuffers,
    host: HostBuffer,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer: int | None = None,
    index_unit: IndexUnit = "token",
    knobs: TransferKnobs | None = None,
    check: bool | None = None,
    impl: Impl = "auto",
) -> str:
    """Copy items of device slots ``src_indices`` into host slots ``dst_indices``.

    Args:
        dev: device buffers, ``B x L`` tensors ``[slots, *item]``.
        host: host buffer (pinned on the GPU path) in any layout.
        src_indices, dst_indices: int64 ``[n]`` on the device pool's device; token slots in
            page-aligned runs, or page ids with ``index_unit="page"``; ``-1`` skips.
        layer: one layer, or None for all layers in one launch.
        knobs: grid cap, tile bytes, warps.
        check: run range/alignment checks (default: :func:`kvtier.kernels.debug_checks`).
        impl: "auto", "triton", "interpreter" or "torch".

    Returns:
        The path taken: "triton", "interpreter" or "torch". Asynchronous on CUDA (current stream).
    """
    return _transfer(
        dev,
        host,
        src_indices,
        dst_indices,
        d2h=True,
        layer=layer,
        unit=index_unit,
        knobs=knobs,
        check=check,
        impl=impl,
    )


def copy_host_to_device(
    host: HostBuffer,
    dev: DeviceBuffers,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    layer: int | None = None,
    index_unit: IndexUnit = "token",
    knobs: TransferKnobs | None = None,
    check: bool | None = None,
    impl: Impl = "auto",
) -> str:
    """Copy items of host slots ``src_indices`` into device slots ``dst_indices``.

    Same arguments as :func:`copy_device_to_host`, with source and destination swapped.
    """
    return _transfer(
        dev,
        host,
        dst_indices,
        src_indices,
        d2h=False,
        layer=layer,
        unit=index_unit,
        knobs=knobs,
        check=check,
        impl=impl,
    )
