"""The prefill instance's engine: batched prefill into a vLLM-layout paged cache, first token, KV handed to the sender.

Requests queue; a worker thread takes as many as fit a token budget and the free blocks, runs
one ragged forward, samples each first token and registers the KV with the HAWK sender (which
frees the blocks once the KV has been staged, or after a deadline if nobody pulls it).

Chunked prefill (``max_prefill_chunk`` > 0): no iteration carries more than that many prompt
tokens. A longer prompt is prefilled over several iterations, chunk by chunk, each chunk a
continuing slice (``start`` = tokens already cached) that attends the KV its earlier chunks left
in the paged cache. The thread goes back to its loop between chunks, so a decode engine sharing
the model and the device (colocated) gets its steps in between instead of stalling behind one
long forward, and a forward's activations stay bounded by the chunk, not the prompt. Blocks for
the whole prompt are taken when its first chunk is scheduled; the first token is sampled after
the last chunk. The request's future stays pending until its last chunk runs, so cancelling it
(the client's ``future.cancel()`` or :meth:`PrefillEngine.cancel`) works mid-way and the engine
frees its blocks before the next iteration.

Layer-wise push (``layer_push``, kv_flow=layerwise): when the forward that completes a prompt (its
last chunk) has written its first layer, the engine asks the connector whether a destination waits
for it (or is on its way: the connector may wait a moment, while the GPU runs); if so, the attention
backend reports each layer as its K/V are written (a prefill graph: after its launch, each layer
with its event), and the connector transforms and writes that layer beside the rest of the forward.
Earlier chunks' KV is already in the cache, so pushing after the last chunk's layer l sends the
whole prompt's layer l. (Pushing per chunk would start earlier on long prompts but cut NPU tiles at
chunk boundaries; not done.)

Stepped (``threaded=False``, the colocated instance's mixed steps): the engine runs no thread and
no forward of its own. The decode engine's loop asks it for this step's pieces under what the
token budget leaves after the running decodes (:meth:`PrefillEngine.plan_step`), runs them in the
same forward as its decode tokens, and hands back their logits (:meth:`PrefillEngine.complete_step`)
or the failure (:meth:`PrefillEngine.fail_step`). Queueing, chunking, blocks, cancellation and
first-token sampling stay here, so both ways share one scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from hawk.engine.block_manager import BlockManager
from hawk.engine.kv_connector import LayerFeed, LayerPushConnector, PrefillKVConnector
from hawk.engine.model import LlamaModel
from hawk.engine.paged_attention import PagedAttention, SeqSlice
from hawk.engine.runner import ModelRunner
from hawk.engine.sampler import NO_TOKEN, NonFiniteLogits, make_generator, sample, sample_batch
from hawk.engine.sequence import SamplingParams
from hawk.errors import BadRequest, EngineFailure, HawkError, PromptTooLong
from hawk.layouts.gpu import GpuKVLayout

log = logging.getLogger(__name__)


def _fault(e: BaseException) -> BaseException:
    """What a failed request's caller gets: a named fault as it is, anything else as EngineFailure
    (the server answers it as the engine's fault, not as a crash of its own)."""
    if isinstance(e, HawkError) or not isinstance(e, Exception):
        return e
    fault = EngineFailure(f"prefill failed: {type(e).__name__}: {e}")
    fault.__cause__ = e
    return fault


#: Default ``max_prefill_chunk``: long enough that a chunk's GEMMs are compute-bound (chunking
#: costs little), short enough that a decode step waits one chunk, not a whole long prompt.
DEFAULT_PREFILL_CHUNK = 2048


@dataclass
class PrefillResult:
    request_id: str
    first_token: int
    num_prompt_tokens: int
    block_ids: list[int]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    future: Future
    arrival: float = field(default_factory=time.monotonic)
    blocks: list[int] | None = None  # the whole prompt's blocks, from its first chunk on
    done: int = 0  # prompt tokens whose KV is in the cache
    planned: int = 0  # prompt tokens scheduled (>= done: a stepping engine may plan before the last step is read)
    started: float | None = None  # when its first chunk was scheduled
    chunks: int = 0


@dataclass(frozen=True)
class _Piece:
    """One job's share of an iteration: prompt tokens ``start .. start + q_len``."""

    job: _Job
    start: int
    q_len: int

    @property
    def last(self) -> bool:
        """This piece finishes the prompt: its logits give the first token."""
        return self.start + self.q_len == len(self.job.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        return self.job.prompt_ids[self.start : self.start + self.q_len]


class PrefillEngine:
    def __init__(
        self,
        model: LlamaModel,
        layout: GpuKVLayout,
        caches: Sequence[torch.Tensor],
        handoff: PrefillKVConnector,
        max_batch_tokens: int = 8192,
        block_manager: BlockManager | None = None,
        max_prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        layer_push: LayerPushConnector | None = None,
        graph_tokens: int = 0,
        threaded: bool = True,
    ):
        """``max_batch_tokens``: prompt tokens per iteration (a longer prompt still runs, alone,
        when chunking is off). ``max_prefill_chunk``: 0 = whole prompts only; N > 0 = at most N
        prompt tokens per iteration, a longer prompt split over iterations. ``graph_tokens`` > 0:
        iterations of at most that many tokens replay CUDA graphs where the device allows (see
        runner.py; the decode graphs a batch of one-token prompts would want are not kept).
        ``threaded`` False: stepped by another engine's loop (see the module docstring); then
        this engine holds no runner and ``on_work`` is called whenever a prompt is queued."""
        if max_prefill_chunk < 0:
            raise ValueError(f"max_prefill_chunk must be >= 0, got {max_prefill_chunk}")
        self.layout, self.caches = layout, list(caches)
        self.blocks = block_manager or BlockManager(layout.num_blocks, layout.block_size)
        if not threaded and layer_push is not None:
            raise ValueError("a stepped prefill engine has no layer-wise push (colocated moves no KV)")
        self.threaded = threaded
        self.runner: ModelRunner | None = None
        if threaded:
            self.runner = ModelRunner(model, PagedAttention(layout, caches), graphs=False, prefill_graph_tokens=graph_tokens)
        #: Stepped: wakes the loop that steps this engine (set by it; called outside this engine's lock).
        self.on_work: Callable[[], None] | None = None
        #: Stepped: ``may_start(blocks, prefilling)``, whether a queued prompt needing ``blocks`` may start
        #: now that ``prefilling`` prompts are part-prefilled (set by the stepping engine: vLLM's gate,
        #: so prompts never hold the blocks the running batch grows into; called under this engine's lock).
        self.may_start: Callable[[int, int], bool] | None = None
        self.handoff = handoff
        self.layer_push = layer_push
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.max_prompt_tokens = min(model.config.max_position_embeddings, layout.num_blocks * layout.block_size)
        self._queue: deque[_Job] = deque()
        self._active: list[_Job] = []  # prompts holding blocks, not yet past their last chunk; oldest first
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="hawk-prefill", daemon=True)
            self._thread.start()

    @property
    def loop_thread(self) -> threading.Thread | None:
        """The thread that runs this engine's steps; None when stepped (its chunks ride the decode's steps)."""
        return self._thread

    def is_alive(self) -> bool:
        """Whether the step loop still runs (a stepped engine has none to die)."""
        return self._thread is None or self._thread.is_alive()

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Future:
        """Queue a prompt; the future resolves to a :class:`PrefillResult` (or the error)."""
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens exceeds this instance's limit of {self.max_prompt_tokens}")
        fut: Future = Future()
        with self._cv:
            self._queue.append(_Job(request_id, list(prompt_ids), params, fut))
            self._cv.notify()
        if self.on_work is not None:
            self.on_work()
        return fut

    def cancel(self, request_id: str) -> bool:
        """Drop a request still waiting for prefill, or one whose last chunk has not started
        (part-way through a chunked prefill: its blocks are freed before the next iteration).
        False once the last forward runs: then the result comes, and the caller discards it."""
        with self._cv:
            for j in self._queue:
                if j.request_id == request_id:
                    self._queue.remove(j)
                    j.future.cancel()
                    return True
            for j in self._active:
                if j.request_id == request_id and j.future.cancel():
                    self._cv.notify()
                    return True
        return False

    def stats(self) -> dict[str, int]:
        with self._cv:
            waiting, prefilling = len(self._queue), len(self._active)
        return {"waiting": waiting, "prefilling": prefilling, "free_blocks": self.blocks.num_free, "total_blocks": self.blocks.num_blocks}

    # -- scheduling (under self._cv) ------------------------------------------------------------

    def _budget(self) -> int:
        """Prompt tokens one iteration may carry: the chunk bounds it when chunking is on."""
        if self.max_prefill_chunk:
            return min(self.max_batch_tokens, self.max_prefill_chunk)
        return self.max_batch_tokens

    def _reap_cancelled(self) -> None:
        """Part-prefilled prompts whose futures were cancelled give their blocks back."""
        for j in [j for j in self._active if j.future.cancelled()]:
            self._active.remove(j)
            self._release(j)

    def _take_batch(self, budget: int | None = None, max_pieces: int = 1 << 30) -> list[_Piece]:
        """This iteration's pieces: part-prefilled prompts continue first (oldest first), then
        queued prompts start while the budget and the free blocks last. Without chunking each
        piece is a whole prompt and the first always goes (as large as it is). ``budget`` (a
        stepped engine: what the step's token budget leaves) is a hard bound: prompts are chunked
        to it whatever ``max_prefill_chunk`` says."""
        self._reap_cancelled()
        if budget is None:
            budget, chunking = self._budget(), self.max_prefill_chunk > 0
        else:
            budget, chunking = min(budget, self._budget()) if self.max_prefill_chunk else budget, True
        pieces: list[_Piece] = []
        for j in self._active:
            if budget <= 0 or len(pieces) >= max_pieces:
                break
            n = min(len(j.prompt_ids) - j.planned, budget)
            if n <= 0:  # its last chunk is in a step not yet read
                continue
            pieces.append(_Piece(j, j.planned, n))
            j.planned += n
            budget -= n
        while self._queue and budget > 0 and len(pieces) < max_pieces:
            j = self._queue[0]
            if j.future.cancelled():  # cancelled by its client since it was queued
                self._queue.popleft()
                continue
            n = min(len(j.prompt_ids), budget) if chunking else len(j.prompt_ids)
            if pieces and n > budget:
                break
            need = self.blocks.blocks_for(len(j.prompt_ids))
            if self.may_start is not None and not self.may_start(need, len(self._active)):
                break  # the stepping engine's batch is full (or its blocks are spoken for)
            blocks = self.blocks.try_allocate(need, j.request_id)
            if blocks is None:  # wait for blocks to come back (the sender frees them after staging)
                break
            self._queue.popleft()
            j.blocks, j.started, j.planned = blocks, time.monotonic(), n
            self._active.append(j)  # from here :meth:`cancel` finds it, until its last chunk runs
            pieces.append(_Piece(j, 0, n))
            budget -= n
        return pieces

    # -- stepped by another engine's loop ----------------------------------------------------

    def has_work(self) -> bool:
        """A part-prefilled prompt has tokens left to plan, or the first queued one's blocks are free
        (read without the lock: a hint to the stepping loop, which then asks :meth:`plan_step`). A queue whose head
        waits for blocks (or for ``may_start``) is no work: the loop keeps its overlapped decode steps."""
        if any(j.planned < len(j.prompt_ids) or j.future.cancelled() for j in self._active):
            return True
        try:
            head = self._queue[0]
        except IndexError:  # empty (or emptied by another thread just now)
            return False
        if head.future.cancelled():
            return True
        need = self.blocks.blocks_for(len(head.prompt_ids))
        return self.blocks.num_free >= need and (self.may_start is None or self.may_start(need, len(self._active)))

    def plan_step(self, budget: int, max_pieces: int = 1 << 30) -> list[_Piece]:
        """This step's pieces, at most ``budget`` prompt tokens and ``max_pieces`` prompts in all
        (none when ``budget`` < 1); their blocks are allocated. The caller runs them (``piece.tokens`` at
        ``SeqSlice(piece.job.blocks, piece.start, piece.q_len)``) and then calls
        :meth:`complete_step` or :meth:`fail_step` with exactly these pieces."""
        if budget < 1:
            return []
        with self._cv:
            if self._stop:
                return []
            batch = self._take_batch(budget, max_pieces)
        return self._runnable(batch)

    def backlog_exceeds(self, tokens: int) -> bool:
        """Whether more than ``tokens`` prompt tokens wait to be planned (queued prompts and the rest of
        part-prefilled ones). Stops counting once past ``tokens``: a stepping engine asks every step."""
        with self._cv:
            left = tokens
            for j in self._active:
                left -= len(j.prompt_ids) - j.planned
                if left < 0:
                    return True
            for j in self._queue:
                left -= len(j.prompt_ids)
                if left < 0:
                    return True
        return False

    def complete_step(self, batch: list[_Piece], logits: torch.Tensor, ready: Any = None) -> None:
        """The forward of ``batch`` ran; ``logits[i]`` is piece i's last-token logits (the caller's
        to keep until this returns). Prompts it completed get their first token and hand off.
        ``ready``: an event recorded behind that forward, or anything whose ``synchronize()`` waits
        for it (the stepping engine may have launched the next step behind it: the stream is not
        waited for), else the current stream is."""
        if logits.is_cuda and any(p.last for p in batch):  # their prefill time ends with the forward, not its launch
            if ready is not None:
                ready.synchronize()
            else:
                torch.cuda.current_stream(logits.device).synchronize()
        t1 = time.monotonic()
        for p in batch:
            p.job.done, p.job.chunks = p.start + p.q_len, p.job.chunks + 1
        rows = [i for i, p in enumerate(batch) if p.last]
        if rows:
            self._finish([batch[i].job for i in rows], logits[rows], t1)

    def fail_step(self, batch: list[_Piece], e: BaseException) -> None:
        """The forward of ``batch`` failed: its prompts fail and give their blocks back."""
        for p in batch:
            self._fail(p.job, e)

    # -- the worker -----------------------------------------------------------------------------

    def _loop(self) -> None:
        """The prefill thread: guarded per iteration, so no one request's failure can stop it."""
        while True:
            try:
                with self._cv:
                    while not self._stop and not self._queue and not self._active:
                        self._cv.wait()
                    if self._stop:
                        return
                    batch = self._take_batch()
                if not batch:
                    time.sleep(0.002)
                    continue
                self._run(batch)
                if self._active:
                    time.sleep(0)  # between chunks: let the other engine's thread take the model
            except Exception:  # noqa: BLE001
                log.exception("prefill loop iteration failed; continuing")
                time.sleep(0.01)

    def _release(self, j: _Job) -> None:
        """Give back a job's blocks (once)."""
        if j.blocks is not None:
            blocks, j.blocks = j.blocks, None
            self.blocks.free(blocks)

    def _forget(self, j: _Job) -> None:
        with self._cv:
            if j in self._active:
                self._active.remove(j)

    def _fail(self, j: _Job, e: BaseException) -> None:
        """This job is over with an error: blocks back, the error to its client (unless it left)."""
        self._forget(j)
        self._release(j)
        try:
            j.future.set_exception(_fault(e))
        except InvalidStateError:  # cancelled meanwhile: nobody is waiting
            pass

    def _runnable(self, batch: list[_Piece]) -> list[_Piece]:
        """Drop the last pieces of prompts cancelled since they were scheduled; the futures of the
        rest turn running (no longer cancellable) as their last chunk starts."""
        out = []
        for p in batch:
            if p.last and not p.job.future.set_running_or_notify_cancel():
                self._forget(p.job)
                self._release(p.job)
                continue
            out.append(p)
        return out

    def _feeds(self, batch: list[_Piece]) -> dict[_Job, LayerFeed]:
        """Layer-wise pushes of the prompts this forward completes (none without ``layer_push``)."""
        if self.layer_push is None:
            return {}
        feeds = {}
        for p in batch:
            if p.last:
                try:
                    feed = self.layer_push(p.job.request_id, len(p.job.prompt_ids), list(p.job.blocks or []))
                except Exception:  # noqa: BLE001 - no push: the KV goes the pull way
                    log.exception("starting the layer-wise push of %s failed", p.job.request_id)
                    feed = None
                if feed is not None:
                    feeds[p.job] = feed
        return feeds

    def _run(self, batch: list[_Piece]) -> None:
        batch = self._runnable(batch)
        if not batch:
            return
        feeds: dict[_Job, LayerFeed] = {}
        assert self.runner is not None
        attn = self.runner.attn
        pushing = self.layer_push is not None and any(p.last for p in batch)
        if pushing:  # the pushes begin at the first layer written: a destination still on its way
            started = []  # (``KVSender.expect``) may be waited for, after a graph's launch on CUDA

            def after_layer(layer: int, marker: object) -> None:
                if not started:
                    started.append(True)
                    feeds.update(self._feeds(batch))
                for f in feeds.values():
                    f.layer_written(layer, marker)

            attn.after_layer = after_layer
        try:
            slices = [SeqSlice(p.job.blocks, p.start, p.q_len) for p in batch]  # type: ignore[arg-type]
            logits = self.runner.forward([p.tokens for p in batch], slices)
            if self.caches[0].is_cuda:  # this forward's stream only: a decode may share the GPU
                torch.cuda.current_stream(self.caches[0].device).synchronize()
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("prefill batch failed")
            for f in feeds.values():
                f.failed(e)
            for p in batch:
                self._fail(p.job, e)
            return
        finally:
            if pushing:
                attn.after_layer = None
        t1 = time.monotonic()
        for p in batch:
            p.job.done, p.job.chunks = p.start + p.q_len, p.job.chunks + 1
        rows = [i for i, p in enumerate(batch) if p.last]
        if rows:
            self._finish([batch[i].job for i in rows], logits[rows] if len(rows) < len(batch) else logits, t1, feeds)

    def _finish(self, jobs: list[_Job], logits: torch.Tensor, t1: float, feeds: dict[_Job, LayerFeed] | None = None) -> None:
        """Prompts whose last chunk just ran: sample each first token, hand the KV off."""
        firsts = self._sample(jobs, logits)
        for j, first in zip(jobs, firsts):
            self._forget(j)
            blocks = j.blocks
            assert blocks is not None
            freed = threading.Event()

            def free(blocks: list[int] = blocks, freed: threading.Event = freed) -> None:
                if not freed.is_set():
                    freed.set()
                    self.blocks.free(blocks)

            try:
                if isinstance(first, Exception):
                    raise first
                if first == NO_TOKEN:
                    raise NonFiniteLogits("the model produced no finite logit for the first token")
                t_hand = time.monotonic()
                self.handoff(j.request_id, len(j.prompt_ids), blocks, free)
                t_hand = time.monotonic() - t_hand
            except Exception as e:  # noqa: BLE001 - this request only: its blocks come back
                log.warning("prefill of %s failed: %s", j.request_id, e)
                if feeds and j in feeds:
                    feeds[j].failed(e)
                free()
                j.blocks = None
                j.future.set_exception(_fault(e))
                continue
            j.blocks = None  # the handoff owns them now
            started = j.started if j.started is not None else t1
            timings = {"queue_s": started - j.arrival, "prefill_s": t1 - started, "prefill_chunks": float(j.chunks),
                       "handoff_s": t_hand}  # the KV handed to the sender (or the colocated decode)
            j.future.set_result(PrefillResult(j.request_id, first, len(j.prompt_ids), blocks, timings))

    @staticmethod
    def _sample(batch: list[_Job], logits: torch.Tensor) -> list[int | Exception]:
        """Each job's first token (one host sync); row by row if the batch fails, so only rows
        that fail again carry their exception."""
        try:
            gens = [make_generator(j.params) for j in batch]
            return list(sample_batch(logits, [j.params for j in batch], gens))
        except Exception:  # noqa: BLE001
            log.exception("batched first-token sampling failed; sampling row by row")
        out: list[int | Exception] = []
        for j, lg in zip(batch, logits):
            try:
                out.append(sample(lg, j.params, make_generator(j.params)))
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def close(self) -> None:
        with self._cv:
            self._stop = True
            for j in [*self._queue, *self._active]:
                j.future.cancel()
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._thread is None or not self._thread.is_alive():  # part-prefilled prompts: nobody will finish them
            with self._cv:
                active, self._active = self._active, []
            for j in active:
                self._release(j)
