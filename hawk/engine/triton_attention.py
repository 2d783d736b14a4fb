"""Triton kernels for attention over the vLLM-style paged KV cache (NHD and HND), and their launchers.

Three kernels, all reading metadata from int32 device tensors so a launch never needs a host sync:

* :func:`write_kv` stores the new tokens' K/V at their flat slots (``block * block_size + offset``);
  a slot ``< 0`` (a dummy pad row) writes nothing.
* :func:`paged_decode` is split-K ("flash-decoding") attention for one query token per sequence.
  The grid ``(batch, kv_heads, splits)`` depends only on the batch size, never on context lengths:
  each program reads its sequence's length from ``seq_lens`` and covers ``ceil(len / splits)``
  tokens (a program past the end writes a neutral partial), so a CUDA graph captured once per
  padded batch size replays for any lengths. All query heads of one KV head share a program, so
  K/V are read once (GQA). A small reduce kernel merges the splits.
* :func:`paged_decode_fused` is the same decode as ONE launch per layer (fewer CUDA-graph nodes):
  it also stores the new tokens' K/V (the program of split 0 per row and KV head does) and merges
  the splits itself (the last split of a row and KV head to finish does, found by an atomic
  counter). The new token is attended where the three-launch path has it -- its own position in
  the last chunk of the last split -- but from the k/v inputs rounded to the cache dtype, never
  from the cache, so no program reads a slot that another program of the launch is writing, and
  the result is the three-launch path's, bit for bit.
* Decode is one sequence of operations everywhere (``_split_chunks``, ``_qk_step``, ``_pv_step``,
  ``_decode_epilogue``, ``decode_reduce``): the NPU-tile decode (triton_npu_attention.py) calls
  the same functions and differs only in where it loads a token's K/V from, so for the same K/V
  values, q and split count, every decode kernel gives the same bits.
* :func:`paged_prefill` is FlashAttention-2 style attention for a packed batch of variable-length
  query chunks over the paged cache (after their K/V were written), causal with bottom-right
  alignment: query ``i`` of a sequence with ``c`` cached tokens sees keys ``0 .. c + i``. It serves
  prompts, chunked prefill and mixed batches. One program per (query block of a sequence, q head).

Every function takes the caller's tensors and allocates only its output (unless ``out`` is given)
and, for decode, its split partials (unless given), so a benchmark can call them directly. The
layer cache is one ``[2, num_blocks, block_size, H, D]`` (NHD) or ``[2, num_blocks, H,
block_size, D]`` (HND) tensor of bf16, fp16 or fp32; q/k/v may be of another float dtype.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import triton
import triton.language as tl

from hawk.triton_launch import launch

__all__ = [
    "cache_strides",
    "decode_block_n",
    "decode_num_splits",
    "decode_qk_scale",
    "decode_reduce",
    "decode_splits",
    "decode_sm_count",
    "paged_decode",
    "paged_decode_fused",
    "paged_prefill",
    "prefill_block_m",
    "prefill_config",
    "prefill_programs",
    "write_kv",
]

_LOG2E = 1.4426950408889634
#: Masked scores and the running max start at a large finite negative (not -inf), so an
#: all-masked row never computes ``-inf - -inf``.
_NEG = tl.constexpr(-1.0e30)
#: Two workarounds for Triton's interpreter (the CPU tests), both compiled out on the GPU: loops with
#: tensor bounds run as ``while`` loops (its ``range`` calls ``int(array([x]))``, which numpy >= 2.3
#: rejects; compiled kernels keep ``for`` loops, which the software pipeliner needs), and ``tl.dot``
#: gets fp32 operands (it multiplies bf16 as raw integers).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cache_strides(cache: torch.Tensor, order: str) -> tuple[int, int, int, int]:
    """Element strides ``(kv, block, slot, head)`` of one layer cache; the dim stride must be 1."""
    if cache.dim() != 5 or cache.stride(4) != 1:
        raise ValueError(f"expected a 5-d layer cache with contiguous head_dim, got {tuple(cache.shape)}")
    s = cache.stride()
    if order == "NHD":
        return s[0], s[1], s[2], s[3]
    if order == "HND":
        return s[0], s[1], s[3], s[2]
    raise ValueError(f"unknown cache order {order!r}")


def _block_size(cache: torch.Tensor, order: str) -> int:
    return cache.shape[2] if order == "NHD" else cache.shape[3]


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products (tf32 would cost ~1e-3 relative error); 16-bit ones are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


# ---- KV write -------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cblk, stride_cslot, stride_chead,
    H, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)  # pads: a harmless address that the mask never touches
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D) & valid
    dst = cache_ptr + blk * stride_cblk + off * stride_cslot + h * stride_chead + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, order: str) -> None:
    """Store ``k, v [T, Hkv, D]`` (any float dtype, last dim contiguous) into ``cache`` at ``slot_mapping``.

    ``slot_mapping [>= T]`` int32 on the cache's device: flat slot ``block * block_size + offset``
    per token, ``-1`` for a token that must write nothing. Grid ``(T,)``: graph-safe for a fixed T.
    """
    t, h, d = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a contiguous last dim")
    skv, sblk, sslot, shead = cache_strides(cache, order)
    launch(
        _write_kv_kernel, (t,),
        k, v, cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        skv, sblk, sslot, shead,
        h, d,
        BLOCK_SIZE=_block_size(cache, order), BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _qk_step(q, k, smask, m_i, l_i, qk_scale,
             MASKED: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """First half of one online-softmax chunk: scores of ``k [N, D]``, new max, weights ``p``, new sum.

    Shared by every attention kernel here and by the NPU-tile decode (triton_npu_attention.py), so
    that two kernels given the same K/V values run the same operations in the same order and agree
    bit for bit however they addressed the loads. MASKED: scores where ``smask`` is False become
    ``_NEG`` (a chunk with no masked key must run unmasked in every kernel alike: the select
    decides whether the compiler may fuse the scale into the exponent's subtraction).
    """
    if INTERPRET:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        s = tl.where(smask, s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _pv_step(acc, p, alpha, v, vmask, q,
             MASKED: tl.constexpr, P_SCALE: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Second half of one online-softmax chunk: ``acc * alpha + p @ v`` (``v [N, D]``, q gives the dot dtype).

    MASKED zeroes V rows where ``vmask`` is False (they may hold anything, NaN bit patterns included).
    ``P_SCALE`` (a power of two) multiplies the rounded weights: a caller whose V is scaled by
    ``1 / P_SCALE`` gets the very same products ``p * v`` (exact power-of-two scaling), hence the
    same dot, bit for bit (the NPU kernel's fast bfloat8_b decode uses it; everyone else passes 1).
    """
    if MASKED:
        v = tl.where(vmask[:, None], v, 0.0)
    if INTERPRET:
        if P_SCALE != 1.0:
            p = p * P_SCALE
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        pb = p.to(q.dtype)
        if P_SCALE != 1.0:
            pb = (pb.to(tl.float32) * P_SCALE).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(pb, v.to(q.dtype), input_precision=DOT_PREC)
    return acc


@triton.jit
def _attn_tile(
    q, acc, m_i, l_i, k_base, bt_row, start, qpos, seq_len, qk_scale,
    stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One key tile of the (prefill) online softmax; MASKED applies the causal and length masks."""
    pos = start + offs_n
    nmask = pos < seq_len
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    row = blk * stride_cblk + (pos % BLOCK_SIZE) * stride_cslot
    kvmask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    smask = (pos[None, :] <= qpos[:, None]) & nmask[None, :]
    p, alpha, m_i, l_i = _qk_step(q, k, smask, m_i, l_i, qk_scale, MASKED, DOT_PREC, INTERPRET)
    v = tl.load(k_base + stride_ckv + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    acc = _pv_step(acc, p, alpha, v, nmask, q, MASKED, 1.0, DOT_PREC, INTERPRET)
    return acc, m_i, l_i


# ---- decode ---------------------------------------------------------------------------------


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 64) -> int:
    """Splits per sequence so ``batch * kv_heads * splits`` programs about fill the GPU once.

    Once, not more: a decode split of a short context is one or two chunks, so its time is latency,
    and each extra split adds a partial to merge. On an H200 (8B shape, context 1k, write + attention
    + reduce per layer, graph-timed over 32 layers' caches; 2026-12-01) batch 1 took 8.7 us at 16
    splits against 10.9 us at the 33 that filling it twice gave, batch 8 17.9 us at 4 against 25.2
    at 16.

    A function of the (padded) batch size only: a captured graph keeps its grid. Every decode
    backend (paged and NPU tiles) takes its split count from here, because the split boundaries
    fix the floating-point summation order: same count, same bits.
    """
    return max(1, min(max_splits, -(-num_sms // (batch * num_kv_heads))))


#: With ``split_tokens``, the most splits a row gets (the grid's third dimension): a row past its own
#: splits idles through the rest (cheap, not free), and a launch's rows may be a mixed graph's padded
#: ones, so the grid cannot shrink with the real batch.
SPLIT_GRID = 8


def decode_splits(batch: int, num_kv_heads: int, num_sms: int, max_len: int, split_tokens: int = 0,
                  max_splits: int = 64) -> tuple[int, int]:
    """``(grid splits, base splits)`` of a decode launch: :func:`decode_num_splits` for both without
    ``split_tokens``; with it, a grid wide enough for a ``max_len``-token row in programs of at most
    ``split_tokens`` tokens, within ``SPLIT_GRID`` (and ``max_splits``), each row taking as many of
    them as its own length needs (``_row_splits``), at least ``base``.

    Why: one split per row past 16 rows on 132 SMs, so a step's decode attention lasts as long as its
    longest row's programs stream alone (about 17 GB/s each on an H200, ``hawk/sim/colocated.py``'s
    ``RowStreams``), and a served batch's contexts spread (log-normal prompts): a 3,000-token row among
    850-token ones adds about 2 ms to an 8B step. A function of the batch size and the model's length
    alone: a captured graph keeps its grid; the rows' lengths choose on the device.
    """
    base = decode_num_splits(batch, num_kv_heads, num_sms, max_splits)
    if not split_tokens:
        return base, base
    return max(base, min(max_splits, SPLIT_GRID, -(-max_len // split_tokens))), base


def decode_sm_count(device: torch.device) -> int:
    """The SM count :func:`decode_num_splits` is given on ``device``: the GPU's, or 8 elsewhere (the
    interpreter), so CPU tests of every backend split alike (and small batches several ways)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_qk_scale(head_dim: int) -> float:
    """``log2(e) / sqrt(head_dim)``: the scale every decode kernel multiplies its scores by (one
    expression, so no backend rounds it differently)."""
    return _LOG2E / math.sqrt(head_dim)


@triton.jit
def _split_chunks(seq_len, sp, num_splits, BLOCK_N: tl.constexpr):
    """Split ``sp``'s tokens ``[lo, hi)`` of a ``seq_len``-token context, and ``tail``, the start of its
    last chunk: chunks ``[lo, tail)`` run unmasked, ``[tail, hi)`` (at most one) masked.

    Splits are whole BLOCK_N-token chunks aligned at multiples of BLOCK_N (chunk c covers tokens
    ``[c*BLOCK_N, (c+1)*BLOCK_N)``); a split past the end is empty (``tail >= hi``). Shared by every
    decode kernel: the same chunks in the same order, masked alike, is what makes them agree.
    """
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    tail = lo + tl.maximum(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N) - 1, 0) * BLOCK_N
    return lo, tail, hi


@triton.jit
def _row_splits(seq_len, num_splits, base_splits, SPLIT_TOKENS: tl.constexpr):
    """The splits a row's context runs in: the launch's ``num_splits`` for every row (SPLIT_TOKENS 0),
    or as many as programs of at most SPLIT_TOKENS tokens need, at least ``base_splits`` and at most
    the launch's (its grid). Shared by the split-K decode and its merges, which must agree on it."""
    if SPLIT_TOKENS == 0:
        return num_splits
    else:
        return tl.minimum(num_splits, tl.maximum(base_splits, tl.cdiv(seq_len, SPLIT_TOKENS)))


@triton.jit
def _decode_epilogue(
    acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, b, heads, hq, sp, num_splits,
    stride_ot, stride_oh, offs_d, hmask, dmask, D, DIRECT: tl.constexpr,
):
    """Store one split's result: the output itself (DIRECT, one split) or the normalized partial
    ``[B, Hq, S, D]`` with its log2-sum-exp for :func:`_merge_head`. An empty range (pad row, idle
    split) gives 0 and a neutral partial, not NaN. Shared by every decode kernel."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), _NEG)
        prow = (b * hq + heads) * num_splits + sp
        tl.store(part_out_ptr + prow[:, None].to(tl.int64) * D + offs_d[None, :], o, mask=omask)
        tl.store(part_lse_ptr + prow, lse, mask=hmask)


@triton.jit
def _decode_chunk(
    q, acc, m_i, l_i, k_base, bt_row, start, hi, new_pos, k_new, v_new, qk_scale,
    stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, NEW: tl.constexpr, DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One BLOCK_N-token chunk of paged decode: gather by block table, then the shared steps.

    NEW (the fused kernel's masked chunks): the row at ``new_pos`` is not read from the cache (split
    0 of this launch is writing it) but taken from ``k_new, v_new``, already rounded to the cache
    dtype -- the very values a read-back would give, in the same place of the same chunk, so the
    fused kernel computes exactly what the three-launch path does.
    """
    pos = start + offs_n
    nmask = pos < hi
    lmask = nmask
    if NEW:
        is_new = pos == new_pos
        lmask = nmask & (pos != new_pos)
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=lmask, other=0).to(tl.int64)
    row = blk * stride_cblk + (pos % BLOCK_SIZE) * stride_cslot
    kvmask = lmask[:, None] & dmask[None, :]
    k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    if NEW:
        k = tl.where(is_new[:, None], k_new[None, :], k)
    p, alpha, m_i, l_i = _qk_step(q, k, nmask[None, :], m_i, l_i, qk_scale, MASKED, DOT_PREC, INTERPRET)
    v = tl.load(k_base + stride_ckv + row[:, None] + offs_d[None, :], mask=kvmask, other=0.0)
    if NEW:
        v = tl.where(is_new[:, None], v_new[None, :], v)
    acc = _pv_step(acc, p, alpha, v, nmask, q, MASKED, 1.0, DOT_PREC, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, bt_ptr, seq_lens_ptr, slot_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    count_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ckv, stride_cblk, stride_cslot, stride_chead,
    stride_bt, num_splits, base_splits, G, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, DIRECT: tl.constexpr, FUSED: tl.constexpr, MERGE: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Split-K decode. FUSED also writes the new K/V; with MERGE the last split to finish merges the
    splits too (one launch), without it the caller's reduce launch does.

    All variants cover the same token ranges with the same chunks (the new token included, at its
    position), so they give the same bits; FUSED only sources the new row from registers.
    Without FUSED, k/v/slot pointers and strides are unused (the three-launch path); without MERGE,
    the count pointer is. SPLIT_TOKENS > 0: a row runs in :func:`_row_splits` of the grid's splits,
    and the programs past them store nothing (the merges read only a row's own).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    hkv = tl.num_programs(1)
    hq = hkv * G
    seq_len = tl.load(seq_lens_ptr + b)
    row_splits = _row_splits(seq_len, num_splits, base_splits, SPLIT_TOKENS)
    lo, tail, hi = _split_chunks(seq_len, sp, row_splits, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    dmask = offs_d < D
    heads = kvh * G + offs_h
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = cache_ptr + kvh * stride_chead
    if FUSED:
        k_new, v_new = _store_new_token(
            k_ptr + b * stride_kt + kvh * stride_kh, v_ptr + b * stride_vt + kvh * stride_vh,
            k_base, slot_ptr + b, sp, stride_ckv, stride_cblk, stride_cslot, offs_d, dmask, BLOCK_SIZE,
        )
    else:
        k_new = tl.zeros([BLOCK_D], cache_ptr.dtype.element_ty)
        v_new = k_new
    new_pos = seq_len - 1
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if INTERPRET:
        start = lo
        while start < tail:
            acc, m_i, l_i = _decode_chunk(q, acc, m_i, l_i, k_base, bt_row, start, hi, new_pos, k_new, v_new,
                                          qk_scale, stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                          BLOCK_SIZE, False, False, DOT_PREC, INTERPRET)
            start += BLOCK_N
        start = tail
        while start < hi:
            acc, m_i, l_i = _decode_chunk(q, acc, m_i, l_i, k_base, bt_row, start, hi, new_pos, k_new, v_new,
                                          qk_scale, stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                          BLOCK_SIZE, True, FUSED, DOT_PREC, INTERPRET)
            start += BLOCK_N
    else:
        for start in range(lo, tail, BLOCK_N):
            acc, m_i, l_i = _decode_chunk(q, acc, m_i, l_i, k_base, bt_row, start, hi, new_pos, k_new, v_new,
                                          qk_scale, stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                          BLOCK_SIZE, False, False, DOT_PREC, INTERPRET)
        for start in range(tail, hi, BLOCK_N):
            acc, m_i, l_i = _decode_chunk(q, acc, m_i, l_i, k_base, bt_row, start, hi, new_pos, k_new, v_new,
                                          qk_scale, stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                          BLOCK_SIZE, True, FUSED, DOT_PREC, INTERPRET)

    live = sp < row_splits
    _decode_epilogue(acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, b, heads, hq, sp, num_splits,
                     stride_ot, stride_oh, offs_d, hmask & live, dmask, D, DIRECT)
    if MERGE:
        if not DIRECT:
            if live:
                _last_split_merges(part_out_ptr, part_lse_ptr, out_ptr, count_ptr + b * hkv + kvh,
                                   b * hq + kvh * G, b * stride_ot + kvh * G * stride_oh, stride_oh,
                                   num_splits, row_splits, G, D, BLOCK_S, BLOCK_D, INTERPRET)


@triton.jit
def _store_new_token(
    k_row, v_row, k_base, slot_row, sp, stride_ckv, stride_cblk, stride_cslot, offs_d, dmask,
    BLOCK_SIZE: tl.constexpr,
):
    """Have split 0 store the new token's K/V in the cache; return them rounded to the cache dtype.

    The rounded rows are what :func:`write_kv` would store and a read-back would return. Split 0
    exists for every row (whatever the length), so exactly one program per (row, KV head) stores
    the token; a pad row (slot < 0) stores nothing. No program of the launch reads that slot.
    """
    k = tl.load(k_row + offs_d, mask=dmask, other=0.0).to(k_base.dtype.element_ty)
    v = tl.load(v_row + offs_d, mask=dmask, other=0.0).to(k_base.dtype.element_ty)
    slot = tl.load(slot_row).to(tl.int64)
    write = dmask & (sp == 0) & (slot >= 0)
    slot = tl.maximum(slot, 0)  # pads: a harmless address that the mask never touches
    dst = k_base + (slot // BLOCK_SIZE) * stride_cblk + (slot % BLOCK_SIZE) * stride_cslot + offs_d
    tl.store(dst, k, mask=write)
    tl.store(dst + stride_ckv, v, mask=write)
    return k, v


@triton.jit
def _last_split_merges(
    part_out_ptr, part_lse_ptr, out_ptr, count_ptr, row0, out_off, stride_oh, num_splits, row_splits, G, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    """After this split's partials are stored: the last of the (row, KV head)'s ``row_splits`` splits
    to arrive merges them (``num_splits``: the grid's, the partials' stride).

    The barrier makes every thread's partial stores happen before the one thread's acq_rel atomic
    (release: the other splits see them; acquire: the merger sees theirs). Partials are read past
    L1 (``.cg``), which is not coherent across SMs. The merger zeroes the counter for the next
    launch or graph replay (the launch boundary orders that store).
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == row_splits - 1:
        if INTERPRET:
            i = 0
            while i < G:
                _merge_head(part_out_ptr, part_lse_ptr, out_ptr + out_off + i * stride_oh, row0 + i,
                            num_splits, row_splits, D, BLOCK_S, BLOCK_D, ".cg")
                i += 1
        else:
            for i in range(0, G):
                _merge_head(part_out_ptr, part_lse_ptr, out_ptr + out_off + i * stride_oh, row0 + i,
                            num_splits, row_splits, D, BLOCK_S, BLOCK_D, ".cg")
        tl.store(count_ptr, 0)


@triton.jit
def _merge_head(
    part_out_ptr, part_lse_ptr, out_row, row, num_splits, row_splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr,
):
    """Merge one query head's first ``row_splits`` split partials (``row = b * Hq + h``; ``num_splits``
    a row's partials in the buffer) into its output row."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < row_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=smask, other=float("-inf"),
                  cache_modifier=CACHE)
    w = tl.exp2(lse - tl.max(lse, 0))  # the largest weight is 1, so the sum is >= 1
    prow = (row * num_splits + offs_s).to(tl.int64)
    o = tl.load(part_out_ptr + prow[:, None] * D + offs_d[None, :],
                mask=smask[:, None] & (offs_d[None, :] < D), other=0.0, cache_modifier=CACHE)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_row + offs_d, res.to(out_row.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr,
    stride_ot, stride_oh, num_splits, base_splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if SPLIT_TOKENS == 0:
        row_splits = num_splits
    else:
        row_splits = _row_splits(tl.load(seq_lens_ptr + b), num_splits, base_splits, SPLIT_TOKENS)
    _merge_head(part_out_ptr, part_lse_ptr, out_ptr + b * stride_ot + h * stride_oh, b * tl.num_programs(1) + h,
                num_splits, row_splits, D, BLOCK_S, BLOCK_D, "")


def decode_reduce(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                  seq_lens: torch.Tensor | None = None, base_splits: int = 1, split_tokens: int = 0) -> None:
    """Merge split partials ``part_out [B, Hq, S, D]``, ``part_lse [B, Hq, S]`` (contiguous fp32) into
    ``out [B, Hq, D]`` (last dim contiguous). Every split-K decode backend merges here: one merge
    code, one summation order. ``split_tokens`` (with ``seq_lens``, ``base_splits``): each row merges
    only the splits it ran in (:func:`_row_splits`)."""
    b, hq, d = out.shape
    if split_tokens and seq_lens is None:
        raise ValueError("split_tokens needs the rows' seq_lens")
    _decode_reduce_kernel[(b, hq)](
        part_out, part_lse, out, seq_lens if seq_lens is not None else part_lse, out.stride(0), out.stride(1),
        num_splits, base_splits, d,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(d), SPLIT_TOKENS=split_tokens,
    )


def decode_block_n(device: torch.device) -> int:
    """Keys per tile of the decode kernels: small under the interpreter, so tiny CPU test contexts
    still spread over several splits and exercise the merge."""
    return 64 if device.type == "cuda" else 16


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    order: str,
    num_splits: int,
    out: torch.Tensor | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    split_tokens: int = 0,
    base_splits: int = 1,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns ``out``.

    ``q [B, Hq, D]`` (last dim contiguous; bf16/fp16/fp32) where row ``b`` is sequence ``b``'s
    newest token, already written to the cache. ``block_tables [B, W]`` int32 (row stride read
    from the tensor), ``seq_lens [B]`` int32 = context length including the new token (0: a pad
    row, output 0). ``num_splits`` (see :func:`decode_num_splits`) fixes the grid. ``out`` ``[B,
    Hq, D]`` in q's dtype is allocated when None; ``part_out [B, Hq, S, D]`` and ``part_lse [B,
    Hq, S]`` fp32 scratch likewise (only used when ``num_splits > 1``). No host sync.
    Two launches when ``num_splits > 1`` (attention, then the reduce), else one.
    ``split_tokens`` > 0: row ``b`` runs in as many of the ``num_splits`` splits as programs of at most
    that many tokens need, at least ``base_splits`` (:func:`decode_splits`); other bits than without.
    """
    out, part_out, part_lse = _decode_buffers(q, num_splits, out, part_out, part_lse)
    _launch_decode(q, None, None, cache, block_tables, seq_lens, None, None, order, num_splits,
                   out, part_out, part_lse, block_n, num_warps, split_tokens, base_splits)
    if num_splits > 1:
        assert part_out is not None and part_lse is not None
        decode_reduce(part_out, part_lse, out, num_splits, seq_lens, base_splits, split_tokens)
    return out


def paged_decode_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    order: str,
    num_splits: int,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    merge: bool = True,
    split_tokens: int = 0,
    base_splits: int = 1,
) -> torch.Tensor:
    """:func:`write_kv` + :func:`paged_decode` in ONE launch (two with ``merge=False`` and several
    splits); returns ``out``.

    As :func:`paged_decode`, except that row ``b``'s new token is NOT yet in the cache: its
    ``k, v [B, Hkv, D]`` (last dim contiguous, any float dtype) are stored at ``slot_mapping[b]``
    (int32, ``< 0``: a pad row, nothing written) by this launch, and attended from the inputs.
    ``merge``: the last split of each (row, KV head) merges the splits in the same launch, using
    ``counters``, int32 scratch of ``>= B * Hkv`` zeros that each launch leaves zeroed again (keep
    one buffer for a captured graph; allocated when None); else a :func:`decode_reduce` launch
    follows (no counters). The last split's merge is serial (one program merges every head of its
    group), so at many splits the separate reduce can be the faster. No host sync. ``split_tokens``,
    ``base_splits``: as :func:`paged_decode`'s.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (b, hkv, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{b}, Hkv, {d}] like q, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v need a contiguous last dim")
    out, part_out, part_lse = _decode_buffers(q, num_splits, out, part_out, part_lse)
    if not merge:
        counters = None
    elif counters is None:
        counters = torch.zeros(b * hkv, dtype=torch.int32, device=q.device)
    elif counters.dtype != torch.int32 or counters.numel() < b * hkv:
        raise ValueError(f"counters must be int32 with >= {b * hkv} elements")
    _launch_decode(q, k, v, cache, block_tables, seq_lens, slot_mapping, counters, order, num_splits,
                   out, part_out, part_lse, block_n, num_warps, split_tokens, base_splits)
    if not merge and num_splits > 1:
        assert part_out is not None and part_lse is not None
        decode_reduce(part_out, part_lse, out, num_splits, seq_lens, base_splits, split_tokens)
    return out


def _decode_buffers(
    q: torch.Tensor, num_splits: int, out: torch.Tensor | None, part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The output and (with splits) the partials the caller did not give, allocated here."""
    b, hq, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        if part_out is None:
            part_out = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        if part_lse is None:
            part_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    return out, part_out, part_lse


def _launch_decode(
    q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor | None,
    counters: torch.Tensor | None, order: str, num_splits: int, out: torch.Tensor,
    part_out: torch.Tensor | None, part_lse: torch.Tensor | None, block_n: int, num_warps: int,
    split_tokens: int = 0, base_splits: int = 1,
) -> None:
    """One launch of :func:`_decode_kernel`; fused when ``k`` is given (then v and slots too), the
    last split merging when ``counters`` is given too."""
    if split_tokens < 0 or base_splits < 1 or base_splits > num_splits:
        raise ValueError(f"split_tokens {split_tokens} must be >= 0 and base_splits {base_splits} within 1..{num_splits}")
    b, hq, d = q.shape
    hkv = cache.shape[3] if order == "NHD" else cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    fused, merge = k is not None, counters is not None
    if k is not None:
        assert v is not None and slot_mapping is not None
        if k.shape[1] != hkv:
            raise ValueError(f"k has {k.shape[1]} heads, the cache {hkv}")
        count_arg = counters if counters is not None else seq_lens  # never touched without a merge
        new_kv = (k, v, slot_mapping, count_arg, k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    else:  # the kernel never touches these: any valid pointers, zero strides
        new_kv = (q, q, seq_lens, seq_lens, 0, 0, 0, 0)
    k_arg, v_arg, slot_arg, count_arg, skt, skh, svt, svh = new_kv
    skv, sblk, sslot, shead = cache_strides(cache, order)
    g = hq // hkv
    _decode_kernel[(b, hkv, num_splits)](
        q, k_arg, v_arg, cache, block_tables, seq_lens, slot_arg, out,
        part_out if part_out is not None else out, part_lse if part_lse is not None else out,
        count_arg, decode_qk_scale(d),
        q.stride(0), q.stride(1), skt, skh, svt, svh, out.stride(0), out.stride(1),
        skv, sblk, sslot, shead,
        block_tables.stride(0), num_splits, base_splits, g, d,
        BLOCK_SIZE=_block_size(cache, order), BLOCK_H=_pow2(g), BLOCK_N=block_n, BLOCK_D=_pow2(d),
        BLOCK_S=triton.next_power_of_2(num_splits), DIRECT=num_splits == 1, FUSED=fused, MERGE=fused and merge,
        SPLIT_TOKENS=split_tokens if num_splits > 1 else 0, DOT_PREC=_dot_precision(q.dtype), INTERPRET=_INTERPRET,
        num_warps=num_warps,
    )


# ---- prefill / mixed ------------------------------------------------------------------------


def prefill_programs(q_lens: np.ndarray, starts: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-program ``(sequence, query block)`` map for :func:`paged_prefill`, int32.

    Heaviest blocks (most keys to read) first, so the long tail of a ragged batch starts early.
    """
    nqb = -(-q_lens // block_m)
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), nqb)
    first = np.cumsum(nqb) - nqb
    blk = np.arange(int(nqb.sum()), dtype=np.int64) - np.repeat(first, nqb)
    work = starts[seq] + (blk + 1) * block_m
    idx = np.argsort(-work, kind="stable")
    return seq[idx].astype(np.int32), blk[idx].astype(np.int32)


# Triton keys compiled variants on each pointer's 16-byte alignment. These five are int32 slices of
# the metadata buffers whose offsets move with the batch's shape (a mixed step's prefill rows start
# after its decode rows: attention.leading_decode_rows), and are read one value at a time: specializing
# on them only bought a new ~1 s compile, mid-serving, for an unseen batch shape.
@triton.jit(do_not_specialize_on_alignment=["bt_ptr", "seq_lens_ptr", "q_start_ptr", "prog_seq_ptr", "prog_blk_ptr"])
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, q_start_ptr, prog_seq_ptr, prog_blk_ptr, out_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ckv, stride_cblk, stride_cslot, stride_chead,
    stride_bt, G, D,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    qb = tl.load(prog_blk_ptr + pid)
    q0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q0
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx0 = seq_len - q_len  # tokens cached before this chunk

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < q_len
    dmask = offs_d < D
    tok = (q0 + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    qpos = ctx0 + offs_m
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + (h // G) * stride_chead
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt

    # Keys every row of this block sees need no mask; the diagonal band after them does. A padded
    # prefill's pad row has no context (seq_len 0, so ctx0 < 0): the clamps leave it nothing to read.
    full_hi = tl.maximum(((ctx0 + qb * BLOCK_M + 1) // BLOCK_N) * BLOCK_N, 0)
    hi = tl.maximum(ctx0 + tl.minimum((qb + 1) * BLOCK_M, q_len), 0)
    if INTERPRET:
        start = 0
        while start < hi:
            acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_base, bt_row, start, qpos, seq_len, qk_scale,
                                       stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                       BLOCK_SIZE, True, DOT_PREC, INTERPRET)
            start += BLOCK_N
    else:
        for start in range(0, full_hi, BLOCK_N):
            acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_base, bt_row, start, qpos, seq_len, qk_scale,
                                       stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                       BLOCK_SIZE, False, DOT_PREC, INTERPRET)
        for start in range(full_hi, hi, BLOCK_N):
            acc, m_i, l_i = _attn_tile(q, acc, m_i, l_i, k_base, bt_row, start, qpos, seq_len, qk_scale,
                                       stride_ckv, stride_cblk, stride_cslot, offs_n, offs_d, dmask,
                                       BLOCK_SIZE, True, DOT_PREC, INTERPRET)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_block_m(device: torch.device, head_dim: int) -> int:
    """Query rows per program of :func:`paged_prefill` (the program map in ``begin`` depends on it)."""
    if device.type != "cuda":
        return 16  # the interpreter: small tiles keep the CPU tests fast
    return 128 if head_dim <= 128 else 64


def prefill_config(q: torch.Tensor) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` for :func:`paged_prefill` on q's device and dtype."""
    if q.device.type != "cuda":
        return 16, 4, 1
    if q.dtype == torch.float32 or q.shape[2] > 128:
        return 32, 8, 2
    return 64, 8, 3


def paged_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: torch.Tensor,
    prog_seq: torch.Tensor,
    prog_blk: torch.Tensor,
    order: str,
    block_m: int,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of a packed batch of query chunks over their paged contexts; returns ``out``.

    ``q [T, Hq, D]``: sequence ``s``'s queries are rows ``q_start[s] .. q_start[s+1]`` (int32
    ``[N+1]``), its newest tokens, whose K/V are already in the cache; ``seq_lens [N]`` int32 is
    its context length including them. ``block_tables [N, W]`` int32. ``prog_seq, prog_blk [P]``
    int32 from :func:`prefill_programs` with the same ``block_m`` (grid ``(P, Hq)``). ``out [T,
    Hq, D]`` in q's dtype is allocated when None.
    """
    t, hq, d = q.shape
    hkv = cache.shape[3] if order == "NHD" else cache.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    if out is None:
        out = torch.empty_like(q)
    bn, nw, ns = prefill_config(q)
    skv, sblk, sslot, shead = cache_strides(cache, order)
    launch(
        _prefill_kernel, (prog_seq.shape[0], hq),
        q, cache, block_tables, seq_lens, q_start, prog_seq, prog_blk, out,
        _LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        skv, sblk, sslot, shead,
        block_tables.stride(0), hq // hkv, d,
        BLOCK_SIZE=_block_size(cache, order), BLOCK_M=block_m, BLOCK_N=block_n or bn, BLOCK_D=_pow2(d),
        DOT_PREC=_dot_precision(q.dtype), INTERPRET=_INTERPRET, num_warps=num_warps or nw, num_stages=num_stages or ns,
    )
    return out
