"""The prefill instance's engine: batched prefill into a vLLM-layout paged cache, first token, KV handed to the sender.

Requests queue; a worker thread takes as many as fit a token budget and the free blocks, runs
one ragged forward, samples each first token and registers the KV with the HAWK sender (which
frees the blocks once the KV has been staged, or after a deadline if nobody pulls it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from hawk.engine.block_manager import BlockManager
from hawk.engine.model import LlamaModel
from hawk.engine.paged_attention import PagedAttention, SeqSlice
from hawk.engine.runner import ModelRunner
from hawk.engine.sampler import NO_TOKEN, NonFiniteLogits, make_generator, sample, sample_batch
from hawk.engine.sequence import SamplingParams
from hawk.layouts.gpu import GpuKVLayout

log = logging.getLogger(__name__)


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


#: ``handoff(request_id, num_tokens, block_ids, free_blocks)``: who takes the KV after prefill.
Handoff = Callable[[str, int, list[int], Callable[[], None]], None]


class PrefillEngine:
    def __init__(
        self,
        model: LlamaModel,
        layout: GpuKVLayout,
        caches: Sequence[torch.Tensor],
        handoff: Handoff,
        max_batch_tokens: int = 8192,
        block_manager: BlockManager | None = None,
    ):
        self.layout, self.caches = layout, list(caches)
        self.blocks = block_manager or BlockManager(layout.num_blocks, layout.block_size)
        # Prefill batches are eager; a graph per batch of one-token prompts would be waste.
        self.runner = ModelRunner(model, PagedAttention(layout, caches), graphs=False)
        self.handoff = handoff
        self.max_batch_tokens = max_batch_tokens
        self.max_prompt_tokens = min(model.config.max_position_embeddings, layout.num_blocks * layout.block_size)
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="hawk-prefill", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> Future:
        """Queue a prompt; the future resolves to a :class:`PrefillResult` (or the error)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds this instance's limit of {self.max_prompt_tokens}")
        fut: Future = Future()
        with self._cv:
            self._queue.append(_Job(request_id, list(prompt_ids), params, fut))
            self._cv.notify()
        return fut

    def cancel(self, request_id: str) -> bool:
        """Drop a request still waiting for prefill."""
        with self._cv:
            for j in self._queue:
                if j.request_id == request_id:
                    self._queue.remove(j)
                    j.future.cancel()
                    return True
        return False

    def stats(self) -> dict[str, int]:
        with self._cv:
            waiting = len(self._queue)
        return {"waiting": waiting, "free_blocks": self.blocks.num_free, "total_blocks": self.blocks.num_blocks}

    def _take_batch(self) -> list[_Job]:
        batch, tokens, free = [], 0, self.blocks.num_free
        while self._queue:
            j = self._queue[0]
            need = self.blocks.blocks_for(len(j.prompt_ids))
            if batch and (tokens + len(j.prompt_ids) > self.max_batch_tokens or need > free):
                break
            if need > free:  # wait for blocks to come back (the sender frees them after staging)
                break
            batch.append(self._queue.popleft())
            tokens += len(j.prompt_ids)
            free -= need
        return batch

    def _loop(self) -> None:
        """The prefill thread: guarded per iteration, so no one request's failure can stop it."""
        while True:
            try:
                with self._cv:
                    while not self._stop and not self._queue:
                        self._cv.wait()
                    if self._stop:
                        return
                    batch = self._take_batch()
                if not batch:
                    time.sleep(0.002)
                    continue
                self._run(batch)
            except Exception:  # noqa: BLE001
                log.exception("prefill loop iteration failed; continuing")
                time.sleep(0.01)

    def _run(self, batch: list[_Job]) -> None:
        # A future cancelled by its client since it was queued is skipped (and can't be cancelled now).
        batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
        if not batch:
            return
        t0 = time.monotonic()
        allocated: list[list[int]] = []
        try:
            for j in batch:
                allocated.append(self.blocks.allocate(self.blocks.blocks_for(len(j.prompt_ids)), j.request_id))
            slices = [SeqSlice(b, 0, len(j.prompt_ids)) for j, b in zip(batch, allocated)]
            logits = self.runner.forward([j.prompt_ids for j in batch], slices)
            if self.caches[0].is_cuda:
                torch.cuda.synchronize(self.caches[0].device)
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("prefill batch failed")
            for b in allocated:
                self.blocks.free(b)
            for j in batch:
                j.future.set_exception(e)
            return
        t1 = time.monotonic()
        firsts = self._sample(batch, logits)
        for j, blocks, first in zip(batch, allocated, firsts):
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
                self.handoff(j.request_id, len(j.prompt_ids), blocks, free)
            except Exception as e:  # noqa: BLE001 - this request only: its blocks come back
                log.warning("prefill of %s failed: %s", j.request_id, e)
                free()
                j.future.set_exception(e)
                continue
            timings = {"queue_s": t0 - j.arrival, "prefill_s": t1 - t0}
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
            for j in self._queue:
                j.future.cancel()
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(timeout=10)
