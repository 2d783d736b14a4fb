"""Where the model's attention meets a KV cache.

The model owns projections and RoPE; a backend owns the cache. That split lets the same
decoder run over a contiguous reference cache (here), a vLLM-style paged cache on the GPU
(prefill) and the NPU's tiled cache (decode) without the model knowing which.

Batches are flattened and ragged (vLLM / nano-vllm style): the tokens of several sequences
are concatenated along one axis. Before each forward the engine tells its backend which
sequences are in the batch and how many new tokens each brings; the backend then splits
q/k/v by those lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F

from hawk.engine.cpu_numerics import attend_widened, widens
from hawk.engine.vllm_cpu_kernel import kernel_isa, thread_kernel


def leading_decode_rows(q_lens: Sequence[int] | np.ndarray) -> int:
    """How many leading rows of a batch bring one token each: a decode engine's running sequences,
    which come before a mixed step's prompt chunks. Backends attend them with a decode kernel and
    the runner replays them through a decode graph, because a prefill kernel gives each such row
    the query slots of a whole chunk (on an H200, 8B shape, context 850, a 512-token chunk: a mixed
    step of 256 decode rows took 77 ms through the prefill kernel against 28 ms for its decode and
    prefill parts run apart; benchmarks/mixed_step_probe.py)."""
    ones = np.asarray(q_lens) == 1
    return len(ones) if ones.all() else int(np.argmin(ones))


@dataclass(frozen=True)
class SeqSlice:
    """One sequence in a forward: its cache blocks, tokens already cached, and new tokens."""

    block_ids: Sequence[int]
    start: int
    q_len: int


@runtime_checkable
class AttentionBackend(Protocol):
    """Stores this forward's k/v and returns causal attention over each sequence's context.

    Called once per layer per forward, with ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (RoPE
    applied, T = all new tokens of the batch); returns ``[T, Hq, D]``.
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class PagedBackend(AttentionBackend, Protocol):
    """A backend over block-addressed caches (the GPU's paged cache, the NPU's tiled pages).

    The contract a CUDA graph relies on: ``begin`` writes the batch's metadata (block tables,
    context lengths, slots of the new tokens) into device buffers the backend owns and keeps, at
    the same addresses on every call, and ``__call__`` reads them without a host sync. A graph
    captured after one ``begin(decode_batch, pad_to=B)`` therefore replays correctly after any
    later ``begin(other_decode_batch, pad_to=B)``.
    """

    #: True when the contract above holds on this backend's device (a CUDA decode path).
    graph_safe: bool

    def begin(self, batch: Sequence[SeqSlice], pad_to: int | None = None) -> None:
        """Declare the next forward's sequences, in the order their tokens are concatenated.

        ``pad_to`` (decode batches only, every ``q_len == 1``): append dummy rows up to that many
        sequences. A dummy row writes no KV and reads none; its output row is finite and ignored.
        """
        ...


@runtime_checkable
class RotatingBackend(AttentionBackend, Protocol):
    """A backend whose decode launch can apply RoPE itself, so the layer runs no RoPE kernel (one
    launch fewer per layer). The model asks :meth:`fuses_rope` once per layer and forward (after
    ``begin``), and where it says True calls :meth:`attend_unrotated` instead of ``__call__``."""

    def fuses_rope(self, num_heads: int, dtype: torch.dtype, device: torch.device) -> bool:
        """True when the declared forward takes q and k before RoPE (``num_heads`` query heads of
        ``dtype`` on ``device``)."""
        ...

    def attend_unrotated(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``__call__`` with q and k un-rotated: the backend rotates row ``i`` by position ``positions[i]``
        with the model's tables ``cos, sin_signed [len, D]`` (as ``triton_ops.qkv_rope``, bit for bit)."""
        ...


def attend(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    causal_offset: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention of one sequence's new queries over its whole context.

    ``q [Tq, Hq, D]``, ``k_ctx, v_ctx [Tk, Hkv, D]`` (the context includes the new tokens).
    Query ``i`` sees keys ``0 .. causal_offset + i``; the default offset ``Tk - Tq`` is the
    usual "new tokens are the last Tq of the context". Returns ``[Tq, Hq, D]``. On a CPU in
    bf16/fp16: vLLM's CPU kernel where vLLM is installed (:mod:`~hawk.engine.vllm_cpu_kernel`, vLLM's
    bits; the default offset only), else computed in fp32 and rounded once
    (:func:`~hawk.engine.cpu_numerics.attend_widened`).
    """
    tq, tk = q.shape[0], k_ctx.shape[0]
    if causal_offset is None:
        causal_offset = tk - tq
    if causal_offset < 0:
        raise ValueError(f"causal_offset must be >= 0 (Tq={tq}, Tk={tk}), got {causal_offset}")
    if q.shape[1] % k_ctx.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {k_ctx.shape[1]}")
    # SDPA's is_causal is top-left aligned: right only when the context is just the new tokens.
    # A single query that sees the whole context needs no mask; otherwise build a
    # bottom-right-aligned one (the fused kernels take it too).
    is_causal, mask = False, None
    if tq == tk and causal_offset == 0:
        is_causal = tq > 1
    elif not (tq == 1 and causal_offset >= tk - 1):
        i = torch.arange(tq, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        mask = j <= i + causal_offset
    if widens(q):
        isa = kernel_isa(q.shape[2], q.dtype)
        if isa is not None and causal_offset == tk - tq and k_ctx.dtype == q.dtype:
            return thread_kernel(isa).attend_contiguous(q, k_ctx, v_ctx)
        if is_causal:
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
        return attend_widened(q, k_ctx, v_ctx, mask)
    # [1, H, T, D]: with a batch dim SDPA picks its fused CPU/GPU kernels, not the math path.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_ctx.transpose(0, 1).unsqueeze(0),
        v_ctx.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=True,
    )[0]
    return out.transpose(0, 1)


class ContiguousKVAttention:
    """The reference backend: each sequence's K/V per layer as one growing tensor.

    Simple rather than fast (appending copies the context); it is the oracle the paged and
    tiled backends are checked against.

    Use: ``begin(seq_ids, query_lens)`` before each forward, in the order the sequences'
    tokens are concatenated; ``free(seq_id)`` when a sequence is done.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._k: dict[int, list[torch.Tensor | None]] = {}
        self._v: dict[int, list[torch.Tensor | None]] = {}
        self._seq_ids: list[int] = []
        self._query_lens: list[int] = []

    def begin(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> None:
        """Declare the next forward's batch: ``seq_ids[n]`` brings ``query_lens[n]`` new tokens."""
        if len(seq_ids) != len(query_lens):
            raise ValueError("seq_ids and query_lens must have the same length")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one batch: {list(seq_ids)}")
        if any(n <= 0 for n in query_lens):
            raise ValueError(f"every query length must be > 0, got {list(query_lens)}")
        for s in seq_ids:
            if s not in self._k:
                self._k[s] = [None] * self.num_layers
                self._v[s] = [None] * self.num_layers
        self._seq_ids = list(seq_ids)
        self._query_lens = list(query_lens)

    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` (read on the last layer: it moves when a forward ends)."""
        k = self._k.get(seq_id, [None])[-1]
        return 0 if k is None else k.shape[0]

    def free(self, seq_id: int) -> None:
        self._k.pop(seq_id, None)
        self._v.pop(seq_id, None)

    def kv(self, seq_id: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached ``[Tk, Hkv, D]`` K and V of one sequence and layer (for tests, transfers)."""
        k, v = self._k[seq_id][layer_idx], self._v[seq_id][layer_idx]
        if k is None or v is None:
            raise KeyError(f"no KV cached for sequence {seq_id} layer {layer_idx}")
        return k, v

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if sum(self._query_lens) != q.shape[0]:
            raise ValueError(
                f"batch has {q.shape[0]} tokens but begin() declared {sum(self._query_lens)}"
            )
        outs = []
        for s, qs, ks, vs in zip(
            self._seq_ids,
            q.split(self._query_lens),
            k.split(self._query_lens),
            v.split(self._query_lens),
        ):
            old_k, old_v = self._k[s][layer_idx], self._v[s][layer_idx]
            k_ctx = ks if old_k is None else torch.cat([old_k, ks])
            v_ctx = vs if old_v is None else torch.cat([old_v, vs])
            self._k[s][layer_idx], self._v[s][layer_idx] = k_ctx, v_ctx
            outs.append(attend(qs, k_ctx, v_ctx))
        return torch.cat(outs)
