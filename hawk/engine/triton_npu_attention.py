"""Tile-native decode attention over the emulated NPU's KV pages (Triton kernels + launch wrappers).

Why: a Tenstorrent decode kernel reads K/V where they live -- 32x32 tiles of four 16x16 faces, in
interleaved (or block-cyclic) pages, bf16 or bfloat8_b -- and writes each new token's row in place.
Emulating that faithfully *and* fast means doing the same on the GPU: no untilized copy of the cache,
no re-encoding of whole tiles, faces reordered in registers, bfloat8_b exponents decoded in the kernel.

Everything about placement is a parameter (page strides, banks, shard size, bank and page strides in
memory), so another arch or page map needs no kernel change. ``hawk/layouts/tt.py`` stays the oracle
for every byte written here.

Kernels: ``_decode_attention_kernel`` (whole row tiles, any page map), ``_decode_tiles_kernel`` (separable
page maps, bf16 and bfloat8_b "bytes"), ``_decode_bfp8_kernel`` (separable maps, bfloat8_b value bytes as
32-bit words: per-row-tile addressing and a four-values-per-word decode, ~0.5x the bytes kernel's
instructions per chunk in an offline sm_90 compile), ``_write_rows_kernel``. Which bfloat8_b kernel and
launch shape runs is a :class:`DecodeConfig`; named variants are in ``BFP8_VARIANTS``.

Metadata (one int32 row per new token, written by ``NpuTileAttention.begin``):
``[seq_len, row_loc, block_table[0..W)]`` where ``seq_len`` counts the tokens this query sees (0 for a
pad row) and ``row_loc = npu_block * block_size + row`` is where its K/V row goes (-1: write nothing).
"""

from __future__ import annotations

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

from hawk.engine import gluon_npu_attention as gk

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
    """True under TRITON_INTERPRET=1 (the shared steps then run their dots in fp32, as the paged kernels do)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_splits(rows: int, num_kv_heads: int, device: torch.device, g: TileGeometry | None = None,
                  config: DecodeConfig | None = None, head_dim: int = 0, group: int = 0) -> int:
    """Split-K factor for a batch of ``rows``: the paged decode's (``decode_num_splits``), by design,
    unless ``g`` and ``config`` (default :func:`default_config`) pick the one-warp register kernel
    (:func:`uses_register_kernel`), which fills the GPU with its own, smaller programs.

    Why the paged count otherwise: split boundaries fix the floating-point summation order, and the
    NPU decode must give the same bits as the paged decode (the colocated reference) for the same K/V.
    """
    from hawk.engine import triton_attention as ta

    sms = ta.decode_sm_count(device)
    if g is not None and uses_register_kernel(g, config, head_dim, group, device):
        return gk.num_splits(rows, num_kv_heads, sms, max_splits=(config or default_config(g)).max_splits)
    return ta.decode_num_splits(rows, num_kv_heads, sms)


if HAVE_TRITON:
    from hawk.engine.triton_attention import _decode_epilogue, _pv_step, _qk_step, _split_chunks

    #: ``2**64``: the fast bfloat8_b decode's values are the codec's times ``2**-64`` (see ``_bfp8_decode``).
    _FAST_BIAS = tl.constexpr(2.0**64)
    _DECODE_PTX = tl.constexpr(gk.DECODE_PTX)

    @triton.jit
    def _decode_program(q, q_s0, q_s1, meta, meta_s0, num_splits,
                        G: tl.constexpr, BH: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
        """The prologue every decode kernel here shares: this program's (row, kv head, split), its
        metadata row and context length ``n``, its split's tokens ``[lo, hi)`` (``tail``: start of the
        masked last chunk, ``_split_chunks``) and BN-token chunks (``cidx``: ``last``, the row's last
        chunk, which prefetches clamp to; the split's chunks ``[c_lo, c_tail)`` unmasked, ``[c_tail,
        c_hi)`` masked; chunk ``c`` = tokens ``[c*BN, (c+1)*BN)``), and its query heads' rows ``qv [BH,
        D]`` (BH >= G; rows past G are zeros, masked by ``hmask``). All G query heads of one KV head
        share a program, so K and V are read once per group (GQA)."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        mrow = meta + row * meta_s0
        n = tl.load(mrow)
        lo, tail, hi = _split_chunks(n, sp, num_splits, BN)
        cidx = (tl.maximum(tl.cdiv(n, BN) - 1, 0), lo // BN, tail // BN, tl.cdiv(hi, BN))
        hh = tl.arange(0, BH)
        d = tl.arange(0, D)
        qh = h * G + hh
        hmask = hh < G
        qv = tl.load(q + row * q_s0 + qh[:, None] * q_s1 + d[None, :], mask=hmask[:, None], other=0.0)
        return row, h, sp, mrow, n, lo, tail, hi, cidx, d, qh, hmask, qv

    @triton.jit
    def _online_init(BH: tl.constexpr, D: tl.constexpr):
        """Online-softmax state ``(max, sum, acc)`` before the first chunk (the paged decode's start values)."""
        return tl.full([BH], -1.0e30, tl.float32), tl.zeros([BH], tl.float32), tl.zeros([BH, D], tl.float32)

    @triton.jit
    def _decode_finish(acc, m, l_sum, out, part_out, part_lse, row, qh, sp, num_splits, o_s0, o_s1, d, hmask,
                       G: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):
        """The paged decode's epilogue (``_decode_epilogue``) for this program's heads."""
        hq_total = tl.num_programs(1) * G
        _decode_epilogue(acc, m, l_sum, out, part_out, part_lse, row, qh, hq_total, sp, num_splits,
                         o_s0, o_s1, d, hmask, d < D, D, DIRECT)

    @triton.jit
    def _tile_offsets(pages, num_banks, shard_pages, bank_stride, page_stride):
        """Page indices -> element offsets of their first element (block-cyclic page map)."""
        bank = (pages // shard_pages) % num_banks
        slot = (pages // (shard_pages * num_banks)) * shard_pages + pages % shard_pages
        return bank.to(tl.int64) * bank_stride + slot.to(tl.int64) * page_stride

    @triton.jit
    def _load_row_tile(mem, base, offs, WT: tl.constexpr, BFP8: tl.constexpr, KDT: tl.constexpr):
        """The WT tiles at ``offs`` (one block, head, row tile) as ``[32 tokens, WT*32]`` rows in KDT.

        Each tile is read as one contiguous page; faces go from (col_tile, face_row, face_col, r, c)
        order to (face_row, r, col_tile, face_col, c) in registers. bfloat8_b decodes exactly (fp32
        ``±m7 * 2^(E-133)``, representable in bf16), so KDT holds the codec's values.
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
            tiles = tl.where((v3 & 0x80) != 0, -mag, mag).to(KDT)
        else:
            tiles = tl.load(mem + start[:, None] + e[None, :]).to(KDT)  # [WT, 1024]
        t5 = tl.reshape(tiles, (WT, 2, 2, 16, 16))
        return tl.reshape(tl.permute(t5, (1, 3, 0, 2, 4)), (32, WT * 32))

    @triton.jit
    def _row_tile(
        mem, base, mrow, rt, n, h, num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        WT: tl.constexpr, RTPB: tl.constexpr, BFP8: tl.constexpr, KDT: tl.constexpr,
    ):
        """Row tile ``rt`` (tokens ``32*rt ..``) of this row and head as ``[32, D]``; a tile past the
        context reads block 0 instead of a block-table entry that may not exist (masked later)."""
        blk = tl.load(mrow + 2 + rt // RTPB, mask=rt * 32 < n, other=0)
        wt = tl.arange(0, WT)
        offs = _tile_offsets(blk * s0 + h * s1 + (rt % RTPB) * s2 + wt, num_banks, shard_pages, bank_stride, page_stride)
        return _load_row_tile(mem, base, offs, WT, BFP8, KDT)

    @triton.jit
    def _tile_chunk(
        mem, base, mrow, start, n, h, num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        WT: tl.constexpr, RTPB: tl.constexpr, BN: tl.constexpr, BFP8: tl.constexpr, KDT: tl.constexpr,
    ):
        """Tokens ``[start, start + BN)`` as ``[BN, D]`` from whole-tile loads: the decode's chunk in
        token space, whatever the tile size (BN 64: two row tiles stacked; 16, the interpreter's: the
        right half of one row tile; 32: one)."""
        D: tl.constexpr = WT * 32
        x = _row_tile(mem, base, mrow, start // 32, n, h, num_banks, shard_pages, bank_stride, page_stride,
                      s0, s1, s2, WT, RTPB, BFP8, KDT)
        if BN == 64:
            y = _row_tile(mem, base, mrow, start // 32 + 1, n, h, num_banks, shard_pages, bank_stride, page_stride,
                          s0, s1, s2, WT, RTPB, BFP8, KDT)
            x = tl.reshape(tl.permute(tl.join(x, y), (2, 0, 1)), (64, D))
        elif BN == 16:
            lo_half, hi_half = tl.split(tl.permute(tl.reshape(x, (2, 16, D)), (1, 2, 0)))
            x = tl.where((start // 16) % 2 == 0, lo_half, hi_half)
        return x

    @triton.jit
    def _generic_chunk(
        qv, m, l_sum, acc, start, hi, n, h, mrow, mem, k_base, v_base, qk_scale,
        num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        WT: tl.constexpr, RTPB: tl.constexpr, BN: tl.constexpr, BFP8: tl.constexpr, KDT: tl.constexpr,
        MASKED: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
    ):
        """One BN-token chunk through the paged decode's own steps (``_qk_step``, ``_pv_step``)."""
        valid = start + tl.arange(0, BN) < hi
        k = _tile_chunk(mem, k_base, mrow, start, n, h, num_banks, shard_pages, bank_stride, page_stride,
                        s0, s1, s2, WT, RTPB, BN, BFP8, KDT)
        p, alpha, m, l_sum = _qk_step(qv, k, valid[None, :], m, l_sum, qk_scale, MASKED, PREC, INTERP)
        v = _tile_chunk(mem, v_base, mrow, start, n, h, num_banks, shard_pages, bank_stride, page_stride,
                        s0, s1, s2, WT, RTPB, BN, BFP8, KDT)
        acc = _pv_step(acc, p, alpha, v, valid, qv, MASKED, 1.0, PREC, INTERP)
        return m, l_sum, acc

    @triton.jit
    def _decode_attention_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse,
        mem, k_base, v_base, meta, meta_s0, qk_scale, num_splits,
        num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
        G: tl.constexpr, BH: tl.constexpr, WT: tl.constexpr, RTPB: tl.constexpr, BN: tl.constexpr,
        BFP8: tl.constexpr, KDT: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
    ):
        """One (row, kv head, split), any page map: the paged decode kernel's splits, chunks, steps
        and epilogue, with whole-tile loads. Only the addressing differs, so the bits do not."""
        D: tl.constexpr = WT * 32
        row, h, sp, mrow, n, lo, tail, hi, _, d, qh, hmask, qv = _decode_program(q, q_s0, q_s1, meta, meta_s0,
                                                                                 num_splits, G, BH, D, BN)
        m, l_sum, acc = _online_init(BH, D)
        if INTERP:  # the interpreter cannot use a loaded scalar as a range bound; the GPU needs `for` to pipeline
            start = lo
            while start < tail:
                m, l_sum, acc = _generic_chunk(qv, m, l_sum, acc, start, hi, n, h, mrow, mem, k_base, v_base, qk_scale,
                                               num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
                                               WT, RTPB, BN, BFP8, KDT, False, PREC, INTERP)
                start += BN
            start = tail
            while start < hi:
                m, l_sum, acc = _generic_chunk(qv, m, l_sum, acc, start, hi, n, h, mrow, mem, k_base, v_base, qk_scale,
                                               num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
                                               WT, RTPB, BN, BFP8, KDT, True, PREC, INTERP)
                start += BN
        else:
            for start in range(lo, tail, BN):
                m, l_sum, acc = _generic_chunk(qv, m, l_sum, acc, start, hi, n, h, mrow, mem, k_base, v_base, qk_scale,
                                               num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
                                               WT, RTPB, BN, BFP8, KDT, False, PREC, INTERP)
            for start in range(tail, hi, BN):
                m, l_sum, acc = _generic_chunk(qv, m, l_sum, acc, start, hi, n, h, mrow, mem, k_base, v_base, qk_scale,
                                               num_banks, shard_pages, bank_stride, page_stride, s0, s1, s2,
                                               WT, RTPB, BN, BFP8, KDT, True, PREC, INTERP)
        _decode_finish(acc, m, l_sum, out, part_out, part_lse, row, qh, sp, num_splits, o_s0, o_s1, d, hmask,
                       G, D, DIRECT)

    # ---- the fast kernel: separable page maps, no register permute ----------------------------

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
        r32 = pos % 32
        return _page_offset_c(page, bank_stride, page_stride, NB, SHARD), r32 // 16, r32 % 16, valid

    @triton.jit
    def _bfp8_bf16_asm(vals, scale):
        """Four value bytes per 32-bit lane -> two bf16x2 words: ``(sign << 15 | m7)`` is the bf16 subnormal
        ``m7 * 2^-133``; one ``mul.bf16x2`` by the face row's ``2^(E-64)`` makes it exact. 1.5 ops per value."""
        return tl.inline_asm_elementwise(
            asm=_DECODE_PTX,
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
    def _bfp8_decode(vals, exps, FAST: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr):
        """Value bytes ``[T, D]`` and shared exponents ``[T, D/16]`` -> values in KDT.

        FAST (bf16 queries): the result is the codec's value times 2^-64, exactly. Byte ``s|m7`` as bf16
        bits ``s<<15 | m7`` is exactly ``±m7·2^-133`` (a subnormal); times ``2^(E-64)`` (a normal bf16 built
        from its bits) it is ``±m7·2^(E-197)``, exact for exponents 64..191 (face rows whose largest |x|
        lies in [2^-63, 2^64); smaller rows lose bits, larger ones saturate). No int->float conversion,
        no fp32. The caller puts the 2^64 back on the other dot operands (q, then p: ``_pv_step``'s
        P_SCALE), so every product, hence every dot, is bit-identical to the paged decode's.
        Otherwise: exact fp32 ``±m7 · 2^(E-133)`` (E=0 gives 0, as the codec packs it), then KDT
        (exact for bf16 and fp32: 7 significant bits).
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
        return tl.where((vals & 0x80) != 0, -mag, mag).to(KDT)

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
    def _tiles_chunk(
        qv, m, l_sum, acc, c, hi, kraw, vraw, kexp, vexp, qk_scale,
        TOKN: tl.constexpr, BFP8: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr, KDT: tl.constexpr,
        PREC: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr,
    ):
        """Chunk ``c`` (raw tiles from ``_load_chunk``) through the paged decode's own steps.

        bf16 tiles go in as loaded; bfloat8_b is decoded in registers first (FAST: scaled by 2^-64,
        undone by ``qv`` and P_SCALE, see ``_bfp8_decode``). The decoded V goes through a size-1
        reduction before the dot on the GPU: a layout anchor that keeps the compiler from moving the
        dot-operand (token-major) conversion onto the raw bytes, which would turn 16-byte shared loads
        into byte gathers. MASKED (the split's last chunk): scores past ``hi`` are masked and V rows
        there zeroed (bf16 rows past the context may hold NaN bit patterns).
        """
        valid = c * TOKN + tl.arange(0, TOKN) < hi
        if BFP8:
            k = _bfp8_decode(kraw, kexp, FAST, ASM, KDT)
        else:
            k = kraw
        p, alpha, m, l_sum = _qk_step(qv, k, valid[None, :], m, l_sum, qk_scale, MASKED, PREC, INTERP)
        if BFP8:
            v = _bfp8_decode(vraw, vexp, FAST, ASM, KDT)
            if FAST:
                if not INTERP:
                    v = _layout_anchor(v)
        else:
            v = vraw
        if FAST:
            acc = _pv_step(acc, p, alpha, v, valid, qv, MASKED, _FAST_BIAS, PREC, INTERP)
        else:
            acc = _pv_step(acc, p, alpha, v, valid, qv, MASKED, 1.0, PREC, INTERP)
        return m, l_sum, acc

    @triton.jit
    def _decode_tiles_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse,
        mem, k_base, v_base, meta, meta_s0, qk_scale, num_splits,
        bank_stride, page_stride, s0, s1, s2,
        NB: tl.constexpr, SHARD: tl.constexpr, G: tl.constexpr, BH: tl.constexpr, WT: tl.constexpr,
        BS: tl.constexpr, TOKN: tl.constexpr, BFP8: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
        KDT: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
    ):
        """One (row, kv head, split), separable page maps: the paged decode's splits, TOKN-token chunks
        (TOKN = its BLOCK_N), steps and epilogue; only the addressing (and the bfloat8_b decode) differ.

        Chunk ``c+1`` is loaded into registers while chunk ``c`` is computed (an explicit one-deep
        prefetch: the compiler's shared-memory pipelining would pick byte-gathering layouts for the
        decode). Prefetch indices are clamped to a real chunk of this row, so nothing reads past its
        block table. Each split's chunks run unmasked but its last, as in the paged kernel.
        """
        D: tl.constexpr = WT * 32
        row, h, sp, mrow, n, lo, tail, hi, cidx, d, qh, hmask, qv = _decode_program(q, q_s0, q_s1, meta, meta_s0,
                                                                                    num_splits, G, BH, D, TOKN)
        last, c_lo, c_tail, c_hi = cidx
        if FAST:  # exact: K comes scaled by 2^-64, so q . k is the same product
            qv = (qv.to(tl.float32) * _FAST_BIAS).to(qv.dtype)
        jv, je = _column_offsets(bank_stride, page_stride, 2 * WT, NB, SHARD)
        m, l_sum, acc = _online_init(BH, D)
        kr, vr, ke, ve = _load_chunk(mrow, tl.minimum(c_lo, last), n, h, mem, k_base, v_base, jv, je, s0, s1, s2,
                                     bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
        if INTERP:  # the interpreter cannot use a loaded scalar as a range bound
            c = c_lo
            while c < c_tail:
                nk, nv, nke, nve = _load_chunk(mrow, tl.minimum(c + 1, last), n, h, mem, k_base, v_base, jv, je,
                                               s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
                m, l_sum, acc = _tiles_chunk(qv, m, l_sum, acc, c, hi, kr, vr, ke, ve, qk_scale,
                                             TOKN, BFP8, FAST, ASM, KDT, PREC, INTERP, False)
                kr, vr, ke, ve = nk, nv, nke, nve
                c += 1
            c = c_tail
            while c < c_hi:
                m, l_sum, acc = _tiles_chunk(qv, m, l_sum, acc, c, hi, kr, vr, ke, ve, qk_scale,
                                             TOKN, BFP8, FAST, ASM, KDT, PREC, INTERP, True)
                c += 1
        else:
            for c in range(c_lo, c_tail):
                nk, nv, nke, nve = _load_chunk(mrow, tl.minimum(c + 1, last), n, h, mem, k_base, v_base, jv, je,
                                               s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, BFP8)
                m, l_sum, acc = _tiles_chunk(qv, m, l_sum, acc, c, hi, kr, vr, ke, ve, qk_scale,
                                             TOKN, BFP8, FAST, ASM, KDT, PREC, INTERP, False)
                kr, vr, ke, ve = nk, nv, nke, nve
            for c in range(c_tail, c_hi):
                m, l_sum, acc = _tiles_chunk(qv, m, l_sum, acc, c, hi, kr, vr, ke, ve, qk_scale,
                                             TOKN, BFP8, FAST, ASM, KDT, PREC, INTERP, True)
        _decode_finish(acc, m, l_sum, out, part_out, part_lse, row, qh, sp, num_splits, o_s0, o_s1, d, hmask,
                       G, D, DIRECT)

    # ---- the bfloat8_b word kernel: value bytes as 32-bit words, decoded four at a time --------

    @triton.jit
    def _rowtile_offset(mrow, pos, n, h, s0, s1, s2, bank_stride, page_stride,
                        NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr):
        """Byte offset of the row tile (column tile 0) holding token ``pos`` of this row and head.

        A scalar per row tile: a chunk's per-token addresses are one of these plus constants, so the
        address arithmetic is per chunk, not per token. A position past the context reads block 0 (a
        real block; its tokens are masked later) instead of a block-table entry that may not exist.
        """
        blk = tl.load(mrow + 2 + pos // BS, mask=pos < n, other=0)
        page = blk * s0 + h * s1 + ((pos % BS) // 32) * s2
        return _page_offset_c(page, bank_stride, page_stride, NB, SHARD)

    @triton.jit
    def _word_columns(bank_stride, page_stride, NJ: tl.constexpr, NB: tl.constexpr, SHARD: tl.constexpr):
        """Per 32-bit word ``i`` of a token's row (values ``4i .. 4i+3``): its word offset in a tile row;
        per 16-wide group ``j = (col_tile, face_col)``: its exponent's byte offset. Once per program."""
        i = tl.arange(0, NJ * 4)
        j = i // 4
        jw = _page_offset_c(j // 2, bank_stride, page_stride, NB, SHARD) // 4 + (j % 2) * 64 + i % 4
        jw = tl.max_contiguous(tl.multiple_of(jw, 4), 4)
        jj = tl.arange(0, NJ)
        je = _page_offset_c(jj // 2, bank_stride, page_stride, NB, SHARD) + (jj % 2) * 16
        return jw, je

    @triton.jit
    def _words_chunk(
        mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je, s0, s1, s2, bank_stride, page_stride,
        NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, TOKN: tl.constexpr,
    ):
        """Chunk ``c``'s K and V value bytes as int32 words ``[TOKN, D/4]`` (four values of one 16-wide
        group each, column order; 16-byte loads) and their shared exponents ``[TOKN, D/16]``.

        Words, not bytes: the prefetched chunk then lives in 32 registers per thread instead of 128, and
        the decode works on four values per instruction. ``kw_ptr``/``vw_ptr`` are the K/V tensors'
        bases as int32 pointers, ``ke_ptr``/``ve_ptr`` as byte pointers.
        """
        t = tl.arange(0, TOKN)
        c0 = c * TOKN
        if TOKN >= 32:
            loc = t
        else:
            loc = c0 % 32 + t
        toff = _rowtile_offset(mrow, c0, n, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS)
        toff = tl.zeros([TOKN], tl.int64) + toff
        for i in tl.static_range(1, TOKN // 32):
            oi = _rowtile_offset(mrow, c0 + 32 * i, n, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS)
            toff = tl.where(t >= 32 * i, oi, toff)
        fr = (loc % 32) // 16
        r = loc % 16
        wrow = tl.multiple_of(toff // 4 + 16 + fr * 128 + r * 4, 4)  # 64-byte exponent header, then faces
        wptr = wrow[:, None] + jw[None, :]
        kw = tl.load(kw_ptr + wptr)
        vw = tl.load(vw_ptr + wptr)
        eptr = (toff + fr * 32 + r)[:, None] + je[None, :]
        ke = tl.load(ke_ptr + eptr)
        ve = tl.load(ve_ptr + eptr)
        return kw, vw, ke, ve

    @triton.jit
    def _words_chunk_tok(
        mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je, s0, s1, s2, bank_stride, page_stride,
        NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, TOKN: tl.constexpr, NJ: tl.constexpr,
    ):
        """``_words_chunk``'s words and exponents (same values for every token before ``n``), from loads
        the compiler's software pipeliner can issue a chunk or two ahead (``num_stages`` > 1): every
        load is a tensor of >= 4-byte elements or 16-byte runs, none a scalar or a lone byte.

        A row tile's block id is a one-element tensor load (a scalar load is never pipelined), and the
        shared exponents are whole 16-byte runs of their tile's header (one face's 16 face rows = 16
        consecutive tokens), ``[TOKN/16, NJ, 16]``, put in ``[TOKN, NJ]`` order in registers.
        ``_words_chunk`` loads a scalar block id per row tile and one exponent byte per token and group;
        neither goes through ``cp.async``, so (in an offline sm_90 compile) every chunk of its loop
        waits on global loads; here none does (3 stages: the block ids run two chunks ahead of the
        words that need them), at ~20% more instructions per chunk. Positions past ``n`` read block 0
        (a real block; masked later).
        """
        pos = c * TOKN + tl.arange(0, TOKN)
        one = tl.zeros([1], tl.int32)
        p0 = c * TOKN + one
        toff = _page_offset_c(tl.load(mrow + 2 + p0 // BS, mask=p0 < n, other=0) * s0 + h * s1 + ((p0 % BS) // 32) * s2,
                              bank_stride, page_stride, NB, SHARD) + tl.zeros([TOKN], tl.int64)
        for i in tl.static_range(1, TOKN // 32):
            pi = p0 + 32 * i
            oi = _page_offset_c(tl.load(mrow + 2 + pi // BS, mask=pi < n, other=0) * s0 + h * s1 + ((pi % BS) // 32) * s2,
                                bank_stride, page_stride, NB, SHARD)
            toff = tl.where(pos >= c * TOKN + 32 * i, oi, toff)
        wrow = tl.multiple_of(toff // 4 + 16 + ((pos % 32) // 16) * 128 + (pos % 16) * 4, 4)
        wptr = wrow[:, None] + jw[None, :]
        kw = tl.load(kw_ptr + wptr)
        vw = tl.load(vw_ptr + wptr)
        bpos = c * TOKN + 16 * tl.arange(0, TOKN // 16)  # first token of each 16-token face-row run
        bblk = tl.load(mrow + 2 + bpos // BS, mask=bpos < n, other=0)
        boff = _page_offset_c(bblk * s0 + h * s1 + ((bpos % BS) // 32) * s2, bank_stride, page_stride, NB, SHARD)
        boff = tl.multiple_of(boff + ((bpos % 32) // 16) * 32, 16)  # the run's face row, at its face column 0
        eptr = (boff[:, None] + tl.multiple_of(je, 16)[None, :])[:, :, None] + tl.arange(0, 16)[None, None, :]
        ke = tl.reshape(tl.permute(tl.load(ke_ptr + eptr), (0, 2, 1)), (TOKN, NJ))
        ve = tl.reshape(tl.permute(tl.load(ve_ptr + eptr), (0, 2, 1)), (TOKN, NJ))
        return kw, vw, ke, ve

    @triton.jit
    def _words_load(
        mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je, s0, s1, s2, bank_stride, page_stride,
        NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, TOKN: tl.constexpr, NJ: tl.constexpr,
        TOKLOAD: tl.constexpr,
    ):
        """Chunk ``c``'s words and exponents: ``_words_chunk_tok`` (TOKLOAD) or ``_words_chunk``."""
        if TOKLOAD:
            return _words_chunk_tok(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je, s0, s1, s2,
                                    bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ)
        else:
            return _words_chunk(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je, s0, s1, s2,
                                bank_stride, page_stride, NB, SHARD, BS, TOKN)

    @triton.jit
    def _load_row(src, WT: tl.constexpr):
        """A new K or V row (one kv head; ``src``: its first value) as ``[WT, 2, 16]`` (col tile, face col, value)."""
        dcol = tl.arange(0, WT)[:, None, None] * 32 + tl.arange(0, 2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        return tl.load(src + dcol)

    @triton.jit
    def _new_row(x, WT: tl.constexpr):
        """A new K or V row (``_load_row``, any float dtype) as the row write packs it (``_pack_bfp8``:
        exponents ``[WT, 2]``, value bytes ``[WT, 2, 16]``) and as the word kernel loads it: words
        ``[8*WT]`` int32 (four values each, column order) and exponents ``[2*WT]``."""
        exps, vals = _pack_bfp8(x.to(tl.float32))
        b = tl.reshape(vals.to(tl.int32), (WT * 8, 4))
        words = tl.sum(b << (8 * tl.arange(0, 4))[None, :], 1)  # disjoint bits: the sum is the bytes' OR
        return exps, vals, words, tl.reshape(exps, (2 * WT,))

    @triton.jit
    def _with_new_row(kw, vw, ke, ve, c, n, nkw, nvw, nke, nve, TOKN: tl.constexpr):
        """Chunk ``c`` with the new token (position ``n - 1``) taken from registers (``_new_row``), not
        from the cache: the fused kernel writes that row in the same launch, so its bytes there may be
        the old ones. The values are the very bytes the write stores, so nothing else changes."""
        is_new = (c * TOKN + tl.arange(0, TOKN) == n - 1)[:, None]
        return (tl.where(is_new, nkw[None, :], kw), tl.where(is_new, nvw[None, :], vw),
                tl.where(is_new, nke[None, :], ke), tl.where(is_new, nve[None, :], ve))

    @triton.jit
    def _row_place(loc, h, s0, s1, s2, bank_stride, page_stride,
                   NB: tl.constexpr, SHARD: tl.constexpr, BS: tl.constexpr, WT: tl.constexpr):
        """Where row ``loc`` (``npu_block * BS + row``, >= 0) of kv head ``h`` goes: its WT tiles'
        offsets, the two faces the row crosses, and its row in them (``_write_rows_kernel``'s addresses)."""
        blk = loc // BS
        r = loc % BS
        rr = r % 32
        face = (rr // 16) * 2 + tl.arange(0, 2)
        offs = _page_offset_c(blk * s0 + h * s1 + (r // 32) * s2 + tl.arange(0, WT), bank_stride, page_stride, NB, SHARD)
        return offs, face, rr % 16

    @triton.jit
    def _bfp8_words_asm(w, s2):
        """Word of four value bytes -> two bf16x2 words: ``(sign << 15 | m7)`` per byte is the bf16
        subnormal ``m7 * 2^-133``; one ``mul.bf16x2`` by the group's ``2^(E-64)`` (``s2``, both halves)
        makes it exact. Two LOP3, two PRMT, two HMUL2 per four values."""
        return tl.inline_asm_elementwise(
            asm=_DECODE_PTX,
            constraints="=r,=r,r,r,r",
            args=[w, s2, s2],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _width_barrier(x):
        """Identity on bf16 pairs, marked impure so the compiler's search for "the width this dot operand
        was loaded with" stops here: it would find the 8-bit exponents and pick a dot-operand layout for
        8-bit data (kWidth 4), which reads the decoded bf16 back from shared memory with narrow loads and
        register shuffles instead of ldmatrix."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)

    @triton.jit
    def _bf16_pairs(lo, hi):
        """Two int32 tensors of bf16 pairs (``lo``: values 0, 1 of a word; ``hi``: 2, 3) -> bf16 ``[T, 4W]``
        in value order (register moves only: the halves of a 32-bit word are its two bf16)."""
        x = tl.interleave(lo, hi)
        return tl.interleave(x.to(tl.int16).to(tl.bfloat16, bitcast=True),
                             (x >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))

    @triton.jit
    def _bfp8_words_fast(w, e, ASM: tl.constexpr):
        """Words ``[T, W]`` and exponents ``[T, W/4]`` -> bf16 ``[T, 4W]``: the codec's values times 2^-64,
        exactly (as ``_bfp8_decode``'s FAST path, for exponents 64..191). ASM: the PTX of
        ``_bfp8_words_asm``; else the same bits from integer ops the compiler schedules."""
        T: tl.constexpr = w.shape[0]
        W: tl.constexpr = w.shape[1]
        sc = (tl.minimum(e.to(tl.int32), 191) + 63) << 7  # bf16 bits of 2^(E-64)
        if ASM:
            s2 = sc | (sc << 16)
            s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (T, W // 4, 4)), (T, W))
            lo, hi = _bfp8_words_asm(w, s2)
            return _width_barrier(_bf16_pairs(lo, hi))
        lo = (w & 0x7F) | ((w & 0x7F80) << 8) | ((w & 0x8000) << 16)
        hi = ((w >> 16) & 0x7F) | ((w >> 8) & 0x7F8000) | (w & -2147483648)
        scale = sc.to(tl.int16).to(tl.bfloat16, bitcast=True)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (T, W // 4, 16)), (T, 4 * W))
        return _width_barrier(_bf16_pairs(lo, hi) * scale)

    @triton.jit
    def _bfp8_words_exact(w, e, KDT: tl.constexpr):
        """Words ``[T, W]`` and exponents ``[T, W/4]`` -> the codec's values ``±m7 * 2^(E-133)`` in KDT,
        through fp32 (the interpreter's path, and non-bf16 queries')."""
        T: tl.constexpr = w.shape[0]
        W: tl.constexpr = w.shape[1]
        b = tl.interleave(tl.interleave(w & 0xFF, (w >> 16) & 0xFF), tl.interleave((w >> 8) & 0xFF, (w >> 24) & 0xFF))
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 0.015625
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (T, W // 4, 16)), (T, 4 * W))
        mag = (b & 0x7F).to(tl.float32) * scale
        return tl.where((b & 0x80) != 0, -mag, mag).to(KDT)

    @triton.jit
    def _words_step(
        qv, m, l_sum, acc, c, hi, kw, vw, ke, ve, qk_scale,
        TOKN: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr, ANCHOR: tl.constexpr, KDT: tl.constexpr,
        VMASK: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, MASKED: tl.constexpr,
    ):
        """Chunk ``c`` (words from ``_words_chunk``) through the paged decode's own steps, as
        ``_tiles_chunk`` does for bytes (FAST values are scaled by 2^-64, undone on q and p).

        MASKED masks the scores past ``hi``; their weights are then exactly 0. V rows there are zeroed
        only with VMASK: decoded bfloat8_b values are finite in bf16 and fp32 (not always in fp16), and
        ``0 * finite`` is a zero, so skipping the select changes no sum (at most the sign of a zero).
        """
        valid = c * TOKN + tl.arange(0, TOKN) < hi
        if FAST:
            k = _bfp8_words_fast(kw, ke, ASM)
        else:
            k = _bfp8_words_exact(kw, ke, KDT)
        p, alpha, m, l_sum = _qk_step(qv, k, valid[None, :], m, l_sum, qk_scale, MASKED, PREC, INTERP)
        if FAST:
            v = _bfp8_words_fast(vw, ve, ASM)
            if ANCHOR:
                if not INTERP:
                    v = _layout_anchor(v)
            acc = _pv_step(acc, p, alpha, v, valid, qv, MASKED and VMASK, _FAST_BIAS, PREC, INTERP)
        else:
            v = _bfp8_words_exact(vw, ve, KDT)
            acc = _pv_step(acc, p, alpha, v, valid, qv, MASKED and VMASK, 1.0, PREC, INTERP)
        return m, l_sum, acc

    @triton.jit
    def _decode_bfp8_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse,
        mem, k_base, v_base, meta, meta_s0, qk_scale, num_splits,
        bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1,
        NB: tl.constexpr, SHARD: tl.constexpr, G: tl.constexpr, BH: tl.constexpr, WT: tl.constexpr,
        BS: tl.constexpr, TOKN: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr, ANCHOR: tl.constexpr,
        PREFETCH: tl.constexpr, KDT: tl.constexpr, VMASK: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr,
        INTERP: tl.constexpr, TOKLOAD: tl.constexpr, FUSED: tl.constexpr,
    ):
        """bfloat8_b, separable page maps: ``_decode_tiles_kernel``'s splits, chunks, steps and epilogue,
        with value bytes loaded and decoded as 32-bit words and per-row-tile (not per-token) address
        arithmetic. Same chunks and steps, so with TOKN = the paged decode's BLOCK_N and 4 warps it gives
        the same bits as the paged decode of the decoded values.

        PREFETCH: chunk ``c+1`` is loaded into registers while chunk ``c`` is computed (as
        ``_decode_tiles_kernel``); else each chunk is loaded in its own iteration and ``num_stages`` > 1
        lets the compiler pipeline the loads through shared memory (words keep those loads 16 bytes wide).
        TOKLOAD: chunks load through ``_words_chunk_tok`` (every load pipelinable), else ``_words_chunk``.

        FUSED (decode batches: one new token per sequence): this launch also writes each row's new K/V
        (``k_new``, ``v_new [rows, Hkv, D]``, where ``meta[:, 1]`` says), which a separate
        ``_write_rows_kernel`` launch does otherwise. The program whose split holds the new token
        (position ``n - 1``, always in its masked last chunk) attends it from registers, packed as the
        write packs it (``_new_row``, ``_with_new_row``), and stores it after its own reads: no program
        reads those bytes from the cache, so no ordering between programs is needed, and the output and
        the cache bytes are the two-launch path's, bit for bit."""
        D: tl.constexpr = WT * 32
        NJ: tl.constexpr = 2 * WT
        row, h, sp, mrow, n, lo, tail, hi, cidx, d, qh, hmask, qv = _decode_program(q, q_s0, q_s1, meta, meta_s0,
                                                                                    num_splits, G, BH, D, TOKN)
        last, c_lo, c_tail, c_hi = cidx
        if FAST:  # exact: K comes scaled by 2^-64, so q . k is the same product
            qv = (qv.to(tl.float32) * _FAST_BIAS).to(qv.dtype)
        jw, je = _word_columns(bank_stride, page_stride, NJ, NB, SHARD)
        ke_ptr = mem + k_base
        ve_ptr = mem + v_base
        kw_ptr = ke_ptr.to(tl.pointer_type(tl.int32))
        vw_ptr = ve_ptr.to(tl.pointer_type(tl.int32))
        m, l_sum, acc = _online_init(BH, D)
        if FUSED:  # loaded now, packed after the unmasked chunks (one value per thread is live across them)
            krow = _load_row(k_new + row * kn_s0 + h * kn_s1, WT)
            vrow = _load_row(v_new + row * vn_s0 + h * vn_s1, WT)
        if PREFETCH:
            kw, vw, ke, ve = _words_load(mrow, tl.minimum(c_lo, last), n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr,
                                         jw, je, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ, TOKLOAD)
            if INTERP:  # the interpreter cannot use a loaded scalar as a range bound
                c = c_lo
                while c < c_tail:
                    nkw, nvw, nke, nve = _words_load(mrow, tl.minimum(c + 1, last), n, h, kw_ptr, vw_ptr, ke_ptr,
                                                     ve_ptr, jw, je, s0, s1, s2, bank_stride, page_stride,
                                                     NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                    m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kw, vw, ke, ve, qk_scale,
                                                TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, False)
                    kw, vw, ke, ve = nkw, nvw, nke, nve
                    c += 1
            else:
                for c in range(c_lo, c_tail):
                    nkw, nvw, nke, nve = _words_load(mrow, tl.minimum(c + 1, last), n, h, kw_ptr, vw_ptr, ke_ptr,
                                                     ve_ptr, jw, je, s0, s1, s2, bank_stride, page_stride,
                                                     NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                    m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kw, vw, ke, ve, qk_scale,
                                                TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, False)
                    kw, vw, ke, ve = nkw, nvw, nke, nve
        else:  # every chunk index here is <= last: no clamping
            if INTERP:
                c = c_lo
                while c < c_tail:
                    kw, vw, ke, ve = _words_load(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je,
                                                 s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                    m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kw, vw, ke, ve, qk_scale,
                                                TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, False)
                    c += 1
            else:
                for c in range(c_lo, c_tail):
                    kw, vw, ke, ve = _words_load(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je,
                                                 s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                    m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kw, vw, ke, ve, qk_scale,
                                                TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, False)
        # the split's masked last chunk (at most one)
        if FUSED:
            kx, k8, nkw, nke = _new_row(krow, WT)
            vx, v8, nvw, nve = _new_row(vrow, WT)
        if INTERP:
            c = c_tail
            while c < c_hi:
                if not PREFETCH:
                    kw, vw, ke, ve = _words_load(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je,
                                                 s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                kc, vc, kec, vec = kw, vw, ke, ve
                if FUSED:
                    kc, vc, kec, vec = _with_new_row(kw, vw, ke, ve, c, n, nkw, nvw, nke, nve, TOKN)
                m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kc, vc, kec, vec, qk_scale,
                                            TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, True)
                c += 1
        else:
            for c in range(c_tail, c_hi):
                if not PREFETCH:
                    kw, vw, ke, ve = _words_load(mrow, c, n, h, kw_ptr, vw_ptr, ke_ptr, ve_ptr, jw, je,
                                                 s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, TOKN, NJ, TOKLOAD)
                kc, vc, kec, vec = kw, vw, ke, ve
                if FUSED:
                    kc, vc, kec, vec = _with_new_row(kw, vw, ke, ve, c, n, nkw, nvw, nke, nve, TOKN)
                m, l_sum, acc = _words_step(qv, m, l_sum, acc, c, hi, kc, vc, kec, vec, qk_scale,
                                            TOKN, FAST, ASM, ANCHOR, KDT, VMASK, PREC, INTERP, True)
        _decode_finish(acc, m, l_sum, out, part_out, part_lse, row, qh, sp, num_splits, o_s0, o_s1, d, hmask,
                       G, D, DIRECT)
        if FUSED:  # after this program's reads of the row's tiles; pad rows (loc < 0, n = 0) write nothing
            loc = tl.load(mrow + 1)
            ok = (lo <= n - 1) & (n - 1 < hi) & (loc >= 0)
            offs, face, ri = _row_place(tl.maximum(loc, 0), h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, WT)
            _store_bfp8_row(mem, k_base + offs, face, ri, kx, k8, ok)
            _store_bfp8_row(mem, v_base + offs, face, ri, vx, v8, ok)

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
    def _store_bfp8_row(mem, start, face, ri, exps, vals, ok):
        """Store a packed bfloat8_b row (``_pack_bfp8``) at row ``ri`` of faces ``face`` of the WT tiles
        at ``mem + start``: its shared exponents and its value bytes, nothing else."""
        c = tl.arange(0, 16)
        tl.store(mem + start[:, None] + face[None, :] * 16 + ri, exps, mask=ok)
        vptr = mem + start[:, None, None] + 64 + face[None, :, None] * 256 + ri * 16 + c[None, None, :]
        tl.store(vptr, vals, mask=ok)

    @triton.jit
    def _write_one(src, mem, base, offs, face, ri, dcol, ok, BFP8: tl.constexpr):
        """Store one head's row ``src + dcol`` into its WT tiles at ``offs`` (row ``ri`` of faces ``face``)."""
        x = tl.load(src + dcol)  # [WT, 2, 16]
        start = base + offs
        c = tl.arange(0, 16)
        if BFP8:
            exps, vals = _pack_bfp8(x.to(tl.float32))
            _store_bfp8_row(mem, start, face, ri, exps, vals, ok)
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
    """Launch shape of the fast decode kernel: warps, pipeline stages, asm decode, bfloat8_b kernel.

    The chunk size is the paged decode's ``decode_block_n`` (equal chunks are part of giving equal
    bits) unless ``tokens`` overrides it (word kernel only; probes). ``num_warps`` other than the paged
    decode's 4 changes how the score sums are reduced across warps, so it breaks bitwise equality with
    the paged decode (probes only). ``num_stages`` 1: the kernel prefetches the next chunk into
    registers itself (see ``_decode_tiles_kernel``). ``asm``: the byte kernel's inline-PTX bfloat8_b
    decode (same bits, fewer ops, but it spilled at 4 warps and measured 2.7x slower at b64 on an H200;
    kept for probes).

    ``bfp8`` picks the bfloat8_b kernel (bf16 tiles ignore it and every field below): ``"bytes"``,
    ``_decode_tiles_kernel`` (value bytes, per-token addresses); ``"words"``, ``_decode_bfp8_kernel``
    (value bytes as 32-bit words, per-row-tile addresses, PTX decode four values at a time);
    ``"words-int"``, the same kernel decoding with integer ops instead of PTX; ``"regs"``, the one-warp
    Gluon kernel with every operand in registers (``gluon_npu_attention``; ``tokens`` per iteration 16
    or 32, by batch when unset; its own splits; sm_90, head_dim 128 and bf16 queries, else the
    bit-keeping word kernel runs). ``prefetch`` (word and register kernels): next chunk into registers
    (else, word kernel, ``num_stages`` > 1 pipelines through shared memory).
    ``maxnreg``: a per-thread register cap (more programs per SM; may spill). ``token_loads`` (word
    kernel): block ids as tensor loads and exponents as 16-byte header runs (``_words_chunk_tok``), so
    that with ``num_stages`` > 1 every load of a chunk is pipelined (the row-tile loads issue a scalar
    block-id load and byte-wide exponent loads in the loop, which the pipeliner leaves synchronous).
    ``fused_write`` (word kernel, decode batches): the decode launch also writes the new K/V rows
    (no separate ``write_rows`` launch; see ``_decode_bfp8_kernel``). ``max_splits`` (register kernel):
    a cap on its splits per row (fewer partials to merge where a row's programs are few). ``early``
    (register kernel): the first chunk's loads go out first (split ``s`` takes chunks ``s, s + S, ...``,
    so its first block-id load need not wait for the sequence length; the new row is packed after).
    ``merge_splits`` (register kernel): with 2 to this many splits the last split of each (row, KV head)
    merges them in the decode launch (needs the caller's ``counters``), no reduce launch after it; the
    merge is one warp's serial work, so it pays only where the splits are few (0: never). ``new_row_program``
    (register kernel, with ``fused_write``): from this many splits up (0: never) the new row gets one of
    them, a program of its own, instead of the split holding it packing it on its chain (where splits are
    many, each is short and that chain is the kernel's time). ``fused_rope`` (register kernel, with
    ``fused_write``): the decode launch also rotates q and the new k (RoPE), so the layer runs no RoPE
    kernel (:func:`fuses_rope`; the layer passes them un-rotated with the tables). All of these keep the
    paged decode's bits except ``tokens`` and ``num_warps`` (and the register kernel keeps none anyway).
    """

    num_warps: int = 4
    num_stages: int = 1
    asm: bool = False
    bfp8: str = "bytes"
    prefetch: bool = True
    tokens: int | None = None
    maxnreg: int | None = None
    token_loads: bool = False
    fused_write: bool = False
    max_splits: int = 32
    early: bool = False
    merge_splits: int = 0
    new_row_program: int = 0
    fused_rope: bool = False

    @property
    def keeps_paged_bits(self) -> bool:
        """True when this config gives the paged decode's bits (its chunks and warp count)."""
        return self.tokens is None and self.num_warps == 4


#: Named bfloat8_b decode variants (for probes, tests and ``HAWK_NPU_BFP8_KERNEL``). "b" in the comment:
#: bitwise equal to the paged decode of the decoded values (same chunks, warps and steps). Programs per
#: SM are for the 8B shape on an H200 (registers from an offline sm_90 compile: words 199, pipe2 159).
BFP8_VARIANTS: dict[str, DecodeConfig] = {
    "bytes": DecodeConfig(),  # b; the kernel before the word kernel
    "words": DecodeConfig(bfp8="words"),  # b
    "words-r168": DecodeConfig(bfp8="words", maxnreg=168),  # b; 3 programs per SM
    "words-r128": DecodeConfig(bfp8="words", maxnreg=128),  # b; 4 programs per SM, some spills
    "words-int": DecodeConfig(bfp8="words-int"),  # b; no PTX decode
    "words-pipe2": DecodeConfig(bfp8="words", prefetch=False, num_stages=2),  # b; 3 programs per SM
    "words-pipe2-r128": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, maxnreg=128),  # b; 4 per SM
    "words-pipe3-r128": DecodeConfig(bfp8="words", prefetch=False, num_stages=3, maxnreg=128),  # b; 4 per SM
    "words-w8": DecodeConfig(bfp8="words", num_warps=8),  # not bitwise: 8 warps
    "words-t128w8": DecodeConfig(bfp8="words", tokens=128, num_warps=8),  # not bitwise: 128-token chunks
    # issue 7 (offline sm_90 compile: 128 registers, no spill in the chunk loops). "-fw": the row write
    # in the decode launch, one launch fewer per layer (batch 1: write + decode + merge -> decode +
    # merge; batch 64: write + decode -> decode).
    "words-pipe2-r128-fw": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, maxnreg=128, fused_write=True),  # b
    # "tok": block ids and exponents loaded so the pipeliner takes them too (``_words_chunk_tok``): the
    # default's loop waits on a global load (exponent bytes, block id) every chunk; with 3 stages no
    # chunk waits on one (12 barriers per chunk instead of 14, ~20% more instructions); with 2 the
    # block-id load still does, but the exponents no longer (10 barriers per chunk).
    "tok-pipe3-r128-fw": DecodeConfig(bfp8="words", prefetch=False, num_stages=3, maxnreg=128, token_loads=True,
                                      fused_write=True),  # b; 4 per SM (40 KB shared memory)
    "tok-pipe2-r128-fw": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, maxnreg=128, token_loads=True,
                                      fused_write=True),  # b; 4 per SM
    # Probes of other launch shapes (not the paged decode's bits; bfloat8_b values need not keep them). One
    # H200, batch 64 x 1k (benchmarks/bfp8_kernel_probe.py): paged 89.5-90.2 us, the default 100.4-102.2,
    # w2-t64 96.4-97.3, w2-t32 104.9-105.5, w1-t16 123.5-124.4, w4-t32 136; at batch 1 none beat the default.
    "tok-w1-t16": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, token_loads=True, fused_write=True,
                               num_warps=1, tokens=16),
    "tok-w2-t32": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, token_loads=True, fused_write=True,
                               num_warps=2, tokens=32),
    "tok-w2-t64": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, token_loads=True, fused_write=True,
                               num_warps=2),
    "tok-w4-t32": DecodeConfig(bfp8="words", prefetch=False, num_stages=2, token_loads=True, fused_write=True,
                               tokens=32, maxnreg=128),
    # The register kernel (gluon_npu_attention): no shared memory, one warp per split, the next chunk's
    # loads issued before this one is computed; "-fw": the new rows packed and written in the decode
    # launch, else by write_rows first; "-tN": N tokens per iteration.
    "regs-t32": DecodeConfig(bfp8="regs", num_warps=1, tokens=32),
    # One H200, write + attention (+ merge) at context 1k, batch 1 / 8 / 64 (us; paged bf16 10.8 / 21.9 /
    # 88.9): regs-t32-fw 11.95 / 20.4 / 67.0, regs-t16-fw 12.1 / 19.1 / 59.7; a 168-register cap on t32
    # (13.1 / 21.2 / 61.9) and t32 without the prefetch (14.5 / 20.3 / 64.0, an earlier call) were worse.
    "regs-t32-fw": DecodeConfig(bfp8="regs", num_warps=1, tokens=32, fused_write=True),
    "regs-t16-fw": DecodeConfig(bfp8="regs", num_warps=1, tokens=16, fused_write=True),
    "regs-fw": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True),  # 32 or 16 tokens by batch (gk.auto_tokens)
    # at most 16 / 8 splits per row (batch 1, 1k: 64 / 128 tokens a split, against 32). Fewer partials
    # did not pay: 8B step / paged at batch 1, 1k on one H200 (three processes, 2026-12-01, raw/
    # engine_h200_splits_s11/): regs-fw 0.999, -s16 1.014, -s8 1.027 (batch 64: 0.872, 0.869, 0.869).
    "regs-fw-s16": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, max_splits=16),
    "regs-fw-s8": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, max_splits=8),
    # the first chunk's loads first: chunks dealt to splits round-robin (a split's first block id is
    # loaded beside the sequence length), the new row packed while they are in flight. One H200, 8B
    # shape, context 1k (2026-12-02, raw/engine_h200_s12/): write + attention + merge against paged bf16
    # (`bfp8_kernel_probe.py --flush-mb 256`) 0.969 / 0.811 / 0.648 at batch 1 / 8 / 64 (regs-fw 1.042 /
    # 0.807 / 0.647); the batch-1 8B step (`decode_step_probe.py`, 300 rounds) 0.987 x paged (regs-fw 0.999).
    "regs-fw-early": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True),
    # and the splits merged in the same launch by the last to finish: one launch per layer. One H200,
    # context 1k (2026-12-02, raw/engine_h200_s12/, probe as above): -m merges always, 1.050 / 0.913 /
    # 0.605 at batch 1 / 8 / 64 (32 / 17 / 3 splits; regs-fw-early 0.955 / 0.799 / 0.651 in that call),
    # 8B step at batch 64 0.848 x paged (regs-fw-early 0.868); -m4 merges where there are at most 4.
    "regs-fw-early-m": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True, merge_splits=64),
    "regs-fw-early-m4": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True, merge_splits=4),
    # 16 tokens per iteration and up to 64 splits: at batch 1 / 1k each program one 16-token chunk, a
    # shorter chain than a 32-token one (offline sm_90: 1984 SASS instructions against 2592,
    # benchmarks/regs_kernel_sass_probe.py), 64 partials to merge against 32. It lost (one H200, 2026-12-02,
    # raw/engine_h200_s17/call0_t16_*): write + attention + merge 12.34 us against 10.45 at batch 1, and in
    # the 8B step its kernel 226 us per step against 198, the reduce 115 against 71.
    "regs-fw-early-t16s64": DecodeConfig(bfp8="regs", num_warps=1, tokens=16, fused_write=True, early=True,
                                         max_splits=64, merge_splits=4),
    # from 8 splits up the new row in a program of its own, one of the splits; "-rope": q and the new k
    # rotated in the launch, no RoPE kernel before it. Offline sm_90 at batch 1 (`benchmarks/
    # regs_kernel_sass_probe.py --program kernel|split|new-row [--rope]`): 2592 SASS instructions when the
    # split holding the row packs it (2864 with -rope); a split program 1848 (2008), the row's 680 (816).
    # One H200, 8B step at 1k against paged bf16 (`decode_step_probe.py`, two builds each, 2026-12-02,
    # raw/engine_h200_s17/call2_*): batch 1 m4 0.9937 / 1.0045, -rope 0.9974 / 0.9968, -nr 0.9968 / 0.9948,
    # -nr-rope 0.9926 / 0.9849; batch 64 0.845, 0.831, 0.845, 0.832 (-nr changes nothing there: 3 splits).
    "regs-fw-early-m4-nr": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True, merge_splits=4,
                                        new_row_program=8),
    "regs-fw-early-m4-rope": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True, merge_splits=4,
                                          fused_rope=True),
    "regs-fw-early-m4-nr-rope": DecodeConfig(bfp8="regs", num_warps=1, fused_write=True, early=True, merge_splits=4,
                                             new_row_program=8, fused_rope=True),
}
#: The fastest bfloat8_b variant that keeps the paged decode's bits (`benchmarks/bfp8_kernel_probe.py
#: --flush-mb 256` on an H200, 2026-11-30: write + attention vs paged bf16 at context 1k, 0.90x at batch 1,
#: 1.15x at batch 64; in the 8B step 1.023x / 1.014x, benchmarks/results/raw/engine_h200_tokpipe2fw.json).
#: What runs where the register kernel cannot (CPU interpreter, other GPUs or shapes), and the reference
#: the bit-keeping variants are tested against.
PAGED_BITS_BFP8_VARIANT = "tok-pipe2-r128-fw"
#: The variant bfloat8_b tiles get when no config is given (``HAWK_NPU_BFP8_KERNEL`` overrides it): the
#: register kernel, its chunk size by batch, the row write fused. One H200, context 1k, write + attention
#: + merge against the paged bf16 decode (`benchmarks/bfp8_kernel_probe.py --flush-mb 256`, 2026-12-01,
#: benchmarks/results/raw/bfp8_kernel_probe_h200_regs_call4.json): 0.66x at batch 64 (16 tokens), 0.89x
#: at batch 8 (16), 1.07x at batch 1 (32) (the bit-keeping word kernel: 1.14x, 1.32x, 1.15x). Since
#: 2026-12-02 its early-loads form, merging in the launch where the splits are few (``regs-fw-early-m4``,
#: numbers above); now also rotating q and k (no RoPE kernel) and, from 8 splits
#: up, packing the new row in a program of its own (``regs-fw-early-m4-nr-rope``; one H200, 8B step at
#: context 1k against paged bf16, `benchmarks/decode_step_probe.py`, two builds of each point: batch 1
#: 0.9926 / 0.9849 (regs-fw-early-m4 0.9937 / 1.0045), batch 64 0.832 (0.845); raw/engine_h200_s17/).
DEFAULT_BFP8_VARIANT = "regs-fw-early-m4-nr-rope"


def fuses_row_write(g: TileGeometry, config: DecodeConfig | None, generic: bool = False) -> bool:
    """True when :func:`decode_attention` with ``config`` (None: :func:`default_config`) writes the
    new rows itself for a decode batch, so the caller must not launch :func:`write_rows` first."""
    if not (g.bfp8 and g.separable) or generic:
        return False
    cfg = config or default_config(g)
    return cfg.fused_write and cfg.bfp8 in ("words", "words-int", "regs")


def fuses_rope(g: TileGeometry, config: DecodeConfig | None, generic: bool, head_dim: int, group: int,
               device: torch.device) -> bool:
    """True when a decode batch's :func:`decode_attention` with ``config`` takes q and the new k
    un-rotated (``rope=``): the register kernel writing the rows, ``DecodeConfig.fused_rope``."""
    if not fuses_row_write(g, config, generic) or not uses_register_kernel(g, config, head_dim, group, device):
        return False
    return (config or default_config(g)).fused_rope


def uses_register_kernel(g: TileGeometry, config: DecodeConfig | None, head_dim: int, group: int,
                         device: torch.device) -> bool:
    """True when :func:`decode_attention` runs ``config`` (None: :func:`default_config`) on the register
    kernel: bfloat8_b on a separable map, the ``"regs"`` config, and a device and shape it supports."""
    if not (g.bfp8 and g.separable) or interpreting():
        return False
    cfg = config or default_config(g)
    return cfg.bfp8 == "regs" and gk.supported(head_dim, group, device)


def default_config(g: TileGeometry) -> DecodeConfig:
    """The fast kernel's config for ``g`` when the caller gives none: ``DecodeConfig()`` for bf16 tiles;
    for bfloat8_b, ``BFP8_VARIANTS[$HAWK_NPU_BFP8_KERNEL or DEFAULT_BFP8_VARIANT]``."""
    if not g.bfp8:
        return DecodeConfig()
    name = os.environ.get("HAWK_NPU_BFP8_KERNEL") or DEFAULT_BFP8_VARIANT
    try:
        return BFP8_VARIANTS[name]
    except KeyError:
        raise ValueError(f"HAWK_NPU_BFP8_KERNEL={name!r}: expected one of {sorted(BFP8_VARIANTS)}") from None


def decode_attention(
    g: TileGeometry,
    layer: int,
    q: torch.Tensor,
    meta: torch.Tensor,
    rows: int,
    num_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor] | None,
    config: DecodeConfig | None = None,
    generic: bool = False,
    block_n: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q [rows, Hq, D]`` over each row's tiled context -> ``[rows, Hq, D]`` in q's dtype (no host sync).

    Bit for bit what ``paged_decode`` gives for the same K/V values (bf16, or bfloat8_b's decoded
    values), q, split count and ``block_n`` (default: the paged decode's, ``decode_block_n``).
    ``partials``: fp32 ``[rows*Hq*num_splits*D]`` and ``[rows*Hq*num_splits]`` (the paged decode's
    split-partial layout; needed when ``num_splits > 1``), merged by the paged decode's reduce.
    A separable page map takes the chunked kernel (``config``, default :func:`default_config`; bfloat8_b
    may take the word kernel, see :class:`DecodeConfig`), bf16 and bfloat8_b alike: on an H200 the whole-tile kernel's bf16 output was not bitwise equal to the
    paged decode (its ``tl.join`` of two row tiles reorders the chunk), which broke token equality with
    the colocated reference. ``generic=True`` forces the whole-tile kernel (non-separable maps use it).

    ``new_kv``: the new rows' ``k, v [rows, Hkv, D]`` (last dim contiguous) when the kernel writes them
    itself (:func:`fuses_row_write` must be True; only for decode batches: each row's new token is its
    sequence's only one); else the caller has written them (:func:`write_rows`).

    ``counters``: int32 zeros, ``>= rows * Hkv``, left zeroed by every launch (keep one buffer per
    captured graph); used where the config merges in the decode launch (``DecodeConfig.merge``).

    ``rope``: ``positions [rows]`` and the ``cos, sin_signed [len, D]`` tables when q and ``new_kv``'s k
    come un-rotated (:func:`fuses_rope` must be True).
    """
    from hawk.engine import triton_attention as ta

    hq, d = q.shape[1], q.shape[2]
    group = hq // g.num_kv_heads
    block_n = block_n or ta.decode_block_n(q.device)
    if block_n not in (16, 32, 64):
        raise ValueError(f"block_n must be 16, 32 or 64, got {block_n}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    interp = interpreting()
    kdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[q.dtype]
    prec = ta._dot_precision(q.dtype)
    part_out, part_lse = partials if partials is not None else (out, out)
    qk_scale = ta.decode_qk_scale(d)
    grid = (rows, g.num_kv_heads, num_splits)
    common = (q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), part_out, part_lse,
              g.memory, g.bases[2 * layer], g.bases[2 * layer + 1], meta, meta.stride(0), qk_scale, num_splits)
    bh = max(16, _next_pow2(group))
    if not generic and q.dtype == torch.bfloat16 and uses_register_kernel(g, config, d, group, q.device):
        cfg = config or default_config(g)
        if new_kv is not None and not cfg.fused_write:
            raise ValueError("new_kv given, but this config does not write the rows in the decode launch")
        tokens = cfg.tokens or gk.auto_tokens(rows, g.num_kv_heads)
        if rope is not None and not (cfg.fused_rope and new_kv is not None):
            raise ValueError("rope given, but this config does not rotate in the decode launch (fuses_rope)")
        newp = new_kv is not None and 0 < cfg.new_row_program <= num_splits
        return gk.decode(g, layer, q, meta, rows, num_splits, partials, tokens, cfg.prefetch, new_kv, cfg.maxnreg,
                         cfg.early, counters if 1 < num_splits <= cfg.merge_splits else None, newp, rope)
    if rope is not None:
        raise ValueError("rope is for the register kernel (DecodeConfig.fused_rope)")
    if g.separable and not generic:
        cfg = config or default_config(g)
        if cfg.bfp8 == "regs":  # not runnable here (device, shape or dtype): the word kernel, fused alike
            cfg = BFP8_VARIANTS[PAGED_BITS_BFP8_VARIANT if cfg.fused_write else "words-pipe2-r128"]
        # FAST is GPU-only: the interpreter's int16 -> bf16 bitcast gives wrong values (its bf16 is
        # emulated), so CPU tests run the exact fp32 decode; the gpu tests check FAST bitwise.
        fast = g.bfp8 and q.dtype == torch.bfloat16 and not interp
        if g.bfp8 and cfg.bfp8 != "bytes":
            if cfg.bfp8 not in ("words", "words-int"):
                raise ValueError(f"DecodeConfig.bfp8 must be bytes, words or words-int, got {cfg.bfp8!r}")
            tokn = cfg.tokens or block_n
            if tokn not in (16, 32, 64, 128):
                raise ValueError(f"DecodeConfig.tokens must be 16, 32, 64 or 128, got {tokn}")
            extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interp else {}
            if new_kv is not None:
                if not fuses_row_write(g, cfg, generic):
                    raise ValueError("new_kv given, but this config does not write the rows in the decode launch")
                kn, vn = new_kv
                if kn.shape != (q.shape[0], g.num_kv_heads, d) or vn.shape != kn.shape or kn.stride(2) != 1 or vn.stride(2) != 1:
                    raise ValueError(f"new_kv must be two [{q.shape[0]}, {g.num_kv_heads}, {d}] tensors, last dim contiguous")
                new_args = (kn, kn.stride(0), kn.stride(1), vn, vn.stride(0), vn.stride(1))
            else:  # never read: any pointer, zero strides
                new_args = (q, 0, 0, q, 0, 0)
            _decode_bfp8_kernel[grid](
                *common, g.bank_stride, g.page_stride, g.s0, g.s1, g.s2, *new_args,
                NB=g.num_banks, SHARD=g.shard_pages, G=group, BH=bh, WT=g.col_tiles, BS=g.block_size, TOKN=tokn,
                FAST=fast, ASM=fast and cfg.bfp8 == "words" and gk.has_bf16x2_mul(q.device), ANCHOR=True,
                PREFETCH=cfg.prefetch, KDT=kdt,
                VMASK=q.dtype == torch.float16,
                DIRECT=num_splits == 1, PREC=prec, INTERP=interp, TOKLOAD=cfg.token_loads, FUSED=new_kv is not None,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
            )
            if num_splits > 1:
                ta.decode_reduce(part_out, part_lse, out, num_splits)
            return out
        if new_kv is not None:
            raise ValueError("new_kv is for the bfloat8_b word kernel (DecodeConfig.fused_write)")
        _decode_tiles_kernel[grid](
            *common, g.bank_stride, g.page_stride, g.s0, g.s1, g.s2,
            NB=g.num_banks, SHARD=g.shard_pages, G=group, BH=bh, WT=g.col_tiles, BS=g.block_size, TOKN=block_n,
            BFP8=g.bfp8, FAST=fast, ASM=cfg.asm and fast and not interp, KDT=kdt, DIRECT=num_splits == 1,
            PREC=prec, INTERP=interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        if new_kv is not None:
            raise ValueError("new_kv is for the bfloat8_b word kernel (DecodeConfig.fused_write)")
        _decode_attention_kernel[grid](
            *common, *_page_args(g),
            G=group, BH=bh, WT=g.col_tiles, RTPB=g.row_tiles, BN=block_n, BFP8=g.bfp8, KDT=kdt,
            DIRECT=num_splits == 1, PREC=prec, INTERP=interp, num_warps=4, num_stages=2,
        )
    if num_splits > 1:
        ta.decode_reduce(part_out, part_lse, out, num_splits)
    return out
