"""The one place a named fault becomes an HTTP status: ``STATUS`` and :func:`http_error`.

Every server installs a handler that answers a :class:`~hawk.errors.HawkError` through this
table, as OpenAI's ``{"error": {...}}``; the router also maps an instance's error code back to
its class (``from_code``), so a fault keeps its name across the hop.
"""

from __future__ import annotations

from hawk.errors import (
    Aborted,
    BadRequest,
    BadUpstream,
    ContractMismatch,
    DuplicateRequest,
    EngineFailure,
    EngineUnavailable,
    HawkError,
    PromptTooLong,
    UnknownKV,
)
from hawk.serve.protocol import OpenAIError

CLIENT_CLOSED = 499  # nginx's "client closed request"

#: fault -> (HTTP status, OpenAI error type, OpenAI error code). Most specific class first.
STATUS: dict[type[HawkError], tuple[int, str, str | None]] = {
    PromptTooLong: (400, "invalid_request_error", "context_length_exceeded"),
    UnknownKV: (400, "invalid_request_error", "unknown_kv"),
    BadRequest: (400, "invalid_request_error", None),
    ContractMismatch: (400, "invalid_request_error", "contract_mismatch"),
    DuplicateRequest: (409, "invalid_request_error", "duplicate_request_id"),
    Aborted: (CLIENT_CLOSED, "invalid_request_error", "aborted"),
    EngineUnavailable: (503, "server_error", "instance_unavailable"),
    BadUpstream: (502, "server_error", "bad_upstream"),
    EngineFailure: (500, "server_error", "engine_failure"),
}


def status_of(exc: HawkError) -> tuple[int, str, str | None]:
    """The table's row for ``exc``'s class or its nearest listed base; unlisted faults are 500s."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]  # type: ignore[index]
    return 500, "server_error", None


def http_error(exc: HawkError) -> OpenAIError:
    status, kind, code = status_of(exc)
    return OpenAIError(status, str(exc), kind, code)


def from_code(code: str | None, message: str) -> HawkError | None:
    """The fault an instance reported by its error code, or None for a code not in the table."""
    for cls, (_, _, c) in STATUS.items():
        if c is not None and c == code:
            return cls(message)
    return None
