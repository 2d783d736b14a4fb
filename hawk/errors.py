"""Faults with names, raised where they are found; the serving layer maps each class to an HTTP
status in one table (``hawk/serve/errors.py``) instead of reading exception types or message text.

They subclass ``ValueError`` / ``RuntimeError`` where callers already catch those, so a component
can start raising them without breaking anyone. This module imports nothing: every layer may
raise them.
"""

from __future__ import annotations


class HawkError(Exception):
    """Base of the named faults."""


class BadRequest(HawkError, ValueError):
    """The caller sent something this component refuses (a bad id, bad parameters)."""


class PromptTooLong(BadRequest):
    """The prompt (or prompt + output) does not fit a limit of this instance."""


class DuplicateRequest(HawkError, ValueError):
    """A request id that is already in use here (being prefilled, holding KV, being decoded)."""


class UnknownKV(BadRequest):
    """No KV is held here under the id the caller named (never prefilled, pulled, or expired)."""


class Aborted(HawkError):
    """The request was aborted (its client went away) before it finished."""


class EngineUnavailable(HawkError, RuntimeError):
    """An engine or instance that the request needs is down, restarting or unreachable."""


class EngineFailure(HawkError, RuntimeError):
    """The engine failed this request (its forward, sampling or handoff raised); the instance
    keeps serving the others. The original exception is its ``__cause__``."""


class ContractMismatch(HawkError, ValueError):
    """A router <-> instance message of another contract version, or missing what it must carry."""


class BadUpstream(HawkError, RuntimeError):
    """An instance answered something that breaks the contract (the router's view)."""


def first_problem(e: Exception, default_where: str) -> str:
    """``where: what`` of a validation error's first problem (a pydantic ``ValidationError``, read by shape so
    this module stays import-free), for messages that name the field a peer or a user got wrong."""
    first = e.errors()[0]  # type: ignore[attr-defined]
    where = ".".join(str(p) for p in first.get("loc", ())) or default_where
    return f"{where}: {first.get('msg')}"
