"""The "prompt plus first token" P/D handoff between a vLLM prefill and a vLLM decode (both HawkConnector):
the requests a client-driven P/D (a router, a proxy, the benchmark) sends, and the answer its client sees.

Why not vLLM's standard handoff (the decode gets the original prompt): a vLLM decode that loads a whole
prompt recomputes its last token with the one-token decode step to sample the first token again
(scheduler_half.py), and that step rounds differently from the prefill step one instance ran there, so
greedy outputs can part at a near-tie. In this form the decode's prompt is the prefill's prompt plus the
first token the prefill sampled: the decode loads the prompt's KV, computes the first token as a one-token
step and samples the second, which is what one instance does after its prefill.

    prefill:  prefill_request(body)                -> POST /v1/completions (max_tokens 1, do_remote_decode)
    then:     after_prefill(body, answer)          -> Done (the prefill's answer is the whole answer) or
              Continue(decode body, first token's text, ...)
    decode:   POST continue.body                   -> the decode's answer; the client sees
              continue.answer(decode_answer)          (or continue.text / continue.usage when streaming)

The prompt's token ids come back in the prefill's answer (vLLM's ``return_token_ids``, which chat
completions answer too), so the KV handle needs not carry them and a router with a chat request can
build the decode as a completion over token ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hawk.errors import BadUpstream
from hawk.integrations.vllm.params import KVHandle, read_handle

#: vLLM's finish reason of a request that stopped at max_tokens: the only prefill that leaves KV behind.
LENGTH = "length"
#: vLLM 0.32's completion default for a request without max_tokens.
DEFAULT_MAX_TOKENS = 16


def max_tokens(body: Mapping[str, Any]) -> int:
    return int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)


def standard_only(body: Mapping[str, Any]) -> list[str]:
    """Why a request cannot keep one instance's output in the prompt+first-token form (empty: it can).

    The first token moves from the output into the prompt, so what vLLM computes over the output alone
    would change: frequency and presence penalties (over output tokens), a stop string spanning the first
    and the second token (vLLM matches stop strings in the output text), several choices (one first token
    each), echo and logprobs (the answer would need the prefill's part merged in)."""
    why = []
    if int(body.get("n") or 1) != 1 or int(body.get("best_of") or 1) != 1:
        why.append("several choices")
    if body.get("frequency_penalty") or body.get("presence_penalty"):
        why.append("frequency or presence penalty")
    stop = body.get("stop") or []
    if any(len(s) > 1 for s in ([stop] if isinstance(stop, str) else stop)):
        why.append("a stop string of more than one character")
    if body.get("echo") or body.get("logprobs") is not None or body.get("prompt_logprobs") is not None:
        why.append("echo or logprobs")
    return why


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill's request: the client's, one token, the KV kept for a remote decode, the ids returned.

    A client asking for one token gets its answer here: no KV is kept for it."""
    out = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True}
    out.pop("stream_options", None)
    if body.get("min_tokens"):
        out["min_tokens"] = 1  # vLLM refuses min_tokens above max_tokens; the decode keeps the rest
    if max_tokens(body) > 1:
        out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


@dataclass(frozen=True)
class Done:
    """The prefill's answer is the whole answer: its first token ended the request (an end token, a stop
    string, one token asked for), so there is nothing to decode. The prefill kept no KV, except after a
    stop string: vLLM's front end matches those after its engine finished the request by length, so
    HawkConnector holds that KV until its TTL (``answer`` then still carries the handle)."""

    answer: dict[str, Any]


@dataclass(frozen=True)
class Continue:
    """The decode's request, and what the client sees before and after it."""

    body: dict[str, Any]  # the decode's /v1/completions request
    handle: KVHandle
    first_text: str  # the first token's text: the prefill's answer, the client's first output
    prompt_token_ids: tuple[int, ...]  # the client's prompt (the decode's prompt without the first token)

    @property
    def first_token(self) -> int:
        return self.handle.first_token

    def text(self, decode_text: str) -> str:
        """The client's text: the first token's, then the decode's (whose first token is the second)."""
        return self.first_text + decode_text

    def usage(self, decode_usage: Mapping[str, Any]) -> dict[str, Any]:
        """The client's usage: the decode counted the first token as a prompt token."""
        out = dict(decode_usage)
        out["prompt_tokens"] = int(decode_usage["prompt_tokens"]) - 1
        out["completion_tokens"] = int(decode_usage["completion_tokens"]) + 1
        return out

    def answer(self, decode_answer: Mapping[str, Any]) -> dict[str, Any]:
        """The client's whole (non-streamed) completion, from the decode's."""
        out = dict(decode_answer)
        choices = []
        for c in decode_answer.get("choices") or []:
            c = {**c, "text": self.text(c.get("text") or "")}
            if c.get("token_ids") is not None:
                c["token_ids"] = [self.first_token, *c["token_ids"]]
            if c.get("prompt_token_ids") is not None:
                c["prompt_token_ids"] = list(self.prompt_token_ids)
            choices.append(c)
        out["choices"] = choices
        if decode_answer.get("usage"):
            out["usage"] = self.usage(decode_answer["usage"])
        out.pop("kv_transfer_params", None)
        return out


def after_prefill(body: Mapping[str, Any], answer: Mapping[str, Any]) -> Done | Continue:
    """What follows the prefill's answer to ``prefill_request(body)``: Done, or the decode's request.

    Raises BadUpstream when the prefill answered no KV handle for a request it stopped at max_tokens
    (a prefill without HawkConnector as a producer), or ids that disagree with its handle."""
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise BadUpstream(f"the prefill answered {len(choices)} choices; the P/D handoff continues one")
    choice = choices[0]
    if choice.get("finish_reason") != LENGTH or max_tokens(body) <= 1:
        return Done(dict(answer))
    handle = read_handle(answer.get("kv_transfer_params"))
    if handle is None:
        raise BadUpstream("the prefill answered no HAWK KV handle: is it running HawkConnector as a kv_producer?")
    prompt, out = choice.get("prompt_token_ids"), choice.get("token_ids")
    if prompt is None or out is None:
        raise BadUpstream("the prefill answered no token ids: it must be asked with return_token_ids (prefill_request)")
    check_ids(handle, prompt, out)
    decode = {k: v for k, v in body.items() if k != "prompt"}
    decode["prompt"] = [*map(int, prompt), handle.first_token]
    decode["max_tokens"] = max_tokens(body) - 1
    if body.get("min_tokens"):
        decode["min_tokens"] = int(body["min_tokens"]) - 1
    decode["kv_transfer_params"] = answer["kv_transfer_params"]
    return Continue(decode, handle, choice.get("text") or "", tuple(map(int, prompt)))


def check_ids(handle: KVHandle, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
    """The prefill's ids are its handle's: the prompt's length and the one token it sampled."""
    if len(prompt_token_ids) != handle.num_tokens or list(output_token_ids) != [handle.first_token]:
        raise BadUpstream(f"the prefill's answer ({len(prompt_token_ids)} prompt ids, output {list(output_token_ids)[:4]}) "
                          f"disagrees with its KV handle ({handle.num_tokens} tokens, first token {handle.first_token})")

