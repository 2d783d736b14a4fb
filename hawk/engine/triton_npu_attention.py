"""Tile-native decode attention over the emulated NPU's KV pages (Triton kernels + launch wrappers).

Why: a Tenstorrent decode kernel reads K/V where they live -- 32x32 tiles of four 16x16 faces, in
interleaved (or block-cyclic) pages, bf16 or bfloat8_b -- and writes each new token's row in place.
Emulating that faithfully *and* fast means doing the same on the GPU: no untilized copy of the cache,
no re-encoding of whole tiles, faces reordered in registers, bfloat8_b exponents decoded in the kernel.

Everything about placement is a parameter (page strides, banks, shard size, bank and page strides in
memory), so another arch or page map needs no kernel change. ``hawk/layouts/tt.py`` stays the oracle
for every byte written here.

Metadata (one int32 row per new token, written by ``NpuTileAttention.begin``):
``[seq_len, row_loc, block_table[0..W)]`` where ``seq_len`` counts the tokens this query sees (0 for a
pad row) and ``row_loc = npu_block * block_size + row`` is where its K/V row goes (-1: write nothing).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

try:  # CI has no triton; the torch path in npu_attention.py covers it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - a broken install is as good as none
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

#: Metadata columns before the block table.
META_SEQ_LEN, META_ROW_LOC, META_BLOCKS = 0, 1, 2


@dataclass(frozen=True)
class TileGeometry:
    """Where a tile lives, as the kernels see it: all in units of ``memory``'s element type.

    ``memory`` is the whole emulated DRAM as one flat tensor (uint8 for bfloat8_b, bfloat16 for bf16
    tiles); tensor ``t`` of the cache starts at ``bases[t]``; page ``p`` of it sits at
    ``bases[t] + bank(p) * bank_stride + slot(p) * page_stride`` (block-cyclic map: ``num_banks``,
    ``shard_pages``); tile ``(block, head, row_tile, col_tile)`` is page ``block*s0 + head*s1 + row_tile*s2 + col_tile``.
    """

    memory: torch.Tensor
    bases: tuple[int, ...]
    bank_stride: int
    page_stride: int
    num_banks: int
    shard_pages: int
    s0: int
    s1: int
    s2: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    bfp8: bool

    @property
    def col_tiles(self) -> int:
        return self.head_dim // 32

    @property
    def row_tiles(self) -> int:
        return self.block_size // 32

    @property
    def separable(self) -> bool:
        """True when a tile's address is ``row part + column part``: the fast kernel's precondition.

        Tile ``(block, head, row_tile, ct)`` is page ``P0 + ct`` with ``P0`` a multiple of the column-tile
        count WT. Its offset splits as ``offset(P0) + offset(ct)`` when the WT pages never straddle a
        bank wrap: either they sit in one shard (``shard % WT == 0``) or they are whole shards on
        consecutive banks that do not wrap (``WT % shard == 0`` and ``WT | shard * banks``). Interleaved
        p150a (8 banks) and Wormhole (12) qualify; p100a (7 banks) does not and takes the generic kernel.
        """
        wt, sh, nb = self.col_tiles, self.shard_pages, self.num_banks
        if any(x % wt for x in (self.s0, self.s1, self.s2)):
            return False
        return sh % wt == 0 or (wt % sh == 0 and (sh * nb) % wt == 0)


def tile_geometry(kv) -> TileGeometry | None:
    """The kernels' view of ``kv`` (an NpuKVCacheMemory), or None when they cannot address it.

    None means: no triton, a dtype other than bf16/bfp8_b, a column-tile count that is not a power of
    two (Triton tensors are), tensors not sharing one storage and one stride pattern, or addresses not
    16-element aligned (the kernels promise 16-element alignment so that loads vectorise).
    """
    lay = kv.layout
    if not HAVE_TRITON or lay.dtype not in ("bf16", "bfp8_b"):
        return None
    wt = lay.col_tiles
    if wt & (wt - 1):
        return None
    views = [kv.pages(t) for t in range(lay.num_tensors)]
    v0 = views[0]
    storage = v0.untyped_storage()
    if any(v.untyped_storage().data_ptr() != storage.data_ptr() or v.stride() != v0.stride() for v in views):
        return None
    flat = torch.empty(0, dtype=torch.uint8, device=v0.device).set_(storage)
    elem = 2 if lay.dtype == "bf16" else 1
    bank_stride, page_stride, _ = v0.stride()
    offs = [v.storage_offset() for v in views]
    if any(x % (16 * elem) for x in (bank_stride, page_stride, *offs)) or flat.numel() % elem:
        return None
    memory = flat.view(torch.bfloat16) if elem == 2 else flat
    s = lay.tile_strides
    return TileGeometry(
        memory=memory,
        bases=tuple(o // elem for o in offs),
        bank_stride=bank_stride // elem,
        page_stride=page_stride // elem,
        num_banks=lay.page_map.num_banks,
        shard_pages=lay.page_map.shard_pages,
        s0=s[0],
        s1=s[1],
        s2=s[2],
        block_size=lay.block_size,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        bfp8=lay.dtype == "bfp8_b",
    )


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (its tl.dot mishandles bf16, so operands go as fp32 there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(rows: int, num_kv_heads: int, max_row_tiles: int, device: torch.device) -> int:
    """Split-K factor for a batch of ``rows``: a function of the batch shape only (fixed grids per B).

    Aim for ~2 programs per SM (measured on an H200 at b64: 1 split beat 2 by 7%, the reduce and
    the smaller per-program loops cost more than the extra parallelism gives); never more splits
    than row tiles a sequence can have; a power of two (the reduce loads all splits as one vector).
    """
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = _next_pow2(max(1, -(-2 * sms // max(1, rows * num_kv_heads))))
    cap = 1 << (max(1, max_row_tiles).bit_length() - 1)  # largest power of two <= max tiles
    return max(1, min(want, cap, 64))


if HAVE_TRITON:

    @triton.jit
    def _tile_offsets(pages, num_banks, shard_pages, bank_stride, page_stride):
        """Page indices -> element offsets of their first element (block-cyclic page map)."""
        bank = (pages // shard_pages) % num_banks
        slot = (pages // (shard_pages * num_banks)) * shard_pages + pages % shard_pages
        return bank.to(tl.int64) * bank_stride + slot.to(tl.int64) * page_stride

    @triton.jit
    def _load_row_tile(mem, base, offs, WT: tl.constexpr, BFP8: tl.constexpr, CDT: tl.constexpr):
        """The WT tiles at ``offs`` (one block, head, row tile) as ``[32 tokens, WT*32]`` rows in CDT.

        Each tile is read as one contiguous page; faces go from (col_tile, face_row, face_col, r, c)
        order to (face_row, r, col_tile, face_col, c) in registers.
        """
        start = tl.multiple_of(base + offs, 16)
        e = tl.arange(0, 1024)
        if BFP8:
            vals = tl.load(mem + start[:, None] + 64 + e[None, :])  # uint8 [WT, 1024]
            x = tl.arange(0, 64)
            exps = tl.load(mem + start[:, None] + x[None, :])  # [WT, 64]: one per face row
            # 2^(E-127) from its bit pattern (E=0 gives 0, as the codec packs it), then * 2^-6
            scale = (exps.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            v3 = tl.reshape(vals, (WT, 64, 16))
            mag = (v3 & 0x7F).to(tl.float32) * scale[:, :, None] * 0.015625
            tiles = tl.where((v3 & 0x80) != 0, -mag, mag).to(CDT)
        else:
            tiles = tl.load(mem + start[:, None] + e[None, :]).to(CDT)  # [WT, 1024]
        t5 = tl.reshape(tiles, (WT, 2, 2, 16, 16))
        return tl.reshape(tl.permute(t5, (1, 3, 0, 2, 4)), (32, WT * 32))

    @triton.jit
    def _attend_row_tile(
        qv, m, l_sum, acc, i, n, h, mrow, mem, k_base, v_base, qk_scale,
        num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        WT: tl.constexpr, RTPB: tl.constexpr, BFP8: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
    ):
        """Online-softmax update with row tile ``i`` (32 tokens) of this sequence's context."""
        blk = tl.load(mrow + 2 + i // RTPB)
        wt = tl.arange(0, WT)
        offs = _tile_offsets(blk * s0 + h * s1 + (i % RTPB) * s2 + wt, num_banks, shard_pages, bank_stride, page_stride)
        k = _load_row_tile(mem, k_base, offs, WT, BFP8, CDT)
        s = tl.dot(qv, tl.trans(k), input_precision=PREC) * qk_scale
        valid = i * 32 + tl.arange(0, 32) < n
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = _load_row_tile(mem, v_base, offs, WT, BFP8, CDT)
        v = tl.where(valid[:, None], v, 0.0)  # rows past the context may hold anything
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
        return m_new, l_sum, acc

    @triton.jit
    def _decode_attention_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, acc_ws, ml_ws,
        mem, k_base, v_base, meta, meta_s0, qk_scale,
        num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        G: tl.constexpr, BH: tl.constexpr, WT: tl.constexpr, RTPB: tl.constexpr,
        NSPLIT: tl.constexpr, BFP8: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """One (row, kv head, split): the G query heads of this KV head over 1/NSPLIT of the context."""
        D: tl.constexpr = WT * 32
        row = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        hq_total = tl.num_programs(1) * G
        mrow = meta + row.to(tl.int64) * meta_s0
        n = tl.load(mrow)
        n_tiles = (n + 31) // 32
        per = (n_tiles + NSPLIT - 1) // NSPLIT
        lo = sp * per
        hi = tl.minimum(lo + per, n_tiles)
        hh = tl.arange(0, BH)
        d = tl.arange(0, D)
        qh = h * G + hh
        hmask = hh < G
        qv = tl.load(q + row.to(tl.int64) * q_s0 + qh[:, None] * q_s1 + d[None, :], mask=hmask[:, None], other=0.0)
        qv = qv.to(CDT)
        m = tl.full([BH], -1.0e30, tl.float32)
        l_sum = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, D], tl.float32)
        if INTERP:  # the interpreter cannot use a loaded scalar as a range bound; the GPU needs `for` to pipeline
            i = lo
            while i < hi:
                m, l_sum, acc = _attend_row_tile(
                    qv, m, l_sum, acc, i, n, h, mrow, mem, k_base, v_base, qk_scale,
                    num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2, WT, RTPB, BFP8, CDT, PREC)
                i += 1
        else:
            for i in range(lo, hi):
                m, l_sum, acc = _attend_row_tile(
                    qv, m, l_sum, acc, i, n, h, mrow, mem, k_base, v_base, qk_scale,
                    num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2, WT, RTPB, BFP8, CDT, PREC)
        if NSPLIT == 1:
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            optr = out + row.to(tl.int64) * o_s0 + qh[:, None] * o_s1 + d[None, :]
            tl.store(optr, o.to(out.dtype.element_ty), mask=hmask[:, None])
        else:
            w = (row.to(tl.int64) * hq_total + qh) * NSPLIT + sp  # [BH]
            tl.store(acc_ws + w[:, None] * D + d[None, :], acc, mask=hmask[:, None])
            tl.store(ml_ws + w * 2, m, mask=hmask)
            tl.store(ml_ws + w * 2 + 1, l_sum, mask=hmask)

    @triton.jit
    def _reduce_splits_kernel(out, o_s0, o_s1, acc_ws, ml_ws, NSPLIT: tl.constexpr, D: tl.constexpr):
        """Merge the NSPLIT partial softmaxes of one (row, query head); an all-empty row gives 0."""
        row = tl.program_id(0)
        hq = tl.program_id(1)
        sp = tl.arange(0, NSPLIT)
        d = tl.arange(0, D)
        w = (row.to(tl.int64) * tl.num_programs(1) + hq) * NSPLIT + sp
        m = tl.load(ml_ws + w * 2)
        l_sum = tl.load(ml_ws + w * 2 + 1)
        mx = tl.max(m, 0)
        scale = tl.exp2(m - mx)
        tot = tl.sum(scale * l_sum, 0)
        acc = tl.load(acc_ws + w[:, None] * D + d[None, :])
        o = tl.sum(acc * scale[:, None], 0) / tl.where(tot > 0, tot, 1.0)
        tl.store(out + row.to(tl.int64) * o_s0 + hq * o_s1 + d, o.to(out.dtype.element_ty))

    # ---- the fast kernel: separable page maps, chunks of TOKN tokens, no register permute ----------

    @triton.jit
    def _page_offset_c(pages, bank_stride, page_stride, NB: tl.constexpr, SHARD: tl.constexpr):
        """``_tile_offsets`` with the bank count and shard size known at compile time (divisions become multiplies)."""
        bank = (pages // SHARD) % NB
        slot = (pages // (SHARD * NB)) * SHARD + pages % SHARD
        return bank.to(tl.int64) * bank_stride + slot.to(tl.int64) * page_stride

    @triton.jit
    def _column_offsets(bank_stride, page_stride, NJ: tl.constexpr, NB: tl.constexpr, SHARD: tl.constexpr):
        """Per 16-wide column group ``j = (col_tile, face_col)``: where its values and its exponents sit in a tile row.

        Computed once per program: with a separable map a tile's offset is ``offset(P0) + offset(col_tile)``.
        """
        j = tl.arange(0, NJ)
        ct = _page_offset_c(j // 2, bank_stride, page_stride, NB, SHARD)
        d = tl.arange(0, NJ * 16)
        dv = _page_offset_c(d // 32, bank_stride, page_stride, NB, SHARD) + ((d // 16) % 2) * 256 + d % 16
        dv = tl.max_contiguous(tl.multiple_of(dv, 16), 16)
        return dv, ct + (j % 2) * 16

    @triton.jit
    def _chunk_rows(mrow, c, n, h, s0, s1, s2, bank_stride, page_stride,
                    NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, TOKN: tl.constexpr):
        """Chunk ``c`` (TOKN tokens): each token's tile offset, face row (0/1), row in face, and validity.

        A chunk inside one NPU block needs one block-table load; a longer one gathers per token.
        """
        tok = tl.arange(0, TOKN)
        pos = c * TOKN + tok
        valid = pos < n
        if BS % TOKN == 0:
            blk = tl.load(mrow + 2 + (c * TOKN) // BS)
        else:
            blk = tl.load(mrow + 2 + pos // BS, mask=valid, other=0)
        page = blk * s0 + h * s1 + ((pos % BS) // 32) * s2
        r32 = tok % 32
        return _page_offset_c(page, bank_stride, page_stride, NB, SHARD), r32 // 16, r32 % 16, valid

    @triton.jit
    def _bfp8_bf16_asm(vals, scale):
        """Four value bytes per 32-bit lane -> two bf16x2 words: ``(sign << 15 | m7)`` is the bf16 subnormal
        ``m7 * 2^-133``; one ``mul.bf16x2`` by the face row's ``2^(E-64)`` makes it exact. 1.5 ops per value."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 m, s, a, b;
            and.b32 m, $2, 0x7F7F7F7F;
            and.b32 s, $2, 0x80808080;
            prmt.b32 a, m, s, 0x5140;
            prmt.b32 b, m, s, 0x7362;
            mul.rn.bf16x2 $0, a, $3;
            mul.rn.bf16x2 $1, b, $4;
            }""",
            constraints="=r,=r,r,r,r",
            args=[vals, scale],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )

    @triton.jit
    def _layout_anchor(x):
        """Identity on bf16 pairs that the compiler cannot see through (opaque asm).

        Why: without it the compiler moves the conversion to the token-major dot-operand layout in
        front of the decode, onto the raw bytes, and gathers them one byte at a time from shared
        memory; behind this anchor the decoded bf16 values take the ldmatrix.trans path instead.
        """
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _bfp8_decode(vals, exps, FAST: tl.constexpr, ASM: tl.constexpr, CDT: tl.constexpr):
        """Value bytes ``[T, D]`` and shared exponents ``[T, D/16]`` -> values in CDT.

        FAST (bf16 compute): the result is the value times 2^-64 (the caller undoes it in the softmax
        scale and the output). Byte ``s|m7`` as bf16 bits ``s<<15 | m7`` is exactly ``±m7·2^-133`` (a
        subnormal); times ``2^(E-64)`` (a normal bf16 built from its bits) it is ``±m7·2^(E-197)``, exact for
        exponents 64..191 (face rows whose largest |x| lies in [2^-63, 2^64); smaller rows lose bits
        below 2^-196 of their true scale, larger ones saturate). No int->float conversion, no fp32.
        Otherwise: exact fp32 ``±m7 · 2^(E-133)`` (E=0 gives 0, as the codec packs it), then CDT.
        """
        T: tl.constexpr = vals.shape[0]
        D: tl.constexpr = vals.shape[1]
        e = exps.to(tl.int32)
        if FAST:
            scale = ((tl.minimum(e, 191) + 63) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (T, D // 16, 16)), (T, D))
            if ASM:
                return _bfp8_bf16_asm(vals, scale)
            v = vals.to(tl.int32)
            den = (((v << 8) | v) & 0x807F).to(tl.int16).to(tl.bfloat16, bitcast=True)
            return den * scale
        scale = (e << 23).to(tl.float32, bitcast=True) * 0.015625
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (T, D // 16, 16)), (T, D))
        mag = (vals & 0x7F).to(tl.float32) * scale
        return tl.where((vals & 0x80) != 0, -mag, mag).to(CDT)

    @triton.jit
    def _load_chunk(
        mrow, c, n, h, mem, k_base, v_base, jv, je, s0, s1, s2, bank_stride, page_stride,
        NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, TOKN: tl.constexpr, BFP8: tl.constexpr,
    ):
        """Raw K and V of chunk ``c`` as ``[TOKN, WT*32]`` (token, column), plus
        their shared exponents ``[TOKN, 2*WT]`` for bfloat8_b (else dummies).

        A token's 16-wide face-row runs are contiguous (one 16-byte load for bfloat8_b, two for bf16);
        the (face, row) order of the tile is absorbed in the addresses, so nothing is permuted later.
        """
        base, fr, r, valid = _chunk_rows(mrow, c, n, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN)
        voff = base + fr * 512 + r * 16
        if BFP8:
            voff += 64
        vptr = tl.multiple_of(voff, 16)[:, None] + jv[None, :]  # [TOKN, D], runs of 16 contiguous
        kraw = tl.load(mem + k_base + vptr)
        vraw = tl.load(mem + v_base + vptr)
        if BFP8:
            eptr = (base + fr * 32 + r)[:, None] + je[None, :]
            kexp = tl.load(mem + k_base + eptr)
            vexp = tl.load(mem + v_base + eptr)
        else:
            kexp = valid
            vexp = valid
        return kraw, vraw, kexp, vexp

    @triton.jit
    def _attend_chunk(
        qv, m, l_sum, acc, c, n, kraw, vraw, kexp, vexp, qk_scale,
        TOKN: tl.constexpr, WT: tl.constexpr, BFP8: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
        CDT: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr,
    ):
        """Online-softmax update with chunk ``c`` (raw tiles from ``_load_chunk``).

        The decoded V goes through a size-1 reduction before the dot: a layout anchor that keeps the
        compiler from moving the dot-operand (token-major) conversion onto the raw bytes, which would
        turn 16-byte shared loads into byte gathers; bf16 values instead take the ldmatrix.trans path.
        MASKED (the last, partial chunk only): scores past the context are -inf, and bf16 V rows there
        are zeroed (they may hold NaN bit patterns; bfloat8_b decodes to finite values by construction).
        """
        D: tl.constexpr = WT * 32
        valid = c * TOKN + tl.arange(0, TOKN) < n
        if BFP8:
            k = _bfp8_decode(kraw, kexp, FAST, ASM, CDT)
        else:
            k = kraw.to(CDT)
        s = tl.dot(qv, tl.trans(k), input_precision=PREC) * qk_scale
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if BFP8:
            v = _bfp8_decode(vraw, vexp, FAST, ASM, CDT)
            if FAST:
                v = _layout_anchor(v)
        else:
            v = vraw.to(CDT)
            if MASKED:
                v = tl.where(valid[:, None], v, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
        return m_new, l_sum, acc

    @triton.jit
    def _decode_tiles_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, acc_ws, ml_ws,
        mem, k_base, v_base, meta, meta_s0, qk_scale,
        bank_stride, page_stride, s0, s1, s2,
        NB: tl.constexpr, SHARD: tl.constexpr, G: tl.constexpr, BH: tl.constexpr, WT: tl.constexpr,
        BS: tl.constexpr, TOKN: tl.constexpr, NSPLIT: tl.constexpr, BFP8: tl.constexpr, FAST: tl.constexpr,
        ASM: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, OUT_SCALE: tl.constexpr,
    ):
        """One (row, kv head, split) over 1/NSPLIT of the context's TOKN-token chunks (separable page maps).

        Chunk ``c+1`` is loaded into registers while chunk ``c`` is computed (an explicit one-deep
        prefetch: the compiler's shared-memory pipelining would pick byte-gathering layouts for the
        decode). Prefetch indices are clamped to a real chunk of this row, so nothing reads past its
        block table. Full chunks run unmasked; only the last, partial one pays for masks.
        ``OUT_SCALE`` undoes the 2^-64 of the FAST bfloat8_b decode (``qk_scale`` carries it for scores).
        """
        D: tl.constexpr = WT * 32
        row = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        hq_total = tl.num_programs(1) * G
        mrow = meta + row.to(tl.int64) * meta_s0
        n = tl.load(mrow)
        n_chunks = (n + TOKN - 1) // TOKN
        last = tl.maximum(n_chunks - 1, 0)
        per = (n_chunks + NSPLIT - 1) // NSPLIT
        lo = sp * per
        hi = tl.minimum(lo + per, n_chunks)
        full = tl.minimum(hi, n // TOKN)
        tail = tl.maximum(lo, full)
        hh = tl.arange(0, BH)
        d = tl.arange(0, D)
        qh = h * G + hh
        hmask = hh < G
        qv = tl.load(q + row.to(tl.int64) * q_s0 + qh[:, None] * q_s1 + d[None, :], mask=hmask[:, None], other=0.0)
        qv = qv.to(CDT)
        jv, je = _column_offsets(bank_stride, page_stride, 2 * WT, NB, SHARD)
        m = tl.full([BH], -1.0e30, tl.float32)
        l_sum = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, D], tl.float32)
        kr, vr, ke, ve = _load_chunk(mrow, tl.minimum(lo, last), n, h, mem, k_base, v_base, jv, je, s0, s1, s2,
                                     bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
        if INTERP:  # the interpreter cannot use a loaded scalar as a range bound
            c = lo
            while c < full:
                nk, nv, nke, nve = _load_chunk(mrow, tl.minimum(c + 1, last), n, h, mem, k_base, v_base, jv, je,
                                               s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
                m, l_sum, acc = _attend_chunk(qv, m, l_sum, acc, c, n, kr, vr, ke, ve, qk_scale,
                                              TOKN, WT, BFP8, FAST, ASM, CDT, PREC, False)
                kr, vr, ke, ve = nk, nv, nke, nve
                c += 1
            c = tail
            while c < hi:
                m, l_sum, acc = _attend_chunk(qv, m, l_sum, acc, c, n, kr, vr, ke, ve, qk_scale,
                                              TOKN, WT, BFP8, FAST, ASM, CDT, PREC, True)
                c += 1
        else:
            for c in range(lo, full):
                nk, nv, nke, nve = _load_chunk(mrow, tl.minimum(c + 1, last), n, h, mem, k_base, v_base, jv, je,
                                               s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
                m, l_sum, acc = _attend_chunk(qv, m, l_sum, acc, c, n, kr, vr, ke, ve, qk_scale,
                                              TOKN, WT, BFP8, FAST, ASM, CDT, PREC, False)
                kr, vr, ke, ve = nk, nv, nke, nve
            for c in range(tail, hi):
                m, l_sum, acc = _attend_chunk(qv, m, l_sum, acc, c, n, kr, vr, ke, ve, qk_scale,
                                              TOKN, WT, BFP8, FAST, ASM, CDT, PREC, True)
        acc = acc * OUT_SCALE
        if NSPLIT == 1:
            o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
            optr = out + row.to(tl.int64) * o_s0 + qh[:, None] * o_s1 + d[None, :]
            tl.store(optr, o.to(out.dtype.element_ty), mask=hmask[:, None])
        else:
            w = (row.to(tl.int64) * hq_total + qh) * NSPLIT + sp  # [BH]
            tl.store(acc_ws + w[:, None] * D + d[None, :], acc, mask=hmask[:, None])
            tl.store(ml_ws + w * 2, m, mask=hmask)
            tl.store(ml_ws + w * 2 + 1, l_sum, mask=hmask)

    @triton.jit
    def _pack_bfp8(x):
        """fp32 ``[WT, 2, 16]`` (16-value face rows) -> (shared exponents [WT, 2], value bytes), as tt.py packs."""
        bits = x.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        shared = tl.max(exp, 2)
        mant = (bits & 0x7FFFFF) | 0x800000
        shift = tl.minimum(17 + shared[:, :, None] - exp, 31)  # >= 25 already shifts everything out
        qv = mant >> shift
        rem = mant - (qv << shift)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((qv & 1) == 1))
        qv = tl.minimum(qv + up.to(tl.int32), 127)
        qv = tl.where(exp != 0, qv, 0)
        sign = tl.where(qv != 0, (bits >> 31) & 1, 0)
        return shared.to(tl.uint8), (qv | (sign << 7)).to(tl.uint8)

    @triton.jit
    def _bf16_rne(x):
        """fp32 -> bf16 rounding to nearest even, in integers: the interpreter's cast truncates."""
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _write_one(src, mem, base, offs, face, ri, dcol, ok, BFP8: tl.constexpr):
        """Store one head's row ``src + dcol`` into its WT tiles at ``offs`` (row ``ri`` of faces ``face``)."""
        x = tl.load(src + dcol)  # [WT, 2, 16]
        start = base + offs
        c = tl.arange(0, 16)
        if BFP8:
            exps, vals = _pack_bfp8(x.to(tl.float32))
            tl.store(mem + start[:, None] + face[None, :] * 16 + ri, exps, mask=ok)
            vptr = mem + start[:, None, None] + 64 + face[None, :, None] * 256 + ri * 16 + c[None, None, :]
            tl.store(vptr, vals, mask=ok)
        else:
            vptr = mem + start[:, None, None] + face[None, :, None] * 256 + ri * 16 + c[None, None, :]
            tl.store(vptr, _bf16_rne(x.to(tl.float32)), mask=ok)

    @triton.jit
    def _write_rows_kernel(
        k, k_s0, k_s1, v, v_s0, v_s1, mem, k_base, v_base, meta, meta_s0,
        num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        BS: tl.constexpr, WT: tl.constexpr, BFP8: tl.constexpr,
    ):
        """One (new row, kv head): put its K and V rows into their tiles in place; pad rows (loc < 0) write nothing."""
        row = tl.program_id(0)
        h = tl.program_id(1)
        loc = tl.load(meta + row.to(tl.int64) * meta_s0 + 1)
        ok = loc >= 0
        loc = tl.maximum(loc, 0)
        blk = loc // BS
        r = loc % BS
        rr = r % 32
        ri = rr % 16
        face = (rr // 16) * 2 + tl.arange(0, 2)  # the two faces this row crosses
        wt = tl.arange(0, WT)
        offs = _tile_offsets(blk * s0 + h * s1 + (r // 32) * s2 + wt, num_banks, shard_pages, bank_stride, page_stride)
        dcol = wt[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        _write_one(k + row.to(tl.int64) * k_s0 + h * k_s1, mem, k_base, offs, face, ri, dcol, ok, BFP8)
        _write_one(v + row.to(tl.int64) * v_s0 + h * v_s1, mem, v_base, offs, face, ri, dcol, ok, BFP8)


def _page_args(g: TileGeometry) -> tuple[int, ...]:
    return (g.num_banks, g.shard_pages, g.bank_stride, g.page_stride, g.s0, g.s1, g.s2)


def write_rows(g: TileGeometry, layer: int, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, rows: int) -> None:
    """Write rows ``k, v [rows, Hkv, D]`` of ``layer`` where ``meta[:, 1]`` says, in one launch."""
    grid = (rows, g.num_kv_heads)
    _write_rows_kernel[grid](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        g.memory, g.bases[2 * layer], g.bases[2 * layer + 1], meta, meta.stride(0),
        *_page_args(g), BS=g.block_size, WT=g.col_tiles, BFP8=g.bfp8,
    )


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the fast decode kernel: tokens per iteration, warps, pipeline stages, asm decode.

    ``num_stages`` 1: the kernel prefetches the next chunk into registers itself (see
    ``_decode_tiles_kernel``). ``asm``: the inline-PTX bfloat8_b decode (same bits, fewer ops, but it
    spills at 4 warps and measured 2.7x slower at b64 on an H200; kept for probes).
    """

    tokens: int = 64
    num_warps: int = 4
    num_stages: int = 1
    asm: bool = False


def decode_config(g: TileGeometry) -> DecodeConfig:
    """Default launch shape: a whole 64-token NPU block per iteration (one block-table load), 4 warps."""
    return DecodeConfig(tokens=64 if g.block_size % 64 == 0 else 32)


def decode_attention(
    g: TileGeometry,
    layer: int,
    q: torch.Tensor,
    meta: torch.Tensor,
    rows: int,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
    config: DecodeConfig | None = None,
    generic: bool = False,
) -> torch.Tensor:
    """``q [rows, Hq, D]`` over each row's tiled context -> ``[rows, Hq, D]`` in q's dtype (no host sync).

    ``workspace``: fp32 ``[rows*Hq*num_splits*D]`` and ``[rows*Hq*num_splits*2]`` for the partials
    (needed when ``num_splits > 1``). bfloat8_b on a separable page map takes the fast kernel
    (``config``, default :func:`decode_config`); bf16 takes it only when ``config`` is given, because
    on an H200 the per-row-tile kernel measured faster for bf16 (b64 ctx 1k: 100 vs 109 us per layer);
    ``generic=True`` forces the per-row-tile kernel.
    """
    hq, d = q.shape[1], q.shape[2]
    group = hq // g.num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    interp = interpreting()
    cdt = tl.float32 if (interp or q.dtype == torch.float32) else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    prec = "ieee" if cdt == tl.float32 else None
    acc_ws, ml_ws = workspace if workspace is not None else (out, out)
    qk_scale = (1.0 / math.sqrt(d)) * math.log2(math.e)
    grid = (rows, g.num_kv_heads, num_splits)
    if g.separable and not generic and (g.bfp8 or config is not None):
        cfg = config or decode_config(g)
        fast = g.bfp8 and cdt == tl.bfloat16
        bias = 2.0**64 if fast else 1.0
        _decode_tiles_kernel[grid](
            q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), acc_ws, ml_ws,
            g.memory, g.bases[2 * layer], g.bases[2 * layer + 1], meta, meta.stride(0), qk_scale * bias,
            g.bank_stride, g.page_stride, g.s0, g.s1, g.s2,
            NB=g.num_banks, SHARD=g.shard_pages, G=group, BH=max(16, _next_pow2(group)), WT=g.col_tiles,
            BS=g.block_size, TOKN=cfg.tokens, NSPLIT=num_splits, BFP8=g.bfp8, FAST=fast, ASM=cfg.asm and fast and not interp,
            CDT=cdt, PREC=prec, INTERP=interp, OUT_SCALE=bias,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        _decode_attention_kernel[grid](
            q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), acc_ws, ml_ws,
            g.memory, g.bases[2 * layer], g.bases[2 * layer + 1], meta, meta.stride(0), qk_scale,
            *_page_args(g),
            G=group, BH=max(16, _next_pow2(group)), WT=g.col_tiles, RTPB=g.row_tiles,
            NSPLIT=num_splits, BFP8=g.bfp8, CDT=cdt, PREC=prec, INTERP=interp,
            num_warps=4, num_stages=2,
        )
    if num_splits > 1:
        _reduce_splits_kernel[(rows, hq)](out, out.stride(0), out.stride(1), acc_ws, ml_ws, NSPLIT=num_splits, D=d, num_warps=4)
    return out
