"""A decode instance (NPU or GPU): admission control on KV memory, then continuous batching.

Mirrors ``hawk.engine.decode_engine``:

1. *Admission* (in arrival order): a request is admitted when a batch slot is free
   (running + transferring + ready < ``max_batch``) and its whole KV reservation (prompt + output
   tokens) fits the free KV memory. Admission reserves the memory and starts the pull (D1); the
   head of the queue waits for memory, others wait behind it. With ``admit_between_steps`` (what
   ``DecodeEngine`` does: its thread admits at the top of each iteration, so a request submitted
   while a step runs waits for that step, pacing included, before its pull starts) a request that
   arrives during a step is admitted when the step ends; an idle instance admits at once.
2. *Transfer*: the KV moves (``transfer.py``); the prefill instance frees its paged copy when
   the KV lands, or, where a pull goes through the prefill's staging buffer, as it is staged (P6).
3. *Join*: at the next step boundary the request joins the batch and its first token (computed by
   prefill) goes out — TTFT therefore includes prefill, the transfer and any admission wait.
   With host staging (``host_s_per_token`` > 0, see ``host.py``) the landed KV still has to be
   copied (and for ``gn-host`` tilized) into the device's cache by this instance's worker: that
   work runs between steps, one request at a time, and the request joins after it.
   With ``first_token_on_decode`` (vLLM's disaggregated serving, which the paper's system runs:
   see ``VLLM_DECODE_FLOW``) the request joins without a token and its first token comes out
   of the first step it is part of, so TTFT also holds the rest of the step running when it became
   ready and one step of its own: TTFT then depends on the decode device's speed.
4. *Steps*: each step takes ``DecodeModel.step_time(batch, context)`` and gives every running
   request one token; a request that has all its tokens leaves and frees its reservation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import simpy

from hawk.sim.compute import DecodeModel
from hawk.sim.request import SimRequest
from hawk.sim.transfer import KVTransferService


class DecodeInstance:
    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        model: DecodeModel,
        transfer: KVTransferService,
        on_prefill_kv_free: Callable[[SimRequest], None],
        on_finished: Callable[[SimRequest], None],
        admit_between_steps: bool = False,
        host_s_per_token: float = 0.0,
        transfer_slots: int | None = None,
        first_token_on_decode: bool = False,
    ):
        self.env, self.index, self.model, self.transfer = env, index, model, transfer
        self.host_s_per_token = host_s_per_token  # worker time to land one token of staged KV
        self.landing: deque[SimRequest] = deque()  # staged KV waiting for the worker
        self.transfer_slots = transfer_slots  # pulls at once (the engine's pull threads); None: no limit
        self.host_busy_s = 0.0
        self.admit_between_steps = admit_between_steps
        self.first_token_on_decode = first_token_on_decode
        self.stepping = False  # a step is running (admission then waits for its end, if asked to)
        self.on_prefill_kv_free, self.on_finished = on_prefill_kv_free, on_finished
        self.waiting: deque[SimRequest] = deque()
        self.transferring = 0
        self.ready: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.kv_used = 0
        self.kv_peak = 0
        self.batch_peak = 0
        self.steps = 0
        self.busy_s = 0.0
        self._wake = env.event()
        env.process(self._run())

    @property
    def load(self) -> int:
        """Requests this instance holds in any state (for a least-loaded router)."""
        return len(self.waiting) + self.transferring + len(self.landing) + len(self.ready) + len(self.running)

    def fits(self, r: SimRequest) -> bool:
        """Could this request ever be admitted here (an empty instance)?"""
        return r.kv_reservation <= self.model.kv_capacity_tokens

    def submit(self, r: SimRequest) -> None:
        self.waiting.append(r)
        if not (self.admit_between_steps and self.stepping):
            self._admit()

    def _slots_used(self) -> int:
        return len(self.running) + self.transferring + len(self.landing) + len(self.ready)

    def _admit(self) -> None:
        while self.waiting and self._slots_used() < self.model.max_batch:
            if self.transfer_slots is not None and self.transferring >= self.transfer_slots:
                return  # every pull thread is busy: the next admission waits for one
            r = self.waiting[0]
            if self.kv_used + r.kv_reservation > self.model.kv_capacity_tokens:
                return  # memory is short: wait, in order, for running requests to finish
            self.waiting.popleft()
            self.kv_used += r.kv_reservation
            self.kv_peak = max(self.kv_peak, self.kv_used)
            self.transferring += 1
            r.t_admitted = self.env.now
            self.env.process(self._fetch(r))

    def _fetch(self, r: SimRequest):  # simpy process
        if r.lost_at_pull is not None:
            yield from self._lose(r)
            return
        yield from self.transfer.move(r, self.on_prefill_kv_free)  # P6 as the KV is staged, where it is
        self.transferring -= 1
        if not self.transfer.stages:
            self.on_prefill_kv_free(r)  # no staging copy: the prefill's blocks are read until the KV lands
        if self.host_s_per_token > 0:
            self.landing.append(r)  # the worker lands it between steps
        else:
            r.t_kv_done = self.env.now
            self.ready.append(r)
        if self.transfer_slots is not None:
            self._admit()  # a pull thread is free (its request still holds its batch slot)
        if not self._wake.triggered:
            self._wake.succeed()

    def _lose(self, r: SimRequest):  # simpy process body
        """The pull fails as it starts (``SimRequest.lost_at_pull``): nothing crosses, the decode's
        reservation and the prefill's copy are freed, and the next admission may start."""
        yield self.env.timeout(0)
        self.transferring -= 1
        self.kv_used -= r.kv_reservation
        r.error = r.lost_at_pull
        self.on_prefill_kv_free(r)  # the prefill drops its copy
        self.on_finished(r)
        self._admit()
        if not self._wake.triggered:
            self._wake.succeed()

    def _finish(self, r: SimRequest) -> None:
        r.finished = True
        self.kv_used -= r.kv_reservation
        assert self.kv_used >= 0, "decode KV released twice"
        self.on_finished(r)

    def _join(self) -> None:
        """Ready requests enter the batch; their first (prefill-computed) token goes out now, or,
        with ``first_token_on_decode``, at the end of the next step (``VLLM_DECODE_FLOW``)."""
        now = self.env.now
        if self.first_token_on_decode:
            self.running.extend(self.ready)  # tokens stay 0: the next step computes the first one
            self.ready = []
            self.batch_peak = max(self.batch_peak, len(self.running))
            return
        for r in self.ready:
            r.t_first = r.t_last = now
            r.tokens = 1
            if r.tokens >= r.output_len:
                self._finish(r)
            else:
                self.running.append(r)
        self.ready = []
        self.batch_peak = max(self.batch_peak, len(self.running))

    def _land(self):  # simpy process body: the worker copies staged KV in, one request at a time
        while self.landing:
            r = self.landing.popleft()
            t = self.host_s_per_token * r.input_len
            yield self.env.timeout(t)
            self.host_busy_s += t
            r.t_kv_done = self.env.now
            self.ready.append(r)

    def _run(self):  # simpy process
        while True:
            if self.landing:
                yield from self._land()
            self._join()
            self._admit()
            if not self.running:
                if not self.ready and not self.landing:
                    yield self._wake
                    self._wake = self.env.event()
                continue
            start = self.env.now
            self.stepping = True
            yield self.env.timeout(self.model.step_time(len(self.running), sum(r.context for r in self.running)))
            self.stepping = False
            self.steps += 1
            self.busy_s += self.env.now - start
            still = []
            for r in self.running:
                r.tokens += 1
                if r.t_first is None:
                    r.t_first = self.env.now  # first_token_on_decode: this step made its first token
                r.t_last = self.env.now
                if r.tokens >= r.output_len:
                    self._finish(r)
                else:
                    still.append(r)
            self.running = still


#: How vLLM v1 (the paper's §5.1.2 serves with vLLM v0.10.0) moves a remote-prefilled request through a
#: decode instance, as ``SimConfig`` fields:
#:
#: * ``admit_between_steps``: ``EngineCore``'s busy loop takes new requests from its input queue only
#:   between two ``step()`` calls, and the connector starts a request's KV load in the worker's next
#:   ``execute_model``, so a request that arrives while a step runs starts its pull when that step ends;
#: * ``first_token_on_decode``: the first output token is sampled by a forward of the serving
#:   instance. ``KVCacheManager.get_computed_blocks`` caps a full prefix hit at ``prompt_length - 1``
#:   ("we must recompute the last token to obtain logits"), the KV connectors load only whole blocks of
#:   a remote prefill (``NixlConnector.get_num_new_matched_tokens``), and the disaggregated proxy
#:   discards the prefill's ``max_tokens=1`` output and streams the decode's.
#:
#: HAWK's engine (``hawk/engine``) also admits between steps (the cross-validation sets that) but sends
#: the prefill's token at the join.
VLLM_DECODE_FLOW = {"admit_between_steps": True, "first_token_on_decode": True}
