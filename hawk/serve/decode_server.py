"""The decode instance over HTTP (the "NPU" role of vLLM's proxy pattern).

POST /internal/decode hands a prefilled request (first token + KV handle) to the decode engine and
streams its token events back as NDJSON, one JSON object per line. The engine pulls the KV over HAWK
before the first event, so the first line arrives once the KV has landed and carries the transfer's
time and bytes.

If the reader goes away mid-stream (the router's client disconnected, or the router hit a stop
string), the request is aborted in the engine so its NPU KV blocks and receive reservations are
freed, wherever it was: queued for memory, transferring, or generating.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from hawk.devices.timing import timing_label
from hawk.engine.decode_engine import DecodeEngine, KVHandle, TokenEvent
from hawk.engine.instances import DecodeInstance
from hawk.engine.sequence import SamplingParams
from hawk.layouts.device import parse_device
from hawk.errors import BadRequest, EngineUnavailable, PromptTooLong, UnknownKV
from hawk.serve.contract import AbortRequest, DecodeAbortReply, DecodeRequest, InstanceInfo, TokenLine
from hawk.serve.instance_app import build_instance_app, dead_rank_names, unavailable_reason

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


#: Turns the KV reference of a request into what ``DecodeEngine.submit`` takes as its handle, and
#: gives it back if the submit is refused (colocated mode holds real blocks behind the handle).
HandleFor = Callable[[DecodeRequest], Any]
GiveBack = Callable[[DecodeRequest, Any], None]


def remote_handle(req: DecodeRequest) -> KVHandle:
    return KVHandle(req.kv.address, req.kv.request_id)


def event_line(ev: TokenEvent) -> bytes:
    """One NDJSON line of the decode stream (unset fields are left out)."""
    line = TokenLine.of(token=ev.token, finish_reason=ev.finish_reason, error=ev.error or None, info=ev.info or None)
    return (line.model_dump_json(exclude_none=True) + "\n").encode()


class DecodeService:
    def __init__(
        self, engine: DecodeEngine, handle_for: HandleFor = remote_handle, give_back: GiveBack | None = None,
        unavailable: Callable[[], str | None] = lambda: None, check_prompt: Callable[[int], None] = lambda n: None,
    ):
        """``check_prompt(prompt_len)`` raises ``PromptTooLong`` for a prompt whose KV can never land
        here (it fits no empty receive buffer): refused before its KV is pulled."""
        self.engine, self.handle_for, self.give_back, self.unavailable = engine, handle_for, give_back, unavailable
        self.check_prompt = check_prompt
        self.aborts = {"aborted_on_disconnect": 0}

    def start(self, req: DecodeRequest) -> StreamingResponse:
        down = self.unavailable()
        if down is not None:  # before the handle: nothing was taken
            raise EngineUnavailable(down)
        try:
            params = SamplingParams.from_dict(req.params)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"params: {e}") from None
        if req.prompt_len + params.max_tokens > self.engine.max_len:  # before the handle: nothing to give back
            raise PromptTooLong(f"prompt ({req.prompt_len}) + max_tokens ({params.max_tokens}) exceeds the context length {self.engine.max_len}")
        self.check_prompt(req.prompt_len)  # before the handle: nothing to give back
        try:
            handle = self.handle_for(req)
        except (KeyError, ValueError) as e:
            raise UnknownKV(f"no KV for request {req.kv.request_id!r}: {e}") from None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def on_event(ev: TokenEvent) -> None:  # engine thread -> event loop
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        rid = req.request_id
        try:
            self.engine.submit(rid, req.prompt_len, req.first_token, params, handle, on_event)
        except ValueError as e:  # the engine's own refusals (a duplicate id, a cache too small)
            if self.give_back is not None:
                self.give_back(req, handle)
            if isinstance(e, BadRequest):
                raise
            raise BadRequest(str(e)) from None
        state = {"finished": False}

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    ev = await queue.get()
                    if ev.finish_reason is not None:
                        state["finished"] = True
                    yield event_line(ev)
                    if state["finished"]:
                        return
            finally:  # cancelled because the reader disconnected: stop the request
                self._abort_unfinished(rid, state)

        # The background task runs even when the stream was never started (a reader gone early).
        return StreamingResponse(lines(), media_type=NDJSON, background=BackgroundTask(self._abort_unfinished, rid, state))

    def _abort_unfinished(self, rid: str, state: dict[str, bool]) -> None:
        if not state["finished"]:
            state["finished"] = True
            if self.engine.abort(rid):
                self.aborts["aborted_on_disconnect"] += 1
                log.info("decode %s aborted: its reader went away", rid)


def decode_routes(svc: DecodeService) -> APIRouter:
    r = APIRouter()

    @r.post("/internal/decode")
    async def decode(req: DecodeRequest) -> StreamingResponse:
        return svc.start(req)

    @r.post("/internal/decode_abort")
    async def abort(req: AbortRequest) -> DecodeAbortReply:
        """Explicit abort (closing the /internal/decode stream does the same)."""
        return DecodeAbortReply.of(request_id=req.request_id, aborted=svc.engine.abort(req.request_id))

    return r


def _labelled(device: str, timing: str | None) -> str:
    """The device as users see it, saying so when its timing is emulated (``--npu-timing``, ``--link-gbps``)."""
    return f"{device} [{timing}]" if timing else device


def create_decode_app(instance: DecodeInstance, close_on_shutdown: bool = True, cluster_secret: str | None = None) -> FastAPI:
    """The HTTP face of a :class:`DecodeInstance`."""
    cfg, mc = instance.cfg, instance.loaded.config
    blocks = instance.blocks
    on_npu = instance.npu is not None
    info = InstanceInfo.of(
        role="decode", model=instance.loaded.name, transfer=cfg.transfer, transport=cfg.transport, device=cfg.decode_device,
        device_label=_labelled(parse_device(cfg.decode_device).label(cfg.arch), timing_label(cfg.npu_timing if on_npu else None, cfg.link_gbps)),
        arch=cfg.arch if on_npu else None,
        kv_dtype=cfg.kv_dtype if on_npu else cfg.gpu_kv_dtype, emulated_npu=on_npu,
        max_model_len=instance.engine.max_len, max_kv_tokens=blocks.num_blocks * blocks.block_size, vocab_size=mc.vocab_size,
    )

    svc = DecodeService(instance.engine, unavailable=lambda: unavailable_reason("decode", instance), check_prompt=instance.check_prompt)

    def accounting() -> dict[str, Any]:
        return {**instance.accounting(), **{f"engine_{k}": v for k, v in instance.engine.stats().items()}, **svc.aborts}

    return build_instance_app(
        "decode", [decode_routes(svc)], info, accounting, instance.loaded.tokenizer,
        instance.close if close_on_shutdown else None, [instance.engine], cluster_secret, lambda: dead_rank_names(instance),
    )
