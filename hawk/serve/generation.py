"""One request's path through the router: prefill, then decode with the KV handle, then text.

``Generation.start`` asks a prefill instance for the first token and a KV handle, then opens a
decode stream that carries them; every input error surfaces there, before the client has been sent
a status line, so it can still be answered with a 4xx. ``Generation.deltas`` turns the decode
stream's token ids into text (incrementally, never splitting a UTF-8 character), cuts at stop
strings, and records the timings the client gets in ``hawk``.

Whatever ends the request early (a stop string, an error, the client leaving), ``aclose`` closes
the upstream decode stream, which makes the decode instance abort it and free its blocks; if no
token ever came back, the prefill instance is told too, so KV waiting there is dropped at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from hawk.engine.sequence import SamplingParams
from hawk.engine.tokenizer import Tokenizer
from hawk.errors import BadUpstream
from hawk.serve.contract import AbortRequest, DecodeRequest, PrefillRequest, PrefillResponse, TokenLine, receive
from hawk.serve.protocol import InstanceDown, OpenAIError

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 5.0
_JSON = {"content-type": "application/json"}


@dataclass
class TextDelta:
    text: str
    finish_reason: str | None = None


class StopMatcher:
    """Cuts generated text at the first stop string, holding back just enough characters that a
    stop string split across tokens is never half-sent."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Text that is safe to send now, and whether a stop string was reached."""
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def upstream_error(resp_status: int, body: bytes, who: str) -> OpenAIError:
    """Map an instance's error answer to what the client sees: its 4xx stays a 4xx (bad input),
    an instance that says it is unavailable (503, e.g. a dead tensor-parallel rank, restarting)
    stays a 503 the client may retry, anything else is the server's fault (502)."""
    try:
        err = json.loads(body).get("error", {})
        msg, code = str(err.get("message") or body[:300].decode(errors="replace")), err.get("code")
    except (ValueError, AttributeError):
        msg, code = body[:300].decode(errors="replace"), None
    if 400 <= resp_status < 500:
        return OpenAIError(400, msg, code=code)
    if resp_status == 503 and code == "instance_unavailable":
        return InstanceDown(f"{who}: {msg}")
    return OpenAIError(502, f"{who} failed ({resp_status}): {msg}", type="server_error", code=code)


class Generation:
    """The life of one request between the router and its two instances."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        prefill_url: str,
        decode_url: str,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        stop: list[str],
        arrival: float,
        extra_info: dict[str, Any] | None = None,
    ):
        self.client, self.prefill_url, self.decode_url = client, prefill_url, decode_url
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.tokenizer, self.stop, self.arrival = tokenizer, stop, arrival
        self.extra_info = dict(extra_info or {})
        self._resp: httpx.Response | None = None
        self._prefilled = False
        self._got_token = False
        self._closed = False
        self.prefill_reply: PrefillResponse | None = None
        self.kv_info: dict[str, Any] = {}
        self.t_prefilled: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None

    # -- phase 1: prefill, then open the decode stream ------------------------------------------

    async def start(self) -> None:
        """Raises OpenAIError for anything the instances refuse; on any failure or cancellation
        the request's state on both instances is released."""
        try:
            await self._prefill()
            await self._open_decode()
        except BaseException:
            await self.aclose()
            raise

    async def _prefill(self) -> None:
        body = PrefillRequest.of(request_id=self.request_id, prompt_ids=self.prompt_ids, params=self.params.to_dict())
        self._prefilled = True  # from here on the prefill may hold something for this request
        try:
            r = await self.client.post(f"{self.prefill_url}/internal/prefill", content=body.model_dump_json(), headers=_JSON)
        except httpx.HTTPError as e:
            raise InstanceDown(f"prefill instance {self.prefill_url} unreachable: {e!r}") from None
        if r.status_code != 200:
            raise upstream_error(r.status_code, r.content, f"prefill at {self.prefill_url}")
        self.prefill_reply = receive(PrefillResponse, r.content, f"prefill at {self.prefill_url}")
        self.t_prefilled = time.monotonic()

    async def _open_decode(self) -> None:
        pre = self.prefill_reply
        assert pre is not None
        body = DecodeRequest.of(
            request_id=self.request_id, prompt_len=pre.num_prompt_tokens, first_token=pre.first_token,
            params=self.params.to_dict(), kv=pre.kv,
        )
        req = self.client.build_request("POST", f"{self.decode_url}/internal/decode", content=body.model_dump_json(), headers=_JSON)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise InstanceDown(f"decode instance {self.decode_url} unreachable: {e!r}") from None
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            raise upstream_error(resp.status_code, content, f"decode at {self.decode_url}")
        self._resp = resp

    # -- phase 2: tokens to text ------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Text as it is generated; the last delta carries the finish reason."""
        assert self._resp is not None, "start() first"
        decoder = self.tokenizer.incremental_decoder()
        stopper = StopMatcher(self.stop)
        try:
            async for line in self._resp.aiter_lines():
                if not line:
                    continue
                ev = receive(TokenLine, line, f"decode at {self.decode_url}")
                if ev.info:
                    self.kv_info.update(ev.info)
                tok, reason = ev.token, ev.finish_reason
                text = ""
                if tok is not None:
                    now = time.monotonic()
                    self.t_first = self.t_first or now
                    self.t_last = now
                    self.num_tokens += 1
                    self._got_token = True
                    piece = decoder.step(tok)
                    if reason is not None and reason not in ("error", "abort"):
                        piece += decoder.flush()  # the last token: nothing may stay held
                    text, hit = stopper.feed(piece)
                    if hit:  # closing the stream (finally) makes the decode instance stop
                        self.finish_reason = "stop"
                        yield TextDelta(text, "stop")
                        return
                if reason is None:
                    if text:
                        yield TextDelta(text)
                    continue
                if reason in ("error", "abort"):
                    detail = ev.error or "the request was aborted on the decode instance"
                    raise OpenAIError(500, f"decode failed: {detail}", type="server_error")
                self.finish_reason = reason
                if tok is None:  # a finish without a token: still release what the decoder holds
                    text, hit = stopper.feed(decoder.flush())
                    if hit:
                        self.finish_reason = "stop"
                        yield TextDelta(text, "stop")
                        return
                yield TextDelta(text + stopper.flush(), reason)
                return
            raise BadUpstream(f"decode instance {self.decode_url} ended the stream early")
        except httpx.HTTPError as e:
            raise BadUpstream(f"decode stream from {self.decode_url} broke: {e!r}") from None
        finally:
            await self.aclose()

    # -- the end ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Idempotent; safe inside a cancelled task (the cleanup is shielded)."""
        if self._closed:
            return
        self._closed = True
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            if self._resp is not None:
                await self._resp.aclose()  # a decode still running sees its reader leave and aborts
            if self._prefilled and not self._got_token and self.finish_reason is None:
                await self._abort_prefill()

    async def _abort_prefill(self) -> None:
        try:
            body = AbortRequest.of(request_id=self.request_id)
            await self.client.post(f"{self.prefill_url}/internal/abort", content=body.model_dump_json(), headers=_JSON)
        except httpx.HTTPError as e:
            log.warning("could not tell %s to abort %s: %r", self.prefill_url, self.request_id, e)

    def summary(self) -> dict[str, Any]:
        """Per-request timings for the client (``hawk`` in the response) and for /metrics."""
        pre_t = self.prefill_reply.timings if self.prefill_reply is not None else {}
        n = self.num_tokens
        now = self.t_last or time.monotonic()
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "prefill_instance": self.prefill_url,
            "decode_instance": self.decode_url,
            **self.extra_info,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "finish_reason": self.finish_reason,
            "ttft_s": None if self.t_first is None else self.t_first - self.arrival,
            "tpot_s": (self.t_last - self.t_first) / (n - 1) if n > 1 and self.t_first and self.t_last else None,
            "e2e_s": now - self.arrival,
            "prefill_queue_s": pre_t.get("queue_s"),
            "prefill_s": pre_t.get("prefill_s"),
            "kv_transfer_s": self.kv_info.get("kv_transfer_s"),
            "kv_bytes": self.kv_info.get("kv_bytes"),
            "kv_requests": self.kv_info.get("kv_requests"),
            "kv_mode": self.kv_info.get("kv_mode"),
            "decode_admit_wait_s": self.kv_info.get("admit_wait_s"),
        }
        if self.t_prefilled is not None and self.t_first is not None:
            out["prefill_to_first_token_s"] = self.t_first - self.t_prefilled
        return out


async def until_disconnected(receive_disconnect: Any, work: Any) -> Any:
    """Run ``work`` (a coroutine) unless the client disconnects first, in which case ``work`` is
    cancelled (its cleanup runs) and ``ClientGone`` is raised. ``receive_disconnect`` is a
    coroutine function that returns when the client has gone; if it raises instead (an instance
    went down), ``work`` is cancelled the same way and that error is raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(receive_disconnect())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - the client is gone; nobody reads this result
            pass
        if not watch.cancelled() and watch.exception() is not None:
            raise watch.exception()  # type: ignore[misc]
        raise ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""
