"""The router <-> instance contract: every internal HTTP message, typed and versioned, defined once.

Both ends use these models: instances validate what the router sends (FastAPI parses the body
into the model) and build their answers from them; the router builds its requests from them and
validates every answer and stream line with :func:`receive`. Each message carries ``version``;
a message of another version, or one missing a field, is refused with a sentence that says so
(a 400 at an instance, a 502 ``bad_upstream`` at the router), never a ``KeyError`` later.

Routes (all under a cluster secret when one is set):

  POST /internal/prefill       PrefillRequest  -> PrefillResponse
  POST /internal/abort         AbortRequest    -> PrefillAbortReply
  POST /internal/decode        DecodeRequest   -> NDJSON stream of TokenLine
  POST /internal/decode_abort  AbortRequest    -> DecodeAbortReply
  GET  /internal/info          InstanceInfo
  GET  /internal/accounting    Accounting
  GET  /health                 Health (503 when an engine thread has died)

Sampling parameters travel as ``SamplingParams.to_dict()``; the engine's ``from_dict`` checks them.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hawk.errors import BadUpstream

#: Bump when a message changes shape; both ends must agree exactly.
CONTRACT_VERSION = 1

Role = Literal["prefill", "decode", "colocated"]
M = TypeVar("M", bound="Message")


class Message(BaseModel):
    """A top-level contract message: strict about its fields and its version."""

    model_config = ConfigDict(extra="forbid")

    version: int

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != CONTRACT_VERSION:
            raise ValueError(
                f"contract version {v} is not this side's {CONTRACT_VERSION}: the router and the instances "
                "run different HAWK versions; start them from the same install"
            )
        return v

    @classmethod
    def of(cls: type[M], **fields: Any) -> M:
        """A message of this side's version (what senders build)."""
        return cls(version=CONTRACT_VERSION, **fields)


class KVRef(BaseModel):
    """Where a prefilled request's KV waits: the prefill's KV control address and the id there."""

    model_config = ConfigDict(extra="forbid")

    address: str
    request_id: str


class PrefillRequest(Message):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class PrefillResponse(Message):
    request_id: str
    first_token: int
    num_prompt_tokens: int
    kv: KVRef
    timings: dict[str, float] = Field(default_factory=dict)  # queue_s, prefill_s


class DecodeRequest(Message):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_len: int = Field(ge=1)
    first_token: int = Field(ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    kv: KVRef


class TokenLine(Message):
    """One line of the decode stream: a token, and on the last line why it finished. ``info``
    (on the first line) carries the KV transfer's time and bytes; ``error`` explains
    finish_reason "error"."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    info: dict[str, Any] | None = None


class AbortRequest(Message):
    request_id: str


class PrefillAbortReply(Message):
    request_id: str
    result: Literal["cancelled", "discarded", "pending", "unknown"]


class DecodeAbortReply(Message):
    request_id: str
    aborted: bool


class InstanceInfo(Message):
    """An instance's identity and the limits the router checks requests against."""

    role: Role
    model: str
    transfer: str
    transport: str | None
    device: str
    device_label: str | None = None
    kv_address: str | None = None  # prefill and colocated
    arch: str | None = None  # decode on an NPU
    kv_dtype: str | None = None
    emulated_npu: bool = False
    max_prompt_tokens: int | None = None  # prefill and colocated
    max_model_len: int
    max_kv_tokens: int | None = None  # decode and colocated
    vocab_size: int


class Health(Message):
    status: Literal["ok", "engine_dead"]
    role: Role
    dead: list[str] = Field(default_factory=list)


class Accounting(Message):
    """What an instance holds (reservations, blocks, abort counts); the keys differ by role, so
    they are open, and every number becomes a gauge in the router's /metrics."""

    model_config = ConfigDict(extra="allow")

    role: Role

    def numbers(self) -> dict[str, Any]:
        """The accounting itself, without the envelope."""
        return self.model_dump(exclude={"version", "role"})


def receive(model: type[M], data: str | bytes, who: str) -> M:
    """Parse an instance's answer as ``model``; a broken one is the instance's fault (502)."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise BadUpstream(f"{who} answered a malformed {model.__name__} ({where}: {first.get('msg')})") from None
