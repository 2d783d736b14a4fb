"""The transfer-aware transformation in plain torch: the byte-exact oracle, on any device.

Gather the request's rows from the paged GPU cache, re-block them into 32x32 tiles of the NPU's
blocks, encode (bf16 or bfloat8_b), and place each tile at its channel-grouped send-buffer offset.
The fused Triton kernel must write the same bytes; this version favours being obviously right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hawk.layouts.tt import FACE, TILE, bytes_to_tiles, tiles_to_bytes
from hawk.plan.kv_plan import KVTransferPlan, TileDest


def _slab_rows(plan: KVTransferPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``[S, 32]`` into a layer viewed as ``[2, rows, head_dim]``, and row validity.

    The plan enumerates tiles with the column tile fastest, so every ``col_tiles`` consecutive
    tiles share one slab: 32 tokens of one head, each a contiguous ``head_dim`` row in the cache.
    """
    src, ct = plan.src, plan.dst.col_tiles
    s = src.strides()
    first = slice(None, None, ct)
    rows = torch.arange(TILE, device=device)
    tok = torch.as_tensor(plan.token_start[first], device=device)[:, None] + rows[None, :]  # [S, 32]
    valid = tok < plan.num_tokens
    tok = tok.clamp(max=plan.num_tokens - 1)
    blk = torch.as_tensor(plan.gpu_block_ids, device=device)[tok // src.block_size]
    head = torch.as_tensor(plan.gpu_head[first], device=device)[:, None]
    offset = blk * s["block"] + (tok % src.block_size) * s["slot"] + head * s["head"]
    return offset // src.head_dim, valid


def gather_faces(caches: Sequence[torch.Tensor], plan: KVTransferPlan, layer: int) -> torch.Tensor:
    """``[2, P, 4, 16, 16]`` tiles (K then V) of one layer in plan order and face order, rows past the request zeroed.

    One gather of whole ``head_dim`` rows, then one permute that does both the column-tile split
    and the 16x16 face order: ``[slab, 2 fr, 16 r, ct, 2 fc, 16 c] -> [slab, ct, fr, fc, r, c]``.
    """
    cache = caches[layer]
    rows, valid = _slab_rows(plan, cache.device)
    slabs = cache.reshape(2, -1, plan.src.head_dim)[:, rows.reshape(-1)]  # [2, S*32, D]
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
    rows, valid = _slab_rows(plan, device)
    keep = valid.reshape(-1)
    target = rows.reshape(-1)[keep]
    for layer in range(plan.src.num_layers):
        raw = torch.stack([pages[(a + (2 * layer + kv) * b) // pb] for kv in range(2)])  # [2, P, pb]
        tiles = bytes_to_tiles(raw.reshape(-1, pb), plan.dst.dtype)
        x = tiles.reshape(2, -1, ct, 2, 2, FACE, FACE).permute(0, 1, 3, 5, 2, 4, 6).reshape(2, -1, d)  # [2, S*32, D]
        cache = caches[layer]
        cache.reshape(2, -1, d)[:, target] = x[:, keep].to(cache.dtype)
