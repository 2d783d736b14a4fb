"""The decode instance's engine: admission by KV memory, KV pulled over HAWK, continuous batching.

A request arrives with its first token (sampled by the prefill) and a handle to its KV. The engine
admits requests in arrival order when their blocks (prompt + max_tokens) fit, pulls the KV into
those blocks on a transfer thread, then runs every admitted sequence one token per step until it
stops. The first token is emitted when the KV has landed, so time-to-first-token includes the
transfer, as in a disaggregated deployment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hawk.engine.block_manager import BlockManager
from hawk.engine.model import LlamaModel
from hawk.engine.attention import SeqSlice
from hawk.engine.runner import ModelRunner, StepOutput
from hawk.engine.sampler import NO_TOKEN, make_generator, sample, sample_batch
from hawk.engine.sequence import SamplingParams, Sequence, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVHandle:
    """Where a request's prompt KV waits: the prefill's control address and its request id there."""

    address: str
    request_id: str


@dataclass
class TokenEvent:
    """One thing the client should hear about: a token, the end, or an error."""

    request_id: str
    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


OnEvent = Callable[[TokenEvent], None]


class KVSource(Protocol):
    """How the decode engine gets a sequence's prompt KV into blocks it owns."""

    blocks: BlockManager

    def blocks_needed(self, seq: Sequence) -> int: ...

    def admit(self, seq: Sequence, block_ids: list[int], handle: Any) -> dict[str, Any]:
        """Fill ``block_ids`` with the prompt KV (blocking); returns transfer info for the client."""
        ...

    def release(self, seq: Sequence) -> None: ...


class RemoteKV:
    """Disaggregated: pull the KV from the prefill instance with the HAWK receiver."""

    def __init__(self, blocks: BlockManager, receiver: Any):
        self.blocks, self.receiver = blocks, receiver

    def blocks_needed(self, seq: Sequence) -> int:
        return self.blocks.blocks_for(seq.prompt_len + seq.params.max_tokens)

    def admit(self, seq: Sequence, block_ids: list[int], handle: KVHandle) -> dict[str, Any]:
        r = self.receiver.pull(handle.address, handle.request_id, block_ids)
        return {"kv_transfer_s": r.timings["total_s"], "kv_bytes": r.bytes, "kv_requests": r.requests, "kv_mode": r.mode}

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []


class LocalKV:
    """Colocated: the prefill's blocks are taken over as they are; only generation blocks are added."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks

    def blocks_needed(self, seq: Sequence) -> int:
        return self.blocks.blocks_for(seq.prompt_len + seq.params.max_tokens) - self.blocks.blocks_for(seq.prompt_len)

    def admit(self, seq: Sequence, block_ids: list[int], handle: list[int]) -> dict[str, Any]:
        seq.block_ids = list(handle) + block_ids
        return {"kv_transfer_s": 0.0, "kv_bytes": 0, "kv_requests": 0, "kv_mode": "colocated"}

    def release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []


@dataclass(eq=False)
class _Entry:
    seq: Sequence
    handle: Any
    on_event: OnEvent
    aborted: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class DecodeEngine:
    def __init__(
        self,
        model: LlamaModel,
        attn: Any,
        kv: KVSource,
        eos_token_ids: tuple[int, ...] = (),
        max_batch: int = 64,
        transfer_threads: int = 4,
        graphs: bool | None = None,
        max_model_len: int | None = None,
    ):
        """``graphs``: CUDA-graph decode steps (None = when the backend allows, see ModelRunner);
        ``max_model_len``: the longest prompt + output accepted (default: the model's context)."""
        self.max_len = min(max_model_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.runner = ModelRunner(model, attn, max_batch=max_batch, graphs=graphs, max_model_len=self.max_len)
        self.kv = kv
        self.eos = set(eos_token_ids)
        self.max_batch = max_batch
        self._lock = threading.Condition()
        self._waiting: deque[_Entry] = deque()
        self._transferring: dict[str, _Entry] = {}
        self._ready: deque[_Entry] = deque()
        self._running: list[_Entry] = []
        self._entries: dict[str, _Entry] = {}
        self._pool = ThreadPoolExecutor(max_workers=transfer_threads, thread_name_prefix="hawk-kv-pull")
        self._stop = False
        self._generators: dict[str, torch.Generator | None] = {}
        self._thread = threading.Thread(target=self._loop, name="hawk-decode", daemon=True)
        self._thread.start()

    # -- requests in ---------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_len: int, first_token: int, params: SamplingParams, handle: Any, on_event: OnEvent) -> None:
        if prompt_len <= 0:
            raise ValueError(f"prompt_len must be positive, got {prompt_len}")
        if prompt_len + params.max_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) exceeds the context length {self.max_len}")
        seq = Sequence(request_id, prompt_len, params, output_ids=[first_token])
        need = self.kv.blocks_needed(seq)
        if need > self.kv.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks, the decode cache has {self.kv.blocks.num_blocks}")
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request {request_id!r} is already being decoded")
            e = _Entry(seq, handle, on_event)
            self._entries[request_id] = e
            self._waiting.append(e)
            self._lock.notify()

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks come back (after its transfer, if one is running)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None:
                return False
            e.aborted = True
            queued = e in self._waiting
            if queued:
                self._waiting.remove(e)
                self._entries.pop(request_id, None)
            self._lock.notify()
        if queued:  # it held nothing yet; the other stages report their abort when they see the flag
            e.on_event(TokenEvent(request_id, finish_reason="abort"))
        return True

    # -- the loop ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self._waiting and len(self._running) + len(self._transferring) + len(self._ready) < self.max_batch:
            e = self._waiting[0]
            need = self.kv.blocks_needed(e.seq)
            if not self.kv.blocks.can_allocate(need):
                return  # memory is short: wait (in order) for running requests to finish
            self._waiting.popleft()
            blocks = self.kv.blocks.allocate(need, e.seq.request_id) if need else []
            e.seq.block_ids = blocks
            e.seq.status = Status.TRANSFERRING
            self._transferring[e.seq.request_id] = e
            self._pool.submit(self._fetch, e, blocks)

    def _fetch(self, e: _Entry, blocks: list[int]) -> None:
        t0 = time.monotonic()
        try:
            e.info = self.kv.admit(e.seq, blocks, e.handle)
            error = None
        except Exception as ex:  # noqa: BLE001 - fail this request, keep serving the rest
            log.warning("KV fetch for %s failed: %s", e.seq.request_id, ex)
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
            self._notify(e, TokenEvent(e.seq.request_id, finish_reason="abort" if e.aborted else "error", error=error, info=e.info))

    def _loop(self) -> None:
        """The engine thread: it must outlive any one request's failure, so every iteration is guarded."""
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # noqa: BLE001 - a bug here must not stop every other request
                log.exception("decode loop iteration failed; continuing")
                time.sleep(0.01)

    def _iterate(self) -> bool:
        """Admit, start the newly ready, run one step; False once the engine is stopping."""
        with self._lock:
            self._admit()
            while not self._stop and not self._ready and not self._running:
                self._lock.wait(0.05)
                self._admit()
            if self._stop:
                return False
            newly = list(self._ready)
            self._ready.clear()
            self._running.extend(newly)
            gone = [e for e in self._running if e.aborted]
            self._running = [e for e in self._running if not e.aborted]
        for e in gone:
            self._finish(e, "abort")
        for e in newly:  # the prefill's token goes out once the KV is here
            try:
                e.seq.status = Status.RUNNING
                # stream 1: the prefill drew the first token from stream 0 of the same seed
                self._generators[e.seq.request_id] = make_generator(e.seq.params, stream=1)
                self._emit(e, e.seq.output_ids[0], dict(e.info))
            except Exception as ex:  # noqa: BLE001
                self._fail(e, f"starting the request failed: {ex}")
        if self._running:
            self._step()
        return True

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
        reason = None
        if (token in self.eos and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_tokens:
            reason = "length"
        e.on_event(TokenEvent(seq.request_id, token=token, finish_reason=reason, info=info or {}))
        if reason is not None:
            with self._lock:
                if e in self._running:
                    self._running.remove(e)
            self._finish(e, None)

    def _finish(self, e: _Entry, reason: str | None) -> None:
        e.seq.status = Status.FINISHED
        try:
            self.kv.release(e.seq)
        finally:
            self._generators.pop(e.seq.request_id, None)
            with self._lock:
                self._entries.pop(e.seq.request_id, None)
        if reason is not None:
            self._notify(e, TokenEvent(e.seq.request_id, finish_reason=reason))

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

    def _step(self) -> None:
        batch = list(self._running)
        slices = [SeqSlice(e.seq.block_ids, e.seq.total_len - 1, 1) for e in batch]
        try:
            out = self.runner.step([[e.seq.last_token] for e in batch], slices)
        except Exception as ex:  # noqa: BLE001
            log.exception("decode step failed")
            for e in batch:
                self._fail(e, f"decode step failed: {ex}")
            return
        for e, tok in zip(batch, self._sample(batch, out)):
            try:
                if isinstance(tok, Exception):
                    raise tok
                if tok == NO_TOKEN:
                    raise ValueError("the model produced no finite logit")
                e.seq.output_ids.append(tok)
                self._emit(e, tok)
            except Exception as ex:  # noqa: BLE001 - this request only
                self._fail(e, f"sampling failed: {ex}")

    def _sample(self, batch: list[_Entry], out: StepOutput) -> list[int | Exception]:
        """The batch's tokens with one host sync; if batched sampling fails, row by row, so that
        only the rows that fail again fail (their exception in place of the token)."""
        params = [e.seq.params for e in batch]
        gens = [self._generators.get(e.seq.request_id) for e in batch]
        try:
            return list(sample_batch(out.logits, params, gens, out.greedy))
        except Exception:  # noqa: BLE001
            log.exception("batched sampling failed; sampling row by row")
        toks: list[int | Exception] = []
        for i, (p, g) in enumerate(zip(params, gens)):
            try:
                toks.append(sample(out.logits[i], p, g))
            except Exception as ex:  # noqa: BLE001
                toks.append(ex)
        return toks

    def warmup(self) -> list[int]:
        """Capture the decode CUDA graphs now (before traffic); the batch sizes captured."""
        return self.runner.warmup()

    # -- introspection -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "waiting": len(self._waiting),
                "transferring": len(self._transferring),
                "running": len(self._running) + len(self._ready),
                "free_blocks": self.kv.blocks.num_free,
                "total_blocks": self.kv.blocks.num_blocks,
            }

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._waiting.clear()
            self._running.clear()
            self._ready.clear()
        for e in entries:
            self.kv.release(e.seq)
