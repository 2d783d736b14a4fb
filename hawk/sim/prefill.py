"""A prefill instance (GPU): FIFO batching up to a token budget, KV held until it is pulled.

Mirrors ``hawk.engine.prefill_engine``: a batch takes waiting prompts in order while their total
stays within ``max_batch_tokens`` and their KV fits; a prompt that does not fit waits (in order)
for transfers to free memory. That hold-until-pulled is what turns a slow decode side into
prefill-side queuing (the paper's "backpressure", §5.3.1).

Chunked prefill (``PrefillModel.chunk_tokens`` > 0, the engine's ``max_prefill_chunk``): an
iteration carries at most ``PrefillModel.budget`` prompt tokens; part-prefilled prompts continue
first (oldest first), then queued prompts start while the budget lasts, the last one cut to what
is left. A prompt's KV is reserved when its first chunk is scheduled; it is prefilled (its first
token exists) when its last chunk ends, and its prefill time runs from its first chunk's start.

Host staging (``host_s_per_token`` > 0, see ``host.py``): after each forward the worker copies the
KV it produced to host memory before it starts the next batch; a prompt is prefilled (its KV can
be pulled) once its copy is done.

CUDA-graph capture on first use (``graphs``, a :class:`GraphCapture`): HAWK's prefill replays one CUDA
graph per (token bucket, sequence bucket) (``hawk/engine/runner.py``). The server captures the
one-prompt buckets before traffic (``warmup_prefill``); any other bucket, such as the first forward
that batches two prompts, is captured when a batch first needs it: ``WARMUP_RUNS`` eager runs of the
forward, the capture, then the replay. That forward costs :meth:`GraphCapture.extra_s` more, once per
bucket per instance.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import simpy

from hawk.engine.graph_buckets import PREFILL_GRAPH_SEQS, WARMUP_RUNS, prefill_seq_buckets, prefill_token_buckets
from hawk.sim.compute import PrefillModel
from hawk.sim.request import SimRequest


@dataclass(frozen=True)
class GraphCapture:
    """The prefill's CUDA graphs: which forwards replay one, and what capturing one costs.

    ``max_tokens``: the engine's ``prefill_graph_tokens`` (larger forwards run eagerly);
    ``capture_s``: the capture's own time beyond the warm-up runs and the replay (measured,
    ``benchmarks/prefill_graph_capture_probe.py``); ``source`` says where it was measured."""

    max_tokens: int = 2048
    capture_s: float = 0.0
    source: str = "assumption"

    def bucket(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The (tokens, sequences) bucket of a forward, or None where it runs eagerly
        (``ModelRunner._prefill_bucket``)."""
        sb = prefill_seq_buckets(PREFILL_GRAPH_SEQS)
        if tokens > self.max_tokens or seqs > sb[-1]:
            return None
        return next(b for b in prefill_token_buckets(self.max_tokens) if b >= tokens), next(b for b in sb if b >= seqs)

    def startup(self) -> set[tuple[int, int]]:
        """What the server captures before traffic: every token bucket for one prompt (``warmup_prefill``)."""
        return {(t, 1) for t in prefill_token_buckets(self.max_tokens)}

    def extra_s(self, forward_s: float) -> float:
        """A first use's cost beyond the forward itself: the warm-up runs, then the capture."""
        return WARMUP_RUNS * forward_s + self.capture_s


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, model: PrefillModel, on_prefilled: Callable[[SimRequest], None],
                 host_s_per_token: float = 0.0, graphs: GraphCapture | None = None,
                 captured: Iterable[tuple[int, int]] = ()):
        """``graphs``: capture prefill graphs on first use (None: no first-use cost); ``captured``: buckets
        already captured beyond the server's startup ones (by earlier traffic to the same instance)."""
        self.env, self.index, self.model, self.on_prefilled = env, index, model, on_prefilled
        self.host_s_per_token = host_s_per_token  # worker time to stage one token's KV in host memory
        self.graphs = graphs
        self.captured: set[tuple[int, int]] = (graphs.startup() if graphs else set()) | {tuple(b) for b in captured}
        self.captures: list[tuple[int, int]] = []  # buckets this run captured, in order
        self.queue: deque[SimRequest] = deque()
        self.active: list[SimRequest] = []  # part-prefilled (chunked prefill), oldest first
        self._done: dict[int, int] = {}  # prompt tokens prefilled so far, by id(request)
        self.kv_used = 0
        self.kv_peak = 0
        self.busy_s = 0.0
        self.batches = 0
        self._wake = env.event()
        env.process(self._run())

    @property
    def queued_tokens(self) -> int:
        return sum(r.input_len for r in self.queue)

    def submit(self, r: SimRequest) -> None:
        self.queue.append(r)
        self._poke()

    def release(self, tokens: int) -> None:
        """The request's KV left (its transfer finished): room for more prefills."""
        self.kv_used -= tokens
        assert self.kv_used >= 0, "prefill KV released twice"
        self._poke()

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _take_batch(self) -> list[tuple[SimRequest, int]]:
        """This iteration's pieces ``(request, prompt tokens)``; newly started requests move to
        ``active`` with their KV reserved (``PrefillEngine._take_batch``)."""
        pieces: list[tuple[SimRequest, int]] = []
        budget, chunking = self.model.budget, self.model.chunk_tokens > 0
        for r in self.active:
            if budget <= 0:
                break
            n = min(r.input_len - self._done[id(r)], budget)
            pieces.append((r, n))
            budget -= n
        while self.queue and budget > 0:
            r = self.queue[0]
            n = min(r.input_len, budget) if chunking else r.input_len
            if pieces and n > budget:
                break
            if r.input_len > self.model.kv_capacity_tokens - self.kv_used:
                break  # its KV does not fit: wait, in order, for transfers to free some
            self.queue.popleft()
            self.kv_used += r.input_len
            self.kv_peak = max(self.kv_peak, self.kv_used)
            r.t_prefill_start = self.env.now
            self._done[id(r)] = 0
            self.active.append(r)
            pieces.append((r, n))
            budget -= n
        return pieces

    def _run(self):  # simpy process
        while True:
            pieces = self._take_batch()
            if not pieces:
                yield self._wake
                self._wake = self.env.event()
                continue
            start = self.env.now
            forward = self.model.batch_time([n for _, n in pieces])
            yield self.env.timeout(forward + self._first_use_s(pieces, forward) + self.host_s_per_token * sum(n for _, n in pieces))
            self.busy_s += self.env.now - start
            self.batches += 1
            for r, n in pieces:
                self._done[id(r)] += n
                if self._done[id(r)] >= r.input_len:
                    del self._done[id(r)]
                    self.active.remove(r)
                    r.t_prefilled = self.env.now
                    self.on_prefilled(r)

    def _first_use_s(self, pieces: list[tuple[SimRequest, int]], forward_s: float) -> float:
        """The capture's cost if this forward's graph bucket is new to this instance (else 0)."""
        if self.graphs is None:
            return 0.0
        b = self.graphs.bucket(sum(n for _, n in pieces), len(pieces))
        if b is None or b in self.captured:
            return 0.0
        self.captured.add(b)
        self.captures.append(b)
        return self.graphs.extra_s(forward_s)
