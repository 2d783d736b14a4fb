"""The fused transfer-aware transformation as Triton kernels: gather + re-block + tilize + encode.

Two kernels write the same bytes; ``transform_triton(kernel=...)`` or ``$HAWK_TRANSFORM_KERNEL``
picks one (default ``v2``; ``v2e`` is v2 without its word path, for comparison):

``v2`` (face rows). One program handles one *row group* (32 consecutive tokens of one head: one
NPU row tile) of ``TPP`` consecutive K/V tensors (default: about 16 KiB of source per program). It
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
int64 element offset per tensor (vLLM allocates one tensor per layer). Index tables derived from a
plan are cached on the plan and, by content, across plan objects (a request's plan is a new object
each time, assembled from cached parts), so transforming the same request shape and blocks again
builds and uploads nothing; a new one uploads its tables in one copy that does not stall the host.
Both kernels launch a configuration's compiled kernel directly after its first launch
(``$HAWK_TRANSFORM_LAUNCH=jit`` keeps Triton's dispatcher), which cuts the host time that bounds
small requests.
"""

from __future__ import annotations

import contextlib
import os
import threading

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs as _knobs

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


@triton.jit
def _rows_kernel(
    src,  # caches[0]'s storage as int16/int32 bits (int32 words of two bf16 values when WORDS)
    meta,  # int64 tables, at element offsets: 0: row_off [G, 32]; o_valid: row_valid [G];
    # o_pa: page_a [G, CTP]; o_pb: page_b [G, CTP]; o_tb: tbase [T] (see _v2_meta)
    out,  # send buffer, uint8
    out16,  # the same, int16 (bf16 pages, bfloat8_b value pairs when WORDS)
    n_tensors,
    o_valid,
    o_pa,
    o_pb,
    o_tb,
    HEAD_DIM: tl.constexpr,  # a multiple of 16
    CTP: tl.constexpr,  # column tiles, rounded up to a power of two
    SRC_KIND: tl.constexpr,
    BFP8: tl.constexpr,
    VEC: tl.constexpr,  # proven divisibility of tbase and row_off, in elements
    TPP: tl.constexpr,  # tensors per program (a power of two)
    WORDS: tl.constexpr,  # bf16 source read as int32 words; bfloat8_b values written as int16 pairs
    EVEN_T: tl.constexpr,  # TPP divides n_tensors: no tensor mask
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
    r5 = r[None, None, :, None, None]
    t5 = t[None, None, None, :, None]
    x5 = x[None, None, None, None, :]

    # Gather.
    if EVEN_T:
        base = tl.load(meta + o_tb + t)
    else:
        base = tl.load(meta + o_tb + t, mask=t < n_tensors, other=0)
    roff = tl.load(meta + g * 32 + r)
    if WORDS:
        base = base // 2
        roff = roff // 2
    base = tl.multiple_of(base, VEC // UNIT)  # (a hint on a division by 1 would be folded away with it)
    roff = tl.multiple_of(roff, VEC // UNIT)
    nvalid = tl.load(meta + o_valid + g)
    hx = h5 * X + x5  # unit within the face row; in output units as well
    ptrs = src + base[None, None, None, :, None] + roff[None, None, :, None, None] + f5 * (16 // UNIT) + hx
    mask = r5 < nvalid
    if not EVEN_T:
        mask = mask & (t5 < n_tensors)
    if NF_SRC < NF:
        mask = mask & (f5 < NF_SRC)
    v = tl.load(ptrs, mask=mask, other=0)

    # Destination page of each (face column, tensor) and each face row's index in its tile.
    ct = f // 2
    pa = tl.load(meta + o_pa + g * CTP + ct)
    pb = tl.load(meta + o_pb + g * CTP + ct)
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
            vbase = tl.multiple_of(page5 * 544 + 32, [32, 32, 32, 32, 32])  # int16 units: values follow 64 exponent bytes
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
            vbase = tl.multiple_of(page5 * 1088 + 64, [64, 64, 64, 64, 64])
            vptr = out + vbase + frow5 * 16 + hx
            tl.store(vptr, _bfp8_fast(a, (bits >> 24) & 0x80, scale).to(tl.uint8), mask=smask5)
            if rare > 0:  # as above
                bits = _fp32_bits(tl.load(ptrs, mask=mask, other=0), SRC_KIND)
                a = bits & 0x7FFFFFFF
                tl.store(vptr, _bfp8_exact(a, (bits >> 24) & 0x80, e5).to(tl.uint8), mask=smask5)
        ebase = tl.multiple_of(page * 1088, [64, 64])  # 64 exponent bytes open each page
        tl.store(out + ebase[:, None, :] + frow[:, :, None], shared.to(tl.uint8), mask=smask[:, None, :])
    else:
        tl.static_assert(not WORDS, "WORDS is for bfloat8_b output")
        if SRC_KIND == 0:
            y = v  # bf16 -> bf16 moves bits unchanged
        else:
            y = _bf16_bits(_fp32_bits(v, SRC_KIND))
        vbase = tl.multiple_of(page5 * 1024, [1024, 1024, 1024, 1024, 1024])  # int16 units
        tl.store(out16 + vbase + frow5 * 16 + hx, y, mask=smask5)


@dataclass(eq=False)
class _PlanTables:
    """Index tables of one plan, on the host: built once per (plan, cache strides); what goes to the
    device is uploaded by the launch state (:class:`_Launch`), in one copy."""

    host: np.ndarray  # int64, flat: row_off [G, 32] | row_valid [G] | page_a [G, CTP] | page_b [G, CTP]
    groups: int
    ctp: int
    vec_rows: int  # gcd-style divisibility of every row offset (elements)

    @property
    def sections(self) -> tuple[int, int, int, int]:
        """Where row_valid, page_a, page_b start in ``host``, and its length."""
        g, c = self.groups, self.ctp
        return g * 32, g * 33, g * (33 + c), g * (33 + 2 * c)


def _pow2_divisor(values: np.ndarray, cap: int) -> int:
    """Largest power of two <= cap (a power of two) dividing every value (cap if there are none): the
    lowest set bit of all values OR-ed together, in one pass."""
    v = np.asarray(values, dtype=np.int64)
    acc = int(np.bitwise_or.reduce(v, axis=None)) if v.size else 0
    return cap if acc == 0 else min(cap, acc & -acc)


def _build_tables(plan: KVTransferPlan, strides: tuple[int, ...]) -> _PlanTables:
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
    # Groups: the distinct (token_start, gpu_head) pairs in lexicographic order, found as one int64
    # key per page (np.unique over rows of a 2-D array sorts a structured view: several times slower).
    lo = int(gh.min()) if len(gh) else 0
    span = int(gh.max()) - lo + 1 if len(gh) else 1
    ukeys, group = np.unique(ts * span + (gh - lo), return_inverse=True)
    group = group.reshape(-1)
    key_ts, key_gh = ukeys // span, ukeys % span + lo
    n_groups = len(ukeys)
    ctp = triton.next_power_of_2(plan.dst.col_tiles)

    # Everything lands in one flat int64 buffer (what the device gets in one copy), section by section.
    host = np.empty(n_groups * (33 + 2 * ctp), dtype=np.int64)
    row_off = host[: n_groups * TILE].reshape(n_groups, TILE)
    row_valid = host[n_groups * TILE : n_groups * 33]
    page_a = host[n_groups * 33 : n_groups * (33 + ctp)].reshape(n_groups, ctp)
    page_b = host[n_groups * (33 + ctp) :].reshape(n_groups, ctp)

    # Rows: token -> (GPU block, slot) through the block table, per token once (a group's 32 rows are
    # 32 consecutive tokens), then gathered per group plus its head; padding rows point at offset 0.
    ntok = plan.num_tokens
    span_t = int(key_ts.max()) + TILE if n_groups else 0
    m = min(ntok, span_t)
    tok_off = np.zeros(max(span_t, 1), dtype=np.int64)
    t = np.arange(m, dtype=np.int64)
    gids = np.asarray(plan.gpu_block_ids, dtype=np.int64)
    tok_off[:m] = gids[t // src.block_size] * s["block"] + (t % src.block_size) * s["slot"]
    np.take(tok_off, key_ts[:, None] + np.arange(TILE, dtype=np.int64)[None, :], out=row_off)
    row_off += key_gh[:, None] * s["head"]
    row_valid[:] = np.clip(ntok - key_ts, 0, TILE)
    part = np.flatnonzero(row_valid < TILE)  # groups running past the request: zero their padding rows
    if len(part):
        sub = row_off[part]
        sub[np.arange(TILE)[None, :] >= row_valid[part][:, None]] = 0
        row_off[part] = sub

    # Pages: A and B of each (group, col tile), in page units.
    a, b = plan.offset_terms()
    pbytes = plan.page_bytes
    if np.any(a % pbytes) or np.any(b % pbytes):
        raise ValueError("send-buffer offsets are not whole pages; the plan is inconsistent")
    page_a.fill(-1)
    page_b.fill(0)
    page_a[group, ct] = a // pbytes
    page_b[group, ct] = b // pbytes

    return _PlanTables(host=host, groups=n_groups, ctp=ctp, vec_rows=_pow2_divisor(row_off, 16))


def _plan_cache(plan: KVTransferPlan) -> dict:
    cache = getattr(plan, _CACHE_ATTR, None)
    if cache is None:
        cache = {}
        setattr(plan, _CACHE_ATTR, cache)
    return cache


def _tables(plan: KVTransferPlan, strides: tuple[int, ...]) -> _PlanTables:
    cache = _plan_cache(plan)
    key = ("tables", strides)
    if key not in cache:
        cache[key] = _build_tables(plan, strides)
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


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(eq=False)
class _Launch:
    """Everything one launch needs but the tensors themselves: built once per (plan, cache pointers).

    It holds no cache tensor, so a plan that outlives its caches does not keep them allocated. Device
    tables are uploaded on first use by the kernel that needs them (v1 or v2), each set in one copy
    that does not stall the host (:func:`hawk.devices.batched_copy.upload_int64`); a launch on another
    stream than the upload's waits for it on the device (:meth:`order_after_uploads`).
    """

    tables: _PlanTables
    deltas_host: np.ndarray  # [L] int64 (v1)
    tbase: np.ndarray  # [2L] int64 (v2)
    device: torch.device
    kv_stride: int
    constexprs: dict  # v1's
    meta_offsets: tuple[int, int, int, int]  # where row_valid, page_a, page_b and tbase start in meta
    vec2: int  # divisibility of every tbase and row offset, in elements, capped at 16 bytes
    words: bool  # v2 may read the source as int32 words (bf16, word-aligned rows and base)
    calls: dict = field(default_factory=dict)  # kernel configuration -> _V2Call
    _meta: torch.Tensor | None = None
    _v1: tuple | None = None
    _pending: list = field(default_factory=list)  # (event, raw stream) of uploads not known complete
    _lock: threading.Lock = field(default_factory=threading.Lock)  # two threads may launch one state

    def _upload(self, arr: np.ndarray) -> torch.Tensor:
        from hawk.devices.batched_copy import upload_int64

        return upload_int64(arr, self.device)

    def _uploaded(self) -> None:
        """Note the device work enqueued so far on the current stream (uploads, casts)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._pending.append((ev, _raw_stream(self.device.index)))

    @property
    def meta(self) -> torch.Tensor:
        """v2's tables in one int64 tensor (one pointer to pass): row_off, row_valid, page_a, page_b, tbase."""
        if self._meta is None:
            with self._lock:
                if self._meta is None:
                    meta = self._upload(np.concatenate([self.tables.host, self.tbase]))
                    self._uploaded()
                    self._meta = meta
        return self._meta

    def v1_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """v1's (deltas, row_off, row_valid int32, page_a, page_b), views of one upload (each section
        starting on a 128-byte boundary)."""
        if self._v1 is None:
            with self._lock:
                if self._v1 is None:
                    self._v1 = self._v1_upload()
        return self._v1  # type: ignore[return-value]

    def _v1_upload(self) -> tuple:
        t = self.tables
        o_valid, o_pa, o_pb, end = t.sections
        parts = [self.deltas_host, t.host[:o_valid], t.host[o_valid:o_pa], t.host[o_pa:o_pb], t.host[o_pb:end]]
        starts, pos = [], 0
        for p in parts:
            starts.append(pos)
            pos += _pad16(len(p))
        buf = np.zeros(pos, dtype=np.int64)
        for p, s in zip(parts, starts):
            buf[s : s + len(p)] = p
        dev = self._upload(buf)
        views = [dev[s : s + len(p)] for p, s in zip(parts, starts)]
        views[2] = views[2].to(torch.int32)  # row_valid: the kernel's int32 table (a device cast)
        self._uploaded()
        return tuple(views)

    def order_after_uploads(self) -> None:
        """Make the current stream wait for uploads made on another stream that may not have run yet."""
        if not self._pending:
            return
        with self._lock:
            cur = _raw_stream(self.device.index)
            left = []
            for ev, stream in self._pending:
                if ev.query():
                    continue
                if stream != cur:
                    torch.cuda.current_stream(self.device).wait_event(ev)
                left.append((ev, stream))
            self._pending = left


#: Launch states by what they depend on, across plan objects: a plan is a new object per request
#: (``PLANS.kv_plan`` assembles one from cached parts), so state kept on the plan alone was rebuilt,
#: re-uploaded and re-dispatched through Triton's JIT on every transfer. Bounded: each holds device
#: tables (about 64 bytes per token per KV head).
_LAUNCHES: OrderedDict = OrderedDict()
_LAUNCHES_MAX = 16
_LAUNCHES_LOCK = threading.Lock()


def _content_key(plan: KVTransferPlan, key: tuple) -> tuple | None:
    """What a launch state depends on beyond ``key`` (the caches): the placement (shared by every plan
    assembled on it; held by the entry, so its id cannot be reused while cached), the GPU layout, the
    token count and the GPU block ids. None for a plan that does not share a placement."""
    memo = getattr(plan, "_memo", None)
    if memo is None:
        return None
    return (id(memo), plan.src, plan.num_tokens, np.ascontiguousarray(plan.gpu_block_ids, dtype=np.int64).tobytes(), key)


def _prepare(plan: KVTransferPlan, caches: Sequence[torch.Tensor]) -> tuple[_Launch, Sequence[torch.Tensor]]:
    """Validate the caches and build (or fetch) the launch state cached on the plan (and, by content,
    across plans: :data:`_LAUNCHES`); also return the caches the kernel reads (contiguous copies in
    the rare case the given ones disagree on strides).

    The key is the layers' pointers relative to layer 0's, layer 0's alignment (what the compiled
    kernel is specialized on) and its shape, dtype and strides: checking all 2L tensors on every call
    would cost more host time than the kernel takes on a small request. Nothing in the state holds an
    absolute cache address (layer 0's pointer is passed at launch), so one state serves every layer of
    a layer-wise push (one-layer lists) and caches that moved together.
    """
    c0 = caches[0]
    p0 = c0.data_ptr()
    key = ("launch", c0.device, c0.dtype, tuple(c0.shape), c0.stride(), p0 % 16, tuple(c.data_ptr() - p0 for c in caches))
    cache = _plan_cache(plan)
    hit = cache.get(key)
    if hit is not None:
        return hit, caches
    ckey = _content_key(plan, key)
    if ckey is not None:
        with _LAUNCHES_LOCK:
            entry = _LAUNCHES.get(ckey)
            if entry is not None and entry[0] is plan._memo:
                _LAUNCHES.move_to_end(ckey)
                cache[key] = entry[1]
                return entry[1], caches
    given = list(caches)
    plan.src.check_cache(given)
    used = _uniform_caches(given)
    c0 = used[0]
    tables = _tables(plan, tuple(c0.stride()))
    deltas, vec_layers = _layer_deltas(used)
    esize = c0.element_size()
    kv_stride = c0.stride(0)
    # Row starts divisible by VEC elements (16 B) let loads vectorize; Triton checks the base pointer.
    vec = min(16 // esize, tables.vec_rows, vec_layers, _pow2_divisor(np.asarray([kv_stride]), 16))
    tbase = (deltas[:, None] + np.arange(2, dtype=np.int64)[None, :] * kv_stride).reshape(-1)
    vec2 = min(16 // esize, tables.vec_rows, _pow2_divisor(tbase, 16))
    copied = any(u is not g for u, g in zip(used, given))
    launch = _Launch(
        tables=tables,
        deltas_host=deltas,
        tbase=tbase,
        device=c0.device,
        kv_stride=kv_stride,
        constexprs={"HEAD_DIM": plan.src.head_dim, "CTP": tables.ctp, "SRC_KIND": _SRC_KIND[c0.dtype], "VEC": vec},
        meta_offsets=tables.sections,
        vec2=vec2,
        words=c0.dtype == torch.bfloat16 and vec2 >= 2 and c0.data_ptr() % 4 == 0,
    )
    if copied:
        return launch, used  # copies made for this call only: their pointers mean nothing next time
    for stale in [k for k in cache if k[0] == "launch"][:-7]:
        del cache[stale]  # caches moved: keep only the last few pointer sets
    cache[key] = launch
    if ckey is not None:
        with _LAUNCHES_LOCK:
            _LAUNCHES[ckey] = (plan._memo, launch)
            _LAUNCHES.move_to_end(ckey)
            while len(_LAUNCHES) > _LAUNCHES_MAX:
                _LAUNCHES.popitem(last=False)
    return launch, used


#: Kernel names ``transform_triton(kernel=...)`` and ``HAWK_TRANSFORM_KERNEL`` take; ``v2e`` is v2
#: without the word path (each element loaded on its own), for comparison.
KERNELS = ("auto", "v1", "v2", "v2e")
ENV_KERNEL = "HAWK_TRANSFORM_KERNEL"
ENV_TPP = "HAWK_TRANSFORM_TPP"  # tensors per v2 program (a power of two); default: ~16 KiB of source each
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


def default_tpp(head_dim: int, elem_bytes: int, num_tensors: int) -> int:
    """Tensors per v2 program: ``$HAWK_TRANSFORM_TPP``, else about 16 KiB of source per program;
    at most the tensors there are (rounded up to a power of two)."""
    env = os.environ.get(ENV_TPP)
    if env:
        tpp = int(env)
    else:
        tpp = max(1, (16 << 10) // (32 * head_dim * elem_bytes))
        tpp = 1 << (tpp.bit_length() - 1)
    return max(1, min(tpp, triton.next_power_of_2(num_tensors)))


@dataclass
class _V2Call:
    """One v2 configuration of one launch state: grid, the arguments after (src, meta, out), and
    the compiled kernel per send-buffer alignment once the JIT has produced it."""

    grid: tuple[int, int, int]
    rest: tuple
    num_warps: int
    direct: bool  # launch through the compiled kernel's launcher after the first launch
    compiled: dict = field(default_factory=dict)


def _v2_call(launch: _Launch, plan: KVTransferPlan, bfp8: bool, words: bool, num_warps: int, tpp: int | None,
             elem_bytes: int) -> _V2Call:
    direct = os.environ.get(ENV_LAUNCH, "direct") != "jit"
    key = (bfp8, words, num_warps, tpp, direct)
    hit = launch.calls.get(key)
    if hit is not None:
        return hit
    n = plan.num_tensors
    tpp = tpp or default_tpp(plan.src.head_dim, elem_bytes, n)
    if tpp < 1 or tpp & (tpp - 1):
        raise ValueError(f"tensors per program must be a power of two, got {tpp}")
    t = launch.tables
    consts = (plan.src.head_dim, t.ctp, launch.constexprs["SRC_KIND"], bfp8, launch.vec2, tpp, words, n % tpp == 0)
    hit = _V2Call(grid=(t.groups, triton.cdiv(n, tpp), 1), rest=(n, *launch.meta_offsets, *consts), num_warps=num_warps,
                  direct=direct)
    launch.calls[key] = hit
    return hit


def _v1_call(launch: _Launch, plan: KVTransferPlan, bfp8: bool, num_warps: int) -> _V2Call:
    """v1's launch configuration; ``rest`` is every argument after the send buffer, in signature order."""
    direct = os.environ.get(ENV_LAUNCH, "direct") != "jit"
    key = ("v1", bfp8, num_warps, direct)
    hit = launch.calls.get(key)
    if hit is None:
        k = launch.constexprs
        hit = _V2Call(grid=(launch.tables.groups, plan.num_tensors, 1),
                      rest=(launch.kv_stride, k["HEAD_DIM"], k["CTP"], k["SRC_KIND"], bfp8, k["VEC"]),
                      num_warps=num_warps, direct=direct)  # fmt: skip
        launch.calls[key] = hit
    return hit


def _launch_v2(call: _V2Call, args: tuple, device: torch.device, align: int, kernel: object = None) -> None:
    """Launch v2 (or ``kernel``: v1). The first launch of a configuration goes through Triton's JIT
    dispatcher; later ones call the compiled kernel's launcher directly with the same arguments
    (``$HAWK_TRANSFORM_LAUNCH`` = ``direct``, the default): ``args`` are all the kernel's parameters in
    signature order, constexprs included, as the dispatcher passes them. Everything the JIT
    specializes on is fixed per launch state except the send buffer's alignment, so compiled kernels
    are kept per ``align`` (its address mod 16)."""
    kernel = _rows_kernel if kernel is None else kernel
    compiled = call.compiled.get(align)
    if compiled is not None and _knobs.runtime.launch_enter_hook is None and _knobs.runtime.launch_exit_hook is None:
        g = call.grid
        try:
            compiled.run(g[0], g[1], g[2], _raw_stream(device.index), compiled.function, compiled.packed_metadata,
                         None, None, None, *args)
            return
        except Exception:  # noqa: BLE001 - a launcher this code does not know: use the dispatcher from now on
            call.compiled.clear()
            call.direct = False
    compiled = kernel[call.grid](*args, num_warps=call.num_warps)  # type: ignore[index]
    if (call.direct and device.type == "cuda" and getattr(compiled, "function", None) is not None
            and hasattr(compiled, "packed_metadata")):
        call.compiled[align] = compiled


def _raw_stream(index: int) -> int:
    """The current CUDA stream's handle on device ``index`` (what Triton's launcher takes)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(index)
    return torch.cuda.current_stream(index).cuda_stream


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
) -> torch.Tensor:
    """Write the plan's send buffer (1-D uint8, ``plan.total_bytes``) in one kernel launch.

    Same contract and bytes as :func:`hawk.transform.reference.transform_reference`, except that rows
    past the request are always +0 (the reference's multiply-by-0 can leave -0, or NaN from inf).
    ``kernel`` picks v1 or v2 (see the module docstring; default ``$HAWK_TRANSFORM_KERNEL`` or v2),
    ``tpp`` v2's tensors per program (default ``$HAWK_TRANSFORM_TPP`` or about 16 KiB of source).
    """
    ndtype = plan.dst.dtype
    if ndtype not in ("bf16", "bfp8_b"):
        raise ValueError(f"Triton transform supports NPU dtypes bf16 and bfp8_b, got {ndtype!r}")
    if len(caches) != plan.src.num_layers:
        raise ValueError(f"expected {plan.src.num_layers} layer tensors, got {len(caches)}")
    which = resolve_kernel(kernel, plan.src.head_dim, plan.dst.dtype)
    launch, used = _prepare(plan, caches)
    c0 = used[0]
    device = c0.device
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
    dst = out if out.numel() == total else out[:total]
    ptr = dst.data_ptr()
    if ptr % 2 and (not bfp8 or which == "v1"):
        # An odd-aligned buffer cannot take int16 stores: write aside, then copy.
        dst.copy_(transform_triton(caches, plan, None, num_warps, kernel, tpp))
        return out

    switch = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():  # launch on the caches' GPU
        if which == "v1":
            deltas, row_off, row_valid, page_a, page_b = launch.v1_tables()
            launch.order_after_uploads()
            call = _v1_call(launch, plan, bfp8, num_warps)
            src = c0.view(_SRC_BITS[c0.dtype])  # `used` stays alive until the launch is enqueued
            args = (src, deltas, row_off, row_valid, page_a, page_b, dst if bfp8 else dst.view(torch.int16), *call.rest)
            _launch_v2(call, args, device, ptr % 16, _transform_kernel)
        else:
            words = bfp8 and launch.words and which == "v2" and ptr % 2 == 0
            call = _v2_call(launch, plan, bfp8, words, num_warps, tpp, c0.element_size())
            meta = launch.meta
            launch.order_after_uploads()
            src = _word_view(c0) if words else c0.view(_SRC_BITS[c0.dtype])
            dst16 = dst.view(torch.int16) if ptr % 2 == 0 else dst  # (odd: only bfloat8_b bytes are stored)
            _launch_v2(call, (src, meta, dst, dst16, *call.rest), device, ptr % 16)
    return out
