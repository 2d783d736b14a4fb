"""HawkConnector's scheduler half: which requests' blocks vLLM must hold, and which prompts it loads.

The request lifecycle, once (the worker half, worker_half.py, does the moving):

  prefill instance (kv_role kv_producer / kv_both), a request with ``{"do_remote_decode": true}``:
    1 vLLM runs it (max_tokens 1, as P/D routers send it); it finishes with its first token
    2 ``request_finished``: HAWK takes over its blocks (vLLM will not free them) and answers a KVHandle in
      the response's ``kv_transfer_params`` (where the KV waits, under which id, the first token)
    3 the next step's plan carries a SendJob; the worker hands the blocks to Algorithm 1's sender
    4 a decode pulls (D1..D9), or the TTL passes, or the worker shuts down: the sender gives the blocks
      back, the worker reports the request as finished sending, vLLM frees its blocks
  A request that finishes otherwise (aborted, stopped on its first token by an end token or a stop token
  id) is not held: vLLM frees it. A stop string is matched by vLLM's front end after its engine finished
  the one-token request by length, so such a request is held, and its KV goes back at the TTL.

  decode instance (kv_role kv_consumer / kv_both), a request whose params carry a KVHandle, in one of
  two forms (``Handoff``):
    standard                 its prompt is the prefill's prompt (vLLM's P/D protocol): all of it loads, and
                             vLLM recomputes the last prompt token with its one-token step (its scheduler
                             counts a fully loaded prompt as one token short) to sample the first token again
    prompt+first-token       its prompt is the prefill's prompt plus the handle's ``first_token``
                             (handoff.py builds it): the prompt's KV loads and vLLM computes only the first
                             token, as a one-token step, sampling the second: what one instance computes
    0 ``on_new_request``: while it waits in vLLM's queue (a busy decode may keep it there longer than the
      prefill's TTL), every sixth of the TTL the step plan asks the worker to keep its KV alive on the
      prefill (as vLLM's NixlConnector renews its KV lease by heartbeats), until its blocks are allocated
      or it finishes
    1 ``get_num_new_matched_tokens``: the handle's prompt tokens load asynchronously
    2 ``update_state_after_alloc``: vLLM allocated the blocks; the next step's plan carries a RecvJob
    3 the worker pulls into them (D1..D9) and reports the request as finished receiving (a failed pull
      reports its blocks as load errors: vLLM recomputes or fails the request, per its
      ``kv_load_failure_policy``; a request it reschedules is not pulled again); vLLM then schedules it
  A decode with local prefix-cache hits for the prompt loads nothing and recomputes (the pull is whole).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hawk.connector.configs import CONFIGS
from hawk.errors import BadRequest
from hawk.integrations.vllm.params import (
    HANDLE_VERSION,
    KVHandle,
    handoff_form,
    handoff_params,
    read_handle,
    wants_remote_decode,
)
from hawk.integrations.vllm.plan import RecvJob, SendJob, StepPlan
from hawk.integrations.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)

#: vLLM's status of a request that stopped at max_tokens: the only finish that leaves KV for a decode.
LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"


class SchedulerHalf:
    def __init__(self, settings: ConnectorSettings, producer: bool, consumer: bool):
        self.settings, self.producer, self.consumer = settings, producer, consumer
        self.address: str | None = None  # the worker's KV control socket (from vLLM's handshake metadata)
        self._plan = StepPlan()
        self._loading: dict[str, KVHandle] = {}  # request id -> its handle, from matched to allocated
        self._tried: set[str] = set()  # requests whose handle was loaded once: a failed load is rescheduled
        # by vLLM and must then recompute, not pull again (until the request finishes)
        self._waiting: dict[str, KVHandle] = {}  # request id -> its handle, from arrival to allocation: kept alive
        self._next_keep_alive = 0.0  # monotonic time of the next keep-alive the plan may carry

    def set_worker_address(self, addresses: dict[int, str]) -> None:
        """vLLM's handshake metadata, by tensor-parallel rank. HAWK's handle names one socket."""
        if len(addresses) != 1:
            raise ValueError(f"HawkConnector supports one worker per vLLM instance (tensor parallel 1), got ranks {sorted(addresses)}")
        self.address = next(iter(addresses.values()))

    # -- decode: loading a prompt's KV ----------------------------------------------------------

    def arrived(self, request: Any) -> None:
        """A new request: one whose handle this decode can pull is kept alive until it is allocated."""
        if not self.consumer:
            return
        try:
            handle = read_handle(request.kv_transfer_params)
        except BadRequest:
            return  # matched_tokens refuses it, and it is recomputed
        if handle is not None and CONFIGS[handle.transfer].decode_on == "gpu":
            self._waiting[request.request_id] = handle

    def _keep_alive(self, now: float) -> dict[str, list[str]]:
        """The waiting requests' KV ids by prefill address, at most every sixth of the TTL."""
        if not self._waiting or now < self._next_keep_alive:
            return {}
        self._next_keep_alive = now + self.settings.ttl_s / 6
        out: dict[str, list[str]] = {}
        for h in self._waiting.values():
            out.setdefault(h.address, []).append(h.request_id)
        return out

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        n, load = self._match(request, num_computed_tokens)
        if not load:  # it recomputes: its KV need not be kept alive
            self._waiting.pop(request.request_id, None)
        return n, load

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.consumer:
            return 0, False
        handle = read_handle(request.kv_transfer_params)
        # asked again before its blocks were allocated (vLLM found no room and retries next step): the same
        # answer, checked again; asked again after (its load failed, or it was preempted): recompute
        self._loading.pop(request.request_id, None)
        if handle is None or request.request_id in self._tried:
            return 0, False
        if CONFIGS[handle.transfer].decode_on != "gpu":
            log.warning("request %s: its prefill sent in %s, which decodes on an NPU; recomputing", request.request_id, handle.transfer)
            return 0, False
        if num_computed_tokens > 0:
            log.info("request %s: %d prompt tokens hit the local prefix cache; recomputing the rest, not pulling",
                     request.request_id, num_computed_tokens)
            return 0, False
        if handoff_form(handle, request.prompt_token_ids) is None:
            log.warning("request %s: the handle holds %d tokens (first token %d), the prompt has %d; recomputing",
                        request.request_id, handle.num_tokens, handle.first_token, len(request.prompt_token_ids))
            return 0, False
        self._loading[request.request_id] = handle
        return handle.num_tokens, True

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self._waiting.pop(request.request_id, None)  # its pull starts with the next step (or it recomputes)
        handle = self._loading.pop(request.request_id, None)
        if handle is None:
            return
        self._tried.add(request.request_id)
        if num_external_tokens == 0:
            return
        self._plan.recvs.append(RecvJob(request.request_id, handle, tuple(block_ids)))

    # -- prefill: holding a finished request's KV -----------------------------------------------

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loading.pop(request.request_id, None)
        self._tried.discard(request.request_id)
        self._waiting.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not self.producer or not wants_remote_decode(params):
            return False, None
        if request.status.name != LENGTH_CAPPED or not request.output_token_ids:
            return False, None  # aborted, or stopped on its first token: nobody will pull it
        if self.address is None:
            log.error("request %s: the worker's KV address is unknown (no handshake metadata); not holding its KV", request.request_id)
            return False, None
        n = len(request.prompt_token_ids)
        self._plan.sends.append(SendJob(request.request_id, n, tuple(block_ids)))
        handle = KVHandle(version=HANDLE_VERSION, address=self.address, request_id=request.request_id, num_tokens=n,
                          first_token=int(request.output_token_ids[0]), transfer=self.settings.transfer)
        return True, handoff_params(handle)

    def take_plan(self, now: float | None = None) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        plan.keep_alive = self._keep_alive(time.monotonic() if now is None else now)
        return plan
