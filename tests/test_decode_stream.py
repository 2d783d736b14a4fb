"""The token stream: the decode instance's plain token line and engine-to-loop mailbox, its shared stream's
release paths (engine held), the router's plain delta."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
from fastapi import FastAPI

from hypothesis import given
from hypothesis import strategies as st

from hawk.engine.decode_engine import TokenEvent
from hawk.serve.common import ThreadedServer
from hawk.serve.contract import CONTRACT_VERSION, TokenLine
from hawk.serve.decode_server import DecodeService, LoopMailbox, decode_routes, event_line


@given(st.integers(min_value=0, max_value=2**31 - 1))
def test_a_token_line_is_the_contract_models_line(token: int) -> None:
    assert event_line(TokenEvent("r", token=token)) == (TokenLine.of(token=token).model_dump_json(exclude_none=True) + "\n").encode()
    assert TokenLine.model_validate_json(event_line(TokenEvent("r", token=token))).token == token


@given(st.integers(min_value=0, max_value=2**31 - 1), st.text(min_size=1, max_size=40))
def test_a_shared_streams_token_line_is_the_contract_models_line(token: int, request_id: str) -> None:
    """On a shared stream the line names its request (any id, quotes and unicode included)."""
    line = event_line(TokenEvent(request_id, token=token), request_id)
    assert TokenLine.model_validate_json(line) == TokenLine.of(token=token, request_id=request_id)
    last = event_line(TokenEvent(request_id, token=token, finish_reason="stop"), request_id)
    assert TokenLine.model_validate_json(last) == TokenLine.of(token=token, finish_reason="stop", request_id=request_id)


def test_lines_with_more_than_a_token_go_through_the_model() -> None:
    last = event_line(TokenEvent("r", token=7, finish_reason="length"))
    assert TokenLine.model_validate_json(last) == TokenLine.of(token=7, finish_reason="length")
    info = event_line(TokenEvent("r", token=7, info={"kv_bytes": 3}))
    assert TokenLine.model_validate_json(info).info == {"kv_bytes": 3}
    err = event_line(TokenEvent("r", finish_reason="error", error="boom"))
    assert TokenLine.model_validate_json(err).error == "boom"


def test_the_mailbox_delivers_every_item_in_order_with_few_wakeups() -> None:
    """Items posted from another thread reach their queues in order; the loop is woken once per
    batch that arrived while none was pending, not once per item."""

    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        box = LoopMailbox(loop)
        wakeups = 0
        deliver = box._deliver

        def counted() -> None:
            nonlocal wakeups
            wakeups += 1
            deliver()

        box._deliver = counted  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(3)]

        def engine() -> None:
            for step in range(200):
                for q in queues:
                    box.post(q, step)

        t = threading.Thread(target=engine)
        t.start()
        got: list[list[int]] = [[] for _ in queues]
        for i, q in enumerate(queues):
            while len(got[i]) < 200:
                got[i].append(await q.get())
        t.join()
        return got, wakeups

    got, wakeups = asyncio.run(run())
    assert got == [list(range(200))] * 3
    assert 1 <= wakeups < 600


def test_a_post_after_the_loop_closed_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    box = LoopMailbox(loop)
    loop.close()
    box.post(asyncio.Queue(), 1)  # no RuntimeError: the server is shutting down


@given(st.text(max_size=20), st.booleans())
def test_a_plain_delta_is_the_models_chunk(text: str, chat: bool) -> None:
    """The router's per-token chunk, built from a template, equals the response models' dump."""
    from hawk.serve.router import ChunkMaker

    c = ChunkMaker(chat, "cmpl-1", "m")
    assert c.delta(text) == c._delta_model(text)
    assert c.delta(text, "stop") == c._delta_model(text, "stop")


class HeldEngine:
    """A decode engine that emits only when told: requests run until aborted (what ``DecodeService`` uses)."""

    max_len = 1 << 20

    def __init__(self) -> None:
        self.emit: dict[str, Any] = {}
        self.aborted: list[str] = []

    def submit(self, rid: str, prompt_len: int, first: int, params: Any, handle: Any, on_event: Any) -> None:
        self.emit[rid] = on_event

    def abort(self, rid: str) -> bool:
        on_event = self.emit.pop(rid, None)
        if on_event is None:
            return False
        self.aborted.append(rid)
        on_event(TokenEvent(rid, finish_reason="abort"))
        return True


def _decode_request(rid: str, subscriber: str) -> dict:
    return {"version": CONTRACT_VERSION, "request_id": rid, "prompt_len": 3, "first_token": 1, "params": {"max_tokens": 100},
            "kv": {"address": "held", "request_id": rid}, "subscriber": subscriber}


def test_a_shared_streams_close_and_aborts_end_its_requests_as_their_kind_says() -> None:
    """Decode side, engine held: a closed shared stream aborts every request still on it, each counted as a
    client's disconnect; an AbortRequest with ``client_gone`` counts too, a stop (the router's) does not;
    a request that finished is not aborted again."""
    engine = HeldEngine()
    svc = DecodeService(engine, handle_for=lambda req: None)
    app = FastAPI()
    app.include_router(decode_routes(svc))
    server = ThreadedServer(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10, trust_env=False) as c:
            with c.stream("GET", "/internal/decode_events", params={"subscriber": "s"}) as events:
                for rid in ("done", "stopped", "gone", "open-1", "open-2"):
                    assert c.post("/internal/decode", json=_decode_request(rid, "s")).json()["request_id"] == rid
                engine.emit.pop("done")(TokenEvent("done", token=5, finish_reason="length"))
                lines = events.iter_lines()
                first = json.loads(next(line for line in lines if line))
                assert first == {"version": CONTRACT_VERSION, "request_id": "done", "token": 5, "finish_reason": "length"}
                for rid, gone in (("stopped", False), ("gone", True)):
                    abort = {"version": CONTRACT_VERSION, "request_id": rid, "client_gone": gone}
                    assert c.post("/internal/decode_abort", json=abort).json()["aborted"] is True
                ends = [json.loads(next(line for line in lines if line)) for _ in range(2)]
                assert [(e["request_id"], e["finish_reason"]) for e in ends] == [("stopped", "abort"), ("gone", "abort")]
                assert svc.aborts["aborted_on_disconnect"] == 1  # "gone" only
            # the stream closed with two requests running
            deadline = time.monotonic() + 10
            while len(engine.aborted) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert sorted(engine.aborted) == ["gone", "open-1", "open-2", "stopped"]
        assert svc.aborts["aborted_on_disconnect"] == 3
        assert not svc._subscribers and not svc._streams
    finally:
        server.stop()
