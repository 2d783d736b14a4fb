"""The decode instance over HTTP (the "NPU" role of vLLM's proxy pattern).

POST /internal/decode hands a prefilled request (first token + KV handle) to the decode engine and
streams its token events back as NDJSON, one JSON object per line. The engine pulls the KV over HAWK
before the first event, so the first line arrives once the KV has landed and carries the transfer's
time and bytes.

If the reader goes away mid-stream (the router's client disconnected, or the router hit a stop
string), the request is aborted in the engine so its NPU KV blocks and receive reservations are
freed, wherever it was: queued for memory, transferring, or generating.

Layer-wise (``kv_flow=layerwise``, decode first): the request comes before its prefill, with no first
token and the address of the prefill that will push its KV. The engine admits it by memory as
always and hands its blocks to that prefill as the push destination; the stream's first line,
``{"handed": true}``, sent as the destination leaves for the prefill, tells the router to start the
prefill then (the prefill waits a moment for a destination still on its way). POST
/internal/first_token later brings the prefill's first token, which the engine emits once the last
layer has landed. A reader that leaves also fails the first token it is waiting for, so the engine
stops waiting at once.

Shared streams (GET /internal/decode_events?subscriber=S): a router process reads the lines of all its
requests here from one stream, each line naming its request, and its DecodeRequests name ``S``; they are
answered with DecodeAccepted. The lines of one loop wake-up (a decode step's tokens) leave in one write.
Closing that stream aborts every request of it still running, as closing a request's own stream does;
an AbortRequest with ``client_gone`` ends one request the same way.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import InvalidStateError
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from hawk.devices.timing import timing_label
from hawk.engine.decode_engine import DecodeEngine, KVHandle, KVPush, TokenEvent
from hawk.engine.instances import DecodeInstance
from hawk.engine.sequence import SamplingParams
from hawk.layouts.device import parse_device
from hawk.errors import Aborted, BadRequest, ContractMismatch, EngineUnavailable, PromptTooLong, UnknownKV
from hawk.serve.contract import (
    CONTRACT_VERSION,
    AbortRequest,
    DecodeAbortReply,
    DecodeAccepted,
    DecodeRequest,
    FirstToken,
    FirstTokenReply,
    InstanceInfo,
    TokenLine,
)
from hawk.serve.instance_app import build_instance_app, dead_rank_names, engine_stats, unavailable_reason

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


#: Turns the KV reference of a request into what ``DecodeEngine.submit`` takes as its handle, and
#: gives it back if the submit is refused (colocated mode holds real blocks behind the handle).
HandleFor = Callable[[DecodeRequest], Any]
GiveBack = Callable[[DecodeRequest, Any], None]


def remote_handle(req: DecodeRequest) -> KVHandle:
    return KVHandle(req.kv.address, req.kv.request_id)


#: A line holding only a token, as ``TokenLine.of(token=t).model_dump_json(exclude_none=True)`` writes it
#: (a test holds them equal): most lines are these, and the model costs several microseconds a line.
_TOKEN_LINE = b'{"version":%d,"token":%%d}\n' % CONTRACT_VERSION


@functools.lru_cache(maxsize=4096)
def _shared_token_line(request_id: str) -> bytes:
    """A shared stream's token line for ``request_id``, its token left as ``%d`` (made once a request)."""
    rid = json.dumps(request_id).encode().replace(b"%", b"%%")  # a literal "%" in the id stays one
    return b'{"version":%d,"request_id":%s,"token":%%d}\n' % (CONTRACT_VERSION, rid)


def event_line(ev: TokenEvent, request_id: str | None = None) -> bytes:
    """One NDJSON line of the decode stream (unset fields are left out); ``request_id`` on a shared stream."""
    if ev.finish_reason is None and not ev.error and not ev.info and ev.token is not None:
        if request_id is None:
            return _TOKEN_LINE % ev.token
        return _shared_token_line(request_id) % ev.token
    line = TokenLine.of(token=ev.token, finish_reason=ev.finish_reason, error=ev.error or None, info=ev.info or None, request_id=request_id)
    return (line.model_dump_json(exclude_none=True) + "\n").encode()


class LoopMailbox:
    """The engine thread's way into the server's event loop: items for many streams, one wake-up.

    Why: a decode step of 256 rows emits 256 events; one ``call_soon_threadsafe`` each meant 256
    wake-ups of the loop, and the engine thread, contending for the interpreter with the loop it
    kept waking, took 5.1 / 3.5 ms a step to emit them at 256 streams, 0.35 / 0.75 ms with this
    mailbox and the coalesced writes (2-core box, engine stubbed, two rounds:
    benchmarks/results/stream_probe_cpu.json). Items posted while a delivery is pending ride with it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread; dropped once the loop is gone (the server is shutting down)."""
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # a delivery is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class Handed:
    """The stream item that says a layer-wise request's blocks are its prefill's push destination."""

    LINE = (TokenLine.of(handed=True).model_dump_json(exclude_none=True) + "\n").encode()

    @staticmethod
    def line(request_id: str | None) -> bytes:
        if request_id is None:
            return Handed.LINE
        return (TokenLine.of(handed=True, request_id=request_id).model_dump_json(exclude_none=True) + "\n").encode()


#: What the engine thread puts on a request's stream: its events, and (layer-wise) the handover.
StreamItem = TokenEvent | Handed


class _HandedSignal(threading.Event):
    """``KVPush.handed`` that also tells the stream, once: the engine sets it as the destination leaves
    for the prefill (or when the attempt is over: then the failure follows as the next event)."""

    def __init__(self, on_first_set: Callable[[], None]):
        super().__init__()
        self._on_first_set = on_first_set
        self._once = threading.Lock()

    def set(self) -> None:
        with self._once:
            first = not self.is_set()
            super().set()
        if first:
            self._on_first_set()


class _Subscriber:
    """A shared stream: the (request id, item) pairs waiting to be written, and the requests it
    carries with their stream state (until each finishes)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: asyncio.Queue[tuple[str, StreamItem]] = asyncio.Queue()
        self.requests: dict[str, dict[str, bool]] = {}


class DecodeService:
    def __init__(
        self, engine: DecodeEngine, handle_for: HandleFor = remote_handle, give_back: GiveBack | None = None,
        unavailable: Callable[[], str | None] = lambda: None, check_prompt: Callable[[int], None] = lambda n: None,
        kv_flow: str = "pull", vocab_size: int | None = None,
    ):
        """``check_prompt(prompt_len)`` raises ``PromptTooLong`` for a prompt whose KV can never land
        here (it fits no empty receive buffer): refused before its KV is pulled. ``kv_flow``: the
        flow this instance was configured for (its receive buffers are sized by it); requests of the
        other flow are refused. ``vocab_size`` bounds a layer-wise first token."""
        self.engine, self.handle_for, self.give_back, self.unavailable = engine, handle_for, give_back, unavailable
        self.check_prompt, self.kv_flow, self.vocab_size = check_prompt, kv_flow, vocab_size
        self.aborts = {"aborted_on_disconnect": 0}
        self._pushes: dict[str, KVPush] = {}  # layer-wise requests admitted here, until their stream ends
        self._streams: dict[str, dict[str, bool]] = {}  # each open stream's state, by request id
        self._subscribers: dict[str, _Subscriber] = {}  # open shared streams, by name
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()

    def start(self, req: DecodeRequest) -> StreamingResponse | JSONResponse:
        """Admit one request: its own stream of lines, or (``req.subscriber``) DecodeAccepted, its
        lines going to that shared stream."""
        down = self.unavailable()
        if down is not None:  # before the handle: nothing was taken
            raise EngineUnavailable(down)
        self._check_flow(req)
        try:
            params = SamplingParams.from_dict(req.params)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"params: {e}") from None
        if req.prompt_len + params.max_tokens > self.engine.max_len:  # before the handle: nothing to give back
            raise PromptTooLong(f"prompt ({req.prompt_len}) + max_tokens ({params.max_tokens}) exceeds the context length {self.engine.max_len}")
        self.check_prompt(req.prompt_len)  # before the handle: nothing to give back
        rid = req.request_id
        sub = self._subscriber(req.subscriber)
        queue: asyncio.Queue[Any] = sub.queue if sub is not None else asyncio.Queue()
        mailbox = self._mailbox()

        def put(item: StreamItem) -> None:  # engine thread -> event loop
            mailbox.post(queue, item if sub is None else (rid, item))

        handle = self._handle(req, lambda: put(Handed()))
        try:
            self.engine.submit(rid, req.prompt_len, self._first_token(req), params, handle, put)
        except ValueError as e:  # the engine's own refusals (a duplicate id, a cache too small)
            if self.give_back is not None and req.kv_flow == "pull":
                self.give_back(req, handle)
            if isinstance(e, BadRequest):
                raise
            raise BadRequest(str(e)) from None
        if isinstance(handle, KVPush):
            self._pushes[rid] = handle
        state = {"finished": False, "stopped": False}
        self._streams[rid] = state
        if sub is not None:  # its lines go to the shared stream, which ends it if it closes first
            sub.requests[rid] = state
            return JSONResponse(DecodeAccepted.of(request_id=rid).model_dump())

        async def lines() -> AsyncIterator[bytes]:
            try:
                while not state["finished"]:
                    out = [self._line(await queue.get(), state)]
                    while not state["finished"] and not queue.empty():  # behind: what waits goes in one write
                        out.append(self._line(queue.get_nowait(), state))
                    yield b"".join(out)
            finally:  # cancelled because the reader disconnected: stop the request
                self._abort_unfinished(rid, state)

        # The background task runs even when the stream was never started (a reader gone early).
        return StreamingResponse(lines(), media_type=NDJSON, background=BackgroundTask(self._abort_unfinished, rid, state))

    def _subscriber(self, name: str | None) -> _Subscriber | None:
        if name is None:
            return None
        sub = self._subscribers.get(name)
        if sub is None:
            raise BadRequest(f"no decode event stream named {name!r} is open here: GET /internal/decode_events?subscriber={name} first")
        return sub

    def subscribe(self, name: str) -> StreamingResponse:
        """Open the shared stream ``name``: the lines of every request that names it, batched per
        loop wake-up. Its close (the reader gone) aborts those still running."""
        if not name or len(name) > 128:
            raise BadRequest("subscriber must be 1-128 characters")
        if name in self._subscribers:
            raise BadRequest(f"a decode event stream named {name!r} is already open here")
        sub = self._subscribers[name] = _Subscriber(name)

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    out = [self._shared_line(sub, *await sub.queue.get())]
                    while not sub.queue.empty():
                        out.append(self._shared_line(sub, *sub.queue.get_nowait()))
                    yield b"".join(out)
            finally:
                self._close_subscriber(sub)

        return StreamingResponse(lines(), media_type=NDJSON, background=BackgroundTask(self._close_subscriber, sub))

    def _shared_line(self, sub: _Subscriber, rid: str, item: StreamItem) -> bytes:
        """A line of a shared stream; a request's last line ends its state there."""
        if isinstance(item, Handed):
            return Handed.line(rid)
        state = sub.requests.get(rid)
        if item.finish_reason is not None and state is not None:
            del sub.requests[rid]
            state["finished"] = True
            self._abort_unfinished(rid, state)  # finished: only its bookkeeping goes
        return event_line(item, rid)

    def _close_subscriber(self, sub: _Subscriber) -> None:
        """A shared stream ended (its reader left, or the server stops): its running requests are aborted."""
        if self._subscribers.get(sub.name) is sub:
            del self._subscribers[sub.name]
        requests, sub.requests = sub.requests, {}
        for rid, state in requests.items():
            self._abort_unfinished(rid, state)
        if requests:
            log.info("decode event stream %s closed with %d requests running: aborted", sub.name, len(requests))

    def _mailbox(self) -> LoopMailbox:
        """The running loop's mailbox (one per loop: a test may serve from several)."""
        loop = asyncio.get_running_loop()
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = LoopMailbox(loop)
        return box

    @staticmethod
    def _line(item: StreamItem, state: dict[str, bool]) -> bytes:
        if isinstance(item, Handed):
            return Handed.LINE
        if item.finish_reason is not None:
            state["finished"] = True
        return event_line(item)

    def _check_flow(self, req: DecodeRequest) -> None:
        """A request of the other KV flow would find no receive buffer sized for it, or no push."""
        if req.kv_flow != self.kv_flow:
            raise ContractMismatch(
                f"request {req.request_id!r} uses kv_flow {req.kv_flow!r}, this decode instance runs {self.kv_flow!r}: "
                "start the router and the instances with the same --kv-flow"
            )

    def _handle(self, req: DecodeRequest, on_handed: Callable[[], None]) -> Any:
        """What the engine fetches the KV through: pull, the prefilled KV's handle; layer-wise, a
        push from the named prefill whose handover is announced on the stream."""
        if req.kv_flow == "layerwise":
            return KVPush(req.kv.address, req.kv.request_id, handed=_HandedSignal(on_handed))
        try:
            return self.handle_for(req)
        except (KeyError, ValueError) as e:
            raise UnknownKV(f"no KV for request {req.kv.request_id!r}: {e}") from None

    @staticmethod
    def _first_token(req: DecodeRequest) -> int:
        """Pull: the prefill's token. Layer-wise: a placeholder the engine replaces with FirstToken's."""
        return req.first_token if req.first_token is not None else 0

    def first_token(self, msg: FirstToken) -> FirstTokenReply:
        """Give a layer-wise request its prefill's first token; not accepted once it stopped waiting."""
        push = self._pushes.get(msg.request_id)
        if push is None:
            return FirstTokenReply.of(request_id=msg.request_id, accepted=False)
        if self.vocab_size is not None and msg.token >= self.vocab_size:  # refused; the request still waits
            raise BadRequest(f"first token {msg.token} is outside the vocabulary (0..{self.vocab_size - 1})")
        try:
            push.first_token.set_result(msg.token)
        except InvalidStateError:  # given already, or failed because its reader left
            return FirstTokenReply.of(request_id=msg.request_id, accepted=False)
        return FirstTokenReply.of(request_id=msg.request_id, accepted=True)

    def _abort_unfinished(self, rid: str, state: dict[str, bool]) -> None:
        """The stream ended: a request still running is aborted, and counted as a client's abort
        unless the router stopped it first (a stop string ends a completion normally)."""
        if not state["finished"]:
            state["finished"] = True
            self.stop_waiting(rid)
            if self.engine.abort(rid) and not state["stopped"]:
                self.aborts["aborted_on_disconnect"] += 1
                log.info("decode %s aborted: its reader went away", rid)
        self._pushes.pop(rid, None)
        if self._streams.get(rid) is state:
            del self._streams[rid]

    def stop(self, rid: str, client_gone: bool = False) -> bool:
        """The router ends a request: it met a stop string, or gave up on it (then the stream's close
        that follows is not counted as a client's disconnect); or (``client_gone``) its client left."""
        state = self._streams.get(rid)
        ended_before = state is not None and state["stopped"]
        if state is not None:  # whatever closes its stream next is not a disconnect (again)
            state["stopped"] = True
        self.stop_waiting(rid)
        aborted = self.engine.abort(rid)
        if aborted and client_gone and not ended_before:
            self.aborts["aborted_on_disconnect"] += 1
            log.info("decode %s aborted: its client went away", rid)
        return aborted

    def stop_waiting(self, rid: str) -> None:
        """A layer-wise request whose reader left will get no first token: fail the wait, so the
        engine frees its blocks as soon as its push is over instead of after the receiver timeout."""
        push = self._pushes.get(rid)
        if push is not None and not push.first_token.done():
            try:
                push.first_token.set_exception(Aborted(f"request {rid!r} was aborted before its first token arrived"))
            except InvalidStateError:
                pass


def decode_routes(svc: DecodeService) -> APIRouter:
    r = APIRouter()

    @r.post("/internal/decode")
    async def decode(req: DecodeRequest) -> Response:
        return svc.start(req)

    @r.get("/internal/decode_events")
    async def decode_events(subscriber: str) -> StreamingResponse:
        """A router process's shared stream: the lines of every request naming ``subscriber``."""
        return svc.subscribe(subscriber)

    @r.post("/internal/first_token")
    async def first_token(msg: FirstToken) -> FirstTokenReply:
        """Layer-wise: the prefill's first token, relayed by the router."""
        return svc.first_token(msg)

    @r.post("/internal/decode_abort")
    async def abort(req: AbortRequest) -> DecodeAbortReply:
        """Explicit abort by the router, e.g. on a stop string (closing the /internal/decode stream
        does the same, but counts as the client's disconnect)."""
        return DecodeAbortReply.of(request_id=req.request_id, aborted=svc.stop(req.request_id, req.client_gone))

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
        max_num_seqs=instance.engine.max_batch,
        kv_flow=cfg.kv_flow,
    )

    svc = DecodeService(
        instance.engine, unavailable=lambda: unavailable_reason("decode", instance), check_prompt=instance.check_prompt,
        kv_flow=cfg.kv_flow, vocab_size=mc.vocab_size,
    )

    def accounting() -> dict[str, Any]:
        return {**instance.accounting(), **engine_stats(instance.engine), **svc.aborts}

    return build_instance_app(
        "decode", [decode_routes(svc)], info, accounting, instance.loaded.tokenizer,
        instance.close if close_on_shutdown else None, [instance.engine], cluster_secret, lambda: dead_rank_names(instance),
    )
