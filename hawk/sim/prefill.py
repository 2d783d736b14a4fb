"""A prefill instance (GPU): FIFO batching up to a token budget, KV held until it is pulled.

Mirrors ``hawk.engine.prefill_engine``: a batch takes waiting prompts in order while their total
stays within ``max_batch_tokens`` and their KV fits; a prompt that does not fit waits (in order)
for transfers to free memory. That hold-until-pulled is what turns a slow decode side into
prefill-side queuing (the paper's "backpressure", §5.3.1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import simpy

from hawk.sim.compute import PrefillModel
from hawk.sim.request import SimRequest


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, model: PrefillModel, on_prefilled: Callable[[SimRequest], None]):
        self.env, self.index, self.model, self.on_prefilled = env, index, model, on_prefilled
        self.queue: deque[SimRequest] = deque()
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

    def _take_batch(self) -> list[SimRequest]:
        batch: list[SimRequest] = []
        tokens, free = 0, self.model.kv_capacity_tokens - self.kv_used
        while self.queue:
            n = self.queue[0].input_len
            if n > free or (batch and tokens + n > self.model.max_batch_tokens):
                break
            batch.append(self.queue.popleft())
            tokens += n
            free -= n
        return batch

    def _run(self):  # simpy process
        while True:
            batch = self._take_batch()
            if not batch:
                yield self._wake
                self._wake = self.env.event()
                continue
            start = self.env.now
            self.kv_used += sum(r.input_len for r in batch)
            self.kv_peak = max(self.kv_peak, self.kv_used)
            for r in batch:
                r.t_prefill_start = start
            yield self.env.timeout(self.model.batch_time([r.input_len for r in batch]))
            self.busy_s += self.env.now - start
            self.batches += 1
            for r in batch:
                r.t_prefilled = self.env.now
                self.on_prefilled(r)
