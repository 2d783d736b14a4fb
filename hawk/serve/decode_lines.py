"""The router's end of a decode instance's token lines, one request at a time.

Two ways to carry them (``RouterConfig.decode_stream``; contract.py, "Shared decode streams"):

- ``request``: POST /internal/decode answers with the request's own NDJSON stream; closing it aborts
  the request on the decode (counted there as the client's disconnect unless the router stopped it).
- ``shared``: each router process keeps one stream per decode instance (GET /internal/decode_events,
  opened on first use), and each request's lines are sorted out of it by request id. A decode step's
  tokens for all of this process's requests arrive in one write, and each is one queue put here instead
  of one HTTP read. A request that ends early is aborted with an AbortRequest; if the shared stream
  breaks, every request on it fails at once, and the next request opens a new one (the decode aborted
  the old one's requests when it closed).

Either way a request reads lines until one carries a finish reason, and ``close`` releases what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Protocol

import anyio
import httpx

from hawk.errors import BadUpstream
from hawk.serve.contract import AbortRequest, DecodeAccepted, DecodeRequest, TokenLine, receive
from hawk.serve.protocol import InstanceDown, upstream_error

log = logging.getLogger(__name__)

JSON_HEADERS = {"content-type": "application/json"}  # a contract message's body
CONNECT_TIMEOUT_S = 5.0


class DecodeLines(Protocol):
    """One request's lines from its decode instance."""

    async def open(self, body: DecodeRequest) -> None:
        """Admit the request (raises the client's error if the decode refuses it)."""

    async def read(self) -> TokenLine | None:
        """The next line; None if the decode ended the stream without a last line."""

    async def close(self, stop: bool) -> None:
        """Release the request on the decode if it has not finished: ``stop``, the router ended it (a stop
        string); else its client left or it failed, which the decode counts as a disconnect. Idempotent."""


async def abort_decode(client: httpx.AsyncClient, url: str, request_id: str, client_gone: bool) -> None:
    """Tell a decode to end a request (best effort: a decode that is gone ended it already)."""
    try:
        body = AbortRequest.of(request_id=request_id, client_gone=client_gone)
        await client.post(f"{url}/internal/decode_abort", content=body.model_dump_json(), headers=JSON_HEADERS)
    except httpx.HTTPError as e:
        log.warning("could not tell %s to stop %s: %r", url, request_id, e)


async def open_stream(client: httpx.AsyncClient, req: httpx.Request, url: str) -> httpx.Response:
    """Send ``req`` to the decode at ``url``; its streaming answer if 200, else the client's error."""
    try:
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise InstanceDown(f"decode instance {url} unreachable: {e!r}") from None
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        raise upstream_error(resp.status_code, content, f"decode at {url}")
    return resp


class RequestLines:
    """The request's own stream (``decode_stream="request"``)."""

    def __init__(self, client: httpx.AsyncClient, url: str, request_id: str) -> None:
        self.client, self.url, self.request_id = client, url, request_id
        self._resp: httpx.Response | None = None
        self._lines = None
        self._ended = False

    async def open(self, body: DecodeRequest) -> None:
        req = self.client.build_request("POST", f"{self.url}/internal/decode", content=body.model_dump_json(), headers=JSON_HEADERS)
        resp = await open_stream(self.client, req, self.url)
        self._resp, self._lines = resp, resp.aiter_lines()

    async def read(self) -> TokenLine | None:
        assert self._lines is not None, "open() first"
        try:
            async for line in self._lines:
                if line:
                    ev = receive(TokenLine, line, f"decode at {self.url}")
                    self._ended = self._ended or ev.finish_reason is not None
                    return ev
        except httpx.HTTPError as e:
            raise BadUpstream(f"decode stream from {self.url} broke: {e!r}") from None
        return None

    async def close(self, stop: bool) -> None:
        if self._resp is None:
            return
        resp, self._resp = self._resp, None
        if stop and not self._ended:  # not counted as a client's abort when the stream closes
            await abort_decode(self.client, self.url, self.request_id, client_gone=False)
        await resp.aclose()  # a decode still running sees its reader leave and aborts


class _Broken:
    """Put on every request's queue when the shared stream ends."""

    def __init__(self, why: str) -> None:
        self.why = why


class SharedStream:
    """One open GET /internal/decode_events: reads it and hands each line to its request's queue."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url = client, url
        self.name = f"router-{uuid.uuid4().hex[:16]}"
        self.queues: dict[str, asyncio.Queue[TokenLine | _Broken]] = {}
        self.broken: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        # no read timeout: it may idle for hours; a decode that hangs is the health monitor's to find
        req = self.client.build_request("GET", f"{self.url}/internal/decode_events", params={"subscriber": self.name},
                                        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        resp = await open_stream(self.client, req, self.url)
        self._task = asyncio.ensure_future(self._read(resp))

    async def _read(self, resp: httpx.Response) -> None:
        why = "the decode ended its event stream"
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                ev = receive(TokenLine, line, f"decode at {self.url}")
                queue = self.queues.get(ev.request_id or "")
                if queue is not None:  # else its request has ended here already
                    queue.put_nowait(ev)
        except httpx.HTTPError as e:
            why = f"the decode's event stream broke: {e!r}"
        except BadUpstream as e:
            why = str(e)
        except asyncio.CancelledError:
            why = "the router closed the decode's event stream"
            raise
        finally:
            self.broken = why
            for queue in self.queues.values():
                queue.put_nowait(_Broken(why))
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # noqa: BLE001 - closing: its end was put on every queue
                pass


class SharedStreams:
    """This router process's shared streams, one per decode instance, each opened on first use and
    reopened (under a new name) after it broke."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._streams: dict[str, SharedStream] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def stream(self, url: str) -> SharedStream:
        lock = self._locks.get(url)
        if lock is None:
            lock = self._locks[url] = asyncio.Lock()
        async with lock:
            s = self._streams.get(url)
            if s is None or s.broken is not None:
                s = SharedStream(self.client, url)
                await s.connect()
                self._streams[url] = s
            return s

    def lines(self, url: str, request_id: str) -> SharedLines:
        return SharedLines(self, url, request_id)

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            await s.close()


class SharedLines:
    """One request's lines out of its decode's shared stream (``decode_stream="shared"``)."""

    def __init__(self, streams: SharedStreams, url: str, request_id: str) -> None:
        self.streams, self.url, self.request_id = streams, url, request_id
        self._stream: SharedStream | None = None
        self._queue: asyncio.Queue[TokenLine | _Broken] = asyncio.Queue()
        self._ended = False

    async def open(self, body: DecodeRequest) -> None:
        stream = await self.streams.stream(self.url)
        stream.queues[self.request_id] = self._queue  # before the POST: no line can come before it
        self._stream = stream
        body = body.model_copy(update={"subscriber": stream.name})
        try:
            r = await self.streams.client.post(f"{self.url}/internal/decode", content=body.model_dump_json(), headers=JSON_HEADERS)
        except httpx.HTTPError as e:
            self._ended = True  # admitted or not, the decode ends it if it is gone
            raise InstanceDown(f"decode instance {self.url} unreachable: {e!r}") from None
        if r.status_code != 200:
            self._ended = True
            if stream.broken is not None:  # refused because its stream closed meanwhile
                raise BadUpstream(f"decode stream from {self.url} broke: {stream.broken}")
            raise upstream_error(r.status_code, r.content, f"decode at {self.url}")
        receive(DecodeAccepted, r.content, f"decode at {self.url}")

    async def read(self) -> TokenLine | None:
        item = await self._queue.get()
        if isinstance(item, _Broken):
            self._ended = True  # the decode aborted it as the stream closed
            raise BadUpstream(f"decode stream from {self.url} broke: {item.why}")
        self._ended = self._ended or item.finish_reason is not None
        return item

    async def close(self, stop: bool) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if not self._ended and stream.broken is None:
            await abort_decode(self.streams.client, self.url, self.request_id, client_gone=not stop)
        if stream.queues.get(self.request_id) is self._queue:
            del stream.queues[self.request_id]
