"""One request's path through the router: the lifecycle below, then tokens to text.

The lifecycle of one request, as the router drives it (each instance's own states are in its engine:
hawk/engine/prefill_engine.py, hawk/engine/decode_engine.py):

  pull (kv_flow=pull; Algorithm 1 as written)
    1 PREFILL  POST /internal/prefill: the prompt runs; the answer is the first token and a KV handle
               (the KV waits on the prefill, in its paged blocks, until pulled or its TTL)
    2 DECODE   POST /internal/decode with both: the decode reserves blocks, pulls the KV, then streams
    3 STREAM   token lines -> text (below), until a finish reason, a stop string, or an error

  layer-wise (kv_flow=layerwise; decode first, so the transfer hides behind the prefill's forward)
    1 ADMIT    POST /internal/decode (no first token; ``kv`` names the prefill): the decode admits it
               by memory, reserves its blocks and hands them to that prefill (the KV connector) as the
               push destination; its stream's first line, ``handed``, comes as they leave
    2 PREFILL  POST /internal/prefill (kv_flow=layerwise): the forward writes each layer into those
               blocks as it finishes it. The decode stream is watched meanwhile: a decode failure
               cancels the prefill instead of waiting for it
    3 FIRST    POST /internal/first_token: the prefill's first token to the decode, which emits it
               once the last layer has landed (its first line carries the transfer's time and bytes)
    4 STREAM   as pull

  The decode's lines come on the request's own stream or on this router process's shared stream
  (decode_lines.py, ``RouterConfig.decode_stream``); the steps are the same.

  Release, on every path (``aclose``, idempotent, shielded from cancellation): the request's own decode
  stream is closed, or on a shared stream the decode is sent an AbortRequest, so the decode aborts the
  request wherever it is and frees its blocks and reservations
  (layer-wise, its wait for the first token fails at once); and, if no token came back, the prefill
  is told to abort, which cancels a queued prompt, drops prefilled KV, and (layer-wise) fails the push
  destination, so the decode's blocks come back now rather than at the connector's TTL.

Every input error surfaces in ``Generation.start``, before the client has been sent a status line,
so it can still be answered with a 4xx. ``Generation.deltas`` turns the decode stream's token ids
into text (incrementally, never splitting a UTF-8 character), cuts at stop strings, and records the
timings the client gets in ``hawk``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx

from hawk.engine.sequence import SamplingParams
from hawk.engine.tokenizer import Tokenizer
from hawk.errors import BadUpstream
from hawk.serve.contract import (
    AbortRequest,
    DecodeRequest,
    FirstToken,
    FirstTokenReply,
    KVRef,
    PrefillRequest,
    PrefillResponse,
    TokenLine,
    receive,
)
from hawk.serve.decode_lines import JSON_HEADERS, DecodeLines, RequestLines, SharedStreams
from hawk.serve.protocol import InstanceDown, OpenAIError, upstream_error
from hawk.serve.vllm_prefill import EndedAtPrefill, prefill_body, prefill_response

_Reply = TypeVar("_Reply")  # a contract reply model
log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 5.0
#: a decode that fails before the prefill answers may be failing *because of* the prefill (a refused
#: prompt discards the push destination, and the decode hears of it first): the prefill's own answer,
#: if it comes within this, is the cause the client is told
CAUSE_GRACE_S = 1.0


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
        kv_flow: str = "pull",
        kv_address: str | None = None,
        prefill_api: str = "hawk",
        prefill_model: str = "",
        shared: SharedStreams | None = None,
    ):
        """``kv_flow="layerwise"`` needs ``kv_address``: the chosen prefill's KV control address,
        which the decode hands its blocks to before the prefill runs. ``prefill_api="vllm"``: the prefill
        is a vLLM server with HawkConnector serving ``prefill_model`` (vllm_prefill.py; pull only). ``shared``:
        the decode's lines come on this router process's shared stream (decode_lines.py), else on the
        request's own."""
        if kv_flow == "layerwise" and not kv_address:
            raise ValueError("a layer-wise generation needs the prefill's KV address")
        if prefill_api == "vllm" and kv_flow != "pull":
            raise ValueError("a vLLM prefill hands its KV over after prefill: kv_flow must be 'pull'")
        self.prefill_api, self.prefill_model = prefill_api, prefill_model
        self.ended_at_prefill: int | None = None  # a vLLM prefill's first token that ended the request
        self.client, self.prefill_url, self.decode_url = client, prefill_url, decode_url
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.tokenizer, self.stop, self.arrival = tokenizer, stop, arrival
        self.extra_info = dict(extra_info or {})
        self.kv_flow, self.kv_address = kv_flow, kv_address
        self._decode: DecodeLines = shared.lines(decode_url, request_id) if shared is not None else RequestLines(client, decode_url, request_id)
        self._decode_open = False
        self._pending: asyncio.Future[TokenLine | None] | None = None  # a decode line being read ahead
        self._prefilled = False
        self._got_token = False
        self._closed = False
        self._stop_hit = False  # a stop string ended the text while the decode still ran
        self.prefill_reply: PrefillResponse | None = None
        self.kv_info: dict[str, Any] = {}
        self.t_prefill_sent: float | None = None
        self.t_decode_sent: float | None = None
        self.t_prefilled: float | None = None
        self.t_handed: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None

    # -- phase 1: prefill and decode started (the order depends on the KV flow) ----------------

    async def start(self) -> None:
        """Raises OpenAIError for anything the instances refuse; on any failure or cancellation
        the request's state on both instances is released."""
        try:
            if self.kv_flow == "layerwise":
                await self._start_layerwise()
            else:
                if self.prefill_reply is None:  # else prefilled elsewhere: its handle came with the request
                    await self._prefill()
                if self.ended_at_prefill is None:
                    await self._open_decode(self._pull_decode_request())
        except BaseException:
            await self.aclose()
            raise

    async def _start_layerwise(self) -> None:
        """Decode first: admit (the destination is handed over), prefill, then the first token."""
        await self._open_decode(self._push_decode_request())
        self._prefilled = True  # the decode may hand the prefill a destination from now on: release it too
        await self._await_handed()
        await self._prefill_watching_decode()
        await self._deliver_first_token()

    async def _call(self, base: str, role: str, path: str, body: Any, reply: type[_Reply]) -> _Reply:
        """POST one contract message to an instance: its typed reply, or the fault the client is told
        (the instance unreachable: 503; an error status or a malformed answer: the upstream's)."""
        r = await self._post(base, role, path, content=body.model_dump_json(), headers=JSON_HEADERS)
        return receive(reply, r.content, f"{role} at {base}")

    async def _post(self, base: str, role: str, path: str, **kw: Any) -> httpx.Response:
        """One POST to an instance, answered 200, or the fault the client is told."""
        try:
            r = await self.client.post(f"{base}{path}", **kw)
        except httpx.HTTPError as e:
            raise InstanceDown(f"{role} instance {base} unreachable: {e!r}") from None
        if r.status_code != 200:
            raise upstream_error(r.status_code, r.content, f"{role} at {base}")
        return r

    async def _prefill(self) -> None:
        if self.prefill_api == "vllm":
            return await self._prefill_vllm()
        body = PrefillRequest.of(request_id=self.request_id, prompt_ids=self.prompt_ids, params=self.params.to_dict(), kv_flow=self.kv_flow)
        self._prefilled = True  # from here on the prefill may hold something for this request
        self.t_prefill_sent = time.monotonic()
        self.prefill_reply = await self._call(self.prefill_url, "prefill", "/internal/prefill", body, PrefillResponse)
        self.t_prefilled = time.monotonic()

    async def _prefill_vllm(self) -> None:
        """vLLM's P/D prefill call (vllm_prefill.py): the same PrefillResponse, from its KV handle."""
        who = f"prefill at {self.prefill_url}"
        body = prefill_body(self.prefill_model, self.prompt_ids, self.params)
        self._prefilled = True
        self.t_prefill_sent = time.monotonic()
        r = await self._post(self.prefill_url, "prefill", "/v1/completions", json=body)
        self.t_prefilled = time.monotonic()
        try:
            answer = r.json()
        except ValueError:
            raise BadUpstream(f"{who} answered non-JSON") from None
        try:
            self.prefill_reply = prefill_response(self.request_id, answer, who, self.t_prefilled - self.t_prefill_sent)
        except EndedAtPrefill as e:
            self.ended_at_prefill = e.token

    def prefilled_elsewhere(self, first_token: int, num_tokens: int, address: str, kv_request_id: str) -> None:
        """The prompt was prefilled before this router saw it (a P/D router ran it on a vLLM server with
        HawkConnector): go straight to the decode with that KV. Nothing here to abort on the prefill
        side: un-pulled KV goes back at HawkConnector's TTL."""
        self.prefill_reply = PrefillResponse.of(request_id=self.request_id, first_token=first_token, num_prompt_tokens=num_tokens,
                                                kv=KVRef(address=address, request_id=kv_request_id))

    def _pull_decode_request(self) -> DecodeRequest:
        """Pull: the prefill's first token and where its KV waits."""
        pre = self.prefill_reply
        assert pre is not None
        return DecodeRequest.of(
            request_id=self.request_id, prompt_len=pre.num_prompt_tokens, first_token=pre.first_token,
            params=self.params.to_dict(), kv=pre.kv,
        )

    def _push_decode_request(self) -> DecodeRequest:
        """Layer-wise: no first token yet; the prefill that will push the KV, under this request's id."""
        assert self.kv_address is not None
        return DecodeRequest.of(
            request_id=self.request_id, prompt_len=len(self.prompt_ids), params=self.params.to_dict(),
            kv=KVRef(address=self.kv_address, request_id=self.request_id), kv_flow="layerwise",
        )

    async def _open_decode(self, body: DecodeRequest) -> None:
        self.t_decode_sent = time.monotonic()
        self._decode_open = True  # from here on the decode may hold something for this request
        await self._decode.open(body)

    async def _await_handed(self) -> None:
        """The decode's first line: its blocks are the prefill's push destination (or why not)."""
        ev = await self._read_event()
        if ev is None or ev.finish_reason is not None:
            raise self._decode_ended(ev)
        if not ev.handed:
            raise BadUpstream(f"decode instance {self.decode_url} sent {ev.model_dump(exclude_none=True)} before handing its blocks over")
        self.t_handed = time.monotonic()

    async def _prefill_watching_decode(self) -> None:
        """Run the prefill while reading ahead on the decode stream. Nothing but a failure can come
        there before the first token is delivered, so a line that does ends the request now (the
        prefill is cancelled and aborted by ``aclose``) instead of after the whole prefill, unless the
        prefill refuses within ``CAUSE_GRACE_S``: its refusal is the cause, the decode's the effect."""
        prefill = asyncio.ensure_future(self._prefill())
        ahead = asyncio.ensure_future(self._read_event())
        keep_ahead = False
        try:
            await asyncio.wait({prefill, ahead}, return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done():
                ended = self._decode_ended(ahead.result())
                await asyncio.wait({prefill}, timeout=CAUSE_GRACE_S)
                if prefill.done() and not prefill.cancelled() and isinstance(prefill.exception(), OpenAIError):
                    raise prefill.exception()  # type: ignore[misc]
                raise ended
            prefill.result()  # the prefill's own failure, if any
            self._check_same_prefill()
            self._pending, keep_ahead = ahead, True  # its line (the first token, or why not) comes next
        finally:
            await _cancel(prefill)
            if not keep_ahead:
                await _cancel(ahead)

    def _check_same_prefill(self) -> None:
        """The prefill that answered must be the one the decode's blocks were handed to; else
        nothing will ever be pushed there (a prefill restarted since the router read its address),
        and the request fails now instead of at the connector's TTL."""
        pre = self.prefill_reply
        assert pre is not None
        if pre.kv.address != self.kv_address:
            raise BadUpstream(
                f"prefill at {self.prefill_url} answered from KV address {pre.kv.address}, but the decode's blocks were handed "
                f"to {self.kv_address} (restarted since the router read its address?); retry"
            )

    async def _deliver_first_token(self) -> None:
        """Relay the prefill's first token to the decode. If the decode no longer waits for it, its
        stream says why (the next line), so a refusal here is not an error of its own."""
        pre = self.prefill_reply
        assert pre is not None
        body = FirstToken.of(request_id=self.request_id, token=pre.first_token)
        reply = await self._call(self.decode_url, "decode", "/internal/first_token", body, FirstTokenReply)
        if not reply.accepted:
            log.info("decode %s did not take %s's first token; its stream says why", self.decode_url, self.request_id)

    def _decode_ended(self, ev: TokenLine | None) -> OpenAIError | BadUpstream:
        """What a decode line that ends the request before its first token means for the client."""
        if ev is None:
            return BadUpstream(f"decode instance {self.decode_url} ended the stream early")
        if ev.finish_reason in ("error", "abort"):
            detail = ev.error or "the request was aborted on the decode instance"
            return OpenAIError(500, f"decode failed: {detail}", type="server_error")
        return BadUpstream(f"decode instance {self.decode_url} sent {ev.model_dump(exclude_none=True)} before the first token was delivered")

    # -- phase 2: tokens to text ------------------------------------------------------------

    async def deltas(self, every_token: bool = False) -> AsyncIterator[TextDelta]:
        """Text as it is generated; the last delta carries the finish reason. ``every_token``: a delta
        for each token, empty where its text is held back (partial UTF-8, a possible stop string), as
        a stream reporting usage on every chunk needs."""
        if self.ended_at_prefill is not None:  # nothing went to a decode: the prefill's token is all
            self.t_first = self.t_last = time.monotonic()
            self.num_tokens, self._got_token, self.finish_reason = 1, True, "stop"
            decoder = self.tokenizer.incremental_decoder()
            yield TextDelta(StopMatcher(self.stop).feed(decoder.step(self.ended_at_prefill) + decoder.flush())[0], "stop")
            return
        assert self._decode_open, "start() first"
        decoder = self.tokenizer.incremental_decoder()
        stopper = StopMatcher(self.stop)
        try:
            while (ev := await self._next_event()) is not None:
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
                    if hit:  # the decode is told to stop (aclose, in finally), then its stream closed
                        self.finish_reason = "stop"
                        self._stop_hit = reason is None
                        yield TextDelta(text, "stop")
                        return
                if reason is None:
                    if text or (every_token and tok is not None):
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
        finally:
            await self.aclose()

    async def _next_event(self) -> TokenLine | None:
        """The decode stream's next line: the one read ahead during the prefill, if any."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return await pending
        return await self._read_event()

    async def _read_event(self) -> TokenLine | None:
        """One line of the decode stream, checked against the contract; None at its end."""
        return await self._decode.read()

    # -- the end ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Idempotent; safe inside a cancelled task (the cleanup is shielded)."""
        if self._closed:
            return
        self._closed = True
        with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            if self._pending is not None:  # a read ahead that nobody will take
                await _cancel(self._pending)
                self._pending = None
            if self._decode_open:  # a stop string is a normal finish, not counted as a client's abort
                await self._decode.close(stop=self._stop_hit)
            if self._prefilled and self.prefill_url and not self._got_token and self.finish_reason is None:
                await self._abort_prefill()

    async def _abort_prefill(self) -> None:
        if self.prefill_api == "vllm":  # vLLM aborts a prefill whose call was cancelled; KV it kept waits for its TTL
            return
        try:
            body = AbortRequest.of(request_id=self.request_id)
            await self.client.post(f"{self.prefill_url}/internal/abort", content=body.model_dump_json(), headers=JSON_HEADERS)
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
            "prefill_handoff_s": pre_t.get("handoff_s"),
            "kv_transfer_s": self.kv_info.get("kv_transfer_s"),
            "kv_bytes": self.kv_info.get("kv_bytes"),
            "kv_requests": self.kv_info.get("kv_requests"),
            "kv_mode": self.kv_info.get("kv_mode"),
            "decode_admit_wait_s": self.kv_info.get("admit_wait_s"),
        }
        if self.kv_info.get("kv_breakdown_ms"):  # where the pull's time went, step by step (Algorithm 1)
            out["kv_breakdown_ms"] = self.kv_info["kv_breakdown_ms"]
        if self.t_prefilled is not None and self.t_first is not None:
            out["prefill_to_first_token_s"] = self.t_first - self.t_prefilled
        out.update(self._hops(pre_t))
        if self.kv_flow == "layerwise":  # the part of the transfer the prefill's forward did not hide
            out["kv_flow"] = "layerwise"
            out["kv_exposed_s"] = self.kv_info.get("kv_exposed_s")
            out["decode_handed_s"] = None if self.t_handed is None else self.t_handed - self.arrival
        return out

    def _hops(self, pre_t: dict[str, Any]) -> dict[str, float]:
        """Where the server's TTFT went outside the engines: the router's own work before the
        prefill call, each instance call's round trip, and (pull) what the calls added to what the
        engines report (HTTP, (de)serialization, the instances' handlers, thread hand-offs)."""
        out: dict[str, float] = {}
        if self.t_prefill_sent is not None and self.t_prefilled is not None:
            out["router_before_prefill_s"] = self.t_prefill_sent - self.arrival
            out["prefill_call_s"] = call = self.t_prefilled - self.t_prefill_sent
            if pre_t.get("prefill_s") is not None:
                out["prefill_hop_s"] = call - sum(pre_t.get(k) or 0.0 for k in ("queue_s", "prefill_s", "handoff_s"))
        first = self.kv_info.get("decode_first_token_s")
        if first is not None:
            out["decode_first_token_s"] = first
        if self.kv_flow == "pull" and self.t_decode_sent is not None and self.t_first is not None:
            out["decode_call_s"] = call = self.t_first - self.t_decode_sent
            if first is not None:
                out["decode_hop_s"] = call - first
        return out


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait for it to end, whatever it ends with (nobody reads its result)."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


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
