"""The OpenAI wire format HAWK's router speaks: requests, responses, streaming chunks and errors.

Only what a serving system needs is modelled. Fields clients commonly send but HAWK cannot honour
(``n > 1``, logprobs, tools, penalties) are rejected with a 400 that names them instead of being
silently ignored, so a client never believes it got something it did not. Unknown extra fields are
ignored, as OpenAI-compatible servers usually do. Types are strict, as OpenAI's are: ``"0.5"`` is not a
temperature nor ``"true"`` a boolean nor ``16.0`` a token count (a 400 naming the field), so a client
bug is found here rather than by a server that guessed.
"""

from __future__ import annotations

import json
import time
import uuid
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI's limits, kept so a request valid there is valid here.
MAX_STOP_STRINGS = 16
TEMPERATURE_MAX = 2.0
# Seeds must fit a 64-bit integer, signed or unsigned: [-2**63, 2**64). Engines seed their
# generators from it, and a larger value would fail there, after the request was accepted.
SEED_MIN, SEED_MAX_EXCLUSIVE = -(2**63), 2**64


class OpenAIError(Exception):
    """An error the client should see as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


class Unauthorized(OpenAIError):
    """Missing or wrong credentials (the router's API key, or the cluster secret internally)."""

    def __init__(self, message: str):
        super().__init__(401, message, "authentication_error", code="invalid_api_key")


class RequestTooLarge(OpenAIError):
    """A request body over the configured limit, refused before it is parsed."""

    def __init__(self, size: int | None, limit: int):
        got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        super().__init__(413, f"request body too large: {got}, the limit is {limit} bytes (see --max-body-mb)", code="request_too_large")


class InstanceDown(OpenAIError):
    """An engine instance the request needs is down (crashed, restarting, or unreachable)."""

    def __init__(self, message: str):
        super().__init__(503, message, "server_error", code="instance_unavailable")


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


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> dict[str, Any]:  # noqa: A002
    """OpenAI's error shape; clients (the ``openai`` package included) read ``error.message``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def find_lone_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """Where a string in a parsed JSON value holds a lone surrogate (``"\\ud800"`` is valid
    JSON but not Unicode text): the path and the code point, or None.

    Such a string cannot be tokenized or encoded as UTF-8, so it is refused up front (a 400)
    instead of failing deep inside the tokenizer (a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path or "body", ord(value[e.start])
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
        hit = find_lone_surrogate(k, where) if isinstance(k, str) else None
        hit = hit or find_lone_surrogate(v, where)
        if hit:
            return hit
    return None


# ============================================================================ requests


#: What every request model shares: OpenAI's strict typing (no string-to-number coercion).
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    #: vLLM's extension: with ``include_usage``, every chunk carries the usage so far, so a client can
    #: count tokens where one chunk holds several (text held back until its UTF-8 bytes are whole).
    continuous_usage_stats: bool = False


class UsageReport(Enum):
    """Where a stream reports its token usage."""

    NONE = "none"
    FINAL = "final"  # a usage-only chunk before [DONE] (OpenAI's include_usage)
    EVERY_CHUNK = "every_chunk"  # and on every chunk (vLLM's continuous_usage_stats)


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # optional: the one served model is the default
    temperature: float | None = Field(default=None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions, handy for benchmarks (fixed output lengths) and chat stops.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's P/D protocol: a P/D router (vllm-router) sends the decode the prefill's KV handle here.
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        hit = find_lone_surrogate(data)
        if hit:
            where, cp = hit
            raise ValueError(
                f"{where} contains a lone surrogate (U+{cp:04X}), which is not valid Unicode text: "
                "send characters outside the BMP as a surrogate pair or as UTF-8"
            )
        return data

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v < SEED_MAX_EXCLUSIVE:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) (a 64-bit value), got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n} is not supported: HAWK returns exactly one choice per request (send n=1 or omit it)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingFields:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by HAWK (send 0 or omit it)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by HAWK")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def usage_report(self) -> UsageReport:
        o = self.stream_options
        if o is None or not o.include_usage:
            return UsageReport.NONE
        return UsageReport.EVERY_CHUNK if o.continuous_usage_stats else UsageReport.FINAL


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by HAWK")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported by HAWK")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported: HAWK samples one sequence")
        if self.suffix:
            raise ValueError("suffix is not supported by HAWK")
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], (str, list)) and len(p) != 1:
                raise ValueError(f"batched prompts ({len(p)} prompts) are not supported: send one prompt per request")
        return self


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... go to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs is not supported by HAWK")
        if self.tools:
            raise ValueError("tools (function calling) are not supported by HAWK")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r} is not supported by HAWK (only 'text')")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


# ============================================================================ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Response(BaseModel):
    """Base of every response body: ``dump`` leaves out the optional top-level extras when unset."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    hawk: dict[str, Any] | None = None  # HAWK's per-request timings (TTFT, TPOT, KV transfer)

    def dump(self) -> dict[str, Any]:
        """JSON-ready dict in OpenAI's key order, without unset ``usage`` / ``hawk``."""
        d = self.model_dump(mode="json")
        order = ["id", "object", "created", "model", "choices", "usage", "hawk"]
        out = {k: d[k] for k in order if k in d and not (k in ("usage", "hawk") and d[k] is None)}
        out.update({k: v for k, v in d.items() if k not in order})
        return out


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]

    def dump(self) -> dict[str, Any]:
        d = super().dump()
        for c in d["choices"]:  # unset delta fields are left out; the finishing delta is {}
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        return d


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hawk"
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # HAWK's own field: a decode instance's --max-num-seqs (the smallest, with several)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
