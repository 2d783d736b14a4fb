"""The fused transfer-aware transformation as Triton kernels: gather + re-block + tilize + encode.

Two kernels write the same bytes; ``transform_triton(kernel=...)`` or ``$HAWK_TRANSFORM_KERNEL``
picks one (default ``v2``; ``v2e`` is v2 without its word path, for comparison):

``v2`` (face rows). One program handles one *row group* (32 consecutive tokens of one head: one
NPU row tile) of ``TPP`` consecutive K/V tensors (default: about 8 KiB of source per program). It
gathers straight into tile/face order: every tensor is indexed ``[half, face column, row, tensor,
unit]``, where ``(half, unit)`` spans one 16-value face row, i.e. 16 contiguous source elements and
16 contiguous destination values (bf16: 32 bytes; bfloat8_b: 16 value bytes plus one exponent
byte). Triton's coalescing gives loads and stores the same register layout (16-byte vectors per
thread, a warp covering whole head_dim rows), so no data goes through shared memory, and the
bfloat8_b exponent max is an in-thread max plus one lane shuffle. A bf16 source with word-aligned
rows is read as 32-bit words (two values each) and the bfloat8_b values are written as 16-bit pairs.

``v1`` (slab permute). One program per (row group, tensor) loads the ``[32, head_dim]`` slab row
by row and reorders it in registers into tile/face order (``reshape`` + ``permute``, through shared
memory). On an H200 it ran at 0.96-0.98 of a plain copy for bf16 pages but 0.45 for bfloat8_b.

Encoding is exact on any backend (GPU or the Triton interpreter): fp32 -> bf16 is the integer
round-to-nearest-even torch uses, and bfloat8_b equals :func:`hawk.layouts.tt.pack_bfp8_rows`
bit for bit. v1 follows that function's integer steps. v2 needs about a third of the integer
operations: a value of biased exponent ``e`` in a face row of shared (max) exponent ``E`` encodes
as ``min(rne(|x| * 2^(133 - E)), 127)``, and ``|x| * 2^(133 - E) + 2^23`` in one fused multiply-add
is exactly ``2^23 + rne(...)`` (the product is exact, the add rounds to nearest even at unit
spacing; see :func:`_bfp8_fast`). Rows with ``1 <= E <= 7`` (where exponent-0 inputs would not
vanish) or ``E == 255`` (inf/NaN) take an exact integer path instead (:func:`_bfp8_exact`), chosen
per program so the common case pays nothing for them.

The whole request is one launch. Per-layer caches are reached from ``caches[0]``'s pointer plus an
int64 element offset per tensor (vLLM allocates one tensor per layer). Both kernels compute each
row's element offset themselves: row ``r`` of a row group is request token ``t = ts + r``, at
``blk[t // block_size] * s_block + (t % block_size) * s_slot + head * s_head`` in its tensor (the
block size and the strides are constexprs of the cache layout, read from the plan's source layout:
HAWK's NHD / HND, or any of vLLM 0.32's GPU layouts, whose per-layer ``[B, H, N, 2D]`` views put V
``head_dim`` elements after K, so a tensor's base is its layer's plus ``kv * kv_stride``; their
power-of-two divisor and the tensor bases' give the vectorization hint), and rows with ``t >= num_tokens`` are masked (zero
padding). So the host tables split by what they depend on, each built and uploaded once:

- per cache layout (an engine has one): each layer's and tensor's offset from ``caches[0]``;
- per placement (the plan's NPU side: layout, heads, NPU block ids, tensor bases; with the token
  count and the GPU head offset): one int32 record per row group, ``[ts, rows holding tokens, head,
  0, page_a[CTP], page_b[CTP]]``, column tile ``c`` of tensor ``t`` going to page ``page_a[c] + t *
  page_b[c]`` of the send buffer; cached by the plan's placement (shared by every plan assembled on
  it: a request's plan is a new object each time, built from cached parts);
- per request: the GPU block ids, a few KiB in one copy that does not stall the host (cached by
  content: a request whose blocks repeat uploads nothing).

A request with new GPU blocks on a known placement builds nothing and uploads only its block ids,
whatever its length; a new placement builds its records with a few vectorized passes over its pages.
Nothing Triton specializes on changes per request (the per-request tables' pointers are exempt from
alignment specialization, every integer argument is fixed per cache layout), so no request compiles,
and both kernels launch a configuration's compiled kernel directly after its first launch
(``$HAWK_TRANSFORM_LAUNCH=jit`` keeps Triton's dispatcher), which cuts the host time that bounds
small requests.
"""

from __future__ import annotations

import math
import os
import threading

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from hawk.layouts.paged import NotStridedError
from hawk.layouts.tt import TILE
from hawk.plan.kv_plan import KVTransferPlan, TileDest
from hawk.transform.upload import upload_int64
from hawk.triton_launch import launch_hooks_idle, launchable, on_device, pointer_args, raw_stream, run_compiled

#: Attribute set on a plan holding its launch states (:class:`_Launch`), keyed by the caches.
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


#: int32 fields of one row group's record in the placement table (see :func:`_build_groups`): the
#: group's first token, its rows holding tokens, its GPU head, one spare (keeps the page sections
#: 16-byte aligned), then ``page_a[CTP]`` and ``page_b[CTP]``. A record is ``4 + 2 * CTP`` int32s.
_REC_TS, _REC_VALID, _REC_HEAD, _REC_PAGES = 0, 1, 2, 4


@triton.jit
def _row_offsets(blk, rec, r, S_BLOCK: tl.constexpr, S_SLOT: tl.constexpr, S_HEAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr):
    """Element offsets (from a layer tensor's K or V half) of rows ``r`` of the group whose record is
    at ``rec``, and their mask (rows that hold tokens): token ``t = ts + r`` sits in GPU block
    ``blk[t // BLOCK_SIZE]``, slot ``t % BLOCK_SIZE``. Rows past the request read no block id and are
    masked; their offsets are still sums of stride multiples (the callers' divisibility hints hold)."""
    ts = tl.load(rec + 0).to(tl.int64)
    nvalid = tl.load(rec + 1)
    gh = tl.load(rec + 2).to(tl.int64)
    tok = ts + r
    valid = r < nvalid
    bid = tl.load(blk + tok // BLOCK_SIZE, mask=valid, other=0)
    return bid * S_BLOCK + (tok % BLOCK_SIZE) * S_SLOT + gh * S_HEAD, valid


# The placement table and the block table are per request (a new tensor each): no alignment
# specialization on their pointers, so every request runs the kernel compiled for the first (the
# direct launch below would otherwise run a kernel specialized for another alignment). Every other
# argument is fixed per cache layout; nothing that varies per request is a specialized integer.
@triton.jit(do_not_specialize_on_alignment=["groups", "blk"])
def _transform_kernel(
    src,  # caches[0] reinterpreted as int16/int32 bits
    layer_delta,  # [L] int64: element offset of layer l's tensor from caches[0]
    groups,  # [G, 4 + 2 * CTP] int32 records: ts, rows holding tokens, gpu head, -, page_a[CTP], page_b[CTP]
    blk,  # [blocks] int64: the request's GPU block ids
    out,  # send buffer, int16 (bf16 pages) or uint8 (bfp8_b pages)
    kv_stride,  # elements between K and V in a layer tensor (fixed per cache layout)
    S_BLOCK: tl.constexpr,  # element strides of a GPU block, slot and head (fixed per cache layout)
    S_SLOT: tl.constexpr,
    S_HEAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per GPU block
    HEAD_DIM: tl.constexpr,
    CTP: tl.constexpr,  # column tiles, rounded up to a power of two
    SRC_KIND: tl.constexpr,
    BFP8: tl.constexpr,
    VEC: tl.constexpr,  # proven divisibility of row starts, in elements (enables wide loads)
    PAGE_UNIT: tl.constexpr,  # bytes per unit of the records' destination offsets (a page, in a send buffer)
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
    rec = groups + g * (4 + 2 * CTP)
    roff, valid = _row_offsets(blk, rec, rows, S_BLOCK, S_SLOT, S_HEAD, BLOCK_SIZE)
    roff = tl.multiple_of(roff, VEC)
    if HEAD_DIM == CTP * 32:
        mask = valid[:, None]  # no padded columns: a row-constant mask keeps loads wide
    else:
        mask = valid[:, None] & (cols < HEAD_DIM)[None, :]
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
    pa = tl.load(rec + 4 + cts).to(tl.int64)
    pb = tl.load(rec + 4 + CTP + cts).to(tl.int64)
    page = pa + t * pb
    has_page = (pa >= 0)[:, None]
    if BFP8:
        exps, vals = _bfp8_rows(tl.reshape(faces, (CTP * 64, 16)))
        start = page * PAGE_UNIT
        e = tl.arange(0, 64)
        tl.store(out + start[:, None] + e[None, :], tl.reshape(exps, (CTP, 64)), mask=has_page)
        v = tl.arange(0, 1024)
        tl.store(out + (start + 64)[:, None] + v[None, :], tl.reshape(vals, (CTP, 1024)), mask=has_page)
    else:
        v = tl.arange(0, 1024)
        tl.store(out + (page * (PAGE_UNIT // 2))[:, None] + v[None, :], tl.reshape(faces, (CTP, 1024)), mask=has_page)


@triton.jit
def _bfp8_fast(a, sgn, scale):
    """bfloat8_b value bytes of fp32 magnitudes ``a`` (int32 bits) with signs at bit 7 of ``sgn``
    (bits 0-6 and 24-31 of ``sgn`` must be 0; bits 8-23 are ignored), in a row with shared exponent
    ``8 <= E <= 254`` and ``scale = 2^(133 - E)``.

    ``t = |x| * scale + 2^23`` in one fused multiply-add (or a multiply and an add: the same bits):
    ``y = |x| * 2^(133 - E) = m8 / 2^(E - e + 1)`` is exact whenever it is a normal float, and
    adding 2^23 rounds it to nearest even at unit spacing, so ``t = 2^23 + rne(y)`` for ``y < 128``.
    Values more than 2^126 below the row max (and subnormal or zero inputs: ``E >= 8`` keeps their
    ``y < 0.5``) land on ``t = 2^23`` however they are flushed or rounded. ``min`` saturates at 127;
    the sign is kept where ``rne(y) >= 1`` (bit 7 of ``t + 127``, whose bits 8-23 are 0), so
    magnitudes that round to 0 pack as +0. The byte is the low 8 bits (bits 24-30 hold 2^23's
    exponent; callers truncate).
    """
    t = (a.to(tl.float32, bitcast=True) * scale + 8388608.0).to(tl.int32, bitcast=True)
    return tl.minimum(t, 0x4B00007F) | ((t + 127) & sgn)


@triton.jit
def _bfp8_exact(a, sgn, shared):
    """:func:`_bfp8_fast` for any row, including ``E <= 7`` and ``E == 255`` (inf/NaN), where the
    scale is not a float or turns inf into inf: integer arithmetic on the exponent field.

    ``y`` is made by adding ``(133 - E) << 23`` to the bits of ``max(a, (E - 133) << 23)``: the clamp
    keeps the field from wrapping for values 2^133 or more below the row max, which become
    ``y = +0``; exponent-0 inputs (zeros, subnormals) are dropped explicitly, as the oracle does.
    Rows of only exponent-0 values (E == 0) come out all +0 either way.
    """
    k = (133 - shared) << 23
    y = (tl.maximum(a, (shared - 133) << 23) + k).to(tl.float32, bitcast=True)
    t = (y + 8388608.0).to(tl.int32, bitcast=True)
    b = tl.minimum(t, 0x4B00007F) | ((t + 127) & sgn)
    return tl.where(a >= 0x800000, b, 0)


@triton.jit
def _row_constants(amax):
    """Per face row max magnitude bits ``[NF, 32, TPP]`` -> (shared exponent ``E``, its fast-path
    scale ``2^(133 - E)`` and ``E`` as ``[1, NF, 32, TPP, 1]``, whether any row needs the exact path).

    The fast path holds for ``8 <= E <= 254`` and ``E == 0`` (scale 1: its values stay below 0.5)."""
    shared = amax >> 23
    scale = tl.where(shared >= 8, (260 - shared) << 23, 127 << 23).to(tl.float32, bitcast=True)
    rare = tl.max((((shared >= 1) & (shared <= 7)) | (shared == 255)).to(tl.int32))
    return shared, scale[None, :, :, :, None], shared[None, :, :, :, None], rare


@triton.jit(do_not_specialize_on_alignment=["groups", "blk"])  # see _transform_kernel
def _rows_kernel(
    src,  # caches[0]'s storage as int16/int32 bits (int32 words of two bf16 values when WORDS)
    tbase,  # [T] int64: element offset of tensor t (layer, K/V) from caches[0]
    groups,  # [G, 4 + 2 * CTP] int32 records (see _transform_kernel)
    blk,  # [blocks] int64: the request's GPU block ids
    out,  # send buffer, uint8
    out16,  # the same, int16 (bf16 pages, bfloat8_b value pairs when WORDS)
    n_tensors,  # fixed per cache layout
    S_BLOCK: tl.constexpr,  # element strides of a GPU block, slot and head (fixed per cache layout)
    S_SLOT: tl.constexpr,
    S_HEAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per GPU block
    HEAD_DIM: tl.constexpr,  # a multiple of 16
    CTP: tl.constexpr,  # column tiles, rounded up to a power of two
    SRC_KIND: tl.constexpr,
    BFP8: tl.constexpr,
    VEC: tl.constexpr,  # proven divisibility of tbase and of the strides, in elements
    TPP: tl.constexpr,  # tensors per program (a power of two)
    WORDS: tl.constexpr,  # bf16 source read as int32 words; bfloat8_b values written as int16 pairs
    EVEN_T: tl.constexpr,  # TPP divides n_tensors: no tensor mask
    PAGE_UNIT: tl.constexpr,  # bytes per unit of the records' destination offsets (a page, in a send buffer)
    ALIGN: tl.constexpr,  # proven alignment of a page start, in bytes (a power of two)
):
    # Axes of every per-element tensor: [2 halves of a face row, NF face columns, 32 rows, TPP
    # tensors, X units]. Only the last is contiguous in memory; Triton's coalescing puts it in a
    # thread (16-byte vectors) and spreads lanes over the next axes in axis order: halves, face
    # columns, rows. So one warp instruction reads whole head_dim rows, and the two halves of a
    # face row sit in neighbouring lanes (the exponent max is one shuffle).
    NF: tl.constexpr = 2 * CTP  # face columns (16 wide) of the padded tile row
    NF_SRC: tl.constexpr = HEAD_DIM // 16  # face columns holding data
    X: tl.constexpr = 4 if WORDS else 8  # source units per half face row
    UNIT: tl.constexpr = 2 if WORDS else 1  # elements per source unit
    g = tl.program_id(0)
    t = tl.program_id(1) * TPP + tl.arange(0, TPP)
    r = tl.arange(0, 32)
    f = tl.arange(0, NF)
    h = tl.arange(0, 2)
    x = tl.arange(0, X)
    h5 = h[:, None, None, None, None]
    f5 = f[None, :, None, None, None]
    t5 = t[None, None, None, :, None]
    x5 = x[None, None, None, None, :]

    # Gather. Row offsets in source units: with WORDS every stride (and tbase) is even (VEC >= 2).
    if EVEN_T:
        base = tl.load(tbase + t)
    else:
        base = tl.load(tbase + t, mask=t < n_tensors, other=0)
    rec = groups + g * (4 + 2 * CTP)
    roff, valid = _row_offsets(blk, rec, r, S_BLOCK // UNIT, S_SLOT // UNIT, S_HEAD // UNIT, BLOCK_SIZE)
    if WORDS:
        base = base // 2
    base = tl.multiple_of(base, VEC // UNIT)  # (a hint on a division by 1 would be folded away with it)
    roff = tl.multiple_of(roff, VEC // UNIT)
    hx = h5 * X + x5  # unit within the face row; in output units as well
    ptrs = src + base[None, None, None, :, None] + roff[None, None, :, None, None] + f5 * (16 // UNIT) + hx
    mask = valid[None, None, :, None, None]
    if not EVEN_T:
        mask = mask & (t5 < n_tensors)
    if NF_SRC < NF:
        mask = mask & (f5 < NF_SRC)
    v = tl.load(ptrs, mask=mask, other=0)

    # Destination page of each (face column, tensor) and each face row's index in its tile.
    ct = f // 2
    pa = tl.load(rec + 4 + ct).to(tl.int64)
    pb = tl.load(rec + 4 + CTP + ct).to(tl.int64)
    page = pa[:, None] + pb[:, None] * t.to(tl.int64)[None, :]  # [NF, TPP]
    smask = (pa >= 0)[:, None]
    if not EVEN_T:
        smask = smask & (t < n_tensors)[None, :]
    frow = ((r // 16) * 32 + (r % 16))[None, :] + ((f % 2) * 16)[:, None]  # face * 16 + row in face, [NF, 32]
    page5 = page[None, :, None, :, None]
    frow5 = frow[None, :, :, None, None]
    smask5 = smask[None, :, None, :, None]

    if BFP8:
        if WORDS:
            alo = (v << 16) & 0x7FFFFFFF  # fp32 magnitude bits of the even element of each word
            ahi = v & 0x7FFF0000  # ... and of the odd one
            amax = tl.max(tl.max(tl.maximum(alo, ahi), axis=4), axis=0)
            shared, scale, e5, rare = _row_constants(amax)
            a16: tl.constexpr = ALIGN // 2  # int16 units: values follow 64 exponent bytes
            vbase = tl.multiple_of(page5 * (PAGE_UNIT // 2) + 32, [a16, a16, a16, a16, a16])
            vptr = out16 + vbase + frow5 * 8 + hx
            sg = (v & -2147450880).to(tl.uint32, bitcast=True)  # 0x80008000: both signs; >> 8 and >> 24
            slo = (sg >> 8).to(tl.int32, bitcast=True)  # put them at bit 7, with the other at bit 23 or
            shi = (sg >> 24).to(tl.int32, bitcast=True)  # shifted out (bits 8-23 are ignored)
            blo = _bfp8_fast(alo, slo, scale)
            bhi = _bfp8_fast(ahi, shi, scale)
            tl.store(vptr, (blo | (bhi << 8)).to(tl.int16), mask=smask5)  # two value bytes, little endian
            if rare > 0:
                # A row with max exponent 1..7 (magnitudes below 2^-120) or 255 (inf/NaN): rewrite this
                # program's values the exact way. The store keeps this a branch rather than selects on
                # every element, and reloading (from L2) keeps the values from staying live until here.
                v = tl.load(ptrs, mask=mask, other=0)
                alo = (v << 16) & 0x7FFFFFFF
                ahi = v & 0x7FFF0000
                sg = (v & -2147450880).to(tl.uint32, bitcast=True)
                blo = _bfp8_exact(alo, (sg >> 8).to(tl.int32, bitcast=True), e5)
                bhi = _bfp8_exact(ahi, (sg >> 24).to(tl.int32, bitcast=True), e5)
                tl.store(vptr, (blo | (bhi << 8)).to(tl.int16), mask=smask5)
        else:
            bits = _fp32_bits(v, SRC_KIND)
            a = bits & 0x7FFFFFFF
            amax = tl.max(tl.max(a, axis=4), axis=0)
            shared, scale, e5, rare = _row_constants(amax)
            vbase = tl.multiple_of(page5 * PAGE_UNIT + 64, [ALIGN, ALIGN, ALIGN, ALIGN, ALIGN])
            vptr = out + vbase + frow5 * 16 + hx
            tl.store(vptr, _bfp8_fast(a, (bits >> 24) & 0x80, scale).to(tl.uint8), mask=smask5)
            if rare > 0:  # as above
                bits = _fp32_bits(tl.load(ptrs, mask=mask, other=0), SRC_KIND)
                a = bits & 0x7FFFFFFF
                tl.store(vptr, _bfp8_exact(a, (bits >> 24) & 0x80, e5).to(tl.uint8), mask=smask5)
        ebase = tl.multiple_of(page * PAGE_UNIT, [ALIGN, ALIGN])  # 64 exponent bytes open each page
        tl.store(out + ebase[:, None, :] + frow[:, :, None], shared.to(tl.uint8), mask=smask[:, None, :])
    else:
        tl.static_assert(not WORDS, "WORDS is for bfloat8_b output")
        if SRC_KIND == 0:
            y = v  # bf16 -> bf16 moves bits unchanged
        else:
            y = _bf16_bits(_fp32_bits(v, SRC_KIND))
        a16: tl.constexpr = ALIGN // 2
        vbase = tl.multiple_of(page5 * (PAGE_UNIT // 2), [a16, a16, a16, a16, a16])  # int16 units
        tl.store(out16 + vbase + frow5 * 16 + hx, y, mask=smask5)


def _pow2_divisor(values: np.ndarray, cap: int) -> int:
    """Largest power of two <= cap (a power of two) dividing every value (cap if there are none): the
    lowest set bit of all values OR-ed together, in one pass."""
    v = np.asarray(values, dtype=np.int64)
    acc = int(np.bitwise_or.reduce(v, axis=None)) if v.size else 0
    return cap if acc == 0 else min(cap, acc & -acc)


class _Table:
    """A host table and its device copy, uploaded on first use (:func:`~hawk.transform.upload.upload_int64`),
    and the stream and event of that copy: a launch on another stream waits for the event on the device
    once (and marks the tensor as used there, so its memory is not reused before that stream's work is
    done)."""

    __slots__ = ("host", "device", "_dev", "_stream", "_event", "_seen", "_lock")

    def __init__(self, host: np.ndarray, device: torch.device):
        self.host = host  # int64, or int32 with an even number of elements (uploaded as int64 pairs)
        self.device = device
        self._dev: torch.Tensor | None = None
        self._stream: int | None = None
        self._event = None
        self._seen: set = set()
        self._lock = threading.Lock()

    def get(self) -> torch.Tensor:
        dev = self._dev
        if dev is None:
            with self._lock:
                if self._dev is None:
                    flat = self.host.reshape(-1)
                    t = upload_int64(flat.view(np.int64), self.device)
                    if flat.dtype == np.int32:
                        t = t.view(torch.int32)  # a reinterpretation on the device: no copy
                    if self.device.type == "cuda":
                        self._stream = raw_stream(self.device.index)
                        self._event = torch.cuda.Event()
                        self._event.record(torch.cuda.current_stream(self.device))
                    self._dev = t
                dev = self._dev
        return dev

    def order(self, stream: int | None) -> None:
        """Order launches on ``stream`` (the current one) after the upload, if it ran on another."""
        if stream == self._stream or stream in self._seen:
            return
        with self._lock:
            cur = torch.cuda.current_stream(self.device)
            if self._event is not None and not self._event.query():
                cur.wait_event(self._event)
            if self._dev is not None:
                self._dev.record_stream(cur)
            self._seen.add(stream)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(eq=False)
class _Groups:
    """A plan's placement table on the host: one int32 record per row group (32 consecutive request
    tokens of one GPU head, one NPU row tile): ``[ts, rows holding tokens, gpu head, 0, page_a[CTP],
    page_b[CTP]]``, the group's column tile ``c`` of tensor ``t`` going to send-buffer page
    ``page_a[c] + t * page_b[c]`` (``page_a`` -1: no such column tile)."""

    host: np.ndarray  # int32 [groups, 4 + 2 * ctp]
    groups: int
    ctp: int


def _build_groups(plan: KVTransferPlan, dest: TileDest | None = None) -> _Groups:
    """The placement table of a plan. It depends on the plan's placement (NPU layout, shared heads,
    NPU block ids, tensor bases: the send-buffer pages), the GPU head offset, the token count and the
    destination (``dest``, default the send buffer; offsets in its units), never on the GPU block ids
    or the caches, so one serves every request on that placement.

    Plans are assembled on a tile grid, which lists each (token start, head)'s column tiles as
    consecutive pages in order: then a group is a run of ``col_tiles`` pages and the records are a
    few reshapes. Any other page order is grouped by (token start, head) with ``np.unique``.
    """
    ts = np.asarray(plan.token_start, dtype=np.int64)
    gh = np.asarray(plan.gpu_head, dtype=np.int64)
    ct = np.asarray(plan.col_tile, dtype=np.int64)
    n_ct = plan.dst.col_tiles
    ctp = triton.next_power_of_2(n_ct)
    dest = dest or plan.send_dest()
    a, b, unit = dest.a, dest.b, dest.unit
    pa, pb = a // unit, b // unit  # (a division and a product are cheaper than a remainder)
    if not (np.array_equal(pa * unit, a) and np.array_equal(pb * unit, b)):
        raise ValueError(f"destination offsets are not whole units of {unit} B; the plan is inconsistent")
    if dest.extent // unit >= 2**31 or plan.num_tokens >= 2**31:
        raise ValueError("request too large for the transform's int32 tables")
    p = len(ts)
    width = 4 + 2 * ctp
    runs = p % n_ct == 0
    if runs:
        n_groups = p // n_ct
        ts2, gh2, ct2 = ts.reshape(n_groups, n_ct), gh.reshape(n_groups, n_ct), ct.reshape(n_groups, n_ct)
        runs = bool((ct2 == np.arange(n_ct)).all() and (ts2 == ts2[:, :1]).all() and (gh2 == gh2[:, :1]).all())
    if runs:
        host = np.empty((n_groups, width), dtype=np.int32)
        host[:, _REC_TS] = ts2[:, 0]
        host[:, _REC_HEAD] = gh2[:, 0]
        host[:, 3] = 0
        pages = host[:, _REC_PAGES:]
        pages[:, :n_ct] = pa.reshape(n_groups, n_ct)
        pages[:, n_ct:ctp] = -1
        pages[:, ctp : ctp + n_ct] = pb.reshape(n_groups, n_ct)
        pages[:, ctp + n_ct :] = 0
    else:
        # Groups: the distinct (token_start, gpu_head) pairs, found as one int64 key per page.
        lo = int(gh.min()) if p else 0
        span = int(gh.max()) - lo + 1 if p else 1
        ukeys, group = np.unique(ts * span + (gh - lo), return_inverse=True)
        group = group.reshape(-1)
        n_groups = len(ukeys)
        host = np.zeros((n_groups, width), dtype=np.int32)
        host[:, _REC_TS] = ukeys // span
        host[:, _REC_HEAD] = ukeys % span + lo
        host[:, _REC_PAGES : _REC_PAGES + ctp] = -1
        host[group, _REC_PAGES + ct] = pa
        host[group, _REC_PAGES + ctp + ct] = pb
    host[:, _REC_VALID] = np.clip(plan.num_tokens - host[:, _REC_TS], 0, TILE)
    return _Groups(host=host, groups=n_groups, ctp=ctp)


@dataclass(eq=False)
class _Placed:
    """A placement table on one device (built by :func:`_build_groups`, uploaded on first use)."""

    groups: int
    ctp: int
    table: _Table


@dataclass(eq=False)
class _Layout:
    """How the kernels address one set of caches: strides, block size, each layer's offset from
    layer 0, divisibility; and the kernel configurations compiled for it. Built once per cache layout
    (an engine has one: its caches never move), whatever the requests."""

    device: torch.device
    head_dim: int
    block_size: int
    src_kind: int
    n_layers: int
    kv_stride: int  # elements between K and V
    s_block: int  # element strides of a GPU block, slot and head
    s_slot: int
    s_head: int
    vec: int  # v1: divisibility of row starts (strides, layer offsets, kv_stride), in elements, <= 16 bytes
    vec2: int  # v2: of the strides and every tensor base
    words: bool  # v2 may read the source as int32 words (bf16, even strides and bases, word-aligned cache)
    table: _Table  # int64: layer deltas [L] (v1) | padding to 16 | tensor bases [2L] (v2)
    calls: dict = field(default_factory=dict)  # kernel configuration -> _Call
    _views: tuple | None = None

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer deltas, tensor bases) on the device."""
        if self._views is None:
            t = self.table.get()
            off = _pad16(self.n_layers)
            self._views = (t[: self.n_layers], t[off : off + 2 * self.n_layers])
        return self._views


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


def _build_layout(plan: KVTransferPlan, used: Sequence[torch.Tensor]) -> _Layout:
    src = plan.src
    c0 = used[0]
    s = src.strides_of(c0)  # the layout's plain strides for this tensor (NotStridedError for an interleaved one)
    if s["dim"] != 1:
        raise NotStridedError(f"the fused transform reads head_dim rows with unit stride, {src.paged().name} has {s}")
    deltas, vec_layers = _layer_deltas(used)
    esize = c0.element_size()
    kv_stride = s["kv"]
    # Row starts are sums of stride multiples plus a tensor base: divisible by VEC elements (up to
    # 16 B) they let loads vectorize (Triton checks the base pointer itself).
    vec_rows = _pow2_divisor(np.asarray([s["block"], s["slot"], s["head"]]), 16)
    vec = min(16 // esize, vec_rows, vec_layers, _pow2_divisor(np.asarray([kv_stride]), 16))
    tbase = (deltas[:, None] + np.arange(2, dtype=np.int64)[None, :] * kv_stride).reshape(-1)
    vec2 = min(16 // esize, vec_rows, _pow2_divisor(tbase, 16))
    n = len(used)
    host = np.zeros(_pad16(n) + 2 * n, dtype=np.int64)
    host[:n] = deltas
    host[_pad16(n) :] = tbase
    return _Layout(
        device=c0.device,
        head_dim=src.head_dim,
        block_size=src.block_size,
        src_kind=_SRC_KIND[c0.dtype],
        n_layers=n,
        kv_stride=kv_stride,
        s_block=s["block"],
        s_slot=s["slot"],
        s_head=s["head"],
        vec=vec,
        vec2=vec2,
        words=c0.dtype == torch.bfloat16 and vec2 >= 2 and c0.data_ptr() % 4 == 0,
        table=_Table(host, c0.device),
    )


@dataclass(eq=False)
class _Launch:
    """Everything one launch needs but the tensors themselves, in three parts cached by what each
    depends on: the cache layout (:class:`_Layout`), the placement table (:class:`_Placed`) and the
    request's GPU block ids (a :class:`_Table`; the only part that changes with every request).

    It holds no cache tensor, so a plan that outlives its caches does not keep them allocated. Device
    tables are uploaded on first use, each in one copy that does not stall the host
    (:func:`~hawk.transform.upload.upload_int64`); a launch on another stream than an upload's waits for
    it on the device (:meth:`order_after_uploads`).
    """

    layout: _Layout
    placed: _Placed
    blocks: _Table

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(layer deltas, tensor bases, placement records, block ids) on the device."""
        deltas, tbase = self.layout.views()
        return deltas, tbase, self.placed.table.get(), self.blocks.get()

    def order_after_uploads(self) -> None:
        """Make the current stream wait for uploads made on another stream that may not have run yet."""
        dev = self.layout.device
        cur = raw_stream(dev.index) if dev.type == "cuda" else None
        self.layout.table.order(cur)
        self.placed.table.order(cur)
        self.blocks.order(cur)


#: Launch-state parts across plan objects (``PLANS.kv_plan`` assembles a new plan from cached parts for
#: each request the sender has not kept whole), each keyed by exactly what it depends on, bounded LRUs:
#: cache layouts (one per engine, in practice), placement tables (48 bytes per 32 tokens per KV head
#: at head_dim 128; keyed by the plan's placement, which the entry holds so its id is not reused),
#: and block tables (by content: a request whose GPU blocks repeat uploads nothing).
_LAYOUTS: OrderedDict = OrderedDict()
_LAYOUTS_MAX = 8
_PLACEMENTS: OrderedDict = OrderedDict()
_PLACEMENTS_MAX = 32
_BLOCKS: OrderedDict = OrderedDict()
_BLOCKS_MAX = 32
_STATES_LOCK = threading.Lock()


def _lru_get(d: OrderedDict, key: object) -> object:
    with _STATES_LOCK:
        v = d.get(key)
        if v is not None:
            d.move_to_end(key)
        return v


def _lru_put(d: OrderedDict, key: object, value: object, cap: int) -> None:
    with _STATES_LOCK:
        d[key] = value
        d.move_to_end(key)
        while len(d) > cap:
            d.popitem(last=False)


def _plan_cache(plan: KVTransferPlan) -> dict:
    cache = getattr(plan, _CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(plan, _CACHE_ATTR, cache)
    return cache


def _placed(plan: KVTransferPlan, device: torch.device, dest: TileDest) -> _Placed:
    """The plan's placement table on ``device`` for ``dest``: cached by placement (every plan assembled
    on one shares its ``_memo``), token count, the GPU side's head offset and the destination; built
    and uploaded once."""
    memo = getattr(plan, "_memo", None)
    key = None if memo is None else (id(memo), device, plan.num_tokens, plan.heads.start - plan.src.head_start, dest.key)
    if key is not None:
        hit = _lru_get(_PLACEMENTS, key)
        if hit is not None and hit[0] is memo:
            return hit[1]
    g = _build_groups(plan, dest)
    placed = _Placed(groups=g.groups, ctp=g.ctp, table=_Table(g.host, device))
    if key is not None:
        _lru_put(_PLACEMENTS, key, (memo, placed), _PLACEMENTS_MAX)
    return placed


def _blocks(plan: KVTransferPlan, device: torch.device) -> _Table:
    """The request's GPU block ids (those holding its tokens) as a device table, by content."""
    n = -(-plan.num_tokens // plan.src.block_size)
    ids = np.ascontiguousarray(np.asarray(plan.gpu_block_ids)[:n], dtype=np.int64)
    key = (device, ids.tobytes())
    hit = _lru_get(_BLOCKS, key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    table = _Table(ids, device)
    _lru_put(_BLOCKS, key, table, _BLOCKS_MAX)
    return table


def _deltas_key(caches: Sequence[torch.Tensor], p0: int) -> bytes:
    """The layers' pointers relative to ``p0`` (layer 0's), as bytes: the same information as a tuple of
    ints, read without a Python int per layer (80 layers cost ~25 us as a tuple on the H200 host, and a
    landed pull pays it on every transform)."""
    ptrs = np.fromiter(map(torch.Tensor.data_ptr, caches), dtype=np.int64, count=len(caches))
    return (ptrs - p0).tobytes()


def _prepare(plan: KVTransferPlan, caches: Sequence[torch.Tensor], dest: TileDest | None = None) -> tuple[_Launch, Sequence[torch.Tensor]]:
    """Validate the caches and build (or fetch) the launch state cached on the plan (and, part by
    part, across plans); also return the caches the kernel reads (contiguous copies in the rare case
    the given ones disagree on strides).

    The key is the layers' pointers relative to layer 0's, layer 0's alignment (what the compiled
    kernel is specialized on) and its shape, dtype and strides: checking all 2L tensors on every call
    would cost more host time than the kernel takes on a small request. Nothing in the state holds an
    absolute cache address (layer 0's pointer is passed at launch), so one state serves every layer of
    a layer-wise push (one-layer lists) and caches that moved together. A plan with new GPU block ids
    on a known placement and caches builds nothing but its block table.
    """
    dest = dest or plan.send_dest()
    c0 = caches[0]
    p0 = c0.data_ptr()
    key = ("launch", c0.device, c0.dtype, tuple(c0.shape), c0.stride(), p0 % 16, _deltas_key(caches, p0), dest.key)
    cache = _plan_cache(plan)
    hit = cache.get(key)
    if hit is not None:
        return hit, caches
    lkey = (key, plan.src)
    layout = _lru_get(_LAYOUTS, lkey)
    used: Sequence[torch.Tensor] = caches
    if layout is None:
        given = list(caches)
        plan.src.check_cache(given)
        used = _uniform_caches(given)
        layout = _build_layout(plan, used)
        if any(u is not g for u, g in zip(used, given)):
            # Copies made for this call only: their pointers mean nothing next time.
            return _Launch(layout, _placed(plan, layout.device, dest), _blocks(plan, layout.device)), used
        _lru_put(_LAYOUTS, lkey, layout, _LAYOUTS_MAX)
    launch = _Launch(layout, _placed(plan, layout.device, dest), _blocks(plan, layout.device))  # type: ignore[arg-type]
    for stale in [k for k in cache if k[0] == "launch"][:-7]:
        del cache[stale]  # caches moved: keep only the last few pointer sets
    cache[key] = launch
    return launch, used


#: Kernel names ``transform_triton(kernel=...)`` and ``HAWK_TRANSFORM_KERNEL`` take; ``v2e`` is v2
#: without the word path (each element loaded on its own), for comparison.
KERNELS = ("auto", "v1", "v2", "v2e")
ENV_KERNEL = "HAWK_TRANSFORM_KERNEL"
ENV_TPP = "HAWK_TRANSFORM_TPP"  # tensors per v2 program (a power of two); default: ~8 KiB of source each
#: ``jit`` launches through Triton's JIT dispatcher every time; ``direct`` (the default) does so
#: once per configuration and then calls the compiled kernel's launcher, skipping argument binding
#: and specialization (host time the 10 MiB case is bound by). Interpreted runs always use ``jit``.
ENV_LAUNCH = "HAWK_TRANSFORM_LAUNCH"


def resolve_kernel(kernel: str | None, head_dim: int, dtype: str = "bfp8_b") -> str:
    """The kernel a call uses: ``kernel``, else ``$HAWK_TRANSFORM_KERNEL``, else auto: v2 for bfloat8_b
    output, v1 for bf16 (measured on an H200, 2026-11-30, v1 -> v2 of copy: bfloat8_b 0.45 -> 0.64 at
    1280 MiB; bf16 0.98 -> 0.93), and v1 whenever head_dim is not a multiple of 16, which v2 does not handle."""
    name = kernel or os.environ.get(ENV_KERNEL) or "auto"
    if name not in KERNELS:
        raise ValueError(f"unknown transform kernel {name!r}; expected one of {KERNELS}")
    if name == "auto":
        name = "v2" if dtype == "bfp8_b" else "v1"
    if name != "v1" and head_dim % 16:
        name = "v1"
    return name


#: Source bytes per v2 program by default, and its register cap (``$HAWK_TRANSFORM_MAXNREG``; 0: none).
#: One H200, bfloat8_b output from bf16 at head_dim 128, 1280 MiB (`hawk.bench.transform --kernels v2
#: --tpp N --num-warps W`, one call): 8 KiB (one tensor, 4 warps) 0.76 of a same-run copy, 16 KiB 0.65,
#: 32 KiB 0.71; 8 warps 0.72-0.73. At 16 KiB Nsight Compute showed 102 registers per thread (a quarter
#: of the warps an SM holds) and warps waiting on their loads: smaller programs and a cap let more of
#: them hide each other's loads. Caps at 8 KiB (three calls): 64 registers 0.80 at 1280 MiB, 0.79 at
#: 320, 0.83 at 10 MiB (48: 0.72, 56: 0.76, 72: 0.78, none: 0.76); bf16 output 0.95 either way.
V2_PROGRAM_BYTES = 8 << 10
V2_MAXNREG = 64
ENV_MAXNREG = "HAWK_TRANSFORM_MAXNREG"


def default_tpp(head_dim: int, elem_bytes: int, num_tensors: int) -> int:
    """Tensors per v2 program: ``$HAWK_TRANSFORM_TPP``, else about :data:`V2_PROGRAM_BYTES` of source
    per program; at most the tensors there are (rounded up to a power of two)."""
    env = os.environ.get(ENV_TPP)
    if env:
        tpp = int(env)
    else:
        tpp = max(1, V2_PROGRAM_BYTES // (32 * head_dim * elem_bytes))
        tpp = 1 << (tpp.bit_length() - 1)
    return max(1, min(tpp, triton.next_power_of_2(num_tensors)))


@dataclass
class _Call:
    """One kernel configuration of one cache layout: the grid's tensor axis, the arguments after the
    send buffer(s) in signature order, and the compiled kernel per send-buffer alignment once the JIT
    has produced it. Every argument it covers is fixed per cache layout, and the per-request tables'
    pointers are not specialized on, so the compiled kernel serves every request (any placement, any
    block ids) with no new compilation and no trip through the JIT dispatcher."""

    grid_y: int
    rest: tuple
    num_warps: int
    direct: bool  # launch through the compiled kernel's launcher after the first launch
    compiled: dict = field(default_factory=dict)
    maxnreg: int | None = None  # a per-thread register cap compiled in (None: the compiler's choice)


def _strides(layout: _Layout, ctp: int) -> tuple:
    """The constexprs both kernels take after their runtime integer: strides, block size, head_dim, CTP."""
    return (layout.s_block, layout.s_slot, layout.s_head, layout.block_size, layout.head_dim, ctp)


def _page_align(unit: int, bfp8: bool) -> int:
    """What every page start is proven divisible by, in bytes, when offsets count ``unit`` bytes:
    up to 64 for bfloat8_b pages (1088 B), up to a whole page for bf16 (2048 B)."""
    return math.gcd(unit, 64 if bfp8 else 2048)


def _v2_call(layout: _Layout, ctp: int, bfp8: bool, words: bool, num_warps: int, tpp: int | None, elem_bytes: int,
             unit: int) -> _Call:
    direct = os.environ.get(ENV_LAUNCH, "direct") != "jit"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # (no registers to cap there)
    maxnreg = None if interpreted else int(os.environ.get(ENV_MAXNREG, V2_MAXNREG)) or None
    key = ("v2", ctp, bfp8, words, num_warps, tpp, direct, unit, maxnreg)
    hit = layout.calls.get(key)
    if hit is not None:
        return hit
    n = 2 * layout.n_layers
    tpp = tpp or default_tpp(layout.head_dim, elem_bytes, n)
    if tpp < 1 or tpp & (tpp - 1):
        raise ValueError(f"tensors per program must be a power of two, got {tpp}")
    # n_tensors stays a runtime integer: it is fixed per cache layout (so is its specialization).
    rest = (n, *_strides(layout, ctp), layout.src_kind, bfp8, layout.vec2, tpp, words, n % tpp == 0, unit,
            _page_align(unit, bfp8))
    hit = _Call(grid_y=triton.cdiv(n, tpp), rest=rest, num_warps=num_warps, direct=direct, maxnreg=maxnreg)
    layout.calls[key] = hit
    return hit


def _v1_call(layout: _Layout, ctp: int, bfp8: bool, num_warps: int, unit: int) -> _Call:
    direct = os.environ.get(ENV_LAUNCH, "direct") != "jit"
    key = ("v1", ctp, bfp8, num_warps, direct, unit)
    hit = layout.calls.get(key)
    if hit is None:
        # kv_stride stays a runtime integer: it is fixed per cache layout (so is its specialization).
        rest = (layout.kv_stride, *_strides(layout, ctp), layout.src_kind, bfp8, layout.vec, unit)
        hit = _Call(grid_y=2 * layout.n_layers, rest=rest, num_warps=num_warps, direct=direct)
        layout.calls[key] = hit
    return hit


def _launch(call: _Call, groups: int, args: tuple, device: torch.device, align: int, kernel: object,
            direct_args: tuple | None = None) -> None:
    """Launch ``kernel`` on ``groups`` row groups. The first launch of a configuration goes through
    Triton's JIT dispatcher; later ones call the compiled kernel's launcher directly with the same
    arguments (``$HAWK_TRANSFORM_LAUNCH`` = ``direct``, the default): ``args`` are all the kernel's
    parameters in signature order, constexprs included, as the dispatcher passes them. Everything the
    JIT specializes on is fixed per cache layout except the send buffer's alignment, so compiled
    kernels are kept per ``align`` (its address mod 16). ``direct_args``: what the direct launch passes
    instead of ``args`` (:func:`~hawk.triton_launch.pointer_args`)."""
    compiled = call.compiled.get(align)
    if compiled is not None and launch_hooks_idle():
        try:
            run_compiled(compiled, (groups, call.grid_y), raw_stream(device.index),
                         args if direct_args is None else direct_args)
            return
        except Exception:  # noqa: BLE001 - a launcher this code does not know: use the dispatcher from now on
            call.compiled.clear()
            call.direct = False
    extra = {"maxnreg": call.maxnreg} if call.maxnreg else {}
    compiled = kernel[(groups, call.grid_y, 1)](*args, num_warps=call.num_warps, **extra)  # type: ignore[index]
    if call.direct and device.type == "cuda" and launchable(compiled):
        call.compiled[align] = compiled


def _word_view(c: torch.Tensor) -> torch.Tensor:
    """An int32 tensor starting at ``c``'s first element (the kernel only uses the pointer)."""
    try:
        return c.view(torch.int32)
    except RuntimeError:
        w = torch.empty(0, dtype=torch.int32, device=c.device)
        return w.set_(c.untyped_storage(), c.storage_offset() * c.element_size() // 4, (1,), (1,))


def transform_triton(
    caches: Sequence[torch.Tensor],
    plan: KVTransferPlan,
    out: torch.Tensor | None = None,
    num_warps: int = 4,
    kernel: str | None = None,
    tpp: int | None = None,
    dest: TileDest | None = None,
) -> torch.Tensor:
    """Write the plan's send buffer (1-D uint8, ``plan.total_bytes``), or its tiles where ``dest`` says
    (``out`` then being all of ``dest.extent``, e.g. the NPU's DRAM), in one kernel launch.

    Same contract and bytes as :func:`hawk.transform.reference.transform_reference`, except that rows
    past the request are always +0 (the reference's multiply-by-0 can leave -0, or NaN from inf).
    ``kernel`` picks v1 or v2 (see the module docstring; default ``$HAWK_TRANSFORM_KERNEL`` or v2),
    ``tpp`` v2's tensors per program (default ``$HAWK_TRANSFORM_TPP`` or about 8 KiB of source).
    """
    out, run = _bound(caches, plan, out, num_warps, kernel, tpp, dest, reusable=False)
    run()
    return out


def bind_triton(
    caches: Sequence[torch.Tensor],
    plan: KVTransferPlan,
    out: torch.Tensor,
    dest: TileDest | None = None,
    num_warps: int = 4,
    kernel: str | None = None,
    tpp: int | None = None,
) -> Callable[[], None]:
    """:func:`transform_triton` into ``out`` as a call to repeat: each call writes the tiles of what the
    caches hold then, with the checks, the launch state's lookup and the arguments done once, here.

    Why: a landed pull repeats one transform into the same pages (a repeated request with the same
    blocks), and on the H200 host that setup costs more host time than the launch itself. The call
    holds ``caches``' tensors, ``out`` and the plan: valid while they are the same objects with the same
    storage (what a sender's caches and a receiver's mapped memory are). Where the caches had to be
    copied for the kernel (strides that disagree), each call transforms from scratch instead."""
    return _bound(caches, plan, out, num_warps, kernel, tpp, dest, reusable=True)[1]


def _bound(caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor | None, num_warps: int, kernel: str | None,
           tpp: int | None, dest: TileDest | None, reusable: bool) -> tuple[torch.Tensor, Callable[[], None]]:
    """Check the arguments and prepare the launch; ``(out, the launch as a call)`` (nothing launched yet).
    ``reusable``: the call will be repeated, so it must not read copies of the caches made now."""
    ndtype = plan.dst.dtype
    if ndtype not in ("bf16", "bfp8_b"):
        raise ValueError(f"Triton transform supports NPU dtypes bf16 and bfp8_b, got {ndtype!r}")
    if len(caches) != plan.src.num_layers:
        raise ValueError(f"expected {plan.src.num_layers} layer tensors, got {len(caches)}")
    which = resolve_kernel(kernel, plan.src.head_dim, plan.dst.dtype)
    to_send = dest is None
    dest = dest or plan.send_dest()
    launch, used = _prepare(plan, caches, dest)
    c0 = used[0]
    device = c0.device
    total = dest.extent
    if out is None:
        out = (torch.empty if to_send else torch.zeros)(total, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"send buffer (or destination) must be 1-D uint8 with >= {total} bytes, got {out.dtype} of shape {tuple(out.shape)}")
    elif out.device != device:
        raise ValueError(f"send buffer is on {out.device}, caches are on {device}")
    elif not out.is_contiguous():
        raise ValueError("send buffer must be contiguous")

    bfp8 = ndtype == "bfp8_b"
    dst = out if out.numel() == total else out[:total]
    ptr = dst.data_ptr()
    if ptr % 2 and (not bfp8 or which == "v1"):
        if not to_send:
            raise ValueError("a destination other than a send buffer must be 2-byte aligned")
        # An odd-aligned buffer cannot take int16 stores: write aside, then copy.
        return out, lambda: dst.copy_(transform_triton(caches, plan, None, num_warps, kernel, tpp))
    if reusable and any(u is not c for u, c in zip(used, caches)):  # copies of this call's caches: not to be kept
        return out, lambda: transform_triton(caches, plan, out, num_warps, kernel, tpp, None if to_send else dest)

    with on_device(device):  # tables are uploaded on the caches' GPU
        deltas, tbase, groups, blk = launch.tables()
    layout, placed = launch.layout, launch.placed
    if which == "v1":
        call = _v1_call(layout, placed.ctp, bfp8, num_warps, dest.unit)
        src = c0.view(_SRC_BITS[c0.dtype])
        args = (src, deltas, groups, blk, dst if bfp8 else dst.view(torch.int16), *call.rest)
        fn = _transform_kernel
    else:
        words = bfp8 and layout.words and which == "v2" and ptr % 2 == 0
        call = _v2_call(layout, placed.ctp, bfp8, words, num_warps, tpp, c0.element_size(), dest.unit)
        src = _word_view(c0) if words else c0.view(_SRC_BITS[c0.dtype])
        dst16 = dst.view(torch.int16) if ptr % 2 == 0 else dst  # (odd: only bfloat8_b bytes are stored)
        args = (src, tbase, groups, blk, dst, dst16, *call.rest)
        fn = _rows_kernel

    direct_args = pointer_args(args) if reusable and device.type == "cuda" else None
    dst_at = (4,) if fn is _transform_kernel else (4, 5)  # where the destination's address is passed
    return out, _BoundLaunch(device, launch, call, placed.groups, args, fn, ptr % 16, direct_args, dst_at, used)


@dataclass
class _BoundLaunch:
    """One prepared transform launch (:func:`_bound`): the kernel, its arguments and launch state.
    ``reads`` every layer the kernel reads through ``args`` (copies made by ``_bound``, in the rare
    case: they must outlive the launch's enqueueing)."""

    device: torch.device
    launch: _Launch
    call: _Call
    groups: int
    args: tuple
    fn: object
    align: int
    direct_args: tuple | None
    dst_at: tuple[int, ...]
    reads: Sequence[torch.Tensor]

    def __call__(self) -> None:
        """One launch on the caches' GPU, after the tables' uploads."""
        with on_device(self.device):
            self.launch.order_after_uploads()
            _launch(self.call, self.groups, self.args, self.device, self.align, self.fn, self.direct_args)

    def moved(self, pairs: Sequence[tuple[int, int]]) -> list[int]:
        """Launch the kernel as compiled for this call on other layers: per pair, its source at ``src``
        and its destination at ``dst`` (addresses; the same cache layout and tiles, elsewhere), all under
        one device guard and stream lookup. Returns the indices of the pairs it launched nothing for:
        that kernel does not fit them (another alignment), or it is not compiled yet."""
        compiled = self.call.compiled.get(self.align)
        if self.direct_args is None or compiled is None or not launch_hooks_idle():
            return list(range(len(pairs)))
        src_align = self.direct_args[0] % 16
        fits = [dst % 16 == self.align and src % 16 == src_align for src, dst in pairs]
        if any(fits):
            args = list(self.direct_args)
            with on_device(self.device):
                self.launch.order_after_uploads()
                stream = raw_stream(self.device.index)
                for (src, dst), ok in zip(pairs, fits):
                    if ok:
                        args[0] = src
                        for j in self.dst_at:
                            args[j] = dst
                        run_compiled(compiled, (self.groups, self.call.grid_y), stream, tuple(args))
        return [i for i, ok in enumerate(fits) if not ok]


def bind_triton_layers(
    caches: Sequence[torch.Tensor],
    plan: KVTransferPlan,
    out: torch.Tensor,
    shifts: Sequence[int],
    dest: TileDest | None = None,
) -> Callable[..., None]:
    """``transform_triton([caches[l]], plan, out[shifts[l]:], dest=dest)`` for any layers ``l`` as one call
    to repeat (``run(*layers)``): layer ``l``'s launch is layer 0's with the two addresses moved (``plan``
    is one layer's, as a layer-wise push's is). Why: a push transforms every layer of a request on the
    forward's own thread, a group at a time, and the checks and setup of each call cost that thread more
    host time than its launch. Layers whose addresses the compiled kernel does not fit are transformed
    from scratch."""
    bound = _bound([caches[0]], plan, out[shifts[0]:], 4, None, None, dest, reusable=True)[1]
    base = out.data_ptr()

    def run(*layers: int) -> None:
        later = [layer for layer in layers if layer != 0]
        if len(later) < len(layers):
            bound()
        if not later:
            return
        pairs = [(caches[layer].data_ptr(), base + shifts[layer]) for layer in later]
        misfits = bound.moved(pairs) if isinstance(bound, _BoundLaunch) else range(len(later))
        for i in misfits:
            layer = later[i]
            transform_triton([caches[layer]], plan, out[shifts[layer]:], dest=dest)

    return run
