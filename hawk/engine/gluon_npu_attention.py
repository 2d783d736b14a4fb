"""bfloat8_b tile decode with every operand in registers (Gluon: Triton with explicit layouts).

Why: the Triton word kernel (``triton_npu_attention._decode_bfp8_kernel``) decodes a chunk into a
blocked layout, and the compiler then moves it through shared memory into the tensor cores' operand
layout, with barriers between the four warps of a program at every step. That round trip, not the
bytes, bounded it (Nsight Compute: a third of the paged kernel's DRAM throughput, stalls on shared
memory). Here one warp owns its split and loads each value byte straight into the register that
``mma.m16n8k16`` reads it from, so nothing is staged in shared memory and no warp waits on another.

How the bytes meet the tensor cores (bf16 ``m16n8k16``; lane = 4*g + t):
- ``S^T = K Q^T``: K is the A operand ``[tokens, D]``. A lane holds, per 16-column block, columns
  ``2t, 2t+1, 2t+8, 2t+9``. The head dimension is summed over, so its order is free: the same
  permutation of D is applied to q, and a lane's four values of a block become four *consecutive*
  bytes of a face row, one 32-bit word; lane t reads face-row runs t and t+4 (16 bytes each), its
  words for all eight blocks. Shared exponents are one byte per (token, run).
- ``O^T = V^T P^T``: V^T is the A operand ``[D, tokens]``; a lane needs four tokens of one column
  (tokens are summed over, so their order is free too: the token order of a 16-token block is
  permuted so a lane's four are rows ``4t .. 4t+3``). It reads those four rows of one face-row run
  (four 16-byte loads) and transposes the 4x4 byte blocks in registers (PRMT); the four rows'
  exponents are one 32-bit word of the tile header. P^T comes from S^T's accumulator with a
  register shuffle, q^T and P^T pad the GQA group to 8 columns.
- Values decode as in the word kernel (``(sign << 15 | m7)`` is the bf16 subnormal ``m7 * 2^-133``;
  one ``mul.bf16x2`` by ``2^(E-64)`` makes it exact): K and V come out times ``2^-64``, which q and
  the output undo exactly (exponents 64..191, as the word kernel's FAST path).

The launch may also rotate q and the new k (RoPE, bit for bit the layer's kernel), so the layer runs no
RoPE kernel, and where the splits are many give the new row a split of its own (see the kernel).

Not the paged decode's bits (other chunks, order and warps): bfloat8_b values need not keep them,
they are checked against the reference within tolerance. Splits are this kernel's own (one warp
per program: more programs than the paged decode's); partials merge in the paged decode's reduce, or
where the splits are few in the decode launch itself (the last split to finish merges them).
Requires sm_80+ (``mma.sync``) and sm_90 for ``mul.bf16x2``; head_dim 128, separable page maps.
"""

from __future__ import annotations

import functools

import torch

try:  # Gluon ships with Triton >= 3.5; CI's CPU image has no Triton at all
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAVE_GLUON = True
except Exception:  # noqa: BLE001 - an older or broken Triton is as good as none
    HAVE_GLUON = False

#: bfloat8_b value bytes -> bf16, four per 32-bit word (``$2``): ``(sign << 15 | m7)`` per byte is the bf16
#: subnormal ``m7 * 2^-133``; one ``mul.bf16x2`` by ``2^(E-64)`` (bytes 0,1 by ``$3``, 2,3 by ``$4``) makes
#: it exact. Outputs ``$0`` (bytes 0,1) and ``$1`` (2,3). Every bfloat8_b decode kernel uses this text.
DECODE_PTX = """{
            .reg .b32 m, s, a, b;
            and.b32 m, $2, 0x7F7F7F7F;
            and.b32 s, $2, 0x80808080;
            prmt.b32 a, m, s, 0x5140;
            prmt.b32 b, m, s, 0x7362;
            mul.rn.bf16x2 $0, a, $3;
            mul.rn.bf16x2 $1, b, $4;
            }"""

#: Head dimension the layouts below are written for (eight 16-value face-row runs per token).
HEAD_DIM = 128
#: Query heads per KV head the kernel pads to (the N of its MMAs).
MAX_GROUP = 8


def _bases(bits: list[tuple[int, ...]]) -> list[list[int]]:
    return [list(b) for b in bits]


@functools.lru_cache(maxsize=None)
def layouts(tokens: int) -> dict:
    """The kernel's register layouts for ``tokens`` per iteration (16 or 32), as constexpr values.

    ``kw``: K words ``[tokens, 8 runs, 4 words]`` (lane t: runs t, t+4; lane g: token g of each
    8-token half; registers: the four words of a run (one 16-byte load), run t+4, token +8, next
    16 tokens). ``vw``: V words ``[tokens/4, 4 rows, 8 runs, 4 words]`` as loaded (lane t: rows
    4t..4t+3 of each 16-token block, lane g: run g); ``vt``: the same registers with the four rows
    first (the transpose takes them four at a time). ``mma``: the accumulators' layout. ``rl``: a new
    row as ``[16 (column in run), 8 (run)]`` (the fused row write packs it).
    """
    if tokens not in (16, 32):
        raise ValueError(f"tokens per iteration must be 16 or 32, got {tokens}")
    kreg = [(0, 0, 1), (0, 0, 2), (0, 4, 0), (8, 0, 0)] + ([(16, 0, 0)] if tokens == 32 else [])
    klane = [(0, 1, 0), (0, 2, 0), (1, 0, 0), (2, 0, 0), (4, 0, 0)]
    kw = gl.DistributedLinearLayout(_bases(kreg), _bases(klane), [], [], [tokens, 8, 4])
    vblk = [(4, 0, 0, 0)] if tokens == 32 else []
    vlane = [(1, 0, 0, 0), (2, 0, 0, 0), (0, 0, 1, 0), (0, 0, 2, 0), (0, 0, 4, 0)]
    vw = gl.DistributedLinearLayout(_bases([(0, 0, 0, 1), (0, 0, 0, 2), (0, 1, 0, 0), (0, 2, 0, 0)] + vblk),
                                    _bases(vlane), [], [], [tokens // 4, 4, 8, 4])
    vt = gl.DistributedLinearLayout(_bases([(0, 1, 0, 0), (0, 2, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2)] + vblk),
                                    _bases(vlane), [], [], [tokens // 4, 4, 8, 4])
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    rl = gl.BlockedLayout([4, 1], [4, 8], [1, 1], [0, 1])  # a new row as [16 (column in run), 8 (run)]
    return {"kw": kw, "vw": vw, "vt": vt, "mma": mma, "rl": rl}


if HAVE_GLUON:
    _DECODE_PTX = gl.constexpr(DECODE_PTX)
    _TWO_64 = gl.constexpr(2.0**64)  # K and V decode to the codec's values times 2^-64 (see DECODE_PTX)

    @gluon.jit
    def _page_offset(pages, bank_stride, page_stride, NB: gl.constexpr, SHARD: gl.constexpr):
        """Page indices -> byte offsets (block-cyclic map, bank count and shard size known at compile time)."""
        bank = (pages // SHARD) % NB
        slot = (pages // (SHARD * NB)) * SHARD + pages % SHARD
        return bank.to(gl.int64) * bank_stride + slot.to(gl.int64) * page_stride

    @gluon.jit
    def _rho(kappa):
        """Memory row (within a 16-token block) of logical token ``kappa``: ``2t + 8h + b -> 4t + 2h + b``."""
        k = kappa % 16
        return ((k % 8) // 2) * 4 + (k // 8) * 2 + k % 2

    @gluon.jit
    def _scale_bits(e):
        """Exponent byte(s) -> bf16 bits of ``2^(E-64)`` (E clamped at 191: larger saturates, as the word kernel)."""
        return (gl.minimum(e, 191) + 63) << 7

    @gluon.jit
    def _decode_words(w, s_lo, s_hi):
        """Four value bytes per word -> two bf16x2 words (bytes 0,1 scaled by ``s_lo``, 2,3 by ``s_hi``)."""
        return gl.inline_asm_elementwise(
            asm=_DECODE_PTX,
            constraints="=r,=r,r,r,r",
            args=[w, s_lo, s_hi],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _transpose4(w):
        """Four words (rows r0..r3, bytes b0..b3 each, consecutive registers) -> word i = ``(r0.bi, r1.bi, r2.bi, r3.bi)``."""
        return gl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t0, t1, t2, t3;
            prmt.b32 t0, $4, $5, 0x5140;
            prmt.b32 t1, $4, $5, 0x7362;
            prmt.b32 t2, $6, $7, 0x5140;
            prmt.b32 t3, $6, $7, 0x7362;
            prmt.b32 $0, t0, t2, 0x5410;
            prmt.b32 $1, t0, t2, 0x7632;
            prmt.b32 $2, t1, t3, 0x5410;
            prmt.b32 $3, t1, t3, 0x7632;
            }""",
            constraints="=r,=r,=r,=r,r,r,r,r",
            args=[w],
            dtype=gl.int32,
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def _pairs(lo, hi):
        """bf16x2 words ``lo`` (values b=0,1 of h=0) and ``hi`` (h=1) -> bf16 with two new last dims (b, h)."""
        lo2 = gl.join(lo.to(gl.int16).to(gl.bfloat16, bitcast=True), (lo >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))
        hi2 = gl.join(hi.to(gl.int16).to(gl.bfloat16, bitcast=True), (hi >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))
        return gl.join(lo2, hi2)

    @gluon.jit
    def _chunk_offset(mrow, start, h, s0, s1, s2, bank_stride, page_stride,
                      NB: gl.constexpr, SHARD: gl.constexpr, BS: gl.constexpr, pred=True):
        """Byte offset of the row tile (column tile 0) holding the chunk at ``start`` (one block table
        read; none when ``pred`` is false: block 0 stands in)."""
        blk = gl.load(mrow + 2 + start // BS, mask=pred, other=0)
        return _page_offset(blk * s0 + h * s1 + ((start % BS) // 32) * s2, bank_stride, page_stride, NB, SHARD)

    @gluon.jit
    def _k_load(wp, ep, off, start, col, TOKN: gl.constexpr, KW: gl.constexpr, pred=True):
        """K of tokens ``[start, start+TOKN)`` as loaded: words ``[TOKN, 8 runs, 4]`` and exponent bytes
        ``[TOKN, 8]`` (token ``kappa`` of a 16-token block is its row ``_rho(kappa)``). ``off``: the
        chunk's row tile; ``col``: the runs' column-tile offsets; ``pred`` false: nothing is read."""
        L2: gl.constexpr = gl.SliceLayout(2, KW)
        kap = gl.arange(0, TOKN, layout=gl.SliceLayout(1, L2))
        run = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
        pos = start + (kap // 16) * 16 + _rho(kap)
        r = pos % 16
        face = (((pos % 32) // 16) * 2)[:, None] + (run % 2)[None, :]
        e = gl.load(ep + (off + col[None, :] + face * 16 + r[:, None]), mask=pred, other=0)  # header byte face*16 + row
        w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, KW)))
        voff = (off + col[None, :] + 64 + face * 256 + (r * 16)[:, None]) // 4
        return gl.load(wp + (gl.expand_dims(voff, 2) + w[None, None, :]), mask=pred, other=0), e

    @gluon.jit
    def _k_operand(words, e, TOKN: gl.constexpr, MMA: gl.constexpr):
        """Loaded K (``_k_load``) as the A operand ``[TOKN, 128]`` of ``S^T = K q^T`` (D in the kernel's order)."""
        sc = _scale_bits(e.to(gl.int32))
        s3 = gl.broadcast(gl.expand_dims(sc | (sc << 16), 2), words)[0]
        lo, hi = _decode_words(words, s3, s3)
        x = _pairs(lo, hi)  # [TOKN, 8 (run = 4j + t), 4 (w), 2 (b), 2 (h)]
        x = gl.reshape(x, [TOKN, 2, 4, 4, 2, 2])  # (j, t, w, b, h)
        x = gl.permute(x, [0, 1, 3, 5, 2, 4])  # (j, w, h, t, b): block kb = 4j + w, column 8h + 2t + b
        x = gl.reshape(x, [TOKN, 128])
        return gl.convert_layout(x, gl.DotOperandLayout(0, MMA, 2), assert_trivial=True)

    @gluon.jit
    def _v_load(wp, off, start, col, TOKN: gl.constexpr, VW: gl.constexpr, pred=True):
        """V of tokens ``[start, start+TOKN)`` as loaded: words ``[TOKN/4, 4 rows, 8 runs, 4]`` (lane t:
        rows 4t .. 4t+3 of each 16-token block, lane g: run g) and the four rows' exponents, one header
        word per (row group, run) ``[TOKN/4, 8]``."""
        L3: gl.constexpr = gl.SliceLayout(3, VW)
        L2: gl.constexpr = gl.SliceLayout(1, L3)
        q4 = gl.arange(0, TOKN // 4, layout=gl.SliceLayout(1, L2))  # 16-token block * 4 + t
        run = gl.arange(0, 8, layout=gl.SliceLayout(0, L2))
        row0 = start + (q4 // 4) * 16 + (q4 % 4) * 4  # first of the lane's four rows
        r0 = row0 % 16
        face = (((row0 % 32) // 16) * 2)[:, None] + (run % 2)[None, :]
        ew = gl.load(wp + (off + col[None, :] + face * 16 + r0[:, None]) // 4, mask=pred, other=0)
        i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VW))))
        base = (off + col[None, :] + 64 + face * 256 + (r0 * 16)[:, None]) // 4  # [q4, run]
        b3 = gl.expand_dims(base, 1) + (i * 4)[None, :, None]  # + row i
        return gl.load(wp + (gl.expand_dims(b3, 3) + w[None, None, None, :]), mask=pred, other=0), ew

    @gluon.jit
    def _v_operand(words, ew, TOKN: gl.constexpr, VT: gl.constexpr, MMA: gl.constexpr):
        """Loaded V (``_v_load``) as the A operand ``[128, TOKN]`` of ``O^T = V^T P^T`` (rows in the
        kernel's D' order, tokens in its per-block order: both undone elsewhere)."""
        s_lo = _scale_bits(ew & 0xFF) | (_scale_bits((ew >> 8) & 0xFF) << 16)  # rows 4t, 4t+1: tokens 2t, 2t+1
        s_hi = _scale_bits((ew >> 16) & 0xFF) | (_scale_bits((ew >> 24) & 0xFF) << 16)  # rows 4t+2, 4t+3: 2t+8, 2t+9
        z = _transpose4(gl.convert_layout(words, VT))  # element (q4, i, run, w): column 4w + i, rows 4t..4t+3
        SV: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, VT))
        s_lo4 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.convert_layout(s_lo, SV), 1), 3), z)[0]
        s_hi4 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.convert_layout(s_hi, SV), 1), 3), z)[0]
        lo, hi = _decode_words(z, s_lo4, s_hi4)
        x = _pairs(lo, hi)  # [q4 (kb, t), i (i1, i0), g, w, b, h]
        x = gl.reshape(x, [TOKN // 16, 4, 2, 2, 8, 4, 2, 2])  # (kb, t, i1, i0, g, w, b, h)
        x = gl.permute(x, [5, 2, 3, 4, 0, 7, 1, 6])  # D' = (w, i1, i0, g), tokens = (kb, h, t, b)
        x = gl.reshape(x, [128, TOKN])
        return gl.convert_layout(x, gl.DotOperandLayout(0, MMA, 2), assert_trivial=True)

    @gluon.jit
    def _pack_row(x):
        """A new row's fp32 values ``[16 (column in run), 8 (run)]`` -> (shared exponents ``[8]``, value
        bytes ``[16, 8]``, the values they decode to): ``hawk/layouts/tt.py``'s packing, per face row."""
        bits = x.to(gl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        shared = gl.max(exp, 0)
        mant = (bits & 0x7FFFFF) | 0x800000
        shift = gl.minimum(17 + shared[None, :] - exp, 31)  # >= 25 already shifts everything out
        qv = mant >> shift
        rem = mant - (qv << shift)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((qv & 1) == 1))
        qv = gl.minimum(qv + up.to(gl.int32), 127)
        qv = gl.where(exp != 0, qv, 0)
        neg = (bits >> 31) & 1
        sign = gl.where(qv != 0, neg, 0)
        scale = (shared << 23).to(gl.float32, bitcast=True) * 0.015625  # 2^(E-133) (E=0 gives 0, as the codec)
        mag = qv.to(gl.float32) * scale[None, :]
        return shared, qv | (sign << 7), gl.where(sign != 0, -mag, mag)

    @gluon.jit
    def _store_row(mem, start, face, ri, exps, vals, ok, RL: gl.constexpr):
        """Store a packed row (``_pack_row``) at row ``ri`` of face ``face[run]`` of the tiles at
        ``mem + start[run]``: its shared exponents and its value bytes, nothing else."""
        c = gl.arange(0, 16, layout=gl.SliceLayout(1, RL))
        gl.store(mem + start + face * 16 + ri, exps.to(gl.uint8), mask=ok)
        vptr = mem + (start + 64 + face * 256 + ri * 16)[None, :] + c[:, None]
        gl.store(vptr, vals.to(gl.uint8), mask=ok)

    @gluon.jit
    def _pack_new(q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, pos, cos, sin, qk_scale, heads,
                  G: gl.constexpr, RL: gl.constexpr, ROPE: gl.constexpr):
        """The new row of (``row``, KV head ``h``): its K (rotated when ROPE) and V packed as the cache
        will hold them (``_pack_row``: exponents, value bytes; V's decoded values) and each query head's
        score of it, ``[8]`` in ``heads``' layout (-1e30 past ``G``)."""
        c16 = gl.arange(0, 16, layout=gl.SliceLayout(1, RL))
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(0, RL))
        dm = r8[None, :] * 16 + c16[:, None]  # [16 (column in run), 8 (run)]
        dp = (r8 ^ 4)[None, :] * 16 + c16[:, None]  # RoPE's partners: column + 64
        kx = _load_rotated(k_new + row * kn_s0 + h * kn_s1, dm, dp, pos, cos, sin, ROPE)
        ke8, kb8, kd = _pack_row(kx.to(gl.float32))
        ve8, vb8, vd = _pack_row(gl.load(v_new + row * vn_s0 + h * vn_s1 + dm).to(gl.float32))
        s_new = gl.full([8], -1.0e30, gl.float32, layout=heads.type.layout)
        for i in gl.static_range(G):
            qi = _load_rotated(q + row * q_s0 + (h * G + i) * q_s1, dm, dp, pos, cos, sin, ROPE).to(gl.float32)
            s_new = gl.where(heads == i, gl.sum(gl.sum(qi * kd, 1), 0) * qk_scale, s_new)
        return ke8, kb8, ve8, vb8, vd, s_new

    @gluon.jit
    def _new_row(q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, n, lo, hi, sp, num_splits, qk_scale,
                 heads, pos, cos, sin, G: gl.constexpr, TOKN: gl.constexpr, RL: gl.constexpr, EARLY: gl.constexpr,
                 ROPE: gl.constexpr):
        """The fused row write's share of a split: whether it holds position ``n - 1`` (``is_new``), the
        new row packed and scored (``_pack_new``; -1e30 where not ``is_new``), and ``hi_m``, the end of what
        is read from the cache."""
        hi_m = gl.minimum(hi, n - 1)  # the cache's row n - 1 is attended from registers instead
        if EARLY:
            is_new = (n > 0) & (((n - 1) // TOKN) % num_splits == sp)
        else:
            is_new = (lo <= n - 1) & (n - 1 < hi)
        ke8, kb8, ve8, vb8, vd, s_new = _pack_new(q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, pos,
                                                  cos, sin, qk_scale, heads, G, RL, ROPE)
        s_new = gl.where(is_new & (heads < G), s_new, -1.0e30)
        return hi_m, is_new, ke8, kb8, ve8, vb8, vd, s_new

    @gluon.jit
    def _merge_splits(part_out, part_lse, out, o_s1, prow0, num_splits, G: gl.constexpr, SP: gl.constexpr):
        """Heads ``0 .. G`` of ``out`` (stride ``o_s1``) from their split partials, rows ``prow0 + i *
        num_splits + s`` of the paged reduce's layout, with its arithmetic (weights ``2^(lse - max)``)."""
        ML: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])  # [splits, 128]: a lane's 4 columns
        si = gl.arange(0, SP, layout=gl.SliceLayout(1, ML))
        di = gl.arange(0, 128, layout=gl.SliceLayout(0, ML))
        smask = si < num_splits
        for i in gl.static_range(G):
            prow = prow0 + i * num_splits + si
            lse = gl.load(part_lse + prow, mask=smask, other=float("-inf"), cache_modifier=".cg")
            o = gl.load(part_out + prow[:, None] * 128 + di[None, :], mask=smask[:, None], other=0.0, cache_modifier=".cg")
            w = gl.exp2(lse - gl.max(lse, 0))  # the largest weight is 1, so the sum is >= 1
            res = gl.sum(o * w[:, None], 0) / gl.sum(w, 0)
            gl.store(out + i * o_s1 + di, res.to(out.dtype.element_ty))

    @gluon.jit
    def _rope(x, xp, c, s):
        """``x * cos + partner * sin_signed`` (partner: the column ``D/2`` away), each product and the sum
        rounded to x's dtype as the layer's RoPE kernel (``triton_ops._qkv_rope_kernel``) rounds them."""
        dt = x.dtype
        return ((x.to(gl.float32) * c).to(dt).to(gl.float32) + (xp.to(gl.float32) * s).to(dt).to(gl.float32)).to(dt)

    @gluon.jit
    def _halves(x):
        """``[128, 8]`` -> its rows ``j`` and ``j + 64`` (``[64, 8]`` each)."""
        return gl.split(gl.permute(gl.reshape(x, [2, 64, 8]), [1, 2, 0]))

    @gluon.jit
    def _rope_q(qv, c, s, QL: gl.constexpr):
        """q^T ``[128 (kernel order), 8]`` rotated (``c``, ``s``: the tables' rows at the kernel's columns).
        A column's RoPE partner (memory column + 64) is kernel column + 64, held by the same lane, so
        the halves are paired in registers instead of loaded again."""
        a, b = _halves(qv)  # kernel columns j and j + 64
        c0, c1 = _halves(gl.broadcast(c[:, None], qv)[0])
        s0, s1 = _halves(gl.broadcast(s[:, None], qv)[0])
        y = gl.join(_rope(a, b, c0, s0), _rope(b, a, c1, s1))
        return gl.convert_layout(gl.reshape(gl.permute(y, [2, 0, 1]), [128, 8]), QL, assert_trivial=True)

    @gluon.jit
    def _load_rotated(ptr, d, dp, pos, cos, sin, ROPE: gl.constexpr):
        """Head values at columns ``d`` of the head at ``ptr`` (memory order, ``D`` = 128), rotated for
        position ``pos`` when ROPE (``dp``: the partners, ``d ^ 64``, written so the compiler sees
        their runs; the tables' rows are ``[len, 128]``); ``d``'s layout is kept."""
        x = gl.load(ptr + d)
        if ROPE:
            xp = gl.load(ptr + dp)
            c = gl.load(cos + pos * 128 + d).to(gl.float32)
            s = gl.load(sin + pos * 128 + d).to(gl.float32)
            x = _rope(x, xp, c, s)
        return x

    @gluon.jit
    def _row_tile(loc, h, s0, s1, s2, bank_stride, page_stride, r8,
                  NB: gl.constexpr, SHARD: gl.constexpr, BS: gl.constexpr):
        """Where cache row ``loc`` (``npu_block * BS + row``) of KV head ``h`` lives: each run's tile
        offset ``[8]`` (``r8``: the runs), its face per run and its row within the face."""
        rr = (loc % BS) % 32
        face = (rr // 16) * 2 + r8 % 2
        tile = _page_offset(loc // BS * s0 + h * s1 + ((loc % BS) // 32) * s2, bank_stride, page_stride, NB, SHARD) \
            + _page_offset(r8 // 2, bank_stride, page_stride, NB, SHARD)
        return tile, face, rr % 16

    @gluon.jit
    def _split_program(
        q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse, mem, k_base, v_base, mrow, meta_w, qk_scale,
        num_splits, parts, row, h, sp, n, pos, cos, sin,
        bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1,
        NB: gl.constexpr, SHARD: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, TOKN: gl.constexpr,
        KW: gl.constexpr, VW: gl.constexpr, VT: gl.constexpr, MMA: gl.constexpr, RL: gl.constexpr,
        DIRECT: gl.constexpr, PREFETCH: gl.constexpr, FUSED: gl.constexpr, EARLY: gl.constexpr, ROPE: gl.constexpr,
    ):
        """Split ``sp`` of ``num_splits`` over the first ``n`` cache rows: its chunks, online softmax, then
        the output (DIRECT) or its partial, row ``sp`` of the ``parts`` per (row, query head). FUSED: also
        the new row at position ``n - 1``, where this split holds it (see the kernel)."""
        if EARLY:  # chunks sp, sp + S, ...: the first one's place is known before n is
            lo = sp * TOKN
            hi = n
            step = num_splits * TOKN
            first_ok = lo // BS < meta_w  # a block-table column: the load need not wait for n
        else:
            split_len = gl.cdiv(gl.cdiv(n, num_splits), TOKN) * TOKN
            lo = sp * split_len
            hi = gl.minimum(lo + split_len, n)
            step = TOKN
            first_ok = lo < hi
        kwp = (mem + k_base).to(gl.pointer_type(gl.int32))
        kep = mem + k_base
        vwp = (mem + v_base).to(gl.pointer_type(gl.int32))
        # q^T as the B operand [128 (kernel order), 8 heads], times 2^64 (K comes scaled by 2^-64)
        QL: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
        kap = gl.arange(0, 128, layout=gl.SliceLayout(1, QL))
        kb = kap // 16
        c = kap % 16
        dmem = ((c % 8) // 2 + 4 * (kb // 4)) * 16 + (kb % 4) * 4 + (c // 8) * 2 + c % 2
        dmem = gl.max_contiguous(gl.multiple_of(dmem, 2), 2)  # columns 2t, 2t+1 are adjacent: 4-byte loads
        hh = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))
        qv = gl.load(q + row * q_s0 + (h * G + hh)[None, :] * q_s1 + dmem[:, None], mask=(hh < G)[None, :], other=0.0)
        if ROPE:
            cq = gl.load(cos + pos * 128 + dmem).to(gl.float32)
            qv = _rope_q(qv, cq, gl.load(sin + pos * 128 + dmem).to(gl.float32), QL)
        qv = (qv.to(gl.float32) * _TWO_64).to(gl.bfloat16)
        # the runs' column-tile offsets (separable map: a tile's offset = its row part + its column part)
        krun = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, KW)))
        kcol = _page_offset(krun // 2, bank_stride, page_stride, NB, SHARD)
        vrun = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, VW))))
        vcol = _page_offset(vrun // 2, bank_stride, page_stride, NB, SHARD)
        SL: gl.constexpr = gl.SliceLayout(0, MMA)
        heads = gl.arange(0, 8, layout=SL)
        m_i = gl.full([8], -1.0e30, gl.float32, layout=SL)
        l_i = gl.zeros([8], gl.float32, layout=SL)
        acc = gl.zeros([128, 8], gl.float32, layout=MMA)
        tok = gl.arange(0, TOKN, layout=gl.SliceLayout(1, MMA))
        hi_m = hi
        if FUSED and not EARLY:  # before the chunks, so that its loads overlap theirs (at batch 1 a split is one chunk)
            hi_m, is_new, ke8, kb8, ve8, vb8, vd, s_new = _new_row(
                q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, n, lo, hi, sp, num_splits, qk_scale,
                heads, pos, cos, sin, G, TOKN, RL, EARLY, ROPE)
        if PREFETCH:  # loads of a chunk past the split (or of an empty split) are masked off: no traffic
            off = _chunk_offset(mrow, lo, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, first_ok)
            kw, ke = _k_load(kwp, kep, off, lo, kcol, TOKN, KW, lo < hi)
            vw, ve = _v_load(vwp, off, lo, vcol, TOKN, VW, lo < hi)
        if FUSED and EARLY:  # packed while the first chunk's loads are in flight
            hi_m, is_new, ke8, kb8, ve8, vb8, vd, s_new = _new_row(
                q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, n, lo, hi, sp, num_splits, qk_scale,
                heads, pos, cos, sin, G, TOKN, RL, EARLY, ROPE)
        for start in range(lo, hi, step):
            if PREFETCH:
                nxt = start + step
                noff = _chunk_offset(mrow, nxt, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS, nxt < hi)
                nkw, nke = _k_load(kwp, kep, noff, nxt, kcol, TOKN, KW, nxt < hi)
                nvw, nve = _v_load(vwp, noff, nxt, vcol, TOKN, VW, nxt < hi)
            else:
                off = _chunk_offset(mrow, start, h, s0, s1, s2, bank_stride, page_stride, NB, SHARD, BS)
                kw, ke = _k_load(kwp, kep, off, start, kcol, TOKN, KW)
                vw, ve = _v_load(vwp, off, start, vcol, TOKN, VW)
            k = _k_operand(kw, ke, TOKN, MMA)
            s = mma_v2(k, qv, gl.zeros([TOKN, 8], gl.float32, layout=MMA)) * qk_scale
            p_ = start + (tok // 16) * 16 + _rho(tok)
            s = gl.where((p_ < hi_m)[:, None], s, -1.0e30)
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            v = _v_operand(vw, ve, TOKN, VT, MMA)
            pb = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(1, MMA, 2))
            acc = mma_v2(v, pb, acc * alpha[None, :])
            if PREFETCH:
                kw, ke, vw, ve = nkw, nke, nvw, nve
        if FUSED:  # the new token: packed as the cache will hold it, attended from registers, stored last
            m_new = gl.maximum(m_i, s_new)
            alpha = gl.exp2(m_i - m_new)
            p_new = gl.where(is_new, gl.exp2(s_new - m_new), 0.0)
            l_i = l_i * alpha + p_new
            m_i = m_new
            vcol_d = gl.convert_layout(gl.reshape(vd, [128]), gl.SliceLayout(1, MMA))  # d' = 8 * column + run
            acc = acc * alpha[None, :] + (vcol_d / _TWO_64)[:, None] * p_new[None, :]  # in V's 2^-64 scale
        # epilogue: D' -> memory order, undo V's 2^-64
        dp = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
        cc = ((dp // 32) * 4 + ((dp // 16) % 2) * 2 + (dp // 8) % 2)  # column within the run: 4w + i
        d_out = (dp % 8) * 16 + cc
        hmask = heads < G
        l_safe = gl.where(l_i > 0, l_i, 1.0)
        o = acc * (_TWO_64 / l_safe)[None, :]
        omask = hmask[None, :] & (d_out < 128)[:, None]
        if DIRECT:
            gl.store(out + row * o_s0 + (h * G + heads)[None, :] * o_s1 + d_out[:, None], o.to(out.dtype.element_ty), mask=omask)
        else:
            hq = gl.num_programs(1) * G
            lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), -1.0e30)
            prow = (row * hq + h * G + heads) * parts + sp
            gl.store(part_out + prow[None, :] * 128 + d_out[:, None], o, mask=omask)
            gl.store(part_lse + prow, lse, mask=hmask)
        if FUSED:  # after this program's reads; pad rows (loc < 0, n = 0) write nothing
            loc = gl.load(mrow + 1)
            r8 = gl.arange(0, 8, layout=gl.SliceLayout(0, RL))
            ok = is_new & (loc >= 0)
            tile, face, ri = _row_tile(gl.maximum(loc, 0), h, s0, s1, s2, bank_stride, page_stride, r8, NB, SHARD, BS)
            _store_row(mem + k_base, tile, face, ri, ke8, kb8, ok, RL)
            _store_row(mem + v_base, tile, face, ri, ve8, vb8, ok, RL)

    @gluon.jit
    def _new_row_program(
        q, q_s0, q_s1, part_out, part_lse, mem, k_base, v_base, mrow, qk_scale, parts, row, h, n, pos, cos, sin,
        bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1,
        NB: gl.constexpr, SHARD: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, RL: gl.constexpr, ROPE: gl.constexpr,
    ):
        """The new token's own split (NEWP, the last of ``parts``): its K/V row packed and stored, and its
        partial: each head's score of it (the lse of a one-token split) and V's decoded row (its output).
        A pad row (``n`` = 0) stores nothing in the cache and a zero partial with lse -1e30, as the other
        splits of a pad row do, so its merged output is 0."""
        r8 = gl.arange(0, 8, layout=gl.SliceLayout(0, RL))  # the runs; also the query heads' scores
        ke8, kb8, ve8, vb8, vd, s_new = _pack_new(q, q_s0, q_s1, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, row, h, pos,
                                                  cos, sin, qk_scale, r8, G, RL, ROPE)
        c16 = gl.arange(0, 16, layout=gl.SliceLayout(1, RL))
        dm = r8[None, :] * 16 + c16[:, None]  # [16 (column in run), 8 (run)]
        prow0 = (row * gl.num_programs(1) * G + h * G) * parts + parts - 1
        o = gl.where(n > 0, vd, 0.0)
        for i in gl.static_range(G):
            gl.store(part_out + (prow0 + i * parts) * 128 + dm, o)
        gl.store(part_lse + prow0 + r8 * parts, gl.where(n > 0, s_new, -1.0e30), mask=r8 < G)
        loc = gl.load(mrow + 1)
        ok = (n > 0) & (loc >= 0)
        tile, face, ri = _row_tile(gl.maximum(loc, 0), h, s0, s1, s2, bank_stride, page_stride, r8, NB, SHARD, BS)
        _store_row(mem + k_base, tile, face, ri, ke8, kb8, ok, RL)
        _store_row(mem + v_base, tile, face, ri, ve8, vb8, ok, RL)

    @gluon.jit
    def _decode_bfp8_regs_kernel(
        q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse,
        mem, k_base, v_base, meta, meta_s0, meta_w, qk_scale, num_splits,
        bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, counters, positions, cos, sin,
        NB: gl.constexpr, SHARD: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, TOKN: gl.constexpr,
        KW: gl.constexpr, VW: gl.constexpr, VT: gl.constexpr, MMA: gl.constexpr, RL: gl.constexpr,
        DIRECT: gl.constexpr, PREFETCH: gl.constexpr, FUSED: gl.constexpr, EARLY: gl.constexpr,
        MERGE: gl.constexpr, SP: gl.constexpr, NEWP: gl.constexpr, ROPE: gl.constexpr,
    ):
        """One (row, kv head, split), one warp: the split's TOKN-token chunks, online softmax, then
        the output (one split) or the split's normalized partial and log2-sum-exp (the paged reduce's format).

        PREFETCH: chunk c+1's loads are issued before chunk c is computed. FUSED (decode batches): the
        new row (``k_new``, ``v_new [rows, Hkv, 128]``, where ``meta[:, 1]`` says) is packed here; the
        program whose split holds position ``n - 1`` attends it from registers (the cache's row there
        is masked: it may hold old bytes) and stores it after its own reads. No other program reads
        that row (splits are whole chunks), so nothing orders programs.

        NEWP (decode batches; instead of FUSED): the new row has a program of its own, split index
        ``num_splits`` (the grid has ``num_splits + 1``): it packs, stores and scores the row (a
        one-token partial); the other splits read the ``n - 1`` rows before it and never the new one.
        That takes the row's packing (~30 % of a split's code at batch 1, where a split is one chunk and
        its chain of dependent instructions is the kernel's time) off the chunk programs.

        ROPE (FUSED or NEWP): q and the new k come un-rotated and are rotated here (``positions [rows]``,
        the tables ``cos``, ``sin`` (sin_signed) ``[len, 128]``), bit for bit as the layer's RoPE kernel,
        which then does not run.

        EARLY: the first chunk's loads go out as early as they can. Split ``sp`` takes chunks ``sp, sp + S,
        sp + 2S, ...`` instead of a contiguous run, so where its first chunk is (its block-id load) does
        not depend on the sequence length and is loaded beside it: one dependent memory round trip fewer
        before the K/V loads. And the new row (FUSED) is packed after they are issued, not before. A
        batch-1 split is one chunk: this chain is most of its time.

        MERGE (several partials): the last program of a (row, KV head) to finish merges every one's
        partials (``SP``: their count rounded up to a power of two), as the paged decode's reduce
        does, instead of a reduce launch after this one. The barrier puts the warp's partial stores
        before its acq_rel atomic on ``counters[row, h]`` (release: the merger sees them; acquire: this
        program sees the others'); partials are read past L1 (``.cg``), which is not coherent across
        SMs; the merger zeroes the counter for the next launch or graph replay."""
        row = gl.program_id(0).to(gl.int64)
        h = gl.program_id(1)
        sp = gl.program_id(2)
        mrow = meta + row * meta_s0
        n = gl.load(mrow)
        if ROPE:
            pos = gl.load(positions + row).to(gl.int64)
        else:
            pos = 0
        parts = num_splits + 1 if NEWP else num_splits  # partials per (row, query head)
        if NEWP:
            if sp == num_splits:
                _new_row_program(q, q_s0, q_s1, part_out, part_lse, mem, k_base, v_base, mrow, qk_scale, parts, row, h,
                                 n, pos, cos, sin, bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new,
                                 vn_s0, vn_s1, NB, SHARD, G, BS, RL, ROPE)
            else:  # the cache's rows before the new one
                _split_program(q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse, mem, k_base, v_base, mrow, meta_w,
                               qk_scale, num_splits, parts, row, h, sp, n - 1, pos, cos, sin, bank_stride, page_stride,
                               s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, NB, SHARD, G, BS, TOKN, KW, VW, VT,
                               MMA, RL, False, PREFETCH, False, EARLY, ROPE)
        else:
            _split_program(q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse, mem, k_base, v_base, mrow, meta_w,
                           qk_scale, num_splits, parts, row, h, sp, n, pos, cos, sin, bank_stride, page_stride,
                           s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, NB, SHARD, G, BS, TOKN, KW, VW, VT,
                           MMA, RL, DIRECT, PREFETCH, FUSED, EARLY, ROPE)
        if MERGE and not DIRECT:
            gl.thread_barrier()
            cnt = counters + row * gl.num_programs(1) + h
            if gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == parts - 1:
                _merge_splits(part_out, part_lse, out + row * o_s0 + h * G * o_s1, o_s1,
                              (row * gl.num_programs(1) + h) * G * parts, parts, G, SP)
                gl.store(cnt, 0)


def has_bf16x2_mul(device: torch.device) -> bool:
    """``mul.bf16x2`` (``DECODE_PTX``) needs sm_90 (older GPUs take the word kernel's integer decode)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    """A GPU's major compute capability, asked once (decode launches check it per layer)."""
    return torch.cuda.get_device_capability(index)[0]


def supported(head_dim: int, group: int, device: torch.device) -> bool:
    """True when this kernel can run: Gluon importable, head_dim 128, GQA group <= 8, an sm_90 GPU."""
    return HAVE_GLUON and head_dim == HEAD_DIM and 1 <= group <= MAX_GROUP and has_bf16x2_mul(device)


def auto_tokens(rows: int, num_kv_heads: int) -> int:
    """Tokens per iteration when the config leaves it open: 32 for a handful of programs' rows (batch 1
    of the 8B shape: 11.3 against 12.4 us with 16), else 16 (fewer registers, more programs per SM:
    batch 8 19.2 against 20.9 us, batch 64 58.8 against 66.7; one H200, context 1k, 2026-12-01,
    benchmarks/results/raw/bfp8_kernel_probe_h200_regs_call4.json)."""
    return 32 if rows * num_kv_heads <= 32 else 16


def num_splits(rows: int, num_kv_heads: int, num_sms: int, programs_per_sm: int = 8, max_splits: int = 32) -> int:
    """Splits per sequence for one-warp programs: about ``programs_per_sm`` per SM (a function of the
    padded batch only, so a captured graph keeps its grid)."""
    return max(1, min(max_splits, -(-num_sms * programs_per_sm // (rows * num_kv_heads))))


def decode(g, layer: int, q: torch.Tensor, meta: torch.Tensor, rows: int, splits: int,
           partials: tuple[torch.Tensor, torch.Tensor] | None, tokens: int = 32, prefetch: bool = True,
           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, maxnreg: int | None = None,
           early: bool = False, counters: torch.Tensor | None = None, new_row_program: bool = False,
           rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q [rows, Hq, 128]`` (bf16) over each row's bfloat8_b tiles (``g``: a ``TileGeometry`` with a
    separable map) -> ``[rows, Hq, 128]``.

    ``new_kv``: the new rows' ``k, v [rows, Hkv, 128]`` (decode batches: one new token per sequence),
    written by this launch where ``meta[:, 1]`` says; else they must be in the cache already
    (``write_rows``). ``splits`` > 1 needs ``partials`` (the paged decode's ``[rows*Hq*splits*D]``,
    ``[rows*Hq*splits]`` fp32 scratch), merged by its reduce. No host sync; fixed grid for a given
    ``rows`` and ``splits``. ``maxnreg``: a per-thread register cap (more programs per SM).
    ``early``: the first chunk's loads go out first (splits take every ``splits``-th chunk; the kernel's EARLY).
    ``counters``: int32 zeros, ``>= rows * Hkv`` (each launch leaves them zeroed: keep one buffer for a
    captured graph): with several partials the last program merges them in this launch (the kernel's
    MERGE), else a reduce launch follows.
    ``new_row_program`` (with ``new_kv`` and ``splits`` >= 2): the new row gets one of the splits, a
    program of its own (the kernel's NEWP); the cache's rows take the other ``splits - 1``.
    ``rope`` (with ``new_kv``): ``positions [rows]`` and the ``cos, sin_signed [len, 128]`` tables: ``q``
    and ``new_kv``'s k come un-rotated and are rotated here (the kernel's ROPE).
    """
    from triton import next_power_of_2

    from hawk.engine import triton_attention as ta

    hq, d = q.shape[1], q.shape[2]
    group = hq // g.num_kv_heads
    if not (g.bfp8 and g.separable) or d != HEAD_DIM or group > MAX_GROUP or q.dtype != torch.bfloat16:
        raise ValueError("the register kernel needs bfloat8_b tiles on a separable map, head_dim 128, "
                         f"GQA group <= {MAX_GROUP} and bf16 queries")
    if q.stride(2) != 1:
        raise ValueError("q's last dim must be contiguous")
    if splits > 1 and partials is None:
        raise ValueError("several splits need the partials scratch")
    if new_row_program and (new_kv is None or splits < 2):
        raise ValueError("new_row_program is for launches that write the new rows (new_kv), with >= 2 splits")
    if rope is not None:
        if new_kv is None:
            raise ValueError("rope is for launches that write the new rows (new_kv): their k is rotated here")
        positions, cos, sin = rope
        if positions.shape[0] < rows or cos.shape[-1] != d or sin.shape != cos.shape \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rope needs >= {rows} positions and two contiguous [len, {d}] tables")
        rope_args = (positions, cos, sin)
    else:
        rope_args = (meta, meta, meta)  # never read
    if new_kv is not None:
        kn, vn = new_kv
        if kn.shape != (q.shape[0], g.num_kv_heads, d) or vn.shape != kn.shape or kn.stride(2) != 1 or vn.stride(2) != 1:
            raise ValueError(f"new_kv must be two [{q.shape[0]}, {g.num_kv_heads}, {d}] tensors, last dim contiguous")
        new_args = (kn, kn.stride(0), kn.stride(1), vn, vn.stride(0), vn.stride(1))
    else:  # never read: any pointer, zero strides
        new_args = (q, 0, 0, q, 0, 0)
    merge = splits > 1 and counters is not None
    if merge and (counters.dtype != torch.int32 or counters.numel() < rows * g.num_kv_heads):
        raise ValueError(f"counters must be int32 with >= {rows * g.num_kv_heads} elements")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    part_out, part_lse = partials if partials is not None else (out, out)
    lay = layouts(tokens)
    _decode_bfp8_regs_kernel[(rows, g.num_kv_heads, splits)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), part_out, part_lse,
        g.memory, g.bases[2 * layer], g.bases[2 * layer + 1], meta, meta.stride(0), meta.shape[1] - 2,
        ta.decode_qk_scale(d), splits - 1 if new_row_program else splits,
        g.bank_stride, g.page_stride, g.s0, g.s1, g.s2, *new_args, counters if merge else meta, *rope_args,
        NB=g.num_banks, SHARD=g.shard_pages, G=group, BS=g.block_size, TOKN=tokens,
        KW=lay["kw"], VW=lay["vw"], VT=lay["vt"], MMA=lay["mma"], RL=lay["rl"], DIRECT=splits == 1,
        PREFETCH=prefetch, FUSED=new_kv is not None and not new_row_program, EARLY=early, MERGE=merge,
        SP=next_power_of_2(splits) if merge else 1, NEWP=new_row_program, ROPE=rope is not None,
        num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    if splits > 1 and not merge:
        ta.decode_reduce(part_out, part_lse, out, splits)
    return out
