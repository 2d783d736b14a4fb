"""Waiting for a condition the system reaches on its own (a release, a queue that drains), in tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_until(what: Callable[[], Any], timeout_s: float, why: str | Callable[[], str]) -> float:
    """Poll ``what()`` until truthy, failing the test with ``why`` after ``timeout_s``; returns how long it took.
    ``why`` may be a callable, read at the failure (the state that was still wrong)."""
    t0 = time.monotonic()
    while not what():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{why() if callable(why) else why}: not within {timeout_s}s")
        time.sleep(0.05)
    return time.monotonic() - t0
