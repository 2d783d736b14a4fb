"""The router: HAWK's OpenAI-compatible front door (vLLM's disaggregated-serving proxy pattern).

For each request it tokenizes (chat template included), checks the request against the instances'
limits, then runs it on one prefill and one decode instance in the order of the instances' KV flow
(``kv_flow``: pull = prefill, then decode with the KV handle; layerwise = admit at the decode first,
then prefill, then the first token to the decode; the lifecycle is stated in generation.py), and
streams the decode's tokens back as text (SSE when ``stream`` is set). Instances of each role are
used round-robin. The router loads no weights: the tokenizer comes from a prefill instance. All
instances must run the same KV flow; the router follows theirs and refuses to start on a mix.

At start it reads the instances' limits and, with ``warmup`` (``hawk serve``'s default), sends one 2-token
request through each prefill and decode instance before it reports ready (:meth:`Router.warm_up`).

Every response carries a non-standard ``hawk`` object (in the last chunk when streaming) with the
request's TTFT, TPOT and KV-transfer time and bytes, so a client can see what the transfer cost.

Guards, outermost first: an API key on /v1/* (when set), a body-size limit (413 before parsing),
a character-count bound on prompts (refused before tokenizing; tokenizing runs in a thread). A
monitor polls each instance's /health: a request that needs an instance that is down gets a 503
at once, and requests in flight on an instance that goes down fail with a 503 instead of waiting.
Down means the connection failed, the instance answered unhealthy, or it missed several probes in a
row; one slow probe on a busy host fails nothing.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hawk.config import DECODE_STREAMS
from hawk.engine.sequence import SamplingParams
from hawk.engine.tokenizer import Tokenizer
from hawk.errors import BadRequest, HawkError
from hawk.integrations.vllm.params import read_handle
from hawk.serve.common import API_KEY_ENV, CLIENT_KEEPALIVE_S, LimitBody, RequireBearer, install_error_handlers
from hawk.serve.contract import Accounting, InstanceInfo, receive
from hawk.serve.decode_lines import SharedStreams
from hawk.serve.errors import CLIENT_CLOSED, http_error
from hawk.serve.generation import ClientGone, Generation, until_disconnected
from hawk.serve.metrics import CONTENT_TYPE, RouterMetrics
from hawk.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Delta,
    InstanceDown,
    ModelCard,
    ModelList,
    OpenAIError,
    Usage,
    UsageReport,
    new_id,
)
from hawk.serve.tokenizer_wire import tokenizer_from_wire
from hawk.serve.vllm_prefill import PREFILL_APIS, vllm_info

log = logging.getLogger(__name__)

#: No tokenizer HAWK serves has a token longer than this many characters, so a prompt of more than
#: max_prompt_tokens x this is too long for sure, and is refused without being tokenized.
MAX_CHARS_PER_TOKEN = 64
MIN_BODY_BYTES = 4 << 20  # the default body limit is this, or more for long-context models


@dataclass
class RouterConfig:
    """Where the instances are and the router's request defaults."""

    prefill_urls: list[str]
    decode_urls: list[str]
    model: str | None = None  # the served model name; default: the name the prefill instance reports
    default_temperature: float = 1.0  # OpenAI's default; send temperature=0 for greedy
    default_chat_max_tokens: int | None = None  # chat requests without max_tokens: None = the rest of the context (vLLM's and OpenAI's behaviour)
    request_timeout_s: float = 600.0
    startup_timeout_s: float = 120.0
    aliases: list[str] = field(default_factory=list)  # more names clients may use for the model
    api_key: str | None = None  # clients must send it as a Bearer token (default: $HAWK_API_KEY)
    cluster_secret: str | None = None  # sent to the instances on every internal call
    max_body_bytes: int | None = None  # default: derived from the context length (body_limit)
    health_interval_s: float = 1.0  # how often instances' /health is polled
    health_timeout_s: float = 3.0  # a probe not answered by then is a miss
    health_misses: int = 3  # consecutive misses before a slow instance counts as down
    warmup: bool = False  # one tiny request through every instance at startup (``hawk serve`` turns it on)
    prefill_api: str = "hawk"  # "vllm": the prefill URLs are vLLM servers running HawkConnector (vllm_prefill.py)
    decode_stream: str = "shared"  # one stream of token lines per decode instance, or "request": one per request (decode_lines.py)

    def body_limit(self, max_model_len: int) -> int:
        """The configured limit, or room for a maximal prompt even as JSON-escaped text."""
        return self.max_body_bytes or max(MIN_BODY_BYTES, max_model_len * MAX_CHARS_PER_TOKEN * 2)


# ============================================================================ instances


@dataclass
class Instance:
    url: str
    role: str
    info: InstanceInfo


class ProbeFault(enum.Enum):
    """Why an instance gave no answer to a probe (the value completes "<role> instance ...")."""

    UNREACHABLE = "unreachable"  # the connection failed: the process or its server is gone
    UNHEALTHY = "not healthy"  # it answered, not 200 (e.g. its engine thread died)
    TIMEOUT = "not answering"  # no answer in time: busy, or hung


class InstancePool:
    """The instances behind the router, the tightest of their limits, and round-robin choice."""

    def __init__(self, prefill: list[Instance], decode: list[Instance], remote_prefill: bool = False):
        """``remote_prefill``: no prefill of its own is needed (a decode front behind a P/D router that
        prefills elsewhere and sends the KV handle with each request)."""
        if (not prefill and not remote_prefill) or not decode:
            raise ValueError("the router needs at least one prefill and one decode instance")
        self.prefill, self.decode = prefill, decode
        self._p, self._d = itertools.count(), itertools.count()
        limits = prefill or decode
        self.max_prompt_tokens = min(i.info.max_prompt_tokens or i.info.max_model_len - 1 for i in limits)
        self.max_model_len = min(i.info.max_model_len for i in [*prefill, *decode])
        self.max_kv_tokens = min(i.info.max_kv_tokens or self.max_model_len for i in decode)
        self.max_num_seqs = min((i.info.max_num_seqs for i in decode if i.info.max_num_seqs), default=None)
        self.vocab_size = min(i.info.vocab_size for i in limits)

    def next_prefill(self, down: dict[str, str] | None = None) -> Instance:
        return self._next(self.prefill, self._p, down or {}, "prefill")

    def next_decode(self, down: dict[str, str] | None = None) -> Instance:
        return self._next(self.decode, self._d, down or {}, "decode")

    @staticmethod
    def _next(insts: list[Instance], counter: itertools.count, down: dict[str, str], role: str) -> Instance:
        """Round-robin over the instances not known to be down."""
        for _ in range(len(insts)):
            inst = insts[next(counter) % len(insts)]
            if inst.url not in down:
                return inst
        why = "; ".join(f"{u}: {down[u]}" for u in (i.url for i in insts))
        raise InstanceDown(f"no {role} instance is available ({why}); it is being restarted, retry shortly")

    def all_entries(self) -> list[Instance]:
        """Every entry, a colocated instance's two (prefill and decode) included."""
        return [*self.prefill, *self.decode]

    def all(self) -> list[Instance]:
        seen: dict[str, Instance] = {}
        for i in [*self.prefill, *self.decode]:
            seen.setdefault(i.url, i)
        return list(seen.values())


def common_kv_flow(infos: dict[str, InstanceInfo]) -> str:
    """The one KV flow every instance runs (the order of a request's steps depends on it)."""
    flows = {url: i.kv_flow for url, i in infos.items()}
    if len(set(flows.values())) != 1:
        raise RuntimeError(f"instances run different KV flows ({', '.join(f'{u}: {f}' for u, f in flows.items())}): start them all with the same --kv-flow")
    return next(iter(flows.values()))


async def fetch_info(client: httpx.AsyncClient, url: str, timeout_s: float) -> InstanceInfo:
    """An instance's /internal/info, retried until it answers (it may still be loading)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = await client.get(f"{url}/internal/info", timeout=5.0)
            r.raise_for_status()
            return receive(InstanceInfo, r.content, f"instance {url}")
        except httpx.HTTPError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"instance {url} did not answer /internal/info within {timeout_s:.0f}s: {e!r}") from None
            await asyncio.sleep(0.2)


# ============================================================================ the app


class Router:
    """State shared by the router's endpoints."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer | None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.client: httpx.AsyncClient | None = None
        self.shared: SharedStreams | None = None  # decode_stream="shared"
        self.pool: InstancePool | None = None
        self.names: list[str] = []
        self.max_body_bytes: int | None = None  # known once the instances' limits are
        self.down: dict[str, str] = {}  # instance url -> why it is down
        self._down_events: dict[str, asyncio.Event] = {}
        self._monitor: asyncio.Task | None = None
        self.kv_flow = "pull"  # the instances' (read at startup)
        self._prefill_models: dict[str, str] = {}  # vLLM prefill url -> the model name it serves

    async def startup(self) -> None:
        cfg = self.cfg
        auth = {"Authorization": f"Bearer {cfg.cluster_secret}"} if cfg.cluster_secret else {}
        self.client = httpx.AsyncClient(
            headers=auth,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=CLIENT_KEEPALIVE_S),
            trust_env=False,  # internal loopback/cluster traffic must not go through an HTTP proxy
        )
        if cfg.decode_stream not in DECODE_STREAMS:
            raise ValueError(f"decode_stream must be one of {DECODE_STREAMS}, got {cfg.decode_stream!r}")
        if cfg.decode_stream == "shared":
            self.shared = SharedStreams(self.client)
        if cfg.prefill_api not in PREFILL_APIS:
            raise ValueError(f"prefill_api must be one of {PREFILL_APIS}, got {cfg.prefill_api!r}")
        if cfg.prefill_api == "vllm":  # vLLM has no /internal/info: the decodes say what is served
            dec = await asyncio.gather(*(fetch_info(self.client, u, cfg.startup_timeout_s) for u in cfg.decode_urls))
            pre = list(await asyncio.gather(*(vllm_info(self.client, u, cfg.startup_timeout_s, dec[0].vocab_size) for u in cfg.prefill_urls)))
            self._prefill_models = {u: p.model for u, p in zip(cfg.prefill_urls, pre)}  # what requests to it must name
            pre = [p.model_copy(update={"model": dec[0].model}) for p in pre]  # the router serves the decode's name
            infos = [*pre, *dec]
        else:
            infos = await asyncio.gather(*(fetch_info(self.client, u, cfg.startup_timeout_s) for u in [*cfg.prefill_urls, *cfg.decode_urls]))
        n = len(cfg.prefill_urls)
        self.pool = InstancePool(
            [Instance(u, "prefill", i) for u, i in zip(cfg.prefill_urls, infos[:n])],
            [Instance(u, "decode", i) for u, i in zip(cfg.decode_urls, infos[n:])],
            remote_prefill=cfg.prefill_api == "vllm",
        )
        models = {i.model for i in infos}
        if len(models) != 1:
            raise RuntimeError(f"instances serve different models: {sorted(models)}")
        self.kv_flow = common_kv_flow(dict(zip([*cfg.prefill_urls, *cfg.decode_urls], infos)))
        served = models.pop()
        self.names = list(dict.fromkeys([cfg.model or served, served, *cfg.aliases]))
        if self.tokenizer is None:
            source = cfg.decode_urls[0] if cfg.prefill_api == "vllm" else cfg.prefill_urls[0]
            r = await self.client.get(f"{source}/internal/tokenizer", timeout=60.0)
            r.raise_for_status()
            self.tokenizer = await asyncio.to_thread(tokenizer_from_wire, r.json())
        self.max_body_bytes = cfg.body_limit(self.pool.max_model_len)
        self._monitor = asyncio.create_task(self._watch_instances(), name="hawk-health-monitor")
        if cfg.warmup and self.pool.prefill:  # a decode front has nothing to warm a pair with
            try:
                await self.warm_up()
            except BaseException:
                await self.shutdown()  # the lifespan never reaches its own shutdown after a failed start
                raise
        log.info("router ready: model %s, prefill %s, decode %s", self.names[0], cfg.prefill_urls, cfg.decode_urls)

    async def warm_up(self) -> None:
        """Before traffic, one tiny greedy request (2 tokens) through each prefill and each decode instance.

        Why: the first request through a pair pays one-time costs no later one does: the transfer's
        first plan, buffer registrations and lazy imports (on the CPU box its KV transfer took 66 ms
        against 20 ms for the next ones: benchmarks/first_request_probe.py), and on a GPU the transform
        kernels' compile where the Triton cache is cold. vLLM and SGLang run a dummy batch at start for
        the same reason. Not counted in the router's metrics (the instances count it: it is a request to
        them). A failure stops the start: a system that cannot serve two tokens should not report ready.
        """
        assert self.pool is not None and self.tokenizer is not None
        ids = self.tokenizer.encode("Hello") or [0]
        params = SamplingParams(max_tokens=2, temperature=0.0)
        for i in range(max(len(self.pool.prefill), len(self.pool.decode))):  # round-robin: each instance at least once
            t0 = time.monotonic()
            gen = self.new_generation(new_id("warmup"), ids, params, [], t0)
            try:
                await asyncio.wait_for(self._drain(gen), self.cfg.startup_timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure is the start's
                raise RuntimeError(f"warm-up request {i + 1} ({gen.prefill_url} -> {gen.decode_url}) failed "
                                   f"after {time.monotonic() - t0:.1f} s: {e}") from e
            log.info("warm-up request %d (%s -> %s): %.2f s", i + 1, gen.prefill_url, gen.decode_url, time.monotonic() - t0)

    @staticmethod
    async def _drain(gen: Generation) -> None:
        await gen.start()
        await _collect(gen)

    async def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        if self.shared is not None:
            await self.shared.close()
        if self.client is not None:
            await self.client.aclose()

    # -- instance health ------------------------------------------------------------------------

    async def _watch_instances(self) -> None:
        """Poll every instance's /health; mark it down or up, and wake requests waiting on it.

        An instance that refuses the connection or answers unhealthy is down at once; one that only
        misses probes (a busy host) is down after ``health_misses`` in a row, so one slow answer
        never fails the requests it is serving."""
        missed: dict[str, int] = {}
        while True:
            try:
                assert self.pool is not None
                insts = self.pool.all()
                res = await asyncio.gather(*(self._probe_one(i, "/health") for i in insts))
                for inst, (body, why) in zip(insts, res):
                    url = inst.url
                    missed[url] = missed.get(url, 0) + 1 if why is ProbeFault.TIMEOUT else 0
                    if why is ProbeFault.TIMEOUT and missed[url] < self.cfg.health_misses:
                        continue
                    if body is not None and url in self.down and not await self._refresh_info(url):
                        continue  # up, but its identity could not be read: still down for requests
                    self.mark(url, None if body is not None else f"{inst.info.role} instance {why.value}")
            except Exception:  # noqa: BLE001 - the monitor must outlive any one probe
                log.exception("health monitor")
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _refresh_info(self, url: str) -> bool:
        """Re-read a restarted instance's /internal/info before using it again: a restarted prefill
        has a new KV control address, which layer-wise requests give the decode before prefill."""
        assert self.pool is not None and self.client is not None
        if url in self._prefill_models:  # a vLLM prefill: nothing of its identity changes across restarts
            return True
        try:
            r = await self.client.get(f"{url}/internal/info", timeout=5.0)
            r.raise_for_status()
            info = receive(InstanceInfo, r.content, f"instance {url}")
        except (httpx.HTTPError, HawkError) as e:
            log.warning("instance %s answers /health but not /internal/info: %s", url, e)
            return False
        if info.kv_flow != self.kv_flow:
            why = f"came back with kv_flow {info.kv_flow!r}, the other instances run {self.kv_flow!r}"
            log.error("instance %s %s: not using it", url, why)
            self.down[url] = why
            return False
        for inst in self.pool.all_entries():
            if inst.url == url:
                inst.info = info
        return True

    def mark(self, url: str, down_reason: str | None) -> None:
        """Record an instance as down (with why) or up; a new down wakes its in-flight requests."""
        if down_reason is None:
            if self.down.pop(url, None) is not None:
                log.warning("instance %s is healthy again", url)
                self._down_events.pop(url, None)
            return
        if url not in self.down:
            log.error("instance %s is down: %s", url, down_reason)
            self.down[url] = down_reason
            self._down_events.setdefault(url, asyncio.Event()).set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Healthy exactly when requests are routed: every instance is up in the monitor's view.

        Why the monitor's view and not a live probe: a restarted instance answers its own /health
        before the router has re-read its identity and routes to it again, and a load balancer told
        200 in that gap sends requests that get a 503; a live probe of a restarting instance also
        waits out ``health_timeout_s``, so this answers at once instead."""
        assert self.pool is not None
        insts = self.pool.all()
        ok = not any(i.url in self.down for i in insts)
        states = {f"{i.info.role} {i.url}": ("down" if i.url in self.down else "ok") for i in insts}
        reasons = {f"{i.info.role} {i.url}": self.down[i.url] for i in insts if i.url in self.down}
        body: dict[str, Any] = {"status": "ok" if ok else "degraded", "instances": states}
        if reasons:
            body["down"] = reasons
        return ok, body

    async def wait_down(self, *urls: str) -> str:
        """Returns (why) when one of ``urls`` is marked down."""
        waits = [asyncio.ensure_future(self._down_events.setdefault(u, asyncio.Event()).wait()) for u in urls]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        u = next((u for u in urls if u in self.down), urls[0])
        return f"{u} went down: {self.down.get(u, 'unhealthy')}"

    # -- request checks -----------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise OpenAIError(404, f"The model `{model}` does not exist. This server serves: {', '.join(self.names)}", code="model_not_found", param="model")

    def check_chars(self, n_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to, without tokenizing it."""
        assert self.pool is not None
        limit = self.pool.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if n_chars > limit:
            raise OpenAIError(
                400,
                f"your prompt has {n_chars} characters, more than any prompt of at most {self.pool.max_prompt_tokens} tokens "
                f"can have (this model's maximum context length is {self.pool.max_model_len} tokens). Please shorten the prompt.",
                code="context_length_exceeded", param=param,
            )

    def completion_prompt(self, prompt: str | list[Any]) -> list[int]:
        assert self.tokenizer is not None and self.pool is not None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one (protocol refuses longer batches)
        self.check_chars(len(prompt), "prompt")  # ids too: a list that long is over the limit
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.pool.vocab_size), None)
            if bad is not None:
                raise OpenAIError(400, f"prompt token id {bad} is outside the vocabulary (0..{self.pool.vocab_size - 1})", param="prompt")
        if not ids:
            raise OpenAIError(400, "prompt is empty", param="prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        assert self.tokenizer is not None
        self.check_chars(sum(_chars(m.content) for m in req.messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(req.message_dicts(), add_generation_prompt=True)
        except ValueError as e:
            raise OpenAIError(400, f"messages: {e}", param="messages") from None
        return self.tokenizer.encode(text)

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, n_prompt: int, max_tokens: int | None, default_max: int | None) -> SamplingParams:
        """Check lengths against the instances' limits and build the engine's parameters.

        Without ``max_tokens`` a request may run to the end of the context (``default_max`` None),
        as vLLM and OpenAI let a chat do: the decode admits by the blocks a request needs now and
        grows them per step, so a long limit reserves nothing up front."""
        assert self.pool is not None
        limit = self.pool.max_model_len
        if n_prompt > min(self.pool.max_prompt_tokens, limit - 1):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens (prompts up to {min(self.pool.max_prompt_tokens, limit - 1)}); "
                f"your prompt has {n_prompt} tokens. Please shorten the prompt.",
                code="context_length_exceeded", param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        if max_tokens is None:  # as much as fits (up to the default, where there is one)
            room = min(limit, self.pool.max_kv_tokens) - n_prompt
            max_tokens = max(1, room if default_max is None else min(default_max, room))
        if max_tokens > limit:
            raise OpenAIError(400, f"max_tokens={max_tokens} is larger than the model's context length ({limit} tokens)", param="max_tokens")
        if n_prompt + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested {n_prompt + max_tokens} tokens "
                f"({n_prompt} in the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                code="context_length_exceeded", param="max_tokens",
            )
        if n_prompt + max_tokens > self.pool.max_kv_tokens:
            raise OpenAIError(
                400,
                f"prompt ({n_prompt}) + max_tokens ({max_tokens}) exceeds the decode instance's KV cache ({self.pool.max_kv_tokens} tokens)",
                param="max_tokens",
            )
        temperature = self.cfg.default_temperature if req.temperature is None else req.temperature
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None

    # -- one request --------------------------------------------------------------------------

    def new_generation(self, rid: str, prompt_ids: list[int], params: SamplingParams, stop: list[str], arrival: float,
                       kv_transfer_params: dict[str, Any] | None = None) -> Generation:
        """One request on a prefill and a decode instance; or, when ``kv_transfer_params`` carry a HAWK KV
        handle (a P/D router such as vllm-router prefilled it on a vLLM server), on a decode instance only."""
        assert self.pool is not None and self.client is not None and self.tokenizer is not None
        try:
            handle = read_handle(kv_transfer_params)
        except BadRequest as e:
            raise OpenAIError(400, str(e)) from None
        if handle is not None and self.kv_flow != "pull":
            raise OpenAIError(400, "a request carrying a KV handle needs decode instances that pull (kv_flow pull)")
        if handle is None and not self.pool.prefill:
            raise OpenAIError(400, "this router has no prefill instance: send kv_transfer_params from a HawkConnector prefill (a P/D router does)")
        d = self.pool.next_decode(self.down)
        p_url, kv_address, model = "", None, ""
        if handle is None:
            p = self.pool.next_prefill(self.down)
            p_url, kv_address, model = p.url, p.info.kv_address, self._prefill_models.get(p.url, "")
        extra = {"transfer": d.info.transfer, "decode_device": d.info.device_label or d.info.device, "kv_dtype": d.info.kv_dtype}
        gen = Generation(
            self.client, p_url, d.url, rid, prompt_ids, params, self.tokenizer, stop, arrival, extra,
            kv_flow=self.kv_flow, kv_address=kv_address, prefill_api=self.cfg.prefill_api, prefill_model=model, shared=self.shared,
        )
        if handle is not None:
            if handle.num_tokens != len(prompt_ids):
                raise OpenAIError(400, f"the KV handle holds {handle.num_tokens} prompt tokens, this prompt has {len(prompt_ids)}")
            gen.prefilled_elsewhere(handle.first_token, handle.num_tokens, handle.address, handle.request_id)
        return gen

    async def run(
        self,
        request: Request,
        gen: Generation,
        stream: bool,
        chunks: ChunkMaker,
        usage: UsageReport,
    ) -> Response:
        try:
            await until_disconnected(lambda: self._stopper(request, gen), gen.start())
        except ClientGone:
            self.metrics.finished.labels("client_disconnected").inc()
            return Response(status_code=CLIENT_CLOSED)
        if stream:
            return StreamingResponse(
                self._sse(gen, chunks, usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            text, reason = await until_disconnected(lambda: self._stopper(request, gen), _collect(gen))
        except ClientGone:
            self.metrics.finished.labels("client_disconnected").inc()
            return Response(status_code=CLIENT_CLOSED)
        summary = gen.summary()
        self.metrics.observe(summary)
        return JSONResponse(chunks.full(text, reason, Usage.of(len(gen.prompt_ids), gen.num_tokens), summary))

    async def _stopper(self, request: Request, gen: Generation) -> None:
        """Returns when the client leaves; raises InstanceDown when an instance of ``gen`` goes down."""
        leave = asyncio.ensure_future(wait_disconnect(request))
        down = asyncio.ensure_future(self.wait_down(gen.prefill_url, gen.decode_url))
        try:
            await asyncio.wait({leave, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leave.cancel()
            down.cancel()
        if down.done() and not down.cancelled() and not leave.done():
            raise InstanceDown(f"the request failed: {down.result()}; retry shortly")

    async def _sse(self, gen: Generation, chunks: ChunkMaker, report: UsageReport) -> AsyncIterator[str]:
        done = False
        every = report is UsageReport.EVERY_CHUNK
        try:
            first = chunks.opening()
            if first is not None:
                yield sse(first)
            async for d in gen.deltas(every_token=every):
                # gen.num_tokens counts the tokens behind this delta: the generator waits at its yield
                so_far = Usage.of(len(gen.prompt_ids), gen.num_tokens) if every else None
                if d.finish_reason is None:
                    yield sse(chunks.delta(d.text, usage=so_far))
                    continue
                summary = gen.summary()
                self.metrics.observe(summary)
                done = True
                usage = Usage.of(len(gen.prompt_ids), gen.num_tokens)
                yield sse(chunks.delta(d.text, d.finish_reason, summary, usage=so_far))
                if report is not UsageReport.NONE:
                    yield sse(chunks.usage(usage, summary))
            yield "data: [DONE]\n\n"
        except (OpenAIError, HawkError) as e:  # the status line is sent already: report in-band, as OpenAI does
            done = True
            self.metrics.finished.labels("error").inc()
            yield sse((e if isinstance(e, OpenAIError) else http_error(e)).body())
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.metrics.finished.labels("client_disconnected").inc()
            await gen.aclose()

    # -- health and metrics -------------------------------------------------------------------

    async def _probe_one(self, inst: Instance, path: str) -> tuple[dict[str, Any] | None, ProbeFault | None]:
        """GET ``path`` on one instance: its JSON body, or None and why not."""
        assert self.client is not None
        try:
            r = await self.client.get(f"{inst.url}{path}", timeout=self.cfg.health_timeout_s)
        except httpx.TimeoutException:
            return None, ProbeFault.TIMEOUT
        except httpx.HTTPError:
            return None, ProbeFault.UNREACHABLE
        if r.status_code != 200:
            return None, ProbeFault.UNHEALTHY
        if not r.content and inst.url in self._prefill_models:  # vLLM's /health: 200, empty
            return {}, None
        try:
            return r.json(), None
        except ValueError:
            return None, ProbeFault.UNHEALTHY

    async def probe(self, path: str) -> dict[tuple[str, str], dict[str, Any] | None]:
        """Every instance's answer to ``path`` (None where it gave none)."""
        assert self.pool is not None
        insts = self.pool.all()
        results = await asyncio.gather(*(self._probe_one(i, path) for i in insts))
        return {(i.info.role, i.url): body for i, (body, _) in zip(insts, results)}


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has closed its connection (the body was read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _chars(content: str | list[Any] | None) -> int:
    if content is None:
        return 0
    return len(content) if isinstance(content, str) else sum(len(p.text) for p in content)


async def _collect(gen: Generation) -> tuple[str, str | None]:
    parts, reason = [], None
    async for d in gen.deltas():
        parts.append(d.text)
        reason = d.finish_reason or reason
    return "".join(parts), reason


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChunkMaker:
    """Builds the response objects of one request, completion- or chat-shaped."""

    def __init__(self, chat: bool, rid: str, model: str):
        self.chat, self.rid, self.model = chat, rid, model
        self.created = int(time.time())
        #: A plain delta (text only) as the models dump it, built once: a stream sends one per token, on
        #: the router's one thread, and the models are costly to build and dump (a test holds the two equal).
        self._plain = self._delta_model("")
        self._plain_choice = self._plain["choices"][0]

    def opening(self) -> dict[str, Any] | None:
        if not self.chat:
            return None
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))]).dump()

    def delta(self, text: str, finish_reason: str | None = None, hawk: dict[str, Any] | None = None,
              usage: Usage | None = None) -> dict[str, Any]:
        if finish_reason is None and hawk is None and usage is None:
            choice = {**self._plain_choice, "delta": {"content": text} if text else {}} if self.chat else {**self._plain_choice, "text": text}
            return {**self._plain, "choices": [choice]}
        return self._delta_model(text, finish_reason, hawk, usage)

    def _delta_model(self, text: str, finish_reason: str | None = None, hawk: dict[str, Any] | None = None,
                     usage: Usage | None = None) -> dict[str, Any]:
        if self.chat:
            delta = Delta(content=text) if text else Delta()
            return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)], usage=usage, hawk=hawk).dump()
        return CompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage, hawk=hawk).dump()

    def usage(self, usage: Usage, hawk: dict[str, Any]) -> dict[str, Any]:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage, hawk=hawk).dump()

    def full(self, text: str, finish_reason: str | None, usage: Usage, hawk: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)], usage=usage, hawk=hawk).dump()
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage, hawk=hawk).dump()


# ============================================================================ request counting


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class CountRequests:
    """Pure ASGI middleware counting requests by endpoint and status (it never touches ``receive``,
    so it cannot interfere with disconnect detection or streaming)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        status = [500]

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()


# ============================================================================ factory


def create_router_app(cfg: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    """The router app; at startup it reads the instances' limits and (unless given) the tokenizer."""
    router = Router(cfg, tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.startup()
        try:
            yield
        finally:
            await router.shutdown()

    app = FastAPI(title="HAWK router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)
    app.add_middleware(LimitBody, limit=lambda: router.max_body_bytes)
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    app.add_middleware(RequireBearer, token=api_key, protected=lambda p: p.startswith("/v1/"), what="API key")
    app.add_middleware(CountRequests, metrics=router.metrics)  # last added = outermost: counts 401/413 too

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        router.check_model(req.model)
        ids = await asyncio.to_thread(router.completion_prompt, req.prompt)  # long prompts: keep the loop free
        params = router.sampling(req, len(ids), req.max_tokens, default_max=16)
        rid = new_id("cmpl")
        gen = router.new_generation(rid, ids, params, req.stop_list(), arrival, req.kv_transfer_params)
        return await router.run(request, gen, req.stream, ChunkMaker(False, rid, router.model_name), req.usage_report)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        router.check_model(req.model)
        ids = await asyncio.to_thread(router.chat_prompt, req)
        params = router.sampling(req, len(ids), req.requested_max_tokens, default_max=cfg.default_chat_max_tokens)
        rid = new_id("chatcmpl")
        gen = router.new_generation(rid, ids, params, req.stop_list(), arrival, req.kv_transfer_params)
        return await router.run(request, gen, req.stream, ChunkMaker(True, rid, router.model_name), req.usage_report)

    def card(name: str) -> ModelCard:
        assert router.pool is not None
        return ModelCard(id=name, max_model_len=router.pool.max_model_len, max_num_seqs=router.pool.max_num_seqs)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(n) for n in router.names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        router.check_model(model_id)
        return card(model_id).model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = router.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        res = await router.probe("/internal/accounting")
        coll = router.metrics.instances
        for key, raw in res.items():
            try:
                acct = None if raw is None else Accounting.model_validate(raw)
            except ValueError:  # another contract version: shown as down, not as a 500 here
                acct = None
            coll.up[key] = acct is not None
            if acct is not None:
                coll.snapshots[key] = acct.numbers()
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app

