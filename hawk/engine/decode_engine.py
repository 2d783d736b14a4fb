"""The decode instance's engine: admission by KV memory, KV pulled over HAWK, continuous batching.

A request arrives with its first token (sampled by the prefill) and a handle to its KV. Its life:

    WAITING       queued here; holds no decode blocks. Its KV waits on the prefill, kept alive
                  (``DecodeKVConnector.keep_alive``) so a memory-bound decode delays it instead of letting
                  the prefill's TTL expire it into an error.
        | admitted: the blocks its prompt + the first step's token need are free (plus a
        | watermark and the next step's growth of the running batch), first come first served
    TRANSFERRING  its blocks are allocated; a transfer thread pulls the prompt KV into them
                  (layer-wise flow, a ``KVPush`` handle: the request arrives before its prefill,
                  its blocks go to the prefill as the destination, and the prefill writes each
                  layer into them as its forward finishes it; see connector/algorithm1.py)
        | the KV has landed: the prefill's first token goes out (TTFT includes the transfer)
    RUNNING       one token per step. Before each step the engine gives every running sequence the
                  block its next token's KV is written to; when none is free it preempts the most
                  recently admitted running sequence(s) (vLLM's policy):
        | preempted
    SWAPPED       its blocks' raw bytes copied to host memory (``hawk.engine.swap``), its blocks
                  freed, requeued at the front of the waiting queue. A disaggregated decode cannot
                  recompute KV (the NPU has no prefill), hence swap rather than recompute.
        | resumed (first in line): new blocks allocated, the bytes copied back -> RUNNING,
        | generating exactly the tokens it would have
    FINISHED      stop token, length, abort or error: every block is freed, the host copy dropped.

Steps overlap (async scheduling, on by default on a GPU): step N+1 is launched with step N's
tokens as its rows' ids, on the device, before the host reads step N's tokens
(hawk/engine/token_fetch.py), so the host's work between steps runs while the GPU computes. Rows
that joined since (their first token is on the host) come after them, and a mixed step's prefill
chunks after those; a mixed step's prompts complete (first token, handoff) when it is read, and the
prefill engine plans the next chunks of a prompt before that (its planned cursor runs ahead of its
done one). A sequence that finishes at step N (stop token or length) has ridden along in step N+1:
that row is dropped (step N+2 chains on without it, the other rows' ids picked on the device) and
its blocks are freed only once step N+1 is done (the step may still write its KV row there). Any
other change (a request resumes or is aborted, or a step would need a preemption) first waits for
the step in flight and emits its tokens, then runs as a synchronous loop would.

Admission policy: first come, first served by *current* need, as vLLM does: a request needs only
its prompt's blocks (+1 token) to start, so a request with a huge ``max_tokens`` does not hold
blocks it has not used and the head of the queue rarely blocks. When the pool runs dry, the
newest running requests are swapped out, so the oldest always make progress and nobody starves:
a short request behind a long one starts as soon as the long one's current blocks leave room, and
finishes before the long one grows into the pool. The head is never passed by a later request
(that could starve a large prompt), except when nothing is in flight to free blocks (colocated,
where the prefill shares the pool: then a later request that fits goes first rather than deadlock).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hawk.connector.algorithm1 import PushFailed
from hawk.devices.timing import pace_until
from hawk.engine.attention import SeqSlice
from hawk.engine.block_manager import BlockManager
from hawk.engine.kv_connector import DecodeKVConnector
from hawk.engine.loop_clock import LoopClock
from hawk.engine.model import LlamaModel
from hawk.engine.runner import ModelRunner, StepOutput, StepPath
from hawk.engine.sampler import NO_TOKEN, make_generator, sample, sample_tokens
from hawk.engine.sequence import SamplingParams, Sequence, Status
from hawk.engine.step_threads import StepThreads
from hawk.engine.step_trace import StepMark, StepTrace
from hawk.engine.swap import BlockSwapper, SwappedKV, swapper_for
from hawk.engine.token_fetch import TokenFetch, TokenFetcher
from hawk.errors import BadRequest, DuplicateRequest, EngineFailure, PromptTooLong

log = logging.getLogger(__name__)


#: Most prompts one mixed step carries beside its decode rows (their graphs are bucketed by sequences:
#: the attention backend of a mixed engine is sized for ``max_batch + MIXED_PREFILL_SEQS + 1`` rows).
MIXED_PREFILL_SEQS = 16


class PrefillSteps(Protocol):
    """A prefill engine stepped by the decode engine's loop (``PrefillEngine(threaded=False)``)."""

    on_work: Callable[[], None] | None
    may_start: Callable[[int, int], bool] | None

    def has_work(self) -> bool: ...

    def plan_step(self, budget: int, max_pieces: int = ...) -> list[Any]: ...

    def backlog_exceeds(self, tokens: int) -> bool: ...

    def complete_step(self, batch: list[Any], logits: torch.Tensor) -> None: ...

    def fail_step(self, batch: list[Any], e: BaseException) -> None: ...


class OutOfKVMemory(MemoryError):
    """A running sequence needs a block, none is free, and it cannot be swapped out (no swapper)."""


@dataclass(frozen=True)
class KVHandle:
    """Where a request's prompt KV waits: the prefill's control address and its request id there."""

    address: str
    request_id: str


@dataclass(eq=False)
class KVPush:
    """Decode first (kv_flow=layerwise): the prefill at ``address`` will push request ``request_id``'s
    KV into the blocks this engine allocates for it, layer by layer during its forward.

    ``handed`` is set as the destination leaves for the prefill (or when the attempt is over): the
    caller starts the request's prefill then, and the prefill expects it (``KVSender.expect``). ``first_token`` is the prefill's first token, which the caller
    sets (or fails) when its prefill returns; the engine emits it once the KV is here. The first
    token given to :meth:`DecodeEngine.submit` with this handle is a placeholder.
    """

    address: str
    request_id: str
    first_token: Future = field(default_factory=Future)
    handed: threading.Event = field(default_factory=threading.Event)


@dataclass
class TokenEvent:
    """One thing the client should hear about: a token, the end, or an error."""

    request_id: str
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


OnEvent = Callable[[TokenEvent], None]


def _pulled(r: Any) -> dict[str, Any]:
    """What a client sees of one transfer (a ``PullResult``): its time, bytes, requests and mode, and
    where its time went (``kv_breakdown_ms``, Algorithm 1's steps): a served run's records then show
    which step held a slow pull back, not only that it was slow."""
    return {"kv_transfer_s": r.timings["total_s"], "kv_bytes": r.bytes, "kv_requests": r.requests, "kv_mode": r.mode,
            "kv_breakdown_ms": r.host_breakdown_ms()}


def _device_ids(tokens: torch.Tensor, keep: list[int], n: int) -> torch.Tensor:
    """The rows ``keep`` of a step's ``n`` device tokens, in order, without leaving the device."""
    if len(keep) == n:
        return tokens
    return tokens.index_select(0, torch.tensor(keep, dtype=torch.int64).to(tokens.device, non_blocking=True))


class _DeviceWaited:
    """A step's event as the prefill engine gets it: the prefill decides whether to wait for the
    forward (only when a prompt completes), and the loop clock counts that wait as the device's."""

    def __init__(self, event: Any, clock: LoopClock) -> None:
        self.event, self.clock = event, clock

    def synchronize(self) -> None:
        with self.clock.device_wait():
            self.event.synchronize()


def _free_blocks(blocks: BlockManager, seq: Sequence) -> None:
    if seq.block_ids:
        ids, seq.block_ids = seq.block_ids, []
        blocks.free(ids)


class RemoteKV:
    """Disaggregated: pull the KV from the prefill instance with the HAWK receiver."""

    kv_here = False  # it arrives by transfer, on a transfer thread

    def __init__(self, blocks: BlockManager, receiver: Any):
        self.blocks, self.receiver = blocks, receiver

    def blocks_needed(self, seq: Sequence) -> int:
        return self.blocks.blocks_for(seq.prompt_len + 1)

    def admit(self, seq: Sequence, block_ids: list[int], handle: KVHandle | KVPush) -> dict[str, Any]:
        if isinstance(handle, KVPush):
            return self._pushed(seq, block_ids, handle)
        # the prompt's length lets the receiver plan while its request (D1) is in flight
        r = self.receiver.pull(handle.address, handle.request_id, block_ids, num_tokens=seq.prompt_len)
        return _pulled(r)

    def _pushed(self, seq: Sequence, block_ids: list[int], handle: KVPush) -> dict[str, Any]:
        """Hand the blocks to the prefill, wait for its layers and its first token."""
        try:
            r = self.receiver.push_to(handle.address, handle.request_id, block_ids, seq.prompt_len, on_handed=handle.handed.set)
        except PushFailed as e:  # its writes may still land: the blocks wait out the drain first
            self._quarantine(seq, e.drain_s)
            raise
        finally:
            handle.handed.set()
        seq.output_ids[0] = int(handle.first_token.result(timeout=self.receiver.timeout_s))
        return {**_pulled(r), "kv_exposed_s": r.timings.get("sender_exposed_s", 0.0)}

    def _quarantine(self, seq: Sequence, delay_s: float) -> None:
        """Take ``seq``'s blocks out of the engine's hands and free them after ``delay_s``."""
        ids, seq.block_ids = seq.block_ids, []
        if not ids:
            return
        if delay_s <= 0:
            self.blocks.free(ids)
            return
        timer = threading.Timer(delay_s, self.blocks.free, [ids])
        timer.daemon = True
        timer.start()

    def keep_alive(self, handles: list[KVHandle]) -> None:
        by_address: dict[str, list[str]] = {}
        for h in handles:
            if isinstance(h, KVPush):  # not prefilled yet: its prefill waits for the destination
                continue
            by_address.setdefault(h.address, []).append(h.request_id)
        for address, ids in by_address.items():
            self.receiver.keep_alive(address, ids)

    def drop(self, handle: KVHandle | KVPush) -> None:
        """Nothing here holds it: the prefill's TTL frees the KV once keep-alives stop (a KVPush
        never handed over is released so its caller does not wait for it)."""
        if isinstance(handle, KVPush):
            handle.handed.set()

    def cancel(self, handle: KVHandle | KVPush) -> None:
        """An aborted request whose layer-wise push may be in flight: stop it now, so its admission
        ends (and its blocks come back after the drain) without waiting for the prefill's forward."""
        if isinstance(handle, KVPush):
            self.receiver.cancel_push(handle.address, handle.request_id, "the decode aborted the request")
            with contextlib.suppress(InvalidStateError):  # the prefill's result may have come meanwhile
                handle.first_token.set_exception(RuntimeError("the decode aborted the request"))

    def release(self, seq: Sequence) -> None:
        _free_blocks(self.blocks, seq)


class LocalKV:
    """Colocated: the prefill's blocks are taken over as they are; only generation blocks are added."""

    def __init__(self, blocks: BlockManager, kv_here: bool = False):
        self.blocks = blocks
        #: The KV is in this engine's blocks when a request arrives: its first token (the prefill's)
        #: is streamed at submit, and admission takes the blocks on the engine thread, no transfer
        #: thread. Why: each hop cost a step; a colocated request's first token waited for the step
        #: in flight when it arrived and for the next one (decode_first_token 160-350 ms on the 2-core
        #: box). Set where the engine computes on a CPU, where that was measured; a GPU engine keeps
        #: the transfer thread's path until it is measured there (its first-token gap is one fast step).
        self.kv_here = kv_here

    def blocks_needed(self, seq: Sequence) -> int:
        return self.blocks.blocks_for(seq.prompt_len + 1) - self.blocks.blocks_for(seq.prompt_len)

    def admit(self, seq: Sequence, block_ids: list[int], handle: list[int]) -> dict[str, Any]:
        seq.block_ids = list(handle) + block_ids
        return {"kv_transfer_s": 0.0, "kv_bytes": 0, "kv_requests": 0, "kv_mode": "colocated"}

    def keep_alive(self, handles: list[Any]) -> None:
        """Nothing expires: the handed-over blocks are held until the request is decoded or dropped."""

    def drop(self, handle: list[int]) -> None:
        if handle:
            self.blocks.free(list(handle))

    def release(self, seq: Sequence) -> None:
        _free_blocks(self.blocks, seq)


@dataclass(eq=False)
class _Entry:
    seq: Sequence
    handle: Any
    on_event: OnEvent
    aborted: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    swapped: SwappedKV | None = None  # set while SWAPPED: the KV bytes to put back on resume
    kv_taken: bool = False  # the handle's KV is in the sequence's blocks (else drop the handle)
    preemptions: int = 0
    first_sent: bool = False  # the first token went out at submit (the KV was already here)
    pending_info: dict[str, Any] = field(default_factory=dict)  # admission info for the next token's event


@dataclass(eq=False)
class _Launched:
    """A decode step on the device whose tokens the host has not read yet."""

    batch: list[_Entry]
    tokens: TokenFetch
    t0: float
    #: A mixed step's prefill chunks, their rows' logits (kept past the next step's launch), and an
    #: event behind the step, which their completion waits for instead of the stream.
    pieces: list[Any] = field(default_factory=list)
    prefill_logits: torch.Tensor | None = None
    ready: Any = None
    members: set[int] = field(init=False)  # id() of the batch's entries
    #: Entries that finished while this step was in flight: its rows may still write their KV, so
    #: their blocks are freed once it is done.
    release_after: list[_Entry] = field(default_factory=list)
    trace: StepMark | None = None  # HAWK_STEP_TRACE: the step's line, written when it is read

    def __post_init__(self) -> None:
        self.members = {id(e) for e in self.batch}

    def holds(self, e: _Entry) -> bool:
        return id(e) in self.members


class DecodeEngine:
    def __init__(
        self,
        model: LlamaModel,
        attn: Any,
        kv: DecodeKVConnector,
        eos_token_ids: tuple[int, ...] = (),
        max_batch: int = 64,
        transfer_threads: int = 4,
        graphs: bool | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.01,
        swapper: BlockSwapper | None = None,
        keepalive_every_s: float = 0.25,
        step_time: Callable[[int, int], float] | None = None,
        overlap: bool | None = None,
        prefill: PrefillSteps | None = None,
        max_num_batched_tokens: int = 640,
        mixed_graphs: bool = False,
        mixed_graph_tokens: int = 0,
        step_token_target: int = 0,
        step_target_backlog: int = 16,
        step_threads: StepThreads | None = None,
    ):
        """``graphs``: CUDA-graph decode steps (None = when the backend allows, see ModelRunner);
        ``max_model_len``: the longest prompt + output accepted (default: the model's context);
        ``watermark``: fraction of the blocks (at least one) a new admission leaves free, so the
        running batch can grow a while before anyone is preempted (vLLM's default, 1%);
        ``swapper``: copies a preempted sequence's blocks to the host and back (default: found
        from ``attn``'s cache); ``keepalive_every_s``: how often queued requests' KV is kept
        alive on the prefill (the receiver sends at most a few times per prefill TTL);
        ``step_time``: timing emulation (``--npu-timing``): modelled seconds of a step of (batch,
        context tokens); a step that finishes sooner waits until then before its tokens go out;
        ``overlap``: launch each step before reading the previous one's tokens (async scheduling;
        None = on a GPU, without tensor parallelism and timing emulation, where it pays);
        ``prefill``: a stepped prefill engine whose chunks ride in this engine's steps (mixed steps,
        see the module docstring), at most ``max_num_batched_tokens`` tokens per step, decode
        tokens included; ``mixed_graph_tokens`` > 0: mixed and prefill-only steps of at most that
        many tokens replay CUDA graphs (the runner's prefill graphs, and past MIXED_PREFILL_SEQS
        sequences its graph pieces, or with ``mixed_graphs`` its mixed graphs; ``attn`` must hold
        ``max_batch + MIXED_PREFILL_SEQS + 1`` rows); ``step_token_target`` > 0: while the prompts keep
        up (their tokens fit in ``step_target_backlog`` such steps), a step carries only what this many
        tokens leave beside its decode rows (a token bucket of its own, see :meth:`_prefill_budget`);
        ``step_threads``: a CPU engine's OpenMP threads per step, more for a step carrying prompt
        tokens (:mod:`hawk.engine.step_threads`; None: unchanged)."""
        if prefill is not None and max_num_batched_tokens <= max_batch:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed max_batch ({max_batch}): "
                             "decode tokens go first, and prefill needs what they leave")
        if not 0 <= step_token_target < max_num_batched_tokens:
            raise ValueError(f"step_token_target ({step_token_target}) must be 0 (off) or below max_num_batched_tokens "
                             f"({max_num_batched_tokens})")
        self.max_len = min(max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.prefill = prefill
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_token_target = step_token_target
        self.step_target_backlog = step_target_backlog
        # Mixed and prefill-only steps of up to MIXED_PREFILL_SEQS sequences replay a prefill graph;
        # larger mixed batches graph pieces, or with ``mixed_graphs`` a mixed graph (runner.py).
        self.runner = ModelRunner(model, attn, max_batch=max_batch, graphs=graphs, max_model_len=self.max_len,
                                  prefill_graph_tokens=mixed_graph_tokens if prefill is not None else 0, prefill_graph_seqs=MIXED_PREFILL_SEQS,
                                  mixed_graphs=mixed_graphs, piecewise_graphs=True,
                                  extra_token_buckets=(self.step_token_target,) if self.step_token_target else ())
        self.kv = kv
        self.swapper = swapper if swapper is not None else swapper_for(attn)
        self.eos = set(eos_token_ids)
        self.max_batch = max_batch
        self.watermark_blocks = max(1, int(watermark * kv.blocks.num_blocks)) if watermark > 0 else 0
        self.keepalive_every_s = keepalive_every_s
        self.step_time = step_time
        self.step_threads = step_threads
        if overlap is None:
            overlap = self.runner.device.type == "cuda" and model.step_hook is None and step_time is None
        self.overlap = overlap
        self._fetcher = TokenFetcher(self.runner.device, max_batch)
        self._inflight: _Launched | None = None  # engine thread only
        #: steps with decode rows launched on the previous step's device tokens / from host ids only
        #: (the first of a batch, after a change or a drain): how much of the decode the overlap
        #: covers; steps that carried prefill chunks (either way, or alone); and steps that ran as
        #: graph pieces (runner.py: mixed steps past MIXED_PREFILL_SEQS sequences)
        self.steps = {"overlapped": 0, "synchronous": 0, "mixed": 0, "piecewise": 0}
        self.preemptions = 0
        #: the step loop's busy time, its waits on the device and its time blocked (hawk/engine/loop_clock.py)
        self.clock = LoopClock()
        #: one line per step when HAWK_STEP_TRACE names a file (hawk/engine/step_trace.py)
        self.trace = StepTrace.from_env()
        self._lock = threading.Condition()
        self._waiting: deque[_Entry] = deque()
        self._transferring: dict[str, _Entry] = {}
        self._ready: deque[_Entry] = deque()
        self._running: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}
        self._pool = ThreadPoolExecutor(max_workers=transfer_threads, thread_name_prefix="hawk-kv-pull")
        # a layer-wise admission waits in its thread for the prefill's queue and forward, moving
        # nothing itself: one thread each (admission caps them at max_batch), else a few waiting
        # requests would keep every other one from reaching the prefill (threads start on demand)
        self._push_pool = ThreadPoolExecutor(max_workers=max_batch, thread_name_prefix="hawk-kv-push")
        self._stop = False
        self._stopped = threading.Event()
        self._generators: dict[str, torch.Generator | None] = {}
        if prefill is not None:
            prefill.on_work = self._wake
            prefill.may_start = self._may_start_prompt
        self._thread = threading.Thread(target=self._loop, name="hawk-decode", daemon=True)
        self._thread.start()
        self._keepalive = threading.Thread(target=self._keepalive_loop, name="hawk-kv-keepalive", daemon=True)
        self._keepalive.start()

    # -- requests in ---------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_len: int, first_token: int, params: SamplingParams, handle: Any, on_event: OnEvent) -> None:
        if prompt_len <= 0:
            raise BadRequest(f"prompt_len must be positive, got {prompt_len}")
        if prompt_len + params.max_tokens > self.max_len:
            raise PromptTooLong(f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) exceeds the context length {self.max_len}")
        seq = Sequence(request_id, prompt_len, params, output_ids=[first_token])
        peak = self.kv.blocks.blocks_for(prompt_len + params.max_tokens)
        if peak > self.kv.blocks.num_blocks:  # alone with the whole cache it could still not finish
            raise PromptTooLong(f"request needs {peak} KV blocks, the decode cache has {self.kv.blocks.num_blocks}")
        e = _Entry(seq, handle, on_event)
        early = self.kv.kv_here and self._finish_reason(seq, first_token) is None
        with self._lock:
            if request_id in self._entries:
                raise DuplicateRequest(f"request {request_id!r} is already being decoded")
            self._entries[request_id] = e
            if not early:
                self._waiting.append(e)
                self._lock.notify()
        if early:  # before it can be admitted, so nothing can follow it out sooner
            e.info["decode_first_token_s"] = time.monotonic() - seq.arrival
            e.first_sent = self._notify(e, TokenEvent(request_id, token=first_token, info=dict(e.info)))
            with self._lock:
                self._waiting.append(e)
                self._lock.notify()

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``token`` as ``seq``'s latest output finishes it ("stop" or "length"), or None."""
        if (token in self.eos and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            return "stop"
        return "length" if len(seq.output_ids) >= seq.params.max_tokens else None

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks come back (after its transfer, if one is running)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None:
                return False
            e.aborted = True
            queued = e in self._waiting
            if queued:  # waiting or swapped: it holds no blocks, at most a host copy
                self._waiting.remove(e)
                self._entries.pop(request_id, None)
                e.swapped = None
                e.seq.status = Status.FINISHED
                self._generators.pop(request_id, None)
            self._lock.notify()
        if queued:  # the other stages report their abort when they see the flag
            self._drop(e)
            self._notify(e, TokenEvent(request_id, finish_reason="abort"))
        else:
            cancel = getattr(self.kv, "cancel", None)
            if cancel is not None:  # a layer-wise push in flight ends now, not after the forward
                try:
                    cancel(e.handle)
                except Exception:  # noqa: BLE001 - the push still ends by its own timeout
                    log.exception("cancelling the KV push of %s failed", request_id)
        return True

    def _drop(self, e: _Entry) -> None:
        """Give back what a never-admitted request's handle holds (colocated: the prefill's blocks)."""
        if not e.kv_taken:
            e.kv_taken = True
            try:
                self.kv.drop(e.handle)
            except Exception:  # noqa: BLE001
                log.exception("dropping the KV handle of %s failed", e.seq.request_id)

    # -- admission (engine lock held) ----------------------------------------------------------

    def _in_flight(self) -> int:
        return len(self._running) + len(self._transferring) + len(self._ready)

    def _shortfall(self, e: _Entry) -> int:
        """Blocks a running sequence lacks for its next step (the token written is at total_len - 1,
        or at total_len while a step holding its previous token is in flight)."""
        ahead = 1 if self._inflight is not None and self._inflight.holds(e) else 0
        return max(0, self.kv.blocks.blocks_for(e.seq.total_len + ahead) - len(e.seq.block_ids))

    def _admission_need(self, e: _Entry) -> int:
        if e.swapped is not None:  # everything it had, and the slot its next step writes
            return max(e.swapped.num_blocks, self.kv.blocks.blocks_for(e.seq.total_len))
        return self.kv.blocks_needed(e.seq)

    def _fits(self, e: _Entry) -> bool:
        """Room for ``e`` now, leaving the running batch its next step's blocks and the watermark
        (when something is in flight: alone, a request may take the whole pool)."""
        reserve = sum(self._shortfall(r) for r in self._running)
        if self._in_flight():
            reserve += self.watermark_blocks
        return self.kv.blocks.num_free >= self._admission_need(e) + reserve

    def _next_admissible(self) -> _Entry | None:
        """FCFS: the head, if it fits. Only when nothing is in flight (so nothing here will free
        blocks: the colocated prefill holds them) may a later request that fits go first."""
        head = self._waiting[0]
        if self._fits(head):
            return head
        if self._in_flight():
            return None
        return next((e for e in self._waiting if self._fits(e)), None)

    def _admit(self) -> list[_Entry]:
        """Start what fits: new requests go to a transfer thread; swapped ones are returned, their
        blocks allocated, for the engine thread to copy their KV back."""
        resumed: list[_Entry] = []
        while self._waiting and self._in_flight() + len(resumed) < self.max_batch:
            e = self._next_admissible()
            if e is None:
                break
            need = self._admission_need(e)
            blocks = self.kv.blocks.try_allocate(need, e.seq.request_id)
            if blocks is None:  # the colocated prefill took them meanwhile
                break
            self._waiting.remove(e)
            if e.swapped is not None:
                e.seq.block_ids = blocks  # a new list: backends may cache a list they saw before
                resumed.append(e)
                continue
            e.seq.block_ids = blocks
            if self.kv.kv_here:  # nothing to fetch: ready for this iteration's step
                e.info = {**e.info, **self.kv.admit(e.seq, blocks, e.handle), "admit_wait_s": time.monotonic() - e.seq.arrival}
                e.kv_taken = True
                self._ready.append(e)
                continue
            e.seq.status = Status.TRANSFERRING
            self._transferring[e.seq.request_id] = e
            pool = self._push_pool if isinstance(e.handle, KVPush) else self._pool
            pool.submit(self._fetch, e, blocks)
        return resumed

    def _fetch(self, e: _Entry, blocks: list[int]) -> None:
        t0 = time.monotonic()
        try:
            e.info = self.kv.admit(e.seq, blocks, e.handle)
            e.kv_taken = True
            error = None
        except Exception as ex:  # noqa: BLE001 - fail this request, keep serving the rest
            log.warning("KV fetch for %s failed %.1f s after its admission (%.1f s after it arrived): %s",
                        e.seq.request_id, time.monotonic() - t0, t0 - e.seq.arrival, ex)
            error = str(ex)
        e.info["admit_wait_s"] = t0 - e.seq.arrival
        with self._lock:
            self._transferring.pop(e.seq.request_id, None)
            if error is None and not e.aborted:
                self._ready.append(e)
            else:
                self._entries.pop(e.seq.request_id, None)
            self._lock.notify()
        if error is not None or e.aborted:
            self.kv.release(e.seq)
            e.seq.status = Status.FINISHED
            self._notify(e, TokenEvent(e.seq.request_id, finish_reason="abort" if e.aborted else "error", error=error, info=e.info))

    # -- keep-alive ----------------------------------------------------------------------------

    def _keepalive_loop(self) -> None:
        """Keep queued requests' KV alive on the prefill: waiting for decode memory is back-pressure,
        not a failure. A thread of its own, so a slow prefill never stalls a decode step."""
        while not self._stopped.wait(self.keepalive_every_s):
            with self._lock:
                handles = [e.handle for e in self._waiting if e.swapped is None and not e.aborted]
            if not handles:
                continue
            try:
                self.kv.keep_alive(handles)
            except Exception as ex:  # noqa: BLE001 - the TTL then decides, as without keep-alive
                log.warning("keeping %d queued requests' KV alive failed: %s", len(handles), ex)

    # -- preemption ----------------------------------------------------------------------------

    def _reserve_next_slots(self) -> None:
        """Give every running sequence the block its next token's KV goes to, oldest first; when
        the pool is dry, preempt the newest running sequences (possibly the one asking)."""
        i = 0
        while i < len(self._running):
            e = self._running[i]
            short = self._shortfall(e)
            got = self.kv.blocks.try_allocate(short, e.seq.request_id) if short else []
            while got is None:
                victim = self._running[-1]
                self._preempt(victim)
                if victim is e:
                    break
                got = self.kv.blocks.try_allocate(short, e.seq.request_id)
            if got is None:
                continue  # ``e`` was the newest and was preempted: the list ended with it
            e.seq.block_ids.extend(got)  # append-only: backends may keep the list object
            i += 1

    def _preempt(self, e: _Entry) -> None:
        """Swap ``e`` out and requeue it first in line; its blocks come back to the pool here."""
        with self._lock:
            self._running.remove(e)
        if e.aborted:
            self._finish(e, "abort")
            return
        try:
            data = self._swap_out(e)
        except Exception as ex:  # noqa: BLE001 - this request only; its blocks still come back
            self._fail(e, f"preempting it failed: {ex}")
            return
        self.kv.release(e.seq)
        e.swapped, e.seq.status = data, Status.SWAPPED
        e.preemptions += 1
        self.preemptions += 1
        log.info("preempted %s (swapped %d blocks, %d bytes, to the host)", e.seq.request_id, data.num_blocks, data.nbytes)
        with self._lock:
            if e.aborted:  # aborted meanwhile (it was in no queue): end it here
                aborted = True
            else:
                aborted = False
                self._waiting.appendleft(e)  # callers preempt newest first, so the oldest ends up first
                self._lock.notify()
        if aborted:
            self._finish(e, "abort")

    def _swap_out(self, e: _Entry) -> SwappedKV:
        if self.swapper is None:
            raise OutOfKVMemory("out of KV blocks, and this decode backend has no swapper to move a sequence out")
        return self.swapper.swap_out(e.seq.block_ids)

    def _resume(self, e: _Entry) -> None:
        """Copy a swapped sequence's KV into its new blocks and put it back in the batch."""
        data, e.swapped = e.swapped, None
        if e.aborted or data is None:
            self._finish(e, "abort")
            return
        try:
            self.swapper.swap_in(data, e.seq.block_ids)  # type: ignore[union-attr]
        except Exception as ex:  # noqa: BLE001 - this request only; _fail frees its blocks
            self._fail(e, f"swapping in failed: {ex}")
            return
        e.seq.status = Status.RUNNING
        with self._lock:
            self._running.append(e)

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        """The engine thread: it must outlive any one request's failure, so every iteration is guarded."""
        while True:
            try:
                with self.clock.iteration():
                    if not self._iterate():
                        return
            except Exception:  # noqa: BLE001 - a bug here must not stop every other request
                log.exception("decode loop iteration failed; continuing")
                time.sleep(0.01)

    def _wake(self) -> None:
        """A prompt was queued for the stepped prefill: the loop may be waiting for work."""
        with self._lock:
            self._lock.notify()

    def _prefill_pending(self) -> bool:
        return self.prefill is not None and self.prefill.has_work()

    def _iterate(self) -> bool:
        """Admit, start the newly ready, run one step; False once the engine is stopping."""
        with self._lock:
            resumed = self._admit()
            while (not self._stop and not self._ready and not self._running and not resumed and self._inflight is None
                   and not self._prefill_pending()):
                with self.clock.idle():
                    self._lock.wait(0.05)
                resumed = self._admit()
            if self._stop:
                stopping = resumed
            else:
                stopping = []
                newly = list(self._ready)
                self._ready.clear()
                self._running.extend(newly)
                gone = [e for e in self._running if e.aborted]
                self._running = [e for e in self._running if not e.aborted]
        if self._stop:
            self._drain(emit=False)
            for e in stopping:  # close() releases every entry's blocks
                e.swapped = None
            return False
        if self._inflight is not None and (gone or resumed):
            self._drain()  # rows leave or come back: the step in flight goes out first
        for e in gone:
            self._finish(e, "abort")
        for e in resumed:
            self._resume(e)
        for e in newly:  # the prefill's token goes out once the KV is here
            try:
                e.seq.status = Status.RUNNING
                # stream 1: the prefill drew the first token from stream 0 of the same seed
                self._generators[e.seq.request_id] = make_generator(e.seq.params, stream=1)
                if e.first_sent:  # it went out at submit: the admission's info rides with the next token
                    e.pending_info = dict(e.info)
                    continue
                e.info["decode_first_token_s"] = time.monotonic() - e.seq.arrival  # admission + KV + pickup
                self._emit(e, e.seq.output_ids[0], dict(e.info))
            except Exception as ex:  # noqa: BLE001
                self._fail(e, f"starting the request failed: {ex}")
        mixing = self._prefill_pending()
        keep = self._carried(self._inflight.batch) if self._running and self._inflight is not None else None
        if keep is not None and self._step_ahead(mixing, keep):
            return True
        self._drain()
        if self._running:
            self._reserve_next_slots()
        pieces = self._plan_prefill() if mixing else []
        if self._running or pieces:
            self._step(pieces)
        elif mixing:  # prompts wait for blocks, nothing runs to free them here: the requests' ends will
            with self.clock.idle():
                time.sleep(0.002)
        return True

    def _may_start_prompt(self, blocks: int, prefilling: int) -> bool:
        """vLLM's gate for a new prompt: the sequences in flight here (running, queued for admission,
        part-prefilled) stay under ``max_batch``, and its blocks leave the watermark and one block per
        running sequence free, so prompts do not take the blocks the batch grows into (which would
        swap running sequences out to make room for sequences that cannot run yet)."""
        if self._in_flight() + len(self._waiting) + prefilling >= self.max_batch:
            return False
        return self.kv.blocks.num_free - blocks >= self.watermark_blocks + len(self._running)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may carry: the token budget less one per running sequence, or, with
        a step token target, what the target leaves while the prompts keep up (at most
        ``step_target_backlog`` such steps of backlog). Why: a decode step reads every weight for few
        rows, so prompt tokens that keep the step under the GEMMs' knee ride that read almost free,
        where a step past it pays their compute and stretches every running sequence's token; when
        prompts queue, the whole budget prefills them in the fewer, efficient steps that saturation
        needs."""
        assert self.prefill is not None
        rows = len(self._running)
        whole = self.max_num_batched_tokens - rows
        small = self.step_token_target - rows
        if self.step_token_target and 0 < small < whole and not self.prefill.backlog_exceeds(self.step_target_backlog * small):
            return small
        return whole

    def _plan_prefill(self) -> list[Any]:
        """This step's prefill chunks, within :meth:`_prefill_budget`."""
        assert self.prefill is not None
        try:
            return self.prefill.plan_step(self._prefill_budget(), MIXED_PREFILL_SEQS)
        except Exception:  # noqa: BLE001 - the decode steps on; the prompts stay queued
            log.exception("planning the prefill share of a step failed")
            return []

    def _notify(self, e: _Entry, ev: TokenEvent) -> bool:
        """Deliver an event; a raising callback is logged, never propagated (False)."""
        try:
            e.on_event(ev)
            return True
        except Exception:  # noqa: BLE001
            log.exception("event callback for %s failed", e.seq.request_id)
            return False

    def _emit(self, e: _Entry, token: int, info: dict[str, Any] | None = None) -> None:
        seq = e.seq
        reason = self._finish_reason(seq, token)
        if e.pending_info:
            info, e.pending_info = {**e.pending_info, **(info or {})}, {}
        if reason is not None and e.preemptions:
            info = {**(info or {}), "preemptions": e.preemptions}
        e.on_event(TokenEvent(seq.request_id, token=token, finish_reason=reason, info=info or {}))
        if reason is not None:
            with self._lock:
                if e in self._running:
                    self._running.remove(e)
            self._finish(e, None)

    def _finish(self, e: _Entry, reason: str | None) -> None:
        e.seq.status = Status.FINISHED
        try:
            self._release(e)
        finally:
            e.swapped = None
            self._generators.pop(e.seq.request_id, None)
            with self._lock:
                self._entries.pop(e.seq.request_id, None)
        if reason is not None:
            self._notify(e, TokenEvent(e.seq.request_id, finish_reason=reason))

    def _release(self, e: _Entry) -> None:
        """Free ``e``'s blocks, or, while a step that holds its row is in flight, once it is done."""
        if self._inflight is not None and self._inflight.holds(e):
            self._inflight.release_after.append(e)
        else:
            self.kv.release(e.seq)

    def _fail(self, e: _Entry, error: str) -> None:
        """End one request with an error; the others carry on."""
        log.warning("request %s failed: %s", e.seq.request_id, error)
        with self._lock:
            if e in self._running:
                self._running.remove(e)
        if e.seq.status is not Status.FINISHED:
            try:
                self._finish(e, None)
            except Exception:  # noqa: BLE001
                log.exception("releasing %s failed", e.seq.request_id)
        self._notify(e, TokenEvent(e.seq.request_id, finish_reason="error", error=error))

    def _step(self, pieces: list[Any] | None = None) -> None:
        """Launch a step for the running batch (and ``pieces``, prefill chunks, in the same forward);
        read its tokens now, or (overlap) on the next iteration."""
        batch = list(self._running)
        try:
            launched = self._launch(batch, None, pieces or [])
        except Exception as ex:  # noqa: BLE001
            log.exception("decode step failed")
            for e in batch:
                self._fail(e, f"decode step failed: {ex}")
            return
        if self.overlap and launched.tokens.device is not None:
            self._inflight = launched
        else:
            self._collect(launched)

    def _carried(self, prev: list[_Entry]) -> list[int] | None:
        """Where the next step may take its leading rows' ids from the device: the in-flight step's
        rows still running, in order, then rows that joined since (their first token is on the host).
        Their indices in ``prev`` (rows that finished at the step before are left out: their last
        step is the one in flight), or None where the running batch is otherwise changed."""
        keep = [i for i, e in enumerate(prev) if e.seq.status is Status.RUNNING and not e.aborted]
        run = self._running
        if len(run) < len(keep) or any(run[j] is not prev[i] for j, i in enumerate(keep)):
            return None
        return keep

    def _step_ahead(self, mixing: bool, keep: list[int]) -> bool:
        """Launch the next step, the in-flight step's rows ``keep`` (see :meth:`_carried`) taking its
        device tokens as their ids (and this step's prefill chunks when ``mixing``), then read the
        in-flight step. False (nothing launched) where the next step must be a synchronous one: its
        blocks need a preemption. A sequence whose last token is in flight rides along too (its
        position is still below ``prompt + max_tokens``, whose blocks submit() checked exist)."""
        prev = self._inflight
        assert prev is not None
        batch = list(self._running)
        if prev.tokens.device is None or not self._reserve_ahead(batch):
            return False
        pieces = self._plan_prefill() if mixing else []
        try:
            nxt = self._launch(batch, prev, pieces, keep)
        except Exception as ex:  # noqa: BLE001
            log.exception("decode step failed")
            self._drain()
            for e in batch:
                if e.seq.status is Status.RUNNING:
                    self._fail(e, f"decode step failed: {ex}")
            return True
        self._inflight = nxt
        self._collect(prev)
        if nxt.tokens.device is None:  # sampled on the host: nothing left in flight to chain from
            self._drain()
        return True

    def _reserve_ahead(self, batch: list[_Entry]) -> bool:
        """The blocks a chained step writes to (each sequence's in-flight token's slot), without
        preempting anyone: False when the pool cannot give them."""
        short = [(e, self._shortfall(e)) for e in batch]
        if sum(n for _, n in short) > self.kv.blocks.num_free:
            return False
        for e, n in short:
            got = self.kv.blocks.try_allocate(n, e.seq.request_id) if n else []
            if got is None:  # the colocated prefill took them meanwhile
                return False
            e.seq.block_ids.extend(got)  # append-only: backends may keep the list object
        return True

    def _launch(self, batch: list[_Entry], prev: _Launched | None, pieces: list[Any], keep: list[int] | None = None) -> _Launched:
        """Run one step of ``batch`` (decode rows first) and ``pieces``, prefill chunks, in the same
        forward; start sampling and fetching the rows' tokens. With ``prev`` (the step in flight),
        its rows ``keep`` lead ``batch`` and take its tokens on the device as their ids, one position
        after each sequence's last known token; rows after them joined since and bring host ids. A
        failed forward fails the pieces here and the rows in the caller. The pieces' prompts
        complete (first tokens, handoffs) when the step is read (:meth:`_collect`)."""
        k = len(keep) if prev is not None and keep is not None else 0
        ids = _device_ids(prev.tokens.device, keep, len(prev.batch)) if k else None  # type: ignore[union-attr]
        slices = [SeqSlice(e.seq.block_ids, e.seq.total_len - 1 + (i < k), 1) for i, e in enumerate(batch)]
        tokens = [[0] if i < k else [e.seq.last_token] for i, e in enumerate(batch)]
        slices += [SeqSlice(p.job.blocks, p.start, p.q_len) for p in pieces]
        tokens += [p.tokens for p in pieces]
        n = len(batch)
        if self.step_threads is not None:
            self.step_threads.enter(sum(p.q_len for p in pieces))
        t0 = time.perf_counter()
        mark = self.trace.begin(self.runner.device) if self.trace is not None else None
        try:
            out = self.runner.step(tokens, slices, ids=ids)
        except Exception as ex:
            if pieces:
                self.prefill.fail_step(pieces, ex)  # type: ignore[union-attr]
            raise
        if mark is not None:
            mark.launched(self.runner.device, rows=n, context=sum(s.start for s in slices[:n]),
                          longest=max((s.start for s in slices[:n]), default=0),
                          prompt_tokens=sum(p.q_len for p in pieces), chunks=len(pieces),
                          spans=[[p.start, p.q_len] for p in pieces], path=out.path.name)
        if n:
            self.steps["overlapped" if k else "synchronous"] += 1
        if pieces:
            self.steps["mixed"] += 1
        if out.path is StepPath.PIECEWISE:
            self.steps["piecewise"] += 1
        greedy = None if out.greedy is None else out.greedy[:n]
        fetch = self._sample(batch, StepOutput(out.logits[:n], greedy, out.path)) if n else TokenFetch.ready([])
        if not pieces:
            return _Launched(batch, fetch, t0, trace=mark)
        rows = out.logits[n:]
        if out.path is StepPath.GRAPH:  # a graph's output: the next step's replay may overwrite it
            rows = rows.clone()
        ready = None
        if rows.is_cuda:
            with torch.cuda.device(rows.device):  # an event belongs to the device current at its record
                ready = torch.cuda.Event()
                ready.record()
        return _Launched(batch, fetch, t0, pieces, rows, ready, trace=mark)

    def _drain(self, emit: bool = True) -> None:
        """Wait for the step in flight, if any, and emit its tokens (or only free what it held)."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._collect(launched, emit)

    def _collect(self, launched: _Launched, emit: bool = True) -> None:
        """Emit a step's tokens to the sequences still running (one that finished or was aborted
        since its launch rode along: its row is dropped), then free what waited for the step.
        ``emit`` False (stopping): only wait for the step and free."""
        try:
            with self.clock.device_wait():
                toks = launched.tokens.result()
        except Exception as ex:  # noqa: BLE001 - the device failed this step: its rows fail
            log.exception("reading a decode step's tokens failed")
            toks = [ex] * len(launched.batch)
        if launched.trace is not None and self.trace is not None:
            self.trace.write(launched.trace)
        if emit and self.step_time is not None and launched.batch:  # a prefill-only step is no decode step
            self._pace(launched.t0, launched.batch)
        for e, tok in zip(launched.batch, toks) if emit else ():
            if e.seq.status is not Status.RUNNING or e.aborted:
                continue
            try:
                if isinstance(tok, Exception):
                    raise tok
                if tok == NO_TOKEN:
                    raise ValueError("the model produced no finite logit")
                e.seq.output_ids.append(tok)
                self._emit(e, tok)
            except Exception as ex:  # noqa: BLE001 - this request only
                self._fail(e, f"sampling failed: {ex}")
        if launched.pieces:
            self._complete(launched, emit)
        for e in launched.release_after:
            self.kv.release(e.seq)

    def _complete(self, launched: _Launched, emit: bool) -> None:
        """A read step's prefill chunks go back to the prefill engine: the prompts it completed get
        their first tokens and hand off (or, stopping, fail and free their blocks)."""
        assert self.prefill is not None and launched.prefill_logits is not None
        try:
            if not emit:
                raise EngineFailure("the engine is stopping")
            ready = None if launched.ready is None else _DeviceWaited(launched.ready, self.clock)
            self.prefill.complete_step(launched.pieces, launched.prefill_logits, ready)
        except Exception as ex:  # noqa: BLE001 - a bug there must not lose the decode rows' tokens
            if emit:
                log.exception("completing a step's prefill chunks failed")
            self.prefill.fail_step(launched.pieces, ex)

    def _pace(self, t0: float, batch: list[_Entry]) -> None:
        """Timing emulation: hold the step's tokens until the modelled step time has passed."""
        modelled = self.step_time(len(batch), sum(e.seq.total_len for e in batch))  # type: ignore[misc]
        with self.clock.device_wait():
            pace_until(t0, modelled)

    def _sample(self, batch: list[_Entry], out: StepOutput) -> TokenFetch:
        """The batch's tokens, sampled on the device and on their way to the host; if batched
        sampling fails, row by row on the host, so that only the rows that fail again fail
        (their exception in place of the token)."""
        params = [e.seq.params for e in batch]
        gens = [self._generators.get(e.seq.request_id) for e in batch]
        try:
            return self._fetcher.start(sample_tokens(out.logits, params, gens, out.greedy))
        except Exception:  # noqa: BLE001
            log.exception("batched sampling failed; sampling row by row")
        toks: list[int | Exception] = []
        for i, (p, g) in enumerate(zip(params, gens)):
            try:
                toks.append(sample(out.logits[i], p, g))
            except Exception as ex:  # noqa: BLE001
                toks.append(ex)
        return TokenFetch.ready(toks)

    def warmup(self) -> list[int]:
        """Capture the decode CUDA graphs now (before traffic); the batch sizes captured."""
        return self.runner.warmup()

    # -- introspection -----------------------------------------------------------------------

    @property
    def loop_thread(self) -> threading.Thread:
        """The thread that runs this engine's steps (a server binds it to the engine's cores)."""
        return self._thread

    def is_alive(self) -> bool:
        """Whether the step loop still runs: a dead one answers nothing, ever."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "waiting": len(self._waiting),
                "swapped": sum(1 for e in self._waiting if e.swapped is not None),
                "preemptions": self.preemptions,
                "transferring": len(self._transferring),
                "running": len(self._running) + len(self._ready),
                "free_blocks": self.kv.blocks.num_free,
                "total_blocks": self.kv.blocks.num_blocks,
                "steps_overlapped": self.steps["overlapped"],
                "steps_synchronous": self.steps["synchronous"],
                "steps_mixed": self.steps["mixed"],
                "steps_piecewise": self.steps["piecewise"],
                **self.clock.stats(),
            }

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._stopped.set()
        self._thread.join(timeout=10)
        self._keepalive.join(timeout=10)
        with self._lock:
            pushes = [e.handle for e in self._transferring.values() if isinstance(e.handle, KVPush)]
        cancel = getattr(self.kv, "cancel", None)
        for h in pushes if cancel is not None else []:  # they would wait out the prefill's queue
            with contextlib.suppress(Exception):
                cancel(h)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._push_pool.shutdown(wait=True, cancel_futures=True)
        if self.trace is not None:
            self.trace.close()
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._waiting.clear()
            self._running.clear()
            self._ready.clear()
        for e in entries:  # every path ends here or in _finish: blocks freed, host copies dropped
            e.swapped = None
            self._drop(e)
            self.kv.release(e.seq)
