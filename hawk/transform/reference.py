"""The transfer-aware transformation in plain torch: the byte-exact oracle, on any device.

Gather the request's rows from the paged GPU cache, re-block them into 32x32 tiles of the NPU's
blocks, encode (bf16 or bfloat8_b), and place each tile at its channel-grouped send-buffer offset.
The fused Triton kernel must write the same bytes; this version favours being obviously right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hawk.layouts.tt import FACE, TILE, tiles_to_bytes
from hawk.plan.kv_plan import KVTransferPlan


def _tile_element_offsets(plan: KVTransferPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, 32, 32]`` element offsets (for K; V adds the kv stride) into one layer tensor, and row validity."""
    src = plan.src
    s = src.strides()
    rows = torch.arange(TILE, device=device)
    tok = torch.as_tensor(plan.token_start, device=device)[:, None] + rows[None, :]  # [P, 32]
    valid = tok < plan.num_tokens
    tok = tok.clamp(max=plan.num_tokens - 1)
    gblocks = torch.as_tensor(plan.gpu_block_ids, device=device)
    blk = gblocks[tok // src.block_size]
    slot = tok % src.block_size
    head = torch.as_tensor(plan.gpu_head, device=device)[:, None]
    row_off = blk * s["block"] + slot * s["slot"] + head * s["head"]  # [P, 32]
    col = torch.as_tensor(plan.col_tile, device=device)[:, None, None] * TILE + rows[None, None, :]
    return row_off[:, :, None] + col * s["dim"], valid


def gather_tiles(caches: Sequence[torch.Tensor], plan: KVTransferPlan, layer: int) -> torch.Tensor:
    """``[2, P, 32, 32]`` tiles (K then V) of one layer, rows past the request zeroed."""
    cache = caches[layer]
    idx, valid = _tile_element_offsets(plan, cache.device)
    flat = cache.reshape(-1)
    kv_stride = plan.src.strides()["kv"]
    tiles = torch.stack([flat[idx], flat[idx + kv_stride]])
    return tiles * valid[None, :, :, None].to(tiles.dtype)


def tiles_to_face_order(tiles: torch.Tensor) -> torch.Tensor:
    """``[..., 32, 32]`` row-major tiles -> ``[n, 4, 16, 16]`` faces (TL, TR, BL, BR)."""
    t = tiles.reshape(-1, 2, FACE, 2, FACE).permute(0, 1, 3, 2, 4)
    return t.reshape(-1, 4, FACE, FACE)


def transform_reference(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Write the plan's send buffer (1-D uint8, ``plan.total_bytes``) from the paged GPU caches."""
    plan.src.check_cache(list(caches))
    device = caches[0].device
    pb = plan.page_bytes
    if out is None:
        out = torch.empty(plan.total_bytes, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.numel() < plan.total_bytes:
        raise ValueError(f"send buffer must be uint8 with >= {plan.total_bytes} bytes, got {out.dtype} x {out.numel()}")
    pages = out[: plan.total_bytes].view(-1, pb)
    a, b = (torch.as_tensor(x, device=device) for x in plan.offset_terms())
    for layer in range(plan.src.num_layers):
        encoded = tiles_to_bytes(tiles_to_face_order(gather_tiles(caches, plan, layer)), plan.dst.dtype)
        encoded = encoded.view(2, -1, pb)
        for kv in range(2):
            t = 2 * layer + kv
            pages[(a + t * b) // pb] = encoded[kv]
    return out
