"""The router's end of a shared decode stream (hawk/serve/decode_lines.py) against a scripted decode:
lines reach their own request, a stream the decode ends fails its requests at once and the next
request opens a new one, and a request that ends early is aborted on the decode (as a client's
disconnect unless a stop string ended it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from hawk.errors import BadUpstream
from hawk.serve.common import ThreadedServer
from hawk.serve.contract import CONTRACT_VERSION, AbortRequest, DecodeAccepted, DecodeRequest, KVRef
from hawk.serve.decode_lines import SharedStreams
from hawk.serve.protocol import OpenAIError

END = object()


class ScriptedDecode:
    """A decode whose event streams send each admitted request two tokens; request ``"cut"`` gets one,
    then its stream ends (as a decode that stops does); request ``"late"`` gets its two after 1 s."""

    def __init__(self) -> None:
        self.subscribers: list[str] = []
        self.aborts: list[dict] = []
        self.queues: dict[str, asyncio.Queue] = {}
        app = FastAPI()

        @app.get("/internal/decode_events")
        async def events(subscriber: str) -> StreamingResponse:
            self.subscribers.append(subscriber)
            queue = self.queues[subscriber] = asyncio.Queue()

            async def lines() -> AsyncIterator[bytes]:
                while (item := await queue.get()) is not END:
                    yield item

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        @app.post("/internal/decode")
        async def decode(req: DecodeRequest) -> dict:
            queue = self.queues[req.subscriber or ""]
            line = {"version": CONTRACT_VERSION, "request_id": req.request_id, "token": 7}

            def send() -> None:
                queue.put_nowait((json.dumps(line) + "\n").encode())
                queue.put_nowait(END if req.request_id == "cut" else (json.dumps({**line, "token": 8}) + "\n").encode())

            if req.request_id == "late":  # the stream idles a while first
                asyncio.get_running_loop().call_later(1.0, send)
            else:
                send()
            return DecodeAccepted.of(request_id=req.request_id).model_dump()

        @app.post("/internal/decode_abort")
        async def abort(req: AbortRequest) -> dict:
            self.aborts.append({"request_id": req.request_id, "client_gone": req.client_gone})
            return {"version": CONTRACT_VERSION, "request_id": req.request_id, "aborted": True}

        self.server = ThreadedServer(app).start()


@pytest.fixture
def decode():
    d = ScriptedDecode()
    yield d
    d.server.stop()


def _request(rid: str) -> DecodeRequest:
    return DecodeRequest.of(request_id=rid, prompt_len=3, first_token=1, params={}, kv=KVRef(address="tcp://127.0.0.1:1", request_id=rid))


def test_a_shared_stream_sorts_lines_fails_fast_when_cut_and_reopens(decode):
    async def main() -> None:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            streams = SharedStreams(client)
            url = decode.server.url
            a, b = streams.lines(url, "a"), streams.lines(url, "b")
            await a.open(_request("a"))
            await b.open(_request("b"))
            assert len(decode.subscribers) == 1  # one stream for both
            assert [(await a.read()).token, (await a.read()).token] == [7, 8]
            assert (await b.read()).token == 7
            await b.close(stop=True)  # a stop string ended it: not the client's disconnect
            await a.close(stop=False)  # its client left
            assert decode.aborts == [{"request_id": "b", "client_gone": False}, {"request_id": "a", "client_gone": True}]

            cut = streams.lines(url, "cut")
            await cut.open(_request("cut"))
            assert (await cut.read()).token == 7
            with pytest.raises(BadUpstream, match="broke"):
                await asyncio.wait_for(cut.read(), 5)  # at once, not at a timeout
            await cut.close(stop=False)
            assert len(decode.aborts) == 2  # the decode ended it with its stream: nothing to abort

            c = streams.lines(url, "c")
            await c.open(_request("c"))
            assert len(decode.subscribers) == 2 and decode.subscribers[0] != decode.subscribers[1]
            assert (await c.read()).token == 7
            await c.close(stop=False)
            await streams.close()

    asyncio.run(main())


def test_a_refused_request_leaves_nothing_registered(decode):
    async def main() -> None:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            streams = SharedStreams(client)
            lines = streams.lines(decode.server.url, "x")
            bad = _request("x").model_copy(update={"prompt_len": 0})  # the scripted decode's model refuses it (422)
            with pytest.raises(OpenAIError) as e:
                await lines.open(bad)
            assert e.value.status == 400  # the decode's 4xx stays the client's 400
            await lines.close(stop=False)
            stream = await streams.stream(decode.server.url)
            assert stream.queues == {} and decode.aborts == []
            await streams.close()

    asyncio.run(main())


def test_a_shared_stream_outlives_the_clients_read_timeout(decode):
    """Idle longer than the router's request timeout, the shared stream still carries the next lines
    (it has no read timeout of its own; a request's own stream would have timed out)."""

    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.3), trust_env=False) as client:
            streams = SharedStreams(client)
            late = streams.lines(decode.server.url, "late")
            await late.open(_request("late"))
            assert [(await late.read()).token, (await late.read()).token] == [7, 8]
            await late.close(stop=False)
            await streams.close()

    asyncio.run(main())
