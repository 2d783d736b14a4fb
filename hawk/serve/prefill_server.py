"""The prefill instance over HTTP (the "GPU" role of vLLM's proxy pattern).

POST /internal/prefill runs one prompt through the batched prefill engine and answers with the first
token and a KV handle (the HAWK sender's control address + the request id) that the router passes
to a decode instance. POST /internal/abort undoes a request the client gave up on: it leaves the
queue, or its finished KV is dropped so its paged blocks come back at once instead of at the TTL.

Layer-wise (``kv_flow=layerwise``): a decode has admitted the request and sent this prefill a push
destination for it (the connector holds it, or waits a moment for it); the forward writes each layer
there as it finishes it, and
the answer's first token goes, through the router, to that decode. A request that fails or is
refused here, or is aborted, has its destination released at once (the decode hears an Error and
frees its blocks) rather than at the connector's TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError as FutureCancelled

from fastapi import APIRouter, FastAPI

from hawk.engine.instances import PrefillInstance
from hawk.engine.prefill_engine import PrefillEngine
from hawk.engine.sequence import SamplingParams
from hawk.errors import Aborted, BadRequest, ContractMismatch, DuplicateRequest, EngineUnavailable, PromptTooLong
from hawk.serve.contract import AbortRequest, InstanceInfo, KVRef, PrefillAbortReply, PrefillRequest, PrefillResponse
from hawk.serve.instance_app import build_instance_app, dead_rank_names, engine_stats, unavailable_reason

log = logging.getLogger(__name__)

ABORT_MEMORY_S = 120.0  # how long an abort for a running prefill is remembered


class PrefillService:
    """Submits prompts, tracks which are still running, and turns aborts into the right release.

    An abort can arrive in three states: queued (cancel it), prefilled with KV waiting (discard it),
    or inside the running batch (neither works yet: remember it and discard when it finishes). One
    for an id not seen yet is remembered too: a prefill arriving after its abort is refused.
    """

    def __init__(
        self,
        engine: PrefillEngine,
        discard: Callable[[str], bool],
        kv_address: str,
        vocab_size: int,
        unavailable: Callable[[], str | None] = lambda: None,
        check_prompt: Callable[[int], None] = lambda n: None,
        kv_flow: str = "pull",
        expect: Callable[[str], None] = lambda rid: None,
    ):
        """``check_prompt(num_tokens)`` raises ``PromptTooLong`` for a prompt this instance can
        prefill but never transfer (its KV fits no empty transfer buffer): refused before prefill.
        ``kv_flow``: how this instance's engine was built (its sender pushes layer by layer only
        when "layerwise"); requests of the other flow are refused. ``expect(request_id)``: a layer-wise
        request's push destination may still be on its way (``KVSender.expect``)."""
        self.engine, self.discard, self.kv_address, self.vocab_size = engine, discard, kv_address, vocab_size
        self.expect = expect
        self.unavailable, self.check_prompt, self.kv_flow = unavailable, check_prompt, kv_flow
        self._running: set[str] = set()
        self._aborted: dict[str, float] = {}
        # how aborts ended, for /internal/accounting and /metrics
        self.aborts = {"aborts_cancelled": 0, "aborts_discarded": 0, "aborts_pending": 0, "aborts_unknown": 0, "aborts_discarded_after_prefill": 0,
                       "aborts_before_prefill": 0}
        if kv_flow == "layerwise":  # push destinations released because their prefill failed or was refused
            self.aborts["push_destinations_released"] = 0

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        """Prefill one prompt. A layer-wise request that does not end in an answer (refused, failed,
        aborted, cancelled) releases the push destination its decode handed over first."""
        if req.kv_flow != "layerwise":
            return await self._prefill(req)
        try:
            return await self._prefill(req)
        except DuplicateRequest:  # the destination belongs to the request running under this id
            raise
        except BaseException:
            self._release_destination(req.request_id)
            raise

    def _release_destination(self, rid: str) -> None:
        """Fail ``rid``'s layer-wise push (and drop any KV it left): its decode frees its blocks now."""
        if self.discard(rid):
            self.aborts["push_destinations_released"] = self.aborts.get("push_destinations_released", 0) + 1

    def _check_flow(self, req: PrefillRequest) -> None:
        """A request of the other KV flow would strand its KV (nobody pulls it, or nobody pushes it)."""
        if req.kv_flow != self.kv_flow:
            raise ContractMismatch(
                f"request {req.request_id!r} uses kv_flow {req.kv_flow!r}, this prefill instance runs {self.kv_flow!r}: "
                "start the router and the instances with the same --kv-flow"
            )

    async def _prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._check_flow(req)
        down = self.unavailable()
        if down is not None:
            raise EngineUnavailable(down)
        try:
            params = SamplingParams.from_dict(req.params)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"params: {e}") from None
        bad = next((t for t in req.prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:  # an out-of-range id would fail the whole batch it lands in
            raise BadRequest(f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        self.check_prompt(len(req.prompt_ids))  # says which transfer buffer it could never fit
        if len(req.prompt_ids) > self.engine.max_prompt_tokens:
            raise PromptTooLong(f"prompt of {len(req.prompt_ids)} tokens exceeds this instance's limit of {self.engine.max_prompt_tokens}")
        rid = req.request_id
        if rid in self._running:
            raise DuplicateRequest(f"request {rid!r} is already being prefilled")
        if self._aborted.pop(rid, None) is not None:  # its abort overtook it (two connections, no order)
            self.aborts["aborts_before_prefill"] += 1
            raise Aborted(f"request {rid!r} was aborted before its prefill arrived")
        if req.kv_flow == "layerwise":
            self.expect(rid)
        try:
            fut = self.engine.submit(rid, req.prompt_ids, params)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        self._running.add(rid)
        try:
            result = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if fut.cancelled():  # cancelled by /internal/abort while queued
                raise Aborted(f"request {rid!r} was aborted") from None
            self.abort(rid)  # this handler itself was cancelled: don't leave its KV behind
            raise
        except FutureCancelled:
            raise Aborted(f"request {rid!r} was aborted") from None
        finally:
            self._running.discard(rid)
        if self._aborted.pop(rid, None) is not None:
            if self.discard(rid):
                self.aborts["aborts_discarded_after_prefill"] += 1
            raise Aborted(f"request {rid!r} was aborted")
        return PrefillResponse.of(
            request_id=rid, first_token=result.first_token, num_prompt_tokens=result.num_prompt_tokens,
            kv=KVRef(address=self.kv_address, request_id=rid), timings=result.timings,
        )

    def abort(self, rid: str) -> str:
        """Release whatever ``rid`` holds here; says which of the three cases it was. Layer-wise,
        a prompt cancelled before its forward also gives up its push destination (the connector
        would otherwise keep it until the TTL, and its decode's blocks with it)."""
        result = self._abort(rid)
        self.aborts[f"aborts_{result}"] += 1
        if result == "cancelled" and self.kv_flow == "layerwise":
            self._release_destination(rid)
        return result

    def _abort(self, rid: str) -> str:
        now = time.monotonic()
        for k in [k for k, t in self._aborted.items() if now - t > ABORT_MEMORY_S]:
            del self._aborted[k]
        if self.engine.cancel(rid):
            return "cancelled"
        if self.discard(rid):
            return "discarded"
        if rid in self._running:
            self._aborted[rid] = now
            return "pending"
        # pulled already (the decode side owns it now), or never seen: its prefill may still be on its
        # way (the router's prefill and abort calls travel on different connections), so remembered
        self._aborted[rid] = now
        return "unknown"


def prefill_routes(svc: PrefillService) -> APIRouter:
    r = APIRouter()

    @r.post("/internal/prefill")
    async def prefill(req: PrefillRequest) -> PrefillResponse:
        return await svc.prefill(req)

    @r.post("/internal/abort")
    async def abort(req: AbortRequest) -> PrefillAbortReply:
        return PrefillAbortReply.of(request_id=req.request_id, result=svc.abort(req.request_id))

    return r


def create_prefill_app(instance: PrefillInstance, close_on_shutdown: bool = True, cluster_secret: str | None = None) -> FastAPI:
    """The HTTP face of a :class:`PrefillInstance`; shutdown closes it unless told not to (tests
    that reuse one loaded instance across apps)."""
    cfg, mc = instance.cfg, instance.loaded.config
    svc = PrefillService(
        instance.engine, instance.discard, instance.kv_address, mc.vocab_size, lambda: unavailable_reason("prefill", instance), instance.check_prompt,
        cfg.kv_flow, instance.sender.expect,
    )
    info = InstanceInfo.of(
        role="prefill", model=instance.loaded.name, transfer=cfg.transfer, transport=cfg.transport, device=cfg.prefill_device,
        kv_address=instance.kv_address, max_prompt_tokens=instance.engine.max_prompt_tokens,
        max_model_len=mc.max_position_embeddings, vocab_size=mc.vocab_size, kv_flow=cfg.kv_flow, staging_bytes=instance.rank.staging_bytes,
    )
    return build_instance_app(
        "prefill", [prefill_routes(svc)], info, lambda: {**instance.accounting(), **engine_stats(instance.engine), **svc.aborts}, instance.loaded.tokenizer,
        instance.close if close_on_shutdown else None, [instance.engine], cluster_secret, lambda: dead_rank_names(instance),
    )
