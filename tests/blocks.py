"""Waiting for an engine's KV blocks to come back, as the engine tests check they do."""

from __future__ import annotations

import time
from typing import Any


def blocks_back(inst: Any, timeout_s: float) -> bool:
    """Whether every block of ``inst.blocks`` is free within ``timeout_s``. Overlapped steps free a
    finished request's blocks only once the step launched before its end was read is done, which can
    be a moment after its last token reached the client."""
    deadline = time.monotonic() + timeout_s
    while inst.blocks.num_free != inst.blocks.num_blocks and time.monotonic() < deadline:
        time.sleep(0.005)
    return inst.blocks.num_free == inst.blocks.num_blocks
