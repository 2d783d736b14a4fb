"""Attention over a vLLM-layout paged KV cache (the GPU side: prefill, and decode for gg-* / colocated).

On CUDA (with Triton) a forward layer has no Python loop over sequences. A decode layer (every
``q_len == 1``) is ONE launch when the batch needs a single split: attention that also stores the
new K/V (:func:`~hawk.engine.triton_attention.paged_decode_fused`); with several splits it is two
launches (that attention, then the split reduce), which measured faster than the fused kernel's
serial last-program merge; :class:`DecodePath` names the three ways. ``HAWK_FUSED_DECODE=0|1``
(read at import) or ``fused_decode=`` forces one. A prefill or mixed layer is two: write the K/V,
then FlashAttention-style varlen attention over the paged cache (:mod:`hawk.engine.triton_attention`);
a mixed layer's leading one-token rows go to the decode kernel. Elsewhere the same metadata drives a
torch fallback: on a CPU in bf16/fp16 where vLLM is installed, every row of a forward in one call
of vLLM's CPU kernel (:mod:`hawk.engine.vllm_cpu_kernel`: vLLM's bits); without vLLM the decode rows
(a mixed batch's leading ones too) attend in fp32 in a few length groups per layer
(:mod:`hawk.engine.cpu_attention`), else batched gather + SDPA; one :func:`attend` per sequence for
prompt chunks.

``begin`` builds all metadata on the host with numpy and uploads it in two copies into device
buffers allocated once, so the decode path is CUDA-graph safe (see :class:`PagedBackend`). A decode
step on the Triton path takes a shortcut: block-table rows are cached per staging slot and only
the blocks a sequence gained since are written (a step of 64 sequences at 1k context costs a few
tens of microseconds of host time instead of ~130).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from enum import Enum
from itertools import chain, islice
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hawk.devices.staging import HostStaging
from hawk.engine.attention import SeqSlice, attend, leading_decode_rows
from hawk.engine.cpu_attention import DecodePlan, DecodeWorkspace, decode_groups
from hawk.engine.cpu_numerics import widens
from hawk.engine.vllm_cpu_kernel import BLOCK_MULTIPLE, IN_PLACE_ISAS, BlockPlan, InPlacePlan, KernelAttention, block_plan, in_place_plan, kernel_isa
from hawk.layouts.gpu import GpuKVLayout

__all__ = ["PagedAttention", "SeqSlice"]

#: Extra metadata room beyond ``3 * max_batch + 1``: prefill slots and the program map.
_META_EXTRA = 3 * 8192
#: Default of ``PagedAttention(fused_decode=None)``: ``HAWK_FUSED_DECODE`` = "auto" (MERGED when the
#: batch needs one split, else WRITE_REDUCE), "1" (always MERGED) or "0" (always SEPARATE). "auto" because
#: the fused kernel's last-program merge is serial: on an H200 (8B shape, batch 1, 1k context, 33 splits)
#: the MERGED step took 5.37 ms against 5.11 ms for SEPARATE, while at batch 64 (one split) MERGED was the
#: faster (7.55 against 7.60 ms).
_FUSED_DECODE: bool | None = {"0": False, "1": True}.get(os.environ.get("HAWK_FUSED_DECODE", "auto"))


class DecodePath(str, Enum):
    """How a Triton decode layer is launched; all three give the same bits."""

    MERGED = "merged"  #: one launch: K/V write, split-K attention, the last split merges
    WRITE_REDUCE = "write+reduce"  #: the attention launch writes the K/V; a reduce launch merges (splits > 1)
    SEPARATE = "separate"  #: K/V write, attention, reduce: three launches


def _load_triton() -> ModuleType | None:
    """The Triton kernels, or None where Triton is not installed (CI, CPU-only hosts)."""
    try:
        from hawk.engine import triton_attention
    except ImportError:
        return None
    return triton_attention


class PagedAttention:
    """A :class:`~hawk.engine.attention.PagedBackend` over one paged cache tensor per layer.

    ``max_batch`` sequences and ``max_model_len`` tokens per sequence (default: the whole cache)
    size the block table; a larger batch regrows the buffers (bumping :attr:`generation`, which
    invalidates captured graphs). ``use_triton`` forces the Triton path (True, e.g. on CPU under
    ``TRITON_INTERPRET=1``) or the torch path (False); None picks Triton on CUDA when installed.
    ``fused_decode`` picks the Triton decode path (:class:`DecodePath`): MERGED (True), SEPARATE
    (False), or MERGED at one split and WRITE_REDUCE at several (None, following ``HAWK_FUSED_DECODE``;
    default).
    """

    def __init__(
        self,
        layout: GpuKVLayout,
        caches: Sequence[torch.Tensor],
        max_batch: int = 256,
        max_model_len: int | None = None,
        *,
        use_triton: bool | None = None,
        fused_decode: bool | None = None,
        decode_split_tokens: int = 0,
    ) -> None:
        layout.check_cache(list(caches))
        if max_batch <= 0:
            raise ValueError(f"max_batch must be > 0, got {max_batch}")
        self.layout, self.caches = layout, list(caches)
        self.device = self.caches[0].device
        cuda = self.device.type == "cuda"
        self._ta = _load_triton() if (use_triton or (use_triton is None and cuda)) else None
        if use_triton and self._ta is None:
            raise RuntimeError("use_triton=True but triton is not importable")
        #: The PagedBackend contract holds: CUDA caches and the Triton kernels.
        self.graph_safe = cuda and self._ta is not None
        #: One launch per decode layer (see the module docstring); only the Triton path reads it.
        self.fused_decode = _FUSED_DECODE if fused_decode is None else fused_decode
        bs = layout.block_size
        self.max_blocks_per_seq = -(-max_model_len // bs) if max_model_len else layout.num_blocks
        self.max_model_len = self.max_blocks_per_seq * bs
        self._num_sms = self._ta.decode_sm_count(self.device) if self._ta else 1
        if decode_split_tokens < 0:
            raise ValueError(f"decode_split_tokens must be >= 0, got {decode_split_tokens}")
        #: Triton decode: each row's attention in programs of at most this many tokens (0: the split
        #: count set by the rows alone, every row alike; ``triton_attention.decode_splits``)
        self.decode_split_tokens = decode_split_tokens if self._ta else 0
        self._block_m = self._ta.prefill_block_m(self.device, layout.head_dim) if self._ta else 0
        self._decode_block_n = self._ta.decode_block_n(self.device) if self._ta else 0
        #: Bumped whenever the device buffers are reallocated (their addresses change).
        self.generation = 0
        self._cap_batch = 0
        self._alloc(max_batch, 3 * max_batch + 1 + _META_EXTRA)
        # Host-side view of the current batch (set by begin).
        self._n = self._n_real = self._tokens = 0
        self._decode = False
        self._q_lens: list[int] = []
        self._starts: list[int] = []
        self._views: dict[str, torch.Tensor] = {}
        self._host: dict[str, torch.Tensor] = {}
        #: The torch path on a CPU: the leading one-token rows' blocks (set by begin) and the kept
        #: buffers they are attended in (:mod:`hawk.engine.cpu_attention`).
        self._cpu_plans: list[DecodePlan] = []
        self._cpu_ws = DecodeWorkspace()
        #: On a CPU where vLLM is installed, every row of a forward through vLLM's CPU kernel (its
        #: bits: :mod:`hawk.engine.vllm_cpu_kernel`): the step's plan (set by begin) and its kept copy.
        isa = kernel_isa(layout.head_dim, self.caches[0].dtype) if self.device.type == "cpu" else None
        self._kernel = KernelAttention(isa) if isa is not None else None
        self._kernel_plan: BlockPlan | InPlacePlan | None = None
        #: A "vec" cache is in the kernel's order, read in place; only the kernel reads it.
        self._in_place = layout.order == "vec"
        if self._in_place and (isa not in IN_PLACE_ISAS or self._ta is not None or bs % BLOCK_MULTIPLE):
            raise ValueError(f"a 'vec' cache is read by vLLM's CPU kernel only (on a CPU where it loads, blocks of a multiple of "
                             f"{BLOCK_MULTIPLE} tokens, not through Triton); here: kernel {isa}, block_size {bs}, triton {self._ta is not None}")

    # ---- buffers ------------------------------------------------------------------------------

    def _alloc(self, cap_batch: int, cap_meta: int) -> None:
        """(Re)allocate the device metadata buffers, their staging ring and the split partials."""
        w, dev = self.max_blocks_per_seq, self.device
        cuda = dev.type == "cuda"
        self._cap_batch, self._cap_meta = cap_batch, cap_meta
        self._bt_dev = torch.zeros((cap_batch, w), dtype=torch.int32, device=dev)
        self._meta_dev = torch.zeros(cap_meta, dtype=torch.int32, device=dev)
        if getattr(self, "_staging", None) is not None:
            self._staging.close()  # its uploads went to the buffers being replaced
        # begin() fills one pinned slot while the other's copy may still be queued (on the host the
        # buffers are their own staging).
        self._staging = HostStaging([self._bt_dev, self._meta_dev], slots=2 if cuda else 1)
        # Per staging slot, per block-table row: (block list, blocks written, last block written),
        # so a decode step rewrites only what changed (see _begin_decode).
        self._row_cache: list[list[tuple[Sequence[int], int, int]]] = [[] for _ in range(2 if cuda else 1)]
        self._view_cache: dict[tuple[int, int, int, int], dict[str, torch.Tensor]] = {}
        self._decode_qstart = np.arange(cap_batch + 1, dtype=np.int32)
        # Split partials are sized per query head; the model's Hq is only known at the first call.
        self._part_rows = max(b * self._splits(b) for b in range(1, cap_batch + 1))
        self._part_out: torch.Tensor | None = None
        self._part_lse: torch.Tensor | None = None
        # The fused decode's split counters, one per (row, KV head): zeroed here, and every launch
        # leaves them zeroed, so a captured graph replays from a clean state.
        self._counters = torch.zeros(cap_batch * self.layout.num_kv_heads, dtype=torch.int32, device=dev)
        self.generation += 1

    def decode_path(self, batch: int) -> DecodePath:
        """How a decode layer of ``batch`` rows is launched on the Triton path."""
        if self.fused_decode is None:
            return DecodePath.MERGED if self._splits(batch) == 1 else DecodePath.WRITE_REDUCE
        return DecodePath.MERGED if self.fused_decode else DecodePath.SEPARATE

    def _splits(self, batch: int) -> int:
        """The decode launch's grid splits at ``batch`` rows."""
        return self._split_counts(batch)[0]

    def _split_counts(self, batch: int) -> tuple[int, int]:
        """``(grid, base)`` splits of a decode launch at ``batch`` rows (``decode_splits``)."""
        if self._ta is None:
            return 1, 1
        return self._ta.decode_splits(batch, self.layout.num_kv_heads, self._num_sms, self.max_model_len, self.decode_split_tokens)

    def _partials(self, n: int, hq: int, splits: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the persistent split scratch, allocated once for the largest batch."""
        rows = self._part_rows * hq
        if self._part_out is None or self._part_out.numel() < rows * d:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("PagedAttention: run one eager decode step before capturing a graph")
            self._part_out = torch.empty(rows * d, dtype=torch.float32, device=self.device)
            self._part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        assert self._part_lse is not None
        m = n * hq * splits
        return self._part_out[: m * d].view(n, hq, splits, d), self._part_lse[:m].view(n, hq, splits)

    # ---- begin --------------------------------------------------------------------------------

    def begin(self, batch: Sequence[SeqSlice], pad_to: int | None = None, pad_tokens: int | None = None,
              pad_decode: int | None = None) -> None:
        """Declare the next forward's sequences, in the order their tokens are concatenated.

        ``pad_to`` (a decode batch) appends dummy rows up to that many sequences: slot -1 (no write)
        and context length 0 (no read, output 0). ``pad_tokens`` (a prefill batch; needs ``pad_to`` >
        the batch): the batch is padded to that many tokens and ``pad_to`` rows, so a prefill CUDA
        graph sees one metadata shape per bucket. Row ``len(batch)`` holds the pad tokens (slot -1,
        no context: output 0), the rows after it are empty, and the attention's program map is
        padded with programs that do nothing.

        ``pad_decode`` (with ``pad_tokens``; a mixed batch: its leading one-token rows, then prompt
        chunks): the decode kernel runs over ``pad_decode`` rows, those rows then empty ones, and the
        chunks are padded as a prefill's in the rows and tokens that are left; the tokens stay packed,
        and what the decode kernel writes for its empty rows lands on chunk or pad tokens, which the
        prefill kernel, launched after it, writes again. Every count of the metadata and every launch's
        shape is then fixed by (``pad_decode``, ``pad_to``, ``pad_tokens``): a mixed step's CUDA graph
        (runner.py). The torch path, whose metadata no graph reads, pads such a batch as a prefill's.
        """
        n_real = len(batch)
        if n_real == 0 and not pad_to:
            raise ValueError("begin() needs at least one sequence (or pad_to: a batch of pad rows, for graph capture)")
        if pad_decode is not None and (pad_to is None or pad_tokens is None):
            raise ValueError("pad_decode needs pad_to and pad_tokens (a mixed step's graph bucket)")
        if pad_tokens is None and self._ta is not None and self.fast_decode and all(s.q_len == 1 for s in batch):
            self._begin_decode(batch, n_real if pad_to is None else pad_to)
            return
        q_lens = np.fromiter((s.q_len for s in batch), dtype=np.int64, count=n_real)
        starts = np.fromiter((s.start for s in batch), dtype=np.int64, count=n_real)
        decode = pad_tokens is None and bool((q_lens == 1).all())
        if pad_decode is not None:
            lead, t_real = leading_decode_rows(q_lens), int(q_lens.sum())
            if not lead <= pad_decode <= pad_tokens or pad_to <= pad_decode + n_real - lead or pad_tokens < t_real:
                raise ValueError(f"a mixed batch of {lead} decode rows and {n_real - lead} chunks ({t_real} tokens) does not fit "
                                 f"pad_decode={pad_decode}, pad_to={pad_to}, pad_tokens={pad_tokens}")
        n = n_real
        if pad_tokens is not None:
            if pad_to is None or pad_to <= n_real:
                raise ValueError(f"pad_tokens needs pad_to > the batch ({n_real}): one row holds the pad tokens")
            n = pad_to
        elif pad_to is not None:
            if not decode:
                raise ValueError("pad_to without pad_tokens is for decode batches only (every q_len == 1)")
            if pad_to < n_real:
                raise ValueError(f"pad_to={pad_to} is smaller than the batch ({n_real})")
            n = pad_to
        ctx = starts + q_lens
        need = self._check_rows(batch, q_lens, starts, ctx)

        t_real = int(q_lens.sum())
        t = t_real + (n - n_real) if pad_tokens is None else pad_tokens
        if t < t_real:
            raise ValueError(f"pad_tokens={pad_tokens} is smaller than the batch's {t_real} tokens")
        # The leading one-token rows the decode kernel takes (a mixed batch's), and the rows it runs over:
        # ``pad_decode`` of them, the rows past the real ones empty (the torch path pads a prefill's way).
        n_dec = leading_decode_rows(q_lens) if (self._ta and not decode and (pad_tokens is None or pad_decode is not None)) else 0
        g = n_dec if pad_decode is None or self._ta is None else pad_decode
        row_of = np.arange(n_real)
        row_of[n_dec:] += g - n_dec
        progs = self._ta.prefill_programs(q_lens[n_dec:], starts[n_dec:], self._block_m) if (self._ta and not decode) else None
        if progs is not None and pad_tokens is not None:  # a count fixed by the bucket
            progs = _pad_programs(progs, n_real - n_dec, t - t_real, -(-t // self._block_m) + n - g, self._block_m)
        p = 0 if progs is None else len(progs[0])
        meta_len = 2 * n + 1 + t + 2 * p
        if n > self._cap_batch or meta_len > self._cap_meta:
            self._alloc(max(n, self._cap_batch), max(meta_len, self._cap_meta))

        bt_np, meta_np = self._staging.next()
        self._row_cache[self._staging.slot] = []  # rows rewritten below: forget what the slot held
        self._fill_block_tables(bt_np, batch, need, row_of)
        # Meta: seq_lens [n] | q_start [n+1] | slots [t] | prog_seq [p] | prog_blk [p]
        seq_lens = meta_np[:n]
        seq_lens[:] = 0
        seq_lens[row_of] = ctx
        q_start = meta_np[n : 2 * n + 1]  # the prefill kernel reads rows g.. of it
        q_start[0] = 0
        q_start[row_of + 1] = np.cumsum(q_lens)
        q_start[n_dec + 1 : g + 1] = n_dec  # the decode kernel's empty rows hold no token
        end = g + n_real - n_dec  # rows up to the last real one
        if pad_tokens is None:  # a decode pad row holds one token
            q_start[end + 1 :] = t_real + np.arange(1, n - end + 1)
        else:  # the first pad row holds every pad token, the rest none
            q_start[end + 1 :] = t
        slots = meta_np[2 * n + 1 : 2 * n + 1 + t]
        self._fill_slots(slots, bt_np, row_of, starts, q_lens)
        if progs is not None:
            meta_np[2 * n + 1 + t : 2 * n + 1 + t + p] = progs[0]
            meta_np[2 * n + 1 + t + p : meta_len] = progs[1]
        self._staging.upload((n * self.max_blocks_per_seq, meta_len))

        self._set_views(n, t, p, meta_len, g)
        self._n, self._n_real, self._tokens, self._decode = n, n_real, t, decode
        self._q_lens, self._starts = q_lens.tolist(), starts.tolist()
        if self._ta is None:
            self._host_metadata(bt_np, slots[:t_real], need, ctx)

    def _check_rows(self, batch: Sequence[SeqSlice], q_lens: np.ndarray, starts: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """The blocks each row's context needs, once every row is checked to have them within ``max_model_len``."""
        if (q_lens <= 0).any() or (starts < 0).any():
            raise ValueError(f"every q_len must be > 0 and start >= 0, got {[(s.start, s.q_len) for s in batch]}")
        need = -(-ctx // self.layout.block_size)
        have = np.fromiter((len(s.block_ids) for s in batch), dtype=np.int64, count=len(batch))
        bad = np.nonzero(have < need)[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"sequence needs {need[i]} blocks for {ctx[i]} tokens, has {have[i]}")
        if (need > self.max_blocks_per_seq).any():
            raise ValueError(f"a sequence of {int(ctx.max())} tokens exceeds max_model_len={self.max_model_len}")
        return need

    @staticmethod
    def _fill_block_tables(bt_np: np.ndarray, batch: Sequence[SeqSlice], need: np.ndarray, row_of: np.ndarray) -> None:
        """Row ``row_of[i]`` of the block table gets the blocks sequence ``i``'s context needs (the kernels never read further)."""
        rows = np.repeat(row_of, need)
        cols = np.arange(int(need.sum())) - np.repeat(np.cumsum(need) - need, need)
        bt_np[rows, cols] = np.fromiter(
            chain.from_iterable(islice(s.block_ids, int(k)) for s, k in zip(batch, need)), dtype=np.int64
        )

    def _fill_slots(self, slots: np.ndarray, bt_np: np.ndarray, row_of: np.ndarray, starts: np.ndarray, q_lens: np.ndarray) -> None:
        """Each real token's cache slot in token order, from the block table rows ``row_of`` (the rest
        -1: pad tokens write nothing)."""
        bs, t_real = self.layout.block_size, int(q_lens.sum())
        tok_row = np.repeat(row_of, q_lens)
        tok_pos = np.repeat(starts, q_lens) + np.arange(t_real) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        slots[:t_real] = bt_np[tok_row, tok_pos // bs].astype(np.int64) * bs + tok_pos % bs
        slots[t_real:] = -1

    #: Take the decode shortcut (tests switch it off to compare against the general path).
    fast_decode = True

    def _begin_decode(self, batch: Sequence[SeqSlice], n: int) -> None:
        """:meth:`begin` for a decode batch on the Triton path, in plain Python over the rows.

        Block-table rows persist in each staging slot: a row whose sequence passes the same block
        list object as when the row was written gets only its new blocks, otherwise the row is
        rewritten. That relies on a block list being append-only while the same object is passed
        (engines hand a new list when they reassign blocks; every caller here does). The last
        cached block is re-checked, which catches a list cleared and refilled in place.
        """
        n_real, bs, w = len(batch), self.layout.block_size, self.max_blocks_per_seq
        if n < n_real:
            raise ValueError(f"pad_to={n} is smaller than the batch ({n_real})")
        meta_len = 3 * n + 1
        if n > self._cap_batch or meta_len > self._cap_meta:
            self._alloc(max(n, self._cap_batch), max(meta_len, self._cap_meta))
        bt_np, meta_np = self._staging.next()
        cache = self._row_cache[self._staging.slot]
        del cache[n_real:]
        seq_lens: list[int] = []
        slots: list[int] = []
        for i, s in enumerate(batch):
            start, ids = s.start, s.block_ids
            need = start // bs + 1
            if start < 0:
                raise ValueError(f"every q_len must be > 0 and start >= 0, got start={start}")
            if len(ids) < need:
                raise ValueError(f"sequence needs {need} blocks for {start + 1} tokens, has {len(ids)}")
            if need > w:
                raise ValueError(f"a sequence of {start + 1} tokens exceeds max_model_len={self.max_model_len}")
            done = 0
            if i < len(cache):
                old, k, last = cache[i]
                if old is ids and len(ids) >= k and ids[k - 1] == last:
                    done = k
            if need > done:
                bt_np[i, done:need] = ids[done:need]
                cache_row = (ids, need, ids[need - 1])
                if i < len(cache):
                    cache[i] = cache_row
                else:
                    cache.append(cache_row)
            seq_lens.append(start + 1)
            slots.append(ids[need - 1] * bs + start % bs)
        # Meta: seq_lens [n] | q_start [n+1] (0..n: one token per row, pads included) | slots [n]
        meta_np[:n_real] = seq_lens
        meta_np[n_real:n] = 0
        meta_np[n : 2 * n + 1] = self._decode_qstart[: n + 1]
        meta_np[2 * n + 1 : 2 * n + 1 + n_real] = slots
        meta_np[2 * n + 1 + n_real : meta_len] = -1
        self._staging.upload((n * w, meta_len))
        self._set_views(n, n, 0, meta_len)
        self._n, self._n_real, self._tokens, self._decode = n, n_real, n, True
        self._q_lens, self._starts = [1] * n_real, [s.start for s in batch]

    def _set_views(self, n: int, t: int, p: int, meta_len: int, n_dec: int = 0) -> None:
        """Name the regions of the device buffers that this batch's metadata occupies (kept per
        shape: a decode step of a known shape makes no tensor views). ``n_dec`` > 0: a mixed batch's
        leading decode rows get views of their own (``dec_*``), and the prefill kernel's views start
        after them (its program map indexes those rows from 0)."""
        key = (n, t, p, meta_len, n_dec)
        views = self._view_cache.get(key)
        if views is None:
            bt_d, meta_d = self._bt_dev, self._meta_dev
            views = self._view_cache[key] = {
                "block_tables": bt_d[n_dec:n],
                "seq_lens": meta_d[n_dec:n],
                "q_start": meta_d[n + n_dec : 2 * n + 1],
                "slots": meta_d[2 * n + 1 : 2 * n + 1 + t],
                "prog_seq": meta_d[2 * n + 1 + t : 2 * n + 1 + t + p],
                "prog_blk": meta_d[2 * n + 1 + t + p : meta_len],
            }
            if n_dec:
                views["dec_block_tables"], views["dec_seq_lens"] = bt_d[:n_dec], meta_d[:n_dec]
            if len(self._view_cache) > 64:  # prefill shapes vary: keep the cache small
                self._view_cache.pop(next(iter(self._view_cache)))
        self._views = views

    def _host_metadata(self, bt_np: np.ndarray, slots: np.ndarray, need: np.ndarray, ctx: np.ndarray) -> None:
        """Index tensors for the torch path (on the cache's device), and on a CPU the plan of the
        leading one-token rows (all rows of a decode batch), computed once for every layer."""
        dev, n_real = self.device, self._n_real
        width = int(need.max(initial=0))
        self._host = {
            "slots": torch.from_numpy(slots.astype(np.int64)).to(dev),
            "block_tables": torch.from_numpy(bt_np[:n_real, :width].astype(np.int64)).to(dev),
        }
        self._need, self._ctx = need.tolist(), ctx.tolist()
        n_dec = n_real if self._decode else leading_decode_rows(self._q_lens)
        self._cpu_plans, self._kernel_plan = [], None
        if self._kernel is not None and n_real and self._in_place:
            self._kernel_plan = in_place_plan(bt_np[:n_real, : max(width, 1)], ctx, np.asarray(self._q_lens))
        elif self._kernel is not None and n_real:
            self._kernel_plan = block_plan(bt_np[:n_real], ctx, np.asarray(self._q_lens), self.layout.block_size)
        elif dev.type == "cpu" and n_dec:
            self._cpu_plans = decode_groups(bt_np[:n_dec], ctx[:n_dec], self.layout.block_size)
        if not self._in_place and self._decode and n_real > 1 and (ctx != width * self.layout.block_size).any():
            keys = torch.arange(width * self.layout.block_size, device=dev)
            self._host["mask"] = (keys[None, :] < torch.from_numpy(ctx).to(dev)[:, None])[:, None, None, :]

    # ---- forward ------------------------------------------------------------------------------

    #: Called as ``after_layer(layer, marker)`` once a layer's K/V are written: how a layer-wise KV
    #: push (kv_flow=layerwise) learns that a layer is ready. ``marker`` None: enqueued on the calling
    #: thread's current stream (an eager forward calls it here, as it passes the layer); else a CUDA
    #: event that completes once they are written (a prefill graph's, called after its replay is
    #: launched, see runner.py). The prefill engine sets it around one forward; None otherwise.
    after_layer: Callable[[int, Any], None] | None = None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._attend(layer_idx, q, k, v)
        if self.after_layer is not None:
            self.after_layer(layer_idx, None)
        return out

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self._tokens:
            raise ValueError(f"batch has {q.shape[0]} tokens but begin() declared {self._tokens}")
        cache = self.caches[layer_idx]
        if self._ta is not None:
            return self._forward_triton(cache, q, k, v)
        if self._n_real == 0:  # pad rows only: nothing to write or read
            return torch.zeros_like(q)
        self._write_torch(cache, k, v)
        if self._kernel_plan is not None and q.dtype == cache.dtype:
            return self._attend_kernel(cache, q)
        if self._in_place:
            raise ValueError(f"a 'vec' cache ({cache.dtype}) is read by vLLM's CPU kernel only, which takes q in its dtype, got {q.dtype}")
        if self._decode:
            return self._decode_torch(cache, q)
        return self._prefill_torch(cache, q, k, v)

    def _forward_triton(self, cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ta, vw, order = self._ta, self._views, self.layout.order
        assert ta is not None
        if self._decode:
            path = self.decode_path(self._n)
            if path is not DecodePath.SEPARATE:
                return self._decode_fused(cache, q, k, v, merge=path is DecodePath.MERGED)
        ta.write_kv(k, v, cache, vw["slots"], order)
        if self._decode:
            return self._paged_decode(cache, q, vw["block_tables"], vw["seq_lens"])
        out = None
        if "dec_seq_lens" in vw:  # a mixed batch: its decode rows first, by the decode kernel
            out = torch.empty_like(q)
            n_dec = vw["dec_seq_lens"].shape[0]
            self._paged_decode(cache, q[:n_dec], vw["dec_block_tables"], vw["dec_seq_lens"], out[:n_dec])
        return ta.paged_prefill(q, cache, vw["block_tables"], vw["seq_lens"], vw["q_start"],
                                vw["prog_seq"], vw["prog_blk"], order, self._block_m, out=out)

    def _paged_decode(self, cache: torch.Tensor, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """One query token per row over K/V already in the cache, split by the row count."""
        assert self._ta is not None
        n = q.shape[0]
        splits, base = self._split_counts(n)
        part_out, part_lse = self._partials(n, q.shape[1], splits, q.shape[2])
        return self._ta.paged_decode(q, cache, block_tables, seq_lens, self.layout.order, splits, out=out,
                                     part_out=part_out, part_lse=part_lse, block_n=self._decode_block_n,
                                     split_tokens=self.decode_split_tokens, base_splits=base)

    def _decode_fused(self, cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      merge: bool) -> torch.Tensor:
        """A decode layer whose attention launch writes the K/V: the split merge in it (``merge``) or after it."""
        ta, vw = self._ta, self._views
        assert ta is not None
        splits, base = self._split_counts(self._n)
        part_out, part_lse = self._partials(self._n, q.shape[1], splits, q.shape[2])
        return ta.paged_decode_fused(q, k, v, cache, vw["block_tables"], vw["seq_lens"], vw["slots"],
                                     self.layout.order, splits, counters=self._counters,
                                     part_out=part_out, part_lse=part_lse, block_n=self._decode_block_n,
                                     merge=merge, split_tokens=self.decode_split_tokens, base_splits=base)

    def _write_torch(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots, t_real = self._host["slots"], len(self._host["slots"])
        bs, dt = self.layout.block_size, cache.dtype
        k, v = k[:t_real].to(dt), v[:t_real].to(dt)
        if self.layout.order == "NHD":
            flat = cache.view(2, -1, *cache.shape[3:])  # [2, blocks * block_size, H, D]
            flat[0, slots], flat[1, slots] = k, v
        elif self._in_place:  # K [D][N], V [N][D] in each (block, head)
            blk, off = slots // bs, slots % bs
            h, d = cache.shape[2], k.shape[-1]
            cache[0].view(-1, h, d, bs)[blk, :, :, off] = k
            cache[1].view(-1, h, bs, d)[blk, :, off] = v
        else:
            blk, off = slots // bs, slots % bs
            cache[0, blk, :, off], cache[1, blk, :, off] = k, v

    def _context(self, cache: torch.Tensor, kv: int, bt: torch.Tensor) -> torch.Tensor:
        """Whole blocks of ``bt [N, nb]`` gathered as ``[N, nb * block_size, H, D]``."""
        x = cache[kv][bt]
        if self.layout.order == "HND":
            x = x.transpose(2, 3)
        return x.reshape(bt.shape[0], -1, *x.shape[3:])

    def _attend_kernel(self, cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Every real row (decode rows and prompt chunks alike) in one call of vLLM's CPU kernel, over
        the cache once this forward's K/V are written; pad rows and pad tokens get zeros."""
        assert self._kernel is not None and self._kernel_plan is not None
        t_real = len(self._host["slots"])
        if isinstance(self._kernel_plan, InPlacePlan):
            out = self._kernel.attend_in_place(q[:t_real], cache, self._kernel_plan)
        else:
            out = self._kernel.attend_blocks(q[:t_real], cache, self._kernel_plan, self.layout.order == "NHD")
        if q.shape[0] > t_real:
            out = torch.cat([out, out.new_zeros(q.shape[0] - t_real, *out.shape[1:])])
        return out

    def _decode_torch(self, cache: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """All real rows at once; pad rows get zeros. On a CPU in bf16/fp16, fp32 attention over
        the blocks the step's plan names (:mod:`hawk.engine.cpu_attention`); otherwise one SDPA over
        a padded, masked context."""
        n_real, bt = self._n_real, self._host["block_tables"]
        if widens(q) and self._cpu_plans:
            out = self._cpu_ws.attend_groups(q[:n_real], cache, self._cpu_plans, self.layout.order == "NHD")
        else:
            kc = self._context(cache, 0, bt).to(q.dtype)
            vc = self._context(cache, 1, bt).to(q.dtype)
            if n_real == 1:  # no mask, no padding
                ctx = self._ctx[0]
                out = attend(q[:1], kc[0, :ctx], vc[0, :ctx])
            else:
                out = F.scaled_dot_product_attention(q[:n_real, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                                     attn_mask=self._host.get("mask"), enable_gqa=True)[:, :, 0]
        if self._n > n_real:
            out = torch.cat([out, out.new_zeros(self._n - n_real, *out.shape[1:])])
        return out

    def _prefill_torch(self, cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One :func:`attend` per sequence: fresh K/V for a prompt, the cache for a continuation. On a
        CPU in bf16/fp16 a mixed batch's leading one-token rows go first, all in one batch (as a
        decode step's)."""
        outs, off, bt = [], 0, self._host["block_tables"]
        first = 0
        if self._cpu_plans and widens(q):
            first = off = sum(p.rows for p in self._cpu_plans)
            outs.append(self._cpu_ws.attend_groups(q[:first], cache, self._cpu_plans, self.layout.order == "NHD"))
        for i in range(first, len(self._q_lens)):
            start, ql = self._starts[i], self._q_lens[i]
            sl = slice(off, off + ql)
            if start == 0:
                outs.append(attend(q[sl], k[sl], v[sl]))
            else:
                row = bt[i : i + 1, : self._need[i]]
                ctx = self._ctx[i]
                kc = self._context(cache, 0, row)[0, :ctx].to(q.dtype)
                vc = self._context(cache, 1, row)[0, :ctx].to(q.dtype)
                outs.append(attend(q[sl], kc, vc))
            off += ql
        if off < q.shape[0]:  # a padded prefill's pad tokens
            outs.append(q.new_zeros(q.shape[0] - off, *q.shape[1:]))
        return torch.cat(outs)


def _pad_programs(progs: tuple[np.ndarray, np.ndarray], pad_row: int, pad_tokens: int, total: int,
                  block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """A padded prefill's program map: the real programs, then ``pad_row``'s (its ``pad_tokens``
    rows get output 0: no context), then fillers up to ``total`` that point past ``pad_row``'s
    last query block (no row to compute, no key to read)."""
    seq, blk = progs
    pad_blocks = -(-pad_tokens // block_m)
    fill = total - len(seq) - pad_blocks
    if fill < 0:
        raise ValueError(f"{len(seq) + pad_blocks} prefill programs exceed the padded map's {total}")
    pad_seq = np.full(pad_blocks + fill, pad_row, dtype=np.int32)
    pad_blk = np.concatenate([np.arange(pad_blocks, dtype=np.int32), np.full(fill, pad_blocks, dtype=np.int32)])
    return np.concatenate([seq, pad_seq]), np.concatenate([blk, pad_blk])
