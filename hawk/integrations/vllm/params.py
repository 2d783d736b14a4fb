"""What HawkConnector puts into vLLM's ``kv_transfer_params`` and reads back: the one process boundary of
vLLM's P/D protocol that HAWK does not own.

vLLM carries these dicts through its OpenAI API; a P/D router (vllm-router, HAWK's router, a proxy)
sends the prefill ``{"do_remote_decode": true}`` with ``max_tokens: 1`` and copies the prefill's answer
verbatim into the decode's request. The prefill's answer is ``{"do_remote_prefill": true, "hawk":
KVHandle}``: where the request's KV waits and under which id, so any decode that speaks HAWK's
Algorithm 1 (a vLLM instance with HawkConnector, or HAWK's own NPU decode) can pull it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hawk.errors import BadRequest, first_problem

#: Bump when KVHandle changes shape; a prefill and a decode of different versions refuse each other.
HANDLE_VERSION = 1
HAWK_KEY = "hawk"


class KVHandle(BaseModel):
    """A prefilled request's KV on a vLLM prefill instance: pull it from ``address`` as ``request_id``."""

    model_config = ConfigDict(extra="forbid")

    version: int
    address: str = Field(min_length=1)  # the prefill worker's KV control socket (Algorithm 1's D1 goes there)
    request_id: str = Field(min_length=1, max_length=512)  # vLLM's internal request id: the key over there
    num_tokens: int = Field(ge=1)  # prompt tokens whose KV waits (the generated token's KV was never computed)
    first_token: int = Field(ge=0)  # the token the prefill sampled: a HAWK decode emits it first
    transfer: str  # the transfer configuration the prefill sends in (e.g. gn-hawk, gg-direct)

    @field_validator("version")
    @classmethod
    def _same_version(cls, v: int) -> int:
        if v != HANDLE_VERSION:
            raise ValueError(f"HAWK KV handle version {v} is not this side's {HANDLE_VERSION}: run the same HAWK on both sides")
        return v


class Handoff(enum.Enum):
    """How a decode request continues a prefilled one (scheduler_half.py says what vLLM computes in each)."""

    STANDARD = "standard"  # the prefill's prompt: vLLM's P/D protocol (the decode recomputes the last prompt token)
    PROMPT_PLUS_FIRST_TOKEN = "prompt+first-token"  # the prompt and the prefill's first token: nothing recomputed


def handoff_form(handle: KVHandle, prompt_token_ids: Sequence[int]) -> Handoff | None:
    """Which form a decode request's prompt takes against its handle; None when it continues neither
    (another prompt: the handle's KV is not this prompt's)."""
    n = len(prompt_token_ids)
    if n == handle.num_tokens:
        return Handoff.STANDARD
    if n == handle.num_tokens + 1 and int(prompt_token_ids[-1]) == handle.first_token:
        return Handoff.PROMPT_PLUS_FIRST_TOKEN
    return None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """Whether a prefill request asks to keep its KV for a remote decode (vLLM's P/D flag)."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


def handoff_params(handle: KVHandle) -> dict[str, Any]:
    """The prefill's ``kv_transfer_params`` answer, in the shape P/D routers copy to the decode."""
    return {"do_remote_prefill": True, "do_remote_decode": False, HAWK_KEY: handle.model_dump()}


def read_handle(params: dict[str, Any] | None) -> KVHandle | None:
    """The KV handle a decode request carries, None when it carries none (a plain request).

    Raises BadRequest for a handle that is there but malformed or of another version."""
    if not params or not params.get("do_remote_prefill"):
        return None
    raw = params.get(HAWK_KEY)
    if raw is None:
        return None
    try:
        return KVHandle.model_validate(raw)
    except ValidationError as e:
        raise BadRequest(f"malformed HAWK KV handle in kv_transfer_params ({first_problem(e, HAWK_KEY)})") from None
