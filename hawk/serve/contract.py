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
                               (with ``subscriber``: DecodeAccepted; the lines go to that stream)
  GET  /internal/decode_events?subscriber=S  -> NDJSON stream of TokenLine, each with its request_id
  POST /internal/first_token   FirstToken      -> FirstTokenReply   (kv_flow=layerwise only)
  POST /internal/decode_abort  AbortRequest    -> DecodeAbortReply
  GET  /internal/info          InstanceInfo
  GET  /internal/accounting    Accounting
  GET  /health                 Health (503 when an engine thread has died)

Sampling parameters travel as ``SamplingParams.to_dict()``; the engine's ``from_dict`` checks them.

Two KV flows (``kv_flow``, hawk/config.py), one set of messages; hawk/serve/generation.py states the
request's lifecycle in each. ``pull``: PrefillRequest, then a DecodeRequest carrying the prefill's
first token and KV handle. ``layerwise`` (decode first): a DecodeRequest without a first token,
naming the prefill that will push the KV; the decode's stream opens with a ``handed`` line once its
blocks are reserved and sent to that prefill as the push destination; then the PrefillRequest; then
FirstToken hands the prefill's first token to the decode, whose stream continues as in pull mode.

Shared decode streams (the router's ``decode_stream="shared"``): one router process opens one event
stream per decode instance and names it (``subscriber``) in each DecodeRequest, so a decode step's tokens
for all of that router's requests leave in one write instead of one per request. Closing that stream
aborts every request of it still running, as closing a request's own stream does; a client that leaves
is an AbortRequest with ``client_gone``.

Version history: 3 added the shared decode stream (``DecodeRequest.subscriber``, ``TokenLine.request_id``,
DecodeAccepted, ``AbortRequest.client_gone``). 2 added ``kv_flow`` (PrefillRequest, DecodeRequest, InstanceInfo),
``TokenLine.handed``, FirstToken/FirstTokenReply, and made ``DecodeRequest.first_token`` optional
(required in pull mode, refused in layer-wise mode).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hawk.errors import BadUpstream, first_problem

#: Bump when a message changes shape; both ends must agree exactly.
CONTRACT_VERSION = 3

Role = Literal["prefill", "decode", "colocated"]
#: How a request's KV reaches the decode (hawk/config.py ``kv_flow``): pulled after prefill, or
#: pushed layer by layer into blocks the decode handed over before prefill.
KVFlow = Literal["pull", "layerwise"]
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
    """Where a request's KV is: the prefill's KV control address and the request's id there (pull:
    where the prefilled KV waits; layer-wise: the prefill that will push it)."""

    model_config = ConfigDict(extra="forbid")

    address: str
    request_id: str


class PrefillRequest(Message):
    """``kv_flow="layerwise"``: a decode has sent this prefill a push destination for this request
    (held here, or about to arrive), so a prefill that fails or is refused must release it (not leave
    it to the TTL)."""

    request_id: str = Field(min_length=1, max_length=256)
    prompt_ids: list[int] = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    kv_flow: KVFlow = "pull"


class PrefillResponse(Message):
    request_id: str
    first_token: int
    num_prompt_tokens: int
    kv: KVRef
    timings: dict[str, float] = Field(default_factory=dict)  # queue_s, prefill_s


class DecodeRequest(Message):
    """Pull: the prefill's ``first_token`` and where its KV waits (``kv``). Layer-wise: no first token
    yet (it comes as :class:`FirstToken`); ``kv`` names the prefill that will push the KV."""

    request_id: str = Field(min_length=1, max_length=256)
    prompt_len: int = Field(ge=1)
    first_token: int | None = Field(default=None, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)
    kv: KVRef
    kv_flow: KVFlow = "pull"
    subscriber: str | None = Field(default=None, min_length=1, max_length=128)  # a shared stream's name

    @model_validator(mode="after")
    def _first_token_matches_the_flow(self) -> DecodeRequest:
        if self.kv_flow == "pull" and self.first_token is None:
            raise ValueError("first_token is required with kv_flow 'pull' (the prefill ran first)")
        if self.kv_flow == "layerwise" and self.first_token is not None:
            raise ValueError("first_token must be left out with kv_flow 'layerwise' (it is sent later, as FirstToken)")
        return self


class TokenLine(Message):
    """One line of the decode stream: a token, and on the last line why it finished. ``info``
    (on the first token's line) carries the KV transfer's time and bytes; ``error`` explains
    finish_reason "error". Layer-wise only, the stream opens with a line of just ``handed``: the
    decode's blocks are reserved and on their way to the prefill as its push destination, so the
    prefill may start."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    info: dict[str, Any] | None = None
    handed: bool | None = None
    request_id: str | None = None  # on a shared stream: whose line it is


class DecodeAccepted(Message):
    """A DecodeRequest naming a shared stream was admitted: its lines come on that stream."""

    request_id: str


class FirstToken(Message):
    """Layer-wise: the prefill's first token for a request the decode admitted first; the decode
    emits it once the pushed KV has landed."""

    request_id: str = Field(min_length=1, max_length=256)
    token: int = Field(ge=0)


class FirstTokenReply(Message):
    """``accepted`` is False when the request no longer waits for a first token here (it ended,
    was aborted, or was never admitted): its decode stream says why."""

    request_id: str
    accepted: bool


class AbortRequest(Message):
    """``client_gone``: the decode counts it as the client's disconnect (closing a request's own
    stream says the same); else the router ends it (a stop string)."""

    request_id: str
    client_gone: bool = False


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
    max_num_seqs: int | None = None  # decode and colocated: the most sequences one decode step runs (--max-num-seqs)
    staging_bytes: int | None = None  # prefill: its KV staging buffer (P4), where a pull's KV waits for D9
    vocab_size: int
    kv_flow: KVFlow = "pull"  # colocated moves no KV: always "pull"


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
        raise BadUpstream(f"{who} answered a malformed {model.__name__} ({first_problem(e, 'body')})") from None
