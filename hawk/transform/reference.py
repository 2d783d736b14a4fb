"""The transfer-aware transformation in plain torch: the byte-exact oracle, on any device.

Gather the request's rows from the paged GPU cache, re-block them into 32x32 tiles of the NPU's
blocks, encode (bf16 or bfloat8_b), and place each tile at its channel-grouped send-buffer offset.
The fused Triton kernel must write the same bytes; this version favours being obviously right.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hawk.layouts.paged import Mode, PagedKVLayout, mode_max
from hawk.layouts.tt import FACE, TILE, bytes_to_tiles, tiles_to_bytes
from hawk.plan.kv_plan import KVTransferPlan, TileDest


def _slab_rows(plan: KVTransferPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets ``[2, S, 32]`` of each tile row's first element (K, then V) in its layer's
    region, and row validity ``[S, 32]``.

    The plan enumerates tiles with the column tile fastest, so every ``col_tiles`` consecutive
    tiles share one slab: 32 tokens of one head. Offsets come from the source's hierarchical layout
    (:meth:`~hawk.layouts.paged.PagedKVLayout.element_offsets`), whatever engine laid it out.
    """
    src, ct = plan.src.paged(), plan.dst.col_tiles
    first = slice(None, None, ct)
    rows = torch.arange(TILE, device=device)
    tok = torch.as_tensor(plan.token_start[first], device=device)[:, None] + rows[None, :]  # [S, 32]
    valid = tok < plan.num_tokens
    tok = tok.clamp(max=plan.num_tokens - 1)
    blk = torch.as_tensor(plan.gpu_block_ids, device=device)[tok // src.block_size]
    head = torch.as_tensor(plan.gpu_head[first], device=device)[:, None]
    kv = torch.arange(2, device=device)[:, None, None]
    return src.element_offsets(kv, blk[None], (tok % src.block_size)[None], head[None], 0), valid


def _elements(plan: KVTransferPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Element offsets ``[2, S*32, head_dim]`` of every row element, and row validity ``[S*32]``: a
    layout's offsets are sums over its coordinates, so a row's are its first element's plus the
    offsets of the dims (one stride, or several for an interleaved order)."""
    src = plan.src.paged()
    rows, valid = _slab_rows(plan, device)
    kv = torch.arange(2, device=device)[:, None]
    dims = src.element_offsets(kv, 0, 0, 0, torch.arange(src.head_dim, device=device)[None, :]) - src.element_offsets(kv, 0, 0, 0, 0)
    return rows.reshape(2, -1, 1) + dims[:, None, :], valid.reshape(-1)


def _rows(flat: torch.Tensor, dim_mode: Mode, step: int) -> torch.Tensor:
    """``flat`` seen as rows of ``head_dim`` elements, one starting every ``step`` elements (rows may
    overlap): row ``i`` holds the elements at ``i * step`` plus the dim mode's offsets (one stride, or
    several nested for an interleaved order). Indexing it by row starts / step gathers whole rows; for
    a layout of contiguous rows ``step`` is the row length, the plain row gather of a reshaped cache."""
    strides = tuple(st for _, st in reversed(dim_mode))
    return flat.as_strided(((flat.numel() - 1 - mode_max(dim_mode)) // step + 1, *_rows_shape(dim_mode)), (step, *strides))


def _rows_shape(dim_mode: Mode) -> tuple[int, ...]:
    """A row's shape in :func:`_rows` (the dim mode's shapes, slowest first)."""
    return tuple(sh for sh, _ in reversed(dim_mode))


def _row_step(src: PagedKVLayout, kv: int) -> int:
    """What every row start of K (or V) is a multiple of: its base and the block, slot and head strides."""
    return math.gcd(src.kv_base[kv], *(st for m in src.modes[kv][:3] for _, st in m)) or 1


def gather_faces(caches: Sequence[torch.Tensor], plan: KVTransferPlan, layer: int) -> torch.Tensor:
    """``[2, P, 4, 16, 16]`` tiles (K then V) of one layer in plan order and face order, rows past the request zeroed.

    One gather of whole rows from the layer's region, then one permute that does both the column-tile
    split and the 16x16 face order: ``[slab, 2 fr, 16 r, ct, 2 fc, 16 c] -> [slab, ct, fr, fc, r, c]``.
    """
    cache, src = caches[layer], plan.src.paged()
    starts, valid = _slab_rows(plan, cache.device)
    flat = plan.src.layer_flat(cache)
    slabs = torch.empty((2, starts[0].numel(), src.head_dim), dtype=cache.dtype, device=cache.device)  # [2, S*32, D]
    for kv in range(2):
        step, dim_mode = _row_step(src, kv), src.modes[kv][3]
        torch.index_select(_rows(flat, dim_mode, step), 0, starts[kv].reshape(-1) // step, out=slabs[kv].view(-1, *_rows_shape(dim_mode)))
    slabs[:, (~valid).reshape(-1)] = 0  # +0 padding rows, as ttnn pads
    s = slabs.reshape(2, -1, 2, FACE, plan.dst.col_tiles, 2, FACE).permute(0, 1, 4, 2, 5, 3, 6)
    return s.reshape(2, -1, 4, FACE, FACE)


def transform_reference(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor | None = None, dest: TileDest | None = None
) -> torch.Tensor:
    """Write the plan's tiles (1-D uint8) from the paged GPU caches: into its send buffer (``plan.total_bytes``),
    or where ``dest`` says (:meth:`KVTransferPlan.memory_dest`: the NPU's DRAM, ``out`` being all of it)."""
    plan.src.check_cache(list(caches))
    device = caches[0].device
    pb = plan.page_bytes
    if out is None:  # a send buffer's bytes are all tiles; any other destination starts zeroed
        n = plan.total_bytes if dest is None else dest.extent
        out = (torch.empty if dest is None else torch.zeros)(n, dtype=torch.uint8, device=device)
    dest = dest or plan.send_dest()
    if out.dtype != torch.uint8 or out.numel() < dest.extent:
        raise ValueError(f"send buffer (or destination) must be uint8 with >= {dest.extent} bytes, got {out.dtype} x {out.numel()}")
    # Offsets are whole units: write units, not bytes (a send buffer's unit is a page: one row per tile).
    unit = dest.unit
    rows = out.view(-1)[: dest.extent].view(-1, unit)
    a, b = (torch.as_tensor(x, device=device) // unit for x in (dest.a, dest.b))
    within = torch.arange(pb // unit, device=device)
    for layer in range(plan.src.num_layers):
        encoded = tiles_to_bytes(gather_faces(caches, plan, layer).reshape(-1, 4, FACE, FACE), plan.dst.dtype)
        encoded = encoded.view(2, -1, pb // unit, unit)
        for kv in range(2):
            t = 2 * layer + kv
            rows[(a + t * b)[:, None] + within[None, :]] = encoded[kv]
    return out


def untransform_reference(send: torch.Tensor, plan: KVTransferPlan, caches: Sequence[torch.Tensor]) -> None:
    """The inverse, for the reverse direction: decode a send buffer's tiles into the paged caches.

    Only the request's rows are written; padding rows of the last NPU block are dropped.
    """
    plan.src.check_cache(list(caches))
    if send.dtype != torch.uint8 or send.numel() < plan.total_bytes:
        raise ValueError(f"send buffer must be uint8 with >= {plan.total_bytes} bytes, got {send.dtype} x {send.numel()}")
    device = caches[0].device
    pb, d, ct = plan.page_bytes, plan.src.head_dim, plan.dst.col_tiles
    pages = send[: plan.total_bytes].to(device).view(-1, pb)
    a, b = (torch.as_tensor(x, device=device) for x in plan.offset_terms())
    idx, keep = _elements(plan, device)
    target = idx[:, keep]
    for layer in range(plan.src.num_layers):
        raw = torch.stack([pages[(a + (2 * layer + kv) * b) // pb] for kv in range(2)])  # [2, P, pb]
        tiles = bytes_to_tiles(raw.reshape(-1, pb), plan.dst.dtype)
        x = tiles.reshape(2, -1, ct, 2, 2, FACE, FACE).permute(0, 1, 3, 5, 2, 4, 6).reshape(2, -1, d)  # [2, S*32, D]
        cache = caches[layer]
        plan.src.layer_flat(cache)[target] = x[:, keep].to(cache.dtype)
