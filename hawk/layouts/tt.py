"""Tenstorrent tile codecs: byte-exact TILE-layout host buffers, in torch, on any device.

A tile is 32x32 elements stored as four 16x16 faces (top-left, top-right, bottom-left,
bottom-right), each face row-major. Tiles of ``[..., H, W]`` are ordered row-major over
``(batch..., H/32, W/32)``. ``bfp8_b`` (bfloat8_b) stores, per tile, 64 shared exponents
(one per 16-value face row) followed by 1024 sign|7-bit-magnitude bytes.

These functions are the oracle for every other writer of NPU pages (the fused Triton
transform, the decode-side tile-row update): they must agree with ttnn byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TILE = 32
FACE = 16
TILE_ELEMS = TILE * TILE

#: Bytes of one tile (one DRAM page) per tile dtype.
PAGE_BYTES: dict[str, int] = {"bf16": 2 * TILE_ELEMS, "bfp8_b": 64 + TILE_ELEMS, "fp32": 4 * TILE_ELEMS}
TILE_DTYPES = ("bf16", "bfp8_b")


def page_bytes(dtype: str) -> int:
    """Size of one tile in bytes; raises for a dtype the NPU tile format does not have."""
    try:
        return PAGE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown tile dtype {dtype!r}; expected one of {sorted(PAGE_BYTES)}") from None


def _check_dtype(dtype: str) -> None:
    if dtype not in PAGE_BYTES:
        raise ValueError(f"unknown tile dtype {dtype!r}; expected one of {sorted(PAGE_BYTES)}")


def to_tiles(x: torch.Tensor) -> torch.Tensor:
    """``[..., H, W]`` -> ``[n_tiles, 4, 16, 16]`` in tile/face order (a view-and-copy, no dtype change)."""
    h, w = x.shape[-2], x.shape[-1]
    if h % TILE or w % TILE:
        raise ValueError(f"tile codecs need H and W to be multiples of {TILE}; got H={h}, W={w}")
    b = x.reshape(-1, h // TILE, 2, FACE, w // TILE, 2, FACE)
    return b.permute(0, 1, 4, 2, 5, 3, 6).reshape(-1, 4, FACE, FACE)


def from_tiles(tiles: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`to_tiles`: ``[n_tiles, 4, 16, 16]`` -> ``shape``."""
    *batch, h, w = shape
    b = tiles.reshape(-1, h // TILE, w // TILE, 2, 2, FACE, FACE)
    return b.permute(0, 1, 3, 5, 2, 4, 6).reshape(*batch, h, w)


def _pad_to_tiles(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad H and W up to multiples of 32, as ttnn does for TILE layout."""
    h, w = x.shape[-2], x.shape[-1]
    ph, pw = -h % TILE, -w % TILE
    if ph or pw:
        x = torch.nn.functional.pad(x, (0, pw, 0, ph))
    return x


def pack_bfp8_rows(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 bit patterns grouped in rows of 16 to bfloat8_b.

    ``bits``: int32 ``[..., 16]``. Returns ``(exponents uint8 [...], values uint8 [..., 16])``.
    Each row shares the max of its 16 biased exponents; magnitudes are the 24-bit mantissa
    shifted right by ``17 + shared - own`` with round-to-nearest-even, saturating at 127.
    """
    b = bits.to(torch.int64) & 0xFFFFFFFF
    exp = (b >> 23) & 0xFF
    shared = exp.amax(dim=-1, keepdim=True)
    mant = (b & 0x7FFFFF) | 0x800000
    shift = (17 + shared - exp).clamp(max=40)
    q = mant >> shift
    rem = mant - (q << shift)
    half = (torch.ones_like(shift) << (shift - 1)).where(shift > 0, torch.zeros_like(shift))
    up = (rem > half) | ((rem == half) & (shift > 0) & ((q & 1) == 1))
    q = (q + up.to(q.dtype)).clamp(max=127)
    q = q.where(exp != 0, torch.zeros_like(q))
    sign = ((b >> 31) & 1).where(q != 0, torch.zeros_like(q))  # a magnitude of 0 packs as +0
    values = (q | (sign << 7)).to(torch.uint8)
    return shared.squeeze(-1).to(torch.uint8), values


def unpack_bfp8_rows(exps: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bfp8_rows`: ``(-1)^s * m7 * 2^(E-133)`` as float32."""
    v = values.to(torch.int32)
    mag = (v & 0x7F).to(torch.float64)
    scale = torch.exp2(exps.to(torch.float64) - 133.0).unsqueeze(-1)
    out = mag * scale
    out = torch.where((v & 0x80) != 0, -out, out)
    return out.to(torch.float32)


def tiles_to_bytes(tiles: torch.Tensor, dtype: str) -> torch.Tensor:
    """Encode ``[n, 4, 16, 16]`` float tiles to ``[n, page_bytes]`` uint8 pages."""
    _check_dtype(dtype)
    n = tiles.shape[0]
    if dtype == "bf16":
        return tiles.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, -1)
    if dtype == "fp32":
        return tiles.to(torch.float32).contiguous().view(torch.uint8).reshape(n, -1)
    bits = tiles.to(torch.float32).contiguous().view(torch.int32)
    exps, vals = pack_bfp8_rows(bits)
    return torch.cat([exps.reshape(n, 64), vals.reshape(n, TILE_ELEMS)], dim=1)


def bytes_to_tiles(pages: torch.Tensor, dtype: str) -> torch.Tensor:
    """Decode ``[n, page_bytes]`` uint8 pages to ``[n, 4, 16, 16]`` float32 tiles."""
    _check_dtype(dtype)
    n = pages.shape[0]
    if dtype == "bf16":
        return pages.contiguous().view(torch.bfloat16).reshape(n, 4, FACE, FACE).to(torch.float32)
    if dtype == "fp32":
        return pages.contiguous().view(torch.float32).reshape(n, 4, FACE, FACE).clone()
    exps = pages[:, :64].reshape(n, 4, FACE)
    vals = pages[:, 64:].reshape(n, 4, FACE, FACE)
    return unpack_bfp8_rows(exps, vals)


def tilize(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """``[..., H, W]`` float32/bfloat16 -> 1-D uint8 equal to ttnn's TILE-layout host buffer.

    H and W that are not multiples of 32 are zero-padded, as ttnn pads them.
    """
    _check_dtype(dtype)
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"tilize takes float32 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"tilize needs at least 2 dims [..., H, W], got shape {tuple(x.shape)}")
    return tiles_to_bytes(to_tiles(_pad_to_tiles(x)), dtype).reshape(-1)


def untilize(data: torch.Tensor, shape: Sequence[int], dtype: str) -> torch.Tensor:
    """Inverse of :func:`tilize`: returns float32 of ``shape`` (padding cropped away)."""
    _check_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"untilize needs a shape [..., H, W], got {shape}")
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"untilize takes a 1-D uint8 tensor, got {data.dtype} of shape {tuple(data.shape)}")
    *batch, h, w = shape
    ph, pw = h + (-h % TILE), w + (-w % TILE)
    n = (ph // TILE) * (pw // TILE)
    for d in batch:
        n *= d
    pb = page_bytes(dtype)
    if data.numel() != n * pb:
        raise ValueError(f"untilize: {data.numel()} bytes do not hold shape {shape} as {dtype} ({n * pb} bytes expected)")
    padded = from_tiles(bytes_to_tiles(data.reshape(n, pb), dtype), (*batch, ph, pw))
    return padded[..., :h, :w].contiguous()
