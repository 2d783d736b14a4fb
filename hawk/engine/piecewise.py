"""A forward cut at attention: CUDA-graph pieces per token count, attention eagerly between them.

Why: a colocated mixed step (the running batch's one-token decode rows, then prompt chunks) with more
sequences than a prefill graph holds ran as two graph replays, its decode rows' decode graph and its
chunks' prefill graph, and each reads every weight: at ~48 rows beside a 512-token chunk (8B, H200) the
rows paid a whole 6 ms decode step on top of the 13 ms chunk, where riding along the chunk's
compute-bound GEMMs should cost them about 10 % (issue 31). Run eagerly as one forward, the same step is launch-bound (14-26 ms of
host time, ``benchmarks/results/mixed_step_h200.json``).

A graph replays one fixed shape, and a mixed batch's attention is shaped by its sequences (how many
decode rows, which chunks, their contexts); everything else in a layer (norms, projections, RoPE, the
MLP) is row-wise and depends only on the token count. So, as vLLM's "piecewise" graphs do, a token
bucket's forward is cut at attention into ``num_layers + 1`` pieces, each captured once:

    piece 0         the embedding, layer 0's norm and RoPE'd q/k/v
    piece i         layer i-1's output projection and MLP, layer i's norm and q/k/v (0 < i < L)
    piece L         layer L-1's output projection and MLP, the final norm

and the backend's attention runs eagerly between them over the batch's real tokens, so it splits the
rows as in an eager step (decode kernel for the leading one-token rows, prefill kernel for the chunks)
and a layer-wise KV push hook is called as it is there (``after_layer(layer, None)``).

Every piece reads and writes only static tensors: ids and positions in (the runner's), and
:class:`PieceBuffers` (the residual stream, q/k/v, attention's output, the final hidden states), one
set sized for the largest bucket whose fronts every bucket uses. Only one bucket runs per step, so
they share the buffers and one graph pool, whose memory is the temporaries of the largest piece.
Pad tokens (the bucket's tail: id 0, position 0) never reach attention, so they write no KV and
attend nothing, and since every op in a piece is row-wise they change no real row.

Host launches per step: ``L + 1`` graph replays, per layer the attention's launches (the paged
backend: K/V write, decode and its split reduce where there is one, prefill) and one copy of its
output, and the LM head's few: for the 8B shape 33 replays and about 150 launches, where the eager
forward launches about 15 kernels a layer (about 480).

On a device without CUDA graphs the pieces are called (:class:`CalledPiece`) rather than replayed: the
same bodies over the same static buffers, which is how the CPU tests check what the GPU replays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hawk.engine.model import LlamaModel

#: A piece's body: reads and writes static tensors, returns nothing (a graph's outputs must be static).
Body = Callable[[], None]
#: Attention over the batch's real tokens: ``(layer, q, k, v) -> o`` (an ``AttentionBackend``).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Piece(Protocol):
    """One captured piece: :meth:`replay` runs its body's work again over the static buffers."""

    def replay(self) -> None: ...


class CalledPiece:
    """A piece where graphs cannot run (the CPU): each replay calls the body."""

    def __init__(self, body: Body) -> None:
        self.body = body
        self.replays = 0

    def replay(self) -> None:
        self.body()
        self.replays += 1


@dataclass
class GraphPiece:
    """A piece captured as a CUDA graph."""

    graph: Any  # torch.cuda.CUDAGraph

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class PieceBuffers:
    """The static tensors the pieces of every bucket read and write (flat, sized for ``tokens``)."""

    tokens: int
    residual: torch.Tensor  # [tokens * hidden]
    qkv: torch.Tensor  # [tokens * (Hq + 2 Hkv) * D]: q, k, v back to back at a bucket's size
    attn_out: torch.Tensor  # [tokens * Hq * D]
    hidden: torch.Tensor  # [tokens * hidden], the final norm's output

    @classmethod
    def for_model(cls, model: LlamaModel, tokens: int) -> PieceBuffers:
        a = model.layers[0].attn
        h, qkv = model.config.hidden_size, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
        def new(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=model.dtype, device=model.device)

        return cls(tokens, new(tokens * h), new(tokens * qkv), new(tokens * a.n_heads * a.head_dim), new(tokens * h))


class PiecewiseForward:
    """One token bucket's pieces over static buffers: :meth:`run` is a forward of up to ``tokens`` tokens."""

    def __init__(self, model: LlamaModel, tokens: int, ids: torch.Tensor, positions: torch.Tensor,
                 bufs: PieceBuffers, capture: Callable[[Body], Piece]) -> None:
        """``ids, positions [tokens]``: the static inputs; ``capture`` turns a body into a piece (a CUDA
        graph, or :class:`CalledPiece`), called in piece order (each capture's warm-up reads what the
        pieces before it leave)."""
        if tokens > bufs.tokens or ids.shape != (tokens,) or positions.shape != (tokens,):
            raise ValueError(f"a bucket of {tokens} tokens needs ids/positions of that many and buffers at least as large")
        a = model.layers[0].attn
        hq, hkv, d, h = a.n_heads, a.n_kv_heads, a.head_dim, model.config.hidden_size
        self.tokens, self.num_layers = tokens, len(model.layers)
        residual = bufs.residual[: tokens * h].view(tokens, h)
        hidden = bufs.hidden[: tokens * h].view(tokens, h)
        qkv = bufs.qkv[: tokens * (hq + 2 * hkv) * d]
        self.q = qkv[: tokens * hq * d].view(tokens, hq, d)
        self.k = qkv[tokens * hq * d : tokens * (hq + hkv) * d].view(tokens, hkv, d)
        self.v = qkv[tokens * (hq + hkv) * d :].view(tokens, hkv, d)
        self.attn_out = bufs.attn_out[: tokens * hq * d].view(tokens, hq, d)
        self.hidden = hidden
        layers = model.layers

        def first() -> None:
            rope = model.rope_args(positions)
            residual.copy_(model.embed(ids))
            _, _, _, r = layers[0].qkv(residual, None, rope, qkv)
            _check_in_place(r, residual)

        def between(i: int) -> Body:  # layer i-1's rest, layer i up to attention
            def body() -> None:
                rope = model.rope_args(positions)
                x, r = layers[i - 1].finish(layers[i - 1].attn.output(self.attn_out), residual, rope)
                _, _, _, r = layers[i].qkv(x, r, rope, qkv)
                _check_in_place(r, residual)
            return body

        def last() -> None:
            rope = model.rope_args(positions)
            x, r = layers[-1].finish(layers[-1].attn.output(self.attn_out), residual, rope)
            hidden.copy_(model.norm.add_norm(x, r, rope.kernels)[0])

        self.pieces = [capture(first)] + [capture(between(i)) for i in range(1, self.num_layers)] + [capture(last)]

    def run(self, t: int, attend: Attend) -> torch.Tensor:
        """The forward of the first ``t`` tokens (the static ids/positions written): the pieces, and
        ``attend`` over the real tokens between them. Returns the final hidden states ``[tokens, hidden]``
        (static: rows past ``t`` are the pads')."""
        if not 0 < t <= self.tokens:
            raise ValueError(f"{t} tokens do not fit a bucket of {self.tokens}")
        q, k, v, o = self.q[:t], self.k[:t], self.v[:t], self.attn_out[:t]
        self.pieces[0].replay()
        for layer in range(self.num_layers):
            o.copy_(attend(layer, q, k, v))
            self.pieces[layer + 1].replay()
        return self.hidden


def _check_in_place(got: torch.Tensor, residual: torch.Tensor) -> None:
    """The norms update the residual stream in place (model.RMSNorm.add_norm), which keeps it in its
    static buffer; a norm that returned a new tensor would leave the next piece reading a stale one."""
    if got is not residual:
        raise RuntimeError("the residual stream left its static buffer: RMSNorm.add_norm must update it in place")
