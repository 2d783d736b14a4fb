"""One forward of a ragged batch: token ids in, each sequence's next-token logits out.

Decode steps on a GPU are launch-bound: an 8B step is hundreds of small kernels whose launch
cost dwarfs their run time. So a decode batch (every sequence brings one token) whose attention
backend is graph-safe (see ``PagedBackend`` in attention.py) runs as a CUDA graph replay: the
batch is padded to a bucket size, its ids and positions are copied into static device buffers,
the backend writes its metadata into its own static buffers (``begin(batch, pad_to=bucket)``),
and one graph per bucket, captured on first use, runs the model, the final norm, the LM head for
every row and the greedy argmax. Everything else (prefill, mixed batches, CPU, backends without
``pad_to``) runs eagerly. Neither path reads a device value back to the host, and a decode step
may take its ids from the device (the previous step's tokens), so it can be launched before the
host has read them.

Short prefills are host-bound too: a 1k-token 8B forward costs ~10 ms of host time against ~24 ms
on an H200, and a busy host stretches the forward to its own time. So a runner given
``prefill_graph_tokens`` also replays prefill and mixed batches up to that size as graphs, one per
(token, sequence) bucket: the backend pads the metadata (``begin(..., pad_tokens=)``; pad tokens
write nothing and attend nothing), the LM head runs on each sequence's last row, and each layer
records an external event in the graph, which a layer-wise KV push waits on after the replay is
launched (``attn.after_layer(layer, event)``) instead of being called between layers.

With ``piecewise_graphs`` (the decode engine's runner), a batch with more sequences than a prefill
graph holds, a mixed step (the running rows first, prompt chunks after them), runs as one forward of
graph pieces (piecewise.py): per token bucket (the prefill graphs' buckets) the non-attention work
between two layers' attentions is one captured graph, ``num_layers + 1`` of them, and attention runs
eagerly between them over the real tokens (the decode kernel for the leading one-token rows, the
prefill kernel for the chunks; the layer-wise hook is called between layers, as in an eager forward).
So the decode rows ride along the chunks' GEMMs: one weight read per step, where the decode graph and
the prefill graph read them twice. At most ``(num_layers + 1) * len(prefill token buckets)`` piece
graphs are captured (8B at the colocated GPU default of 512 tokens: 33 * 7), in one pool of their own.
A prefill engine's runner leaves them off: its batches past 16 prompts stay eager rather than
capture up to 33 * 16 graphs (2048 tokens) on a first use while serving.

With ``mixed_graphs`` (the colocated decode engine's runner with ``--mixed-graphs``), a mixed step
past the prefill graphs' sequences replays one CUDA graph per (tokens, chunk sequences) bucket
instead, attention inside it: the decode kernel runs over a fixed number of rows (the decode rows,
then empty ones) and the prefill kernel over the chunks, padded as a prefill graph's
(``begin(..., pad_decode=)``), so every launch's shape is fixed by the bucket and the tokens are padded
exactly as the pieces pad them. Graph pieces
launch ~33 replays and ~150 kernels per 8B step from Python (9-12 ms of host time on the H200 host,
more than the GPU time of 48 decode rows beside a chunk of up to 256 tokens:
``benchmarks/mixed_step_probe.py``); a mixed graph is one replay.

Paths, in the order :meth:`ModelRunner.step` tries them:

* decode graph: every row one token, at most ``max_batch`` rows (``StepPath.GRAPH``)
* prefill graph: at most ``prefill_graph_tokens`` tokens and ``prefill_graph_seqs`` sequences (``GRAPH``)
* mixed graph: leading one-token rows (at most ``max_batch``) then at most ``prefill_graph_seqs`` chunks,
  at most ``prefill_graph_tokens`` tokens, ``mixed_graphs`` (``GRAPH``)
* piecewise: at most ``prefill_graph_tokens`` tokens, any number of sequences, ``piecewise_graphs`` (``PIECEWISE``)
* eager: everything else, and everything on a CPU or without graph-safe backends (``EAGER``)
"""

from __future__ import annotations

import contextlib

import enum
import inspect
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hawk.devices.staging import HostStaging
from hawk.engine.attention import SeqSlice, leading_decode_rows
from hawk.engine.graph_buckets import PREFILL_GRAPH_SEQS, WARMUP_RUNS, prefill_seq_buckets, prefill_token_buckets
from hawk.engine.model import LlamaModel
from hawk.engine.piecewise import Body, CalledPiece, GraphPiece, Piece, PieceBuffers, PiecewiseForward
from hawk.engine.sampler import NO_TOKEN


class GraphsUnavailable(RuntimeError):
    """``graphs=True`` was asked for, but this model / backend cannot replay CUDA graphs."""


class StepPath(enum.Enum):
    """How the runner executed a step (for tests and metrics)."""

    EAGER = "eager"
    GRAPH = "graph"
    #: One forward as graph pieces with attention eagerly between them (piecewise.py; logits: a new tensor).
    PIECEWISE = "piecewise"


@dataclass(frozen=True)
class StepOutput:
    """One step's result.

    ``logits [n, vocab]`` fp32. After a graph replay it is a view of the graph's output buffer,
    valid until this runner's next step: consume (sample) it before then. ``greedy [n]`` int64,
    :func:`~hawk.engine.sampler.greedy_tokens` of the logits when the graph already computed it.
    """

    logits: torch.Tensor
    greedy: torch.Tensor | None
    path: StepPath


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes a decode graph is captured for: 1, 2, 4, 8, then 2**k and 1.5 * 2**k
    (16, 24, 32, 48, 64, 96, ...) up to and including ``max_batch``. Padding costs at most a third."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = {1, 2, 4, 8}
    b = 16
    while b <= max_batch:
        sizes.update((b, b * 3 // 2))
        b *= 2
    out = sorted(s for s in sizes if s <= max_batch)
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


@dataclass
class _PrefillGraph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # [sequence bucket + 1, vocab], each row's last-token logits (pad rows: token 0's)
    #: One external event per layer, recorded in the graph once that layer's K/V are written: what a
    #: layer-wise push waits for (``attn.after_layer(layer, event)`` after the replay is launched).
    layer_events: list[Any]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab], the graph's output
    greedy: torch.Tensor  # [bucket]
    #: ``(logits[:n], greedy[:n])`` per real batch size n, sliced once (views cost host time).
    views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    """Runs ragged batches of a model over one attention backend (one runner per backend)."""

    #: Eager warm-up runs before a capture (``graph_buckets.WARMUP_RUNS``).
    WARMUP_RUNS = WARMUP_RUNS

    def __init__(
        self,
        model: LlamaModel,
        attn: Any,
        max_batch: int = 64,
        graphs: bool | None = None,
        max_model_len: int | None = None,
        prefill_graph_tokens: int = 0,
        prefill_graph_seqs: int = PREFILL_GRAPH_SEQS,
        piecewise_graphs: bool = False,
        mixed_graphs: bool = False,
        extra_token_buckets: tuple[int, ...] = (),
    ) -> None:
        """``graphs``: None = use CUDA graphs when possible, False = never, True = required
        (raises :class:`GraphsUnavailable` otherwise); decode steps. ``max_model_len`` (default: the
        model's context length) sizes the RoPE table up front, so no step has to grow it.
        ``prefill_graph_tokens`` > 0: prefill and mixed batches of at most that many tokens and
        ``prefill_graph_seqs`` sequences replay a CUDA graph per (token, sequence) bucket where the
        backend can pad a prefill (``begin(..., pad_tokens=)``), one model without a step hook (not
        tensor-parallel); captured on first use or by :meth:`warmup_prefill`. ``mixed_graphs``: such
        batches with more sequences, leading decode rows then chunks, replay a mixed graph per
        (tokens, chunk sequences) bucket where the backend pads them (``begin(..., pad_decode=)``;
        captured on first use or by :meth:`warmup_mixed`). ``piecewise_graphs``: the other such batches
        run as graph pieces per token bucket (captured on first use or by :meth:`warmup_piecewise`) rather
        than eagerly. ``extra_token_buckets``: token buckets besides the default ones (a mixed step's
        token target, so steps that fill it pad nothing)."""
        self.model, self.attn = model.fuse_projections(), attn
        self.device = model.device
        self.max_batch = max_batch
        self.buckets = decode_buckets(max_batch)
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        if self.device.type != "meta":
            model.reserve_positions(self.max_model_len)
        why_not = self._why_no_graphs()
        if graphs and why_not:
            raise GraphsUnavailable(why_not)
        self.use_graphs = graphs is not False and why_not is None
        self._lock = threading.Lock()
        self._graphs: dict[int, _Graph] = {}
        self._graph_rope_version: tuple[int, int] = (-1, -1)
        self._pool: Any = None
        self._io: torch.Tensor | None = None  # [2 * max bucket]: ids then positions, per bucket
        self._io_stage: HostStaging | None = None  # its pinned staging (on the host: itself)
        if self.use_graphs:
            self._io = torch.zeros(2 * self.buckets[-1], dtype=torch.int64, device=self.device)
            self._io_stage = HostStaging([self._io])
        self.prefill_tokens = prefill_token_buckets(prefill_graph_tokens, extra=extra_token_buckets) if prefill_graph_tokens > 0 else []
        self.prefill_seqs = prefill_seq_buckets(prefill_graph_seqs) if self.prefill_tokens else []
        params = inspect.signature(attn.begin).parameters
        if self.prefill_tokens and (why_not or "pad_tokens" not in params):
            self.prefill_tokens = self.prefill_seqs = []
        self.mixed_graphs = bool(mixed_graphs and self.prefill_tokens and "pad_decode" in params)
        self._prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self._mixed_graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self._prefill_pool: Any = None
        self._prefill_captured_for: tuple[int, int] = (-1, -1)  # (RoPE table version, backend buffer generation)
        self._pio: torch.Tensor | None = None  # ids [T] | positions [T] | last rows [S + 1], per bucket
        self._pio_stage: HostStaging | None = None
        if self.prefill_tokens:
            size = 2 * self.prefill_tokens[-1] + self.prefill_seqs[-1] + 1 + (max_batch if self.mixed_graphs else 0)
            self._pio = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._pio_stage = HostStaging([self._pio])
        # Piecewise forwards, one per prefill token bucket (batches past the prefill graphs' sequences).
        self.piecewise_tokens = self.prefill_tokens if piecewise_graphs else []
        self._piecewise: dict[int, PiecewiseForward] = {}
        self._piece_pool: Any = None
        self._piece_rope_version = -1
        self._piece_bufs: PieceBuffers | None = None  # allocated with the first bucket
        self._wio: torch.Tensor | None = None  # ids [T] | positions [T] | last rows [n <= T], per bucket
        self._wio_stage: HostStaging | None = None
        if self.piecewise_tokens:
            self._wio = torch.zeros(3 * self.piecewise_tokens[-1], dtype=torch.int64, device=self.device)
            self._wio_stage = HostStaging([self._wio])

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The model's GPU as the calling thread's current device: Triton launches, and graphs
        capture, on the current device, and an engine thread's default is GPU 0 whatever the model's."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _why_no_graphs(self) -> str | None:
        if self.device.type != "cuda":
            return f"CUDA graphs need a CUDA model, this one is on {self.device}"
        if not getattr(self.attn, "graph_safe", False):
            return f"{type(self.attn).__name__} is not graph-safe"
        try:
            params = inspect.signature(self.attn.begin).parameters
        except (TypeError, ValueError):
            return f"cannot inspect {type(self.attn).__name__}.begin"
        if "pad_to" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return f"{type(self.attn).__name__}.begin takes no pad_to"
        return None

    # -- the public steps --------------------------------------------------------------------

    def forward(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice]) -> torch.Tensor:
        """``tokens[i]`` are sequence i's new tokens, at positions ``slices[i].start ...``;
        returns each sequence's last-token logits ``[n, vocab]`` fp32 (the caller's to keep)."""
        out = self.step(tokens, slices)
        return out.logits.clone() if out.path is StepPath.GRAPH else out.logits

    @torch.inference_mode()
    def step(self, tokens: Sequence[Sequence[int]] | None, slices: Sequence[SeqSlice], ids: torch.Tensor | None = None) -> StepOutput:
        """:meth:`forward` without the copy, plus the greedy tokens when a graph computed them.

        ``ids``: the input ids of the batch's first ``k`` rows as a device tensor ``[k]``, each
        row one token (typically the previous step's sampled tokens), so this step is launched
        before the host has read them (async scheduling, see token_fetch.py); ``tokens`` is None
        (every row) or holds placeholders for those rows. A row holding the sampler's NO_TOKEN
        reads token 0 instead: its request fails when that token is read, and its row here is
        never used.
        """
        if ids is not None:
            k = ids.shape[0] if ids.dim() == 1 else -1
            if not 0 < k <= len(slices) or any(s.q_len != 1 for s in slices[:k]) or (tokens is None and k != len(slices)):
                raise ValueError("ids replace the tokens of the batch's first rows, one token each")
            if tokens is None:
                tokens = _DEVICE_IDS * len(slices)
        if not slices or tokens is None or len(tokens) != len(slices):
            raise ValueError(f"need one token list per sequence, got {len(tokens or ())} for {len(slices)}")
        with self._lock, self._on_device():
            starts = [s.start for s in slices]
            q_lens = [s.q_len for s in slices]
            need = max(map(operator.add, starts, q_lens))
            if need > len(self.model.rope):
                self.model.reserve_positions(need)  # grows the table: graphs are recaptured
            decode = q_lens.count(1) == len(q_lens)
            if self.use_graphs and decode and len(slices) <= self.buckets[-1]:
                return self._replay(tokens, slices, starts, ids)
            bucket = None if decode else self._prefill_bucket(sum(q_lens), len(slices))
            if bucket is not None:
                return self._replay_prefill(tokens, slices, q_lens, *bucket, ids)
            mixed = None if decode else self._mixed_bucket(q_lens)
            if mixed is not None:
                return self._replay_mixed(tokens, slices, q_lens, *mixed, ids)
            pieces = None if decode else self._piecewise_bucket(sum(q_lens))
            if pieces is not None:
                return self._run_piecewise(tokens, slices, q_lens, pieces, ids)
            return self._eager(tokens, slices, decode, ids)

    @torch.inference_mode()
    def warmup(self, buckets: Iterable[int] | None = None) -> list[int]:
        """Capture the decode graphs of ``buckets`` (default: all) now rather than on first use.

        Runs all-padding batches (``attn.begin([], pad_to=b)``: no KV is read or written), largest
        first so smaller graphs reuse its pool memory. Returns the buckets captured (none when
        graphs are off).
        """
        if not self.use_graphs:
            return []
        wanted = sorted({self._bucket(b) for b in (buckets or self.buckets)}, reverse=True)
        with self._lock, self._on_device():
            for b in wanted:
                self.attn.begin([], pad_to=b)
                assert self._io is not None
                self._io[: 2 * b].zero_()
                self._graph_for(b)
        return wanted

    @torch.inference_mode()
    def warmup_prefill(self, seqs: Iterable[int] = (1,)) -> list[tuple[int, int]]:
        """Capture the prefill graphs of every token bucket for ``seqs`` sequences now (largest
        first, all-padding batches: no KV is written) rather than on a request's first use.
        Returns the (tokens, sequences) buckets captured (none when prefill graphs are off)."""
        if not self.prefill_tokens:
            return []
        keys = sorted({(t, self._seq_bucket(s)) for t in self.prefill_tokens for s in seqs}, reverse=True)
        with self._lock, self._on_device():
            for t, sb in keys:
                self.attn.begin([], pad_to=sb + 1, pad_tokens=t)
                assert self._pio is not None
                self._pio[: 2 * t + sb + 1].zero_()
                self._prefill_graph_for(t, sb)
        return keys

    # -- eager -------------------------------------------------------------------------------

    def _eager(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], decode: bool,
               device_ids: torch.Tensor | None = None) -> StepOutput:
        ids = [t for seq in tokens for t in seq]
        if decode:
            pos = [s.start for s in slices]
        else:
            pos = [p for s in slices for p in range(s.start, s.start + s.q_len)]
        if len(ids) != len(pos):
            raise ValueError(f"{len(ids)} tokens given for {len(pos)} declared by the slices")
        io = _to_device(torch.tensor([ids, pos], dtype=torch.int64), self.device)
        if device_ids is not None:  # the leading rows are one token each: token i is row i's
            io[0, : device_ids.shape[0]].copy_(device_ids).clamp_(min=0)
        self.attn.begin(slices)
        hidden = self.model(io[0], io[1], self.attn)
        if not decode:  # only each sequence's last token goes through the LM head
            last, end = [], 0
            for s in slices:
                end += s.q_len
                last.append(end - 1)
            hidden = hidden.index_select(0, _to_device(torch.tensor(last), self.device))
        return StepOutput(self.model.compute_logits(hidden), None, StepPath.EAGER)

    # -- graphs ------------------------------------------------------------------------------

    def _bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest decode bucket {self.buckets[-1]}")

    def _replay(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], starts: list[int],
                device_ids: torch.Tensor | None = None) -> StepOutput:
        n = len(slices)
        b = self._bucket(n)
        try:
            ids = [t for (t,) in tokens]  # unpacking checks one token per sequence
        except ValueError:
            raise ValueError("a decode step takes exactly one token per sequence") from None
        self.attn.begin(slices, pad_to=b)
        self._write_io(ids, starts, b)
        if device_ids is not None:  # behind the upload on the stream, so it overwrites the placeholders
            assert self._io is not None
            self._io[: device_ids.shape[0]].copy_(device_ids).clamp_(min=0)
        g = self._graph_for(b)
        g.graph.replay()
        outs = g.views.get(n)
        if outs is None:
            outs = g.views[n] = (g.logits[:n], g.greedy[:n])
        return StepOutput(outs[0], outs[1], StepPath.GRAPH)

    def _write_io(self, ids: list[int], starts: list[int], b: int) -> None:
        """ids then positions, each padded with zeros to ``b``, into the static ``_io[:2b]``:
        through a pinned staging slot and one async H2D copy on CUDA, in place on the host."""
        assert self._io_stage is not None
        n = len(ids)
        (io,) = self._io_stage.next()
        io[:n] = ids
        io[n:b] = 0
        io[b : b + n] = starts
        io[b + n : 2 * b] = 0
        self._io_stage.upload((2 * b,))

    def _graph_for(self, b: int) -> _Graph:
        """The bucket's graph, captured now if missing (or stale: the RoPE table moved, or the backend
        reallocated the metadata buffers the graph reads, as a mixed step's larger batch may)."""
        version = (self.model.rope.version, getattr(self.attn, "generation", 0))
        if version != self._graph_rope_version:
            self._graphs.clear()  # captured before the table grew: too short; start a fresh pool
            self._pool = None
            self._graph_rope_version = version
        g = self._graphs.get(b)
        if g is None:
            g = self._graphs[b] = self._capture(b)
        return g

    def _graph_body(self, b: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """What a bucket's graph runs: the model over the static ids/positions, the final norm,
        the LM head for every row and the greedy tokens."""
        assert self._io is not None
        ids, pos = self._io[:b], self._io[b : 2 * b]

        def body() -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.model.compute_logits(self.model(ids, pos, self.attn))
            return logits, finite_argmax(logits)

        return body

    def _capture(self, b: int) -> _Graph:
        """Warm up on a side stream, then capture the step for bucket ``b`` into the shared pool.

        The backend has been ``begin``-ed and the static ids/positions written, so the warm-up
        runs are a real (idempotent: the same K/V to the same slots) forward of the batch.
        """
        graph, (logits, greedy), self._pool = self._warm_and_capture(self._graph_body(b), self._pool)
        return _Graph(graph, logits, greedy)

    def _warm_and_capture(self, body: Callable[[], Any], pool: Any, before_capture: Callable[[], None] | None = None) -> tuple[Any, Any, Any]:
        """Run ``body`` ``WARMUP_RUNS`` times on a side stream, then capture it into ``pool`` (a new one
        when None); returns the graph, what the captured ``body`` returned, and the pool."""
        dev = self.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if before_capture is not None:
            before_capture()
        # thread_local: other threads (KV transfers, a colocated prefill) keep using the GPU. The
        # stream is named: torch's default capture stream is made once per process, on whichever
        # GPU captured first, and a capture on another GPU's stream records nothing.
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            out = body()
        return graph, out, pool

    # -- prefill graphs ----------------------------------------------------------------------

    def _seq_bucket(self, n: int) -> int:
        return next(b for b in self.prefill_seqs if b >= n)

    def _prefill_bucket(self, t: int, n: int) -> tuple[int, int] | None:
        """The (tokens, sequences) graph bucket of a prefill batch, or None: eager."""
        if not self.prefill_tokens or t > self.prefill_tokens[-1] or n > self.prefill_seqs[-1] or self.model.step_hook is not None:
            return None
        return next(b for b in self.prefill_tokens if b >= t), self._seq_bucket(n)

    def _replay_prefill(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], q_lens: list[int], t: int, sb: int,
                        device_ids: torch.Tensor | None = None) -> StepOutput:
        """A prefill batch through its bucket's graph (``t`` tokens, ``sb`` sequences): metadata and ids
        padded to the bucket, the replay launched, then the layer-wise hook (if any) told where each
        layer's K/V is done."""
        self.attn.begin(slices, pad_to=sb + 1, pad_tokens=t)
        # at most prefill_graph_seqs rows: each its own assignment
        return self._replay_padded(tokens, slices, q_lens, t, sb + 1, 0, device_ids, lambda: self._prefill_graph_for(t, sb))

    def _replay_padded(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], q_lens: list[int], t: int, rows: int,
                       n_dec: int, device_ids: torch.Tensor | None, graph_for: Callable[[], _PrefillGraph]) -> StepOutput:
        """A begun batch through a prefill or mixed graph of ``t`` tokens and ``rows`` last rows: its ids
        and positions packed, zeros to ``t``; each sequence's last row in batch order (zeros to ``rows``);
        the replay, then the layer-wise hook told each layer's event."""
        n, t_real = len(slices), sum(q_lens)
        assert self._pio_stage is not None
        (io,) = self._pio_stage.next()
        _write_ids(io[:t], io[t : 2 * t], tokens, slices, n_dec)
        io[t_real:t] = 0
        io[t + t_real : 2 * t] = 0
        last = io[2 * t : 2 * t + rows]
        np.cumsum(q_lens, out=last[:n])
        last[:n] -= 1
        last[n:] = 0
        self._pio_stage.upload((2 * t + rows,))
        if device_ids is not None:  # leading one-token rows: token i is row i's
            assert self._pio is not None
            self._pio[: device_ids.shape[0]].copy_(device_ids).clamp_(min=0)
        g = graph_for()
        g.graph.replay()
        hook = getattr(self.attn, "after_layer", None)
        if hook is not None:
            for layer, event in enumerate(g.layer_events):
                hook(layer, event)
        return StepOutput(g.logits[:n], None, StepPath.GRAPH)

    def _prefill_graph_for(self, t: int, sb: int) -> _PrefillGraph:
        """The bucket's graph, captured now if missing or stale (the RoPE table grew, or the backend
        reallocated the metadata buffers the graph reads)."""
        self._drop_stale_prefill_graphs()
        g = self._prefill_graphs.get((t, sb))
        if g is None:
            g = self._prefill_graphs[(t, sb)] = self._capture_prefill(t, sb + 1)
        return g

    def _drop_stale_prefill_graphs(self) -> None:
        """Forget the prefill and mixed graphs (and their pool) if the RoPE table grew or the backend
        reallocated the metadata buffers they read since they were captured."""
        now = (self.model.rope.version, getattr(self.attn, "generation", 0))
        if now != self._prefill_captured_for:
            self._prefill_graphs.clear()
            self._mixed_graphs.clear()
            self._prefill_pool = None
            self._prefill_captured_for = now

    def _prefill_body(self, t: int, rows: int) -> Callable[[], torch.Tensor]:
        """What a prefill (or mixed) bucket's graph runs: the model over the static ids/positions of
        ``t`` tokens and the LM head over the static last-token rows, ``rows`` of them."""
        assert self._pio is not None
        ids, pos, last = self._pio[:t], self._pio[t : 2 * t], self._pio[2 * t : 2 * t + rows]

        def body() -> torch.Tensor:
            hidden = self.model(ids, pos, self.attn)
            return self.model.compute_logits(hidden.index_select(0, last))

        return body

    def _capture_prefill(self, t: int, rows: int) -> _PrefillGraph:
        """As :meth:`_capture`, for a prefill bucket: the forward over the static ids/positions and the
        LM head over each row's last token. The layer-wise hook is off during the warm-up runs and,
        in the capture, records each layer's event instead of being called."""
        events = [torch.cuda.Event(external=True) for _ in range(self.model.config.num_layers)]
        hook = getattr(self.attn, "after_layer", None)

        def record_layers() -> None:
            self.attn.after_layer = lambda layer, _marker: events[layer].record()

        try:
            self.attn.after_layer = None
            graph, logits, self._prefill_pool = self._warm_and_capture(self._prefill_body(t, rows), self._prefill_pool, record_layers)
        finally:
            self.attn.after_layer = hook
        return _PrefillGraph(graph, logits, events)

    # -- mixed graphs ------------------------------------------------------------------------

    def _mixed_bucket(self, q_lens: list[int]) -> tuple[int, int] | None:
        """The (tokens, chunk sequences) graph bucket of a mixed batch (leading one-token rows, then
        chunks) that no prefill graph takes, or None."""
        if not self.mixed_graphs or self.model.step_hook is not None:
            return None
        n_dec = leading_decode_rows(q_lens)
        n_pre, t = len(q_lens) - n_dec, sum(q_lens)
        if not n_dec or not n_pre or n_dec > self.max_batch or n_pre > self.prefill_seqs[-1] or t > self.prefill_tokens[-1]:
            return None
        return next(b for b in self.prefill_tokens if b >= t), self._seq_bucket(n_pre)

    def _decode_rows(self, t: int) -> int:
        """The rows a mixed graph of ``t`` tokens runs the decode kernel over (its decode rows, then empty
        ones): every count the bucket allows, so one graph serves every split of its tokens."""
        return min(t, self.max_batch)

    def _replay_mixed(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], q_lens: list[int], t: int, sb: int,
                      device_ids: torch.Tensor | None = None) -> StepOutput:
        """A mixed batch through its bucket's graph (``t`` tokens, ``sb`` chunks): the decode kernel over
        ``_decode_rows(t)`` rows, ids packed as an eager step's."""
        g = self._decode_rows(t)
        self.attn.begin(slices, pad_to=g + sb + 1, pad_tokens=t, pad_decode=g)
        return self._replay_padded(tokens, slices, q_lens, t, g + sb, leading_decode_rows(q_lens), device_ids,
                                   lambda: self._mixed_graph_for(t, sb))

    def _mixed_graph_for(self, t: int, sb: int) -> _PrefillGraph:
        """The mixed bucket's graph, captured now if missing or stale."""
        self._drop_stale_prefill_graphs()
        g = self._mixed_graphs.get((t, sb))
        if g is None:
            g = self._mixed_graphs[(t, sb)] = self._capture_prefill(t, self._decode_rows(t) + sb)
        return g

    @torch.inference_mode()
    def warmup_mixed(self, chunks: Iterable[int] = (1,)) -> list[tuple[int, int]]:
        """Capture the mixed graphs of every token bucket for ``chunks`` chunk sequences now (largest
        first, all-padding batches: no KV is written) rather than on a step's first use. Returns the
        (tokens, sequences) buckets captured (none when mixed graphs are off)."""
        if not self.mixed_graphs or self.model.step_hook is not None:
            return []
        keys = sorted({(t, self._seq_bucket(c)) for t in self.prefill_tokens for c in chunks}, reverse=True)
        with self._lock, self._on_device():
            for t, sb in keys:
                g = self._decode_rows(t)
                self.attn.begin([], pad_to=g + sb + 1, pad_tokens=t, pad_decode=g)
                assert self._pio is not None
                self._pio[: 2 * t + g + sb].zero_()
                self._mixed_graph_for(t, sb)
        return keys

    # -- piecewise forwards ------------------------------------------------------------------

    def _piecewise_bucket(self, t: int) -> int | None:
        """The token bucket of a batch no prefill graph takes (more sequences than they hold) that runs
        as graph pieces, or None: eager (no prefill graphs here, more tokens than their largest bucket,
        or a step hook: tensor parallel)."""
        if not self.piecewise_tokens or t > self.piecewise_tokens[-1] or self.model.step_hook is not None:
            return None
        return next(b for b in self.piecewise_tokens if b >= t)

    def _run_piecewise(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], q_lens: list[int], t: int,
                       device_ids: torch.Tensor | None = None) -> StepOutput:
        """A batch through bucket ``t``'s pieces: the backend ``begin``s the real batch (attention runs
        eagerly, over the real tokens only), ids and positions are padded to the bucket, and the LM head
        runs eagerly over each sequence's last row (whatever the sequence count: no bucket for it)."""
        n, t_real = len(slices), sum(q_lens)
        self.attn.begin(slices)
        assert self._wio_stage is not None and self._wio is not None
        (io,) = self._wio_stage.next()
        _write_ids(io[:t], io[t : 2 * t], tokens, slices, leading_decode_rows(q_lens))
        io[t_real:t] = 0
        io[t + t_real : 2 * t] = 0
        np.cumsum(q_lens, out=io[2 * t : 2 * t + n])
        io[2 * t : 2 * t + n] -= 1
        self._wio_stage.upload((2 * t + n,))
        if device_ids is not None:  # leading one-token rows: token i is row i's
            self._wio[: device_ids.shape[0]].copy_(device_ids).clamp_(min=0)
        hidden = self._piecewise_for(t).run(t_real, self.attn)
        logits = self.model.compute_logits(hidden.index_select(0, self._wio[2 * t : 2 * t + n]))
        return StepOutput(logits, finite_argmax(logits), StepPath.PIECEWISE)

    def _piecewise_for(self, t: int) -> PiecewiseForward:
        """Bucket ``t``'s pieces, captured now if missing or stale (the RoPE table grew; attention, run
        eagerly, reads no captured address, so the backend's buffers may move)."""
        if self.model.rope.version != self._piece_rope_version:
            self._piecewise.clear()
            self._piece_pool = None
            self._piece_rope_version = self.model.rope.version
        fwd = self._piecewise.get(t)
        if fwd is None:
            assert self._wio is not None
            if self._piece_bufs is None:
                self._piece_bufs = PieceBuffers.for_model(self.model, self.piecewise_tokens[-1])
            fwd = self._piecewise[t] = PiecewiseForward(self.model, t, self._wio[:t], self._wio[t : 2 * t],
                                                        self._piece_bufs, self._capture_piece)
        return fwd

    def _capture_piece(self, body: Body) -> Piece:
        """A piece as a CUDA graph in the pieces' shared pool, or called where graphs cannot run."""
        if self.device.type != "cuda":
            return CalledPiece(body)
        graph, _, self._piece_pool = self._warm_and_capture(body, self._piece_pool)
        return GraphPiece(graph)

    @torch.inference_mode()
    def warmup_piecewise(self) -> list[int]:
        """Capture every token bucket's pieces now (largest first, so the smaller ones reuse its pool
        memory) rather than on a mixed step's first use; they read only static buffers, so nothing is
        written to the KV cache. Returns the buckets: ``(num_layers + 1) * len(buckets)`` graphs."""
        if not self.piecewise_tokens or self.model.step_hook is not None:
            return []
        with self._lock, self._on_device():
            for t in reversed(self.piecewise_tokens):
                self._piecewise_for(t)
        return list(reversed(self.piecewise_tokens))


def _write_ids(ids: np.ndarray, pos: np.ndarray, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice], n_dec: int) -> None:
    """The batch's token ids and positions, back to back from the front of ``ids`` and ``pos``: its
    ``n_dec`` leading one-token rows in one assignment each (a mixed step's hundreds of decode rows
    cost a few microseconds, not one slice assignment per row), the prompt chunks after them row by row."""
    try:
        ids[:n_dec] = [tok for (tok,) in tokens[:n_dec]]
    except ValueError:
        raise ValueError("a one-token slice was given another number of tokens") from None
    pos[:n_dec] = [s.start for s in slices[:n_dec]]
    at = n_dec
    for seq, s in zip(tokens[n_dec:], slices[n_dec:]):
        k = len(seq)
        if k != s.q_len:
            raise ValueError(f"{k} tokens given for a slice of {s.q_len}")
        ids[at : at + k] = seq
        pos[at : at + k] = range(s.start, s.start + k)
        at += k


#: The placeholder token list of a step whose ids come as a device tensor (overwritten on the device).
_DEVICE_IDS: list[list[int]] = [[0]]


def finite_argmax(logits: torch.Tensor) -> torch.Tensor:
    """:func:`~hawk.engine.sampler.greedy_tokens` in four kernels instead of seven (a graph's
    tail runs it over ``[bucket, vocab]`` every step). NaN and +inf become -inf (-inf must be
    named too, or nan_to_num makes it finite), so a row's max is finite exactly when the row has
    a finite value, and max returns the first maximal index, as argmax does."""
    clean = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("-inf"), neginf=float("-inf"))
    best, idx = clean.max(-1)
    return torch.where(best > float("-inf"), idx, NO_TOKEN)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (pageable H2D is staged at once)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
