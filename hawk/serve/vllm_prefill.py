"""A stock vLLM server (with HawkConnector) as the router's prefill instance.

The router speaks vLLM's P/D protocol to it, the one vllm-router speaks: the prompt's token ids as an
OpenAI completion with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``. vLLM's
answer carries HawkConnector's KV handle (hawk/integrations/vllm/params.py): the first token and where
the KV waits. That becomes the same PrefillResponse a HAWK prefill instance answers, so the rest of the
request's lifecycle (generation.py) does not change.

What vLLM does not offer, and what it means here: no /internal/info (the instance's identity is built
from /v1/models), no abort of a finished prefill (un-pulled KV goes back to vLLM at HawkConnector's TTL),
no tokenizer endpoint (the router takes the decode instance's tokenizer: serve the same model folder).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from hawk.engine.sequence import SamplingParams
from hawk.errors import BadUpstream
from hawk.integrations.vllm.params import read_handle
from hawk.serve.contract import InstanceInfo, KVRef, PrefillResponse

#: ``--prefill-api`` values: how the router talks to its prefill instances.
PREFILL_APIS = ("hawk", "vllm")


async def vllm_info(client: httpx.AsyncClient, url: str, timeout_s: float, vocab_size: int) -> InstanceInfo:
    """A vLLM server's identity as an InstanceInfo, from /v1/models (retried while it starts)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = await client.get(f"{url}/v1/models", timeout=5.0)
            r.raise_for_status()
            card = r.json()["data"][0]
            max_len = int(card["max_model_len"])
            return InstanceInfo.of(role="prefill", model=str(card["id"]), transfer="vllm", transport=None, device="vllm",
                                   max_prompt_tokens=max_len - 1, max_model_len=max_len, vocab_size=vocab_size)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server {url} did not answer /v1/models within {timeout_s:.0f}s: {e!r}") from None
            await asyncio.sleep(0.5)


def prefill_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The P/D prefill request: one token, the KV kept for a remote decode."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt_ids, "max_tokens": 1, "stream": False,
        "temperature": params.temperature, "top_p": params.top_p,
        "kv_transfer_params": {"do_remote_decode": True}, "return_token_ids": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.ignore_eos:
        body["ignore_eos"] = True
    return body


class EndedAtPrefill(Exception):
    """The prefill's first token ended the request (an end token): there is nothing to decode."""

    def __init__(self, token: int):
        super().__init__(f"the request ended at its first token {token}")
        self.token = token


def prefill_response(request_id: str, answer: dict[str, Any], who: str, prefill_s: float) -> PrefillResponse:
    """vLLM's answer as the router's PrefillResponse; a missing handle is the server's fault (no HawkConnector).
    Raises EndedAtPrefill when vLLM stopped the request at its first token (it keeps no KV then)."""
    try:
        handle = read_handle(answer.get("kv_transfer_params"))
    except ValueError as e:
        raise BadUpstream(f"{who}: {e}") from None
    if handle is None:
        choice = (answer.get("choices") or [{}])[0]
        reason, ids = choice.get("finish_reason"), choice.get("token_ids") or []
        if reason == "stop" and len(ids) == 1:
            raise EndedAtPrefill(int(ids[0]))
        raise BadUpstream(f"{who} answered no HAWK KV handle (finish_reason {reason!r}): is it running HawkConnector as a kv_producer?")
    return PrefillResponse.of(request_id=request_id, first_token=handle.first_token, num_prompt_tokens=handle.num_tokens,
                              kv=KVRef(address=handle.address, request_id=handle.request_id), timings={"prefill_s": prefill_s})
