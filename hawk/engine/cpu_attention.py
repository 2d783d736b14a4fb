"""Paged decode attention on a CPU: every one-token row of a step in one batch of ops per layer.

Where vLLM is installed, :class:`~hawk.engine.paged_attention.PagedAttention` runs vLLM's own CPU kernel
instead (:mod:`hawk.engine.vllm_cpu_kernel`: vLLM's bits, and a step no slower); this is the torch form
without vLLM or with ``HAWK_CPU_ATTENTION=torch``.

Why: the torch path attended each decode row on its own (:func:`~hawk.engine.cpu_numerics.attend_widened`
per row, ~12 ops each), after gathering every row's whole blocks into a freshly allocated tensor per
layer. At SmolLM2's size a row's work is a few microseconds of arithmetic, so the step was Python and
allocator overhead: at batch 32 (context 300) about 300 of its 430 ms (``benchmarks/cpu_step_probe.py``).
Fresh multi-megabyte tensors cost more than the arithmetic too: glibc maps them anew and the first touch
faults every page (converting a 32 x 304-token K to fp32 took 1.2 ms into a new tensor, 0.15 ms into a
kept one).

So a step's decode rows run as one batch: :func:`decode_plan` computes once per step (not per layer)
which cache blocks each row reads and which key positions are padding; per layer
:class:`DecodeWorkspace` gathers those blocks into kept buffers, widens them to fp32 there, and the
attention is two ``bmm`` over every (row, KV head) at once.

Numerics: the arithmetic of :func:`~hawk.engine.cpu_numerics.attend_widened` run per row (fp32 scores,
softmax and weighted V, divided by the sum last, rounded once). A lone row attends exactly its context
and keeps that form's bits. Rows of a batch are padded to the longest one: a padded key's score is
-inf, so its weight is an exact 0 and adds nothing, but MKL and torch's sum pick their blocking by the
padded length, so an fp32 result may differ in its last bit, and about 1 in 10^4 bf16 outputs then by
one ulp (``tests/test_cpu_attention.py`` bounds it; vLLM's own CPU kernel differs from the per-row form
at that rate too, see docs/vllm.md). A padded key's cache slot must hold a finite value (0 * inf is
NaN): padding reads the row's own blocks (written K/V, or the zeros the cache was allocated with).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DecodePlan:
    """Which cache blocks a step's decode rows read, laid out ``[rows, blocks]``, and their padding.

    ``blocks [rows * width]`` (int64): row ``i``'s blocks, then its first block repeated up to
    ``width`` (the longest row's count). ``keys``: the key positions attended, ``width * block_size``,
    or a lone row's context (no padding at all: its sums run over exactly the keys the per-row form's
    do, so it keeps that form's bits). ``pad [rows, 1, keys]`` (bool) marks key positions past a row's
    context; None when no row has any. ``index``: which rows of the step's batch these are, in order
    (None: all of them, as they come).
    """

    blocks: torch.Tensor
    pad: torch.Tensor | None
    rows: int
    width: int
    keys: int
    index: torch.Tensor | None = None


#: At most this many length groups per step (:func:`decode_groups`); each costs a layer ~15 more ops.
MAX_GROUPS = 4


def decode_groups(block_tables: np.ndarray, ctx: np.ndarray, block_size: int, max_groups: int = MAX_GROUPS) -> list[DecodePlan]:
    """A step's decode rows as up to ``max_groups`` plans of rows of similar length, so that short rows
    are not padded to the longest one.

    Why: a serving batch mixes contexts (the chatbot workload's prompts span 10x), and one plan pads
    every row to the longest: in a served decode step at batch 32 the widening of padded K/V was 37 %
    of the engine thread (py-spy). Rows sorted by length, longest first; a group takes the rows that
    fill more than half its width (its longest row's), so padding at most doubles a row and usually
    adds far less; the last group takes whatever is left.
    """
    need = -(-ctx // block_size)
    order = np.argsort(-need, kind="stable")
    groups: list[np.ndarray] = []
    i = 0
    while i < len(order):
        if len(groups) == max_groups - 1:
            groups.append(order[i:])
            break
        w = need[order[i]]
        j = i + int(np.count_nonzero(2 * need[order[i:]] > w))  # sorted: a prefix of the rest
        groups.append(order[i:j])
        i = j
    if len(groups) == 1:
        return [decode_plan(block_tables, ctx, block_size)]
    plans = []
    for rows in groups:
        rows = np.sort(rows)
        plan = decode_plan(block_tables[rows], ctx[rows], block_size)
        plans.append(DecodePlan(plan.blocks, plan.pad, plan.rows, plan.width, plan.keys, torch.from_numpy(rows)))
    return plans


def decode_plan(block_tables: np.ndarray, ctx: np.ndarray, block_size: int) -> DecodePlan:
    """The :class:`DecodePlan` of rows with block table rows ``block_tables [rows, >= width]`` and
    ``ctx [rows]`` tokens of context (each > 0, the new token's included)."""
    rows = len(ctx)
    need = -(-ctx // block_size)
    width = int(need.max())
    cols = np.arange(width)
    real = cols[None, :] < need[:, None]
    table = np.where(real, block_tables[:rows, :width], block_tables[:rows, :1])
    keys, pad = width * block_size, None
    if rows == 1:
        keys = int(ctx[0])
    elif (ctx != keys).any():
        pad = torch.from_numpy(np.arange(keys)[None, None, :] >= ctx[:, None, None])
    blocks = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64)).view(-1)
    return DecodePlan(blocks, pad, rows, width, keys)


class KeptBuffers:
    """Named flat buffers, grown (at least doubling) as batches grow and never shrunk, so a layer
    allocates nothing the size of its context. ``zeroed``: a new buffer starts as zeros (for readers of
    slots nothing wrote, which must stay finite)."""

    def __init__(self, zeroed: bool = False) -> None:
        self.zeroed = zeroed
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or b.numel() < numel or b.dtype != dtype:
            new = torch.zeros if self.zeroed else torch.empty
            with torch.inference_mode(False):  # a kept buffer outlives the mode it was made in: never an inference tensor
                b = self._bufs[name] = new(max(numel, 2 * (0 if b is None else b.numel())), dtype=dtype)
        return b[:numel]


class DecodeWorkspace:
    """Kept buffers for :meth:`attend`: one gather buffer in the cache's dtype and the fp32 K and V."""

    def __init__(self) -> None:
        self._buf = KeptBuffers().get

    def _widen(self, side: torch.Tensor, plan: DecodePlan, nhd: bool, name: str) -> torch.Tensor:
        """One side (K or V) of the cache ``[blocks, ...]``, the plan's blocks, as fp32 ``[rows, H, keys, D]``."""
        nb = plan.rows * plan.width
        shape = side.shape[1:]  # NHD: [bs, H, D]; HND: [H, bs, D]
        (bs, h, d) = (shape[0], shape[1], shape[2]) if nhd else (shape[1], shape[0], shape[2])
        gathered = self._buf("gather", nb * bs * h * d, side.dtype).view(nb, *shape)
        torch.index_select(side, 0, plan.blocks, out=gathered)
        wide = self._buf(name, nb * bs * h * d, torch.float32).view(plan.rows, h, plan.width * bs, d)
        g = gathered.view(plan.rows, plan.width, *shape)
        # [rows, width, bs, H, D] -> [rows, H, width, bs, D] (NHD) or [rows, width, H, bs, D] -> the same (HND)
        src = g.permute(0, 3, 1, 2, 4) if nhd else g.permute(0, 2, 1, 3, 4)
        wide.view(plan.rows, h, plan.width, bs, d).copy_(src)
        return wide

    def attend_groups(self, q: torch.Tensor, cache: torch.Tensor, plans: list[DecodePlan], nhd: bool) -> torch.Tensor:
        """:meth:`attend` for each of :func:`decode_groups`' plans, the rows put back in the batch's order."""
        if len(plans) == 1 and plans[0].index is None:
            return self.attend(q, cache, plans[0], nhd)
        out = torch.empty_like(q)
        for plan in plans:
            assert plan.index is not None
            out.index_copy_(0, plan.index, self.attend(q.index_select(0, plan.index), cache, plan, nhd))
        return out

    def attend(self, q: torch.Tensor, cache: torch.Tensor, plan: DecodePlan, nhd: bool) -> torch.Tensor:
        """Attention of one query per row, ``q [rows, Hq, D]``, over the plan's context in ``cache``
        (``[2, blocks, ...]``, NHD if ``nhd`` else HND); fp32 throughout, rounded once to ``q``'s dtype."""
        rows, hq, d = q.shape
        keys = plan.keys
        kf = self._widen(cache[0], plan, nhd, "k")[:, :, :keys].flatten(0, 1)  # [rows * Hkv, keys, D]
        vf = self._widen(cache[1], plan, nhd, "v")[:, :, :keys].flatten(0, 1)
        hkv = kf.shape[0] // rows
        g = hq // hkv
        qg = q.float().view(rows * hkv, g, d)  # a KV head's query heads are adjacent
        scores = torch.bmm(qg, kf.transpose(1, 2)) * d**-0.5  # [rows * Hkv, G, keys]
        if plan.pad is not None:
            scores = scores.view(rows, hkv * g, keys).masked_fill_(plan.pad, float("-inf")).view(rows * hkv, g, keys)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        out = torch.bmm(weights, vf) / weights.sum(-1, keepdim=True)
        return out.view(rows, hq, d).to(q.dtype)
