"""The fused transfer-aware transformation as one Triton kernel: gather + re-block + tilize + encode.

One program handles one *row group* of one K/V tensor: 32 consecutive tokens of one head (one NPU
row tile), all column tiles. It loads that ``[32, head_dim]`` slab row by row through the GPU block
table (each row is ``head_dim`` contiguous elements in NHD and HND alike), reorders it in registers
into tile/face order (``reshape`` + ``permute``) and stores every tile as one contiguous page. On
H200 this shape of kernel ran at 0.94-0.97 of a plain copy, where per-element scattered stores ran
at 0.11 (DESIGN §4); keeping stores whole pages is the point of the design.

All encoding is done on integer bit patterns, so the bytes equal the torch reference's on any
backend (GPU or the Triton interpreter) with no dependence on float modes (denormal flushing,
NaN canonicalization aside): fp32 -> bf16 is the integer round-to-nearest-even torch uses, and
bfloat8_b follows :func:`hawk.layouts.tt.pack_bfp8_rows` step for step.

The whole request is one launch: grid ``(row groups, 2 * layers)``; per-layer caches are reached
from ``caches[0]``'s pointer plus an int64 element delta per layer (vLLM allocates one tensor per
layer). Index tables derived from a plan are cached on the plan, so transforming the same plan
again uploads nothing.
"""

from __future__ import annotations

import contextlib

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from hawk.layouts.tt import TILE
from hawk.plan.kv_plan import KVTransferPlan

#: Attribute set on a plan holding its device tables, keyed by what they depend on.
_CACHE_ATTR = "_triton_tables"

# Source kinds: how the kernel turns loaded bits into fp32 bits.
_SRC_BF16, _SRC_FP16, _SRC_FP32 = 0, 1, 2
_SRC_KIND = {torch.bfloat16: _SRC_BF16, torch.float16: _SRC_FP16, torch.float32: _SRC_FP32}
# The integer type the cache is reinterpreted as (loads move bits, never floats).
_SRC_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _fp32_bits(x, SRC_KIND: tl.constexpr):
    """Loaded source bits -> fp32 bit patterns (int32). bf16 widens by a shift; fp16 converts exactly."""
    if SRC_KIND == 0:
        bits = x.to(tl.int32) << 16  # the sign extension shifts out
    elif SRC_KIND == 1:
        bits = x.to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    else:
        bits = x
    return bits


@triton.jit
def _bf16_bits(bits):
    """fp32 bits -> bf16 bits (int16), round to nearest even: torch's formula, NaNs aside."""
    u = bits.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _bfp8_rows(bits):
    """``[R, 16]`` fp32 bits -> (shared exponents ``[R]`` uint8, values ``[R, 16]`` uint8).

    Mirrors ``pack_bfp8_rows``: shared = max biased exponent; magnitude = 24-bit mantissa >> (17 +
    shared - own), round to nearest even, saturate at 127; exponent-0 elements and magnitudes
    that round to 0 pack as +0. Shifts are clamped to 31 (the result is 0 from 25 on anyway).
    """
    exp = (bits >> 23) & 0xFF
    shared = tl.max(exp, axis=1)
    mant = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(17 + shared[:, None] - exp, 31)
    q = mant >> shift
    rem = mant - (q << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = tl.minimum(q + up.to(tl.int32), 127)
    q = tl.where(exp != 0, q, 0)
    sign = tl.where(q != 0, (bits >> 31) & 1, 0)
    vals = (q | (sign << 7)).to(tl.uint8)
    return shared.to(tl.uint8), vals


@triton.jit
def _transform_kernel(
    src,  # caches[0] reinterpreted as int16/int32 bits
    layer_delta,  # [L] int64: element offset of layer l's tensor from caches[0]
    row_off,  # [G, 32] int64: element offset (K half) of each row of a group; 0 for padding
    row_valid,  # [G] int32: rows of a group that hold tokens (the rest are zero padding)
    page_a,  # [G, CTP] int64: A[q] in pages; -1 where the group has no such column tile
    page_b,  # [G, CTP] int64: B[q] in pages
    out,  # send buffer, int16 (bf16 pages) or uint8 (bfp8_b pages)
    kv_stride,  # elements between K and V in a layer tensor
    HEAD_DIM: tl.constexpr,
    CTP: tl.constexpr,  # column tiles, rounded up to a power of two
    SRC_KIND: tl.constexpr,
    BFP8: tl.constexpr,
    VEC: tl.constexpr,  # proven divisibility of row starts, in elements (enables wide loads)
):
    g = tl.program_id(0)
    t = tl.program_id(1)
    layer = t // 2
    kv = t - 2 * layer

    # Load the [32, head_dim] slab: row r of token (group start + r), rows past the request are 0.
    base = tl.load(layer_delta + layer) + kv * kv_stride
    base = tl.multiple_of(base, VEC)
    rows = tl.arange(0, 32)
    cols = tl.arange(0, CTP * 32)
    roff = tl.multiple_of(tl.load(row_off + g * 32 + rows), VEC)
    nvalid = tl.load(row_valid + g)
    if HEAD_DIM == CTP * 32:
        mask = (rows < nvalid)[:, None]  # no padded columns: a row-constant mask keeps loads wide
    else:
        mask = (rows < nvalid)[:, None] & (cols < HEAD_DIM)[None, :]
    x = tl.load(src + base + roff[:, None] + cols[None, :], mask=mask, other=0)
    if BFP8:
        y = _fp32_bits(x, SRC_KIND)
    elif SRC_KIND == 0:
        y = x  # bf16 -> bf16 moves bits unchanged
    else:
        y = _bf16_bits(_fp32_bits(x, SRC_KIND))  # narrow before the reorder: half the shuffle traffic

    # Rows (fr, r), cols (ct, fc, c) -> tile ct, face (fr, fc), row r, col c: page order.
    faces = tl.permute(tl.reshape(y, (2, 16, CTP, 2, 16)), (2, 0, 3, 1, 4))

    cts = tl.arange(0, CTP)
    pa = tl.load(page_a + g * CTP + cts)
    pb = tl.load(page_b + g * CTP + cts)
    page = pa + t * pb
    has_page = (pa >= 0)[:, None]
    if BFP8:
        exps, vals = _bfp8_rows(tl.reshape(faces, (CTP * 64, 16)))
        start = page * 1088
        e = tl.arange(0, 64)
        tl.store(out + start[:, None] + e[None, :], tl.reshape(exps, (CTP, 64)), mask=has_page)
        v = tl.arange(0, 1024)
        tl.store(out + (start + 64)[:, None] + v[None, :], tl.reshape(vals, (CTP, 1024)), mask=has_page)
    else:
        v = tl.arange(0, 1024)
        tl.store(out + (page * 1024)[:, None] + v[None, :], tl.reshape(faces, (CTP, 1024)), mask=has_page)


@dataclass(frozen=True)
class _PlanTables:
    """Device index tables of one plan: built once per (plan, device, cache strides)."""

    row_off: torch.Tensor
    row_valid: torch.Tensor
    page_a: torch.Tensor
    page_b: torch.Tensor
    groups: int
    ctp: int
    vec_rows: int  # gcd-style divisibility of every row offset (elements)


def _pow2_divisor(values: np.ndarray, cap: int) -> int:
    """Largest power of two <= cap dividing every value (cap if there are none)."""
    d = cap
    while d > 1 and np.any(values % d):
        d //= 2
    return d


def _build_tables(plan: KVTransferPlan, strides: tuple[int, ...], device: torch.device) -> _PlanTables:
    """Group the plan's pages by (token_start, gpu_head) and lay out per-group row and page tables.

    Why host-side: the q arrays are small (pages per tensor), while the grid's other axis (the
    2L tensors) multiplies them; the kernel then only does two table loads per program.
    """
    src = plan.src
    names = ("kv", "block", "slot", "head", "dim") if src.order == "NHD" else ("kv", "block", "head", "slot", "dim")
    s = dict(zip(names, strides))
    ts = np.asarray(plan.token_start, dtype=np.int64)
    gh = np.asarray(plan.gpu_head, dtype=np.int64)
    ct = np.asarray(plan.col_tile, dtype=np.int64)
    keys, group = np.unique(np.stack([ts, gh], axis=1), axis=0, return_inverse=True)
    group = group.reshape(-1)
    n_groups = len(keys)
    ctp = triton.next_power_of_2(plan.dst.col_tiles)

    # Rows: token -> (GPU block, slot) through the block table; padding rows point at offset 0.
    tok = keys[:, 0:1] + np.arange(TILE, dtype=np.int64)[None, :]
    valid = tok < plan.num_tokens
    tok = np.minimum(tok, plan.num_tokens - 1)
    gids = np.asarray(plan.gpu_block_ids, dtype=np.int64)
    blk = gids[tok // src.block_size]
    row_off = blk * s["block"] + (tok % src.block_size) * s["slot"] + keys[:, 1:2] * s["head"]
    row_off = np.where(valid, row_off, 0)
    row_valid = valid.sum(axis=1).astype(np.int32)

    # Pages: A and B of each (group, col tile), in page units.
    a, b = plan.offset_terms()
    pbytes = plan.page_bytes
    if np.any(a % pbytes) or np.any(b % pbytes):
        raise ValueError("send-buffer offsets are not whole pages; the plan is inconsistent")
    page_a = np.full((n_groups, ctp), -1, dtype=np.int64)
    page_b = np.zeros((n_groups, ctp), dtype=np.int64)
    page_a[group, ct] = a // pbytes
    page_b[group, ct] = b // pbytes

    as_dev = lambda x: torch.as_tensor(np.ascontiguousarray(x)).to(device)  # noqa: E731
    return _PlanTables(
        row_off=as_dev(row_off),
        row_valid=as_dev(row_valid),
        page_a=as_dev(page_a),
        page_b=as_dev(page_b),
        groups=n_groups,
        ctp=ctp,
        vec_rows=_pow2_divisor(row_off, 16),
    )


def _plan_cache(plan: KVTransferPlan) -> dict:
    cache = getattr(plan, _CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(plan, _CACHE_ATTR, cache)
    return cache


def _tables(plan: KVTransferPlan, strides: tuple[int, ...], device: torch.device) -> _PlanTables:
    cache = _plan_cache(plan)
    key = ("tables", str(device), strides)
    if key not in cache:
        cache[key] = _build_tables(plan, strides, device)
    return cache[key]


def _layer_deltas(caches: Sequence[torch.Tensor]) -> tuple[np.ndarray, int]:
    """``[L]`` int64 element offsets of each layer's tensor from ``caches[0]``, and their divisibility."""
    esize = caches[0].element_size()
    raw = np.asarray([c.data_ptr() for c in caches], dtype=np.int64) - caches[0].data_ptr()
    if np.any(raw % esize):
        raise ValueError("layer caches are not element-aligned relative to each other")
    deltas = raw // esize
    return deltas, _pow2_divisor(deltas, 16)


def _uniform_caches(caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Caches sharing one stride tuple with unit dim stride, as the kernel addresses them.

    vLLM's caches already are (any strides, e.g. a sliced view, are fine as long as they agree);
    anything else is made contiguous, which is correct but costs a copy on every call.
    """
    caches = list(caches)
    strides = caches[0].stride()
    if all(c.stride() == strides for c in caches) and strides[-1] == 1:
        return caches
    return [c.contiguous() for c in caches]


@dataclass(frozen=True)
class _Launch:
    """Everything one launch needs but the tensors themselves: built once per (plan, cache pointers).

    It holds no cache tensor, so a plan that outlives its caches does not keep them allocated.
    """

    deltas: torch.Tensor
    tables: _PlanTables
    kv_stride: int
    constexprs: dict


def _prepare(plan: KVTransferPlan, caches: Sequence[torch.Tensor]) -> tuple[_Launch, list[torch.Tensor]]:
    """Validate the caches and build (or fetch) the launch state cached on the plan; also return the
    caches the kernel reads (contiguous copies in the rare case the given ones disagree on strides).

    The key is the layer pointers plus layer 0's shape, dtype and strides: checking all 2L tensors
    on every call would cost more host time than the kernel takes on a small request.
    """
    c0 = caches[0]
    key = ("launch", c0.device, c0.dtype, tuple(c0.shape), c0.stride(), tuple(c.data_ptr() for c in caches))
    cache = _plan_cache(plan)
    hit = cache.get(key)
    if hit is not None:
        return hit, list(caches)
    given = list(caches)
    plan.src.check_cache(given)
    used = _uniform_caches(given)
    c0 = used[0]
    tables = _tables(plan, tuple(c0.stride()), c0.device)
    deltas, vec_layers = _layer_deltas(used)
    esize = c0.element_size()
    kv_stride = c0.stride(0)
    # Row starts divisible by VEC elements (16 B) let loads vectorize; Triton checks the base pointer.
    vec = min(16 // esize, tables.vec_rows, vec_layers, _pow2_divisor(np.asarray([kv_stride]), 16))
    copied = any(u is not g for u, g in zip(used, given))
    launch = _Launch(
        deltas=torch.as_tensor(deltas).to(c0.device),
        tables=tables,
        kv_stride=kv_stride,
        constexprs={"HEAD_DIM": plan.src.head_dim, "CTP": tables.ctp, "SRC_KIND": _SRC_KIND[c0.dtype], "VEC": vec},
    )
    if copied:
        return launch, used  # copies made for this call only: their pointers mean nothing next time
    for stale in [k for k in cache if k[0] == "launch"][:-7]:
        del cache[stale]  # caches moved: keep only the last few pointer sets
    cache[key] = launch
    return launch, used


def transform_triton(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor | None = None, num_warps: int = 4
) -> torch.Tensor:
    """Write the plan's send buffer (1-D uint8, ``plan.total_bytes``) in one kernel launch.

    Same contract and bytes as :func:`hawk.transform.reference.transform_reference`, except that rows
    past the request are always +0 (the reference's multiply-by-0 can leave -0, or NaN from inf).
    """
    ndtype = plan.dst.dtype
    if ndtype not in ("bf16", "bfp8_b"):
        raise ValueError(f"Triton transform supports NPU dtypes bf16 and bfp8_b, got {ndtype!r}")
    if len(caches) != plan.src.num_layers:
        raise ValueError(f"expected {plan.src.num_layers} layer tensors, got {len(caches)}")
    launch, used = _prepare(plan, caches)
    src = used[0].view(_SRC_BITS[used[0].dtype])  # `used` stays alive until the launch is enqueued
    device = src.device
    total = plan.total_bytes
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"send buffer must be 1-D uint8 with >= {total} bytes, got {out.dtype} of shape {tuple(out.shape)}")
    elif out.device != device:
        raise ValueError(f"send buffer is on {out.device}, caches are on {device}")
    elif not out.is_contiguous():
        raise ValueError("send buffer must be contiguous")

    bfp8 = ndtype == "bfp8_b"
    dst = out[:total]
    if not bfp8:
        if dst.data_ptr() % 2:
            # An odd-aligned buffer cannot be viewed as int16: write aside, then copy.
            dst.copy_(transform_triton(caches, plan, None, num_warps))
            return out
        dst = dst.view(torch.int16)

    t = launch.tables
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # launch on the caches' GPU
        _transform_kernel[(t.groups, plan.num_tensors)](
            src, launch.deltas, t.row_off, t.row_valid, t.page_a, t.page_b, dst, launch.kv_stride,
            BFP8=bfp8, num_warps=num_warps, **launch.constexprs,
        )
    return out
