"""A served decode engine's steps, one JSON line each: what the step carried and how long it ran.

Why: a step probe times a step it builds (fresh chunks, one context length); a server's steps carry
what its load brings (chunks deep into their prompts, several prompts at once, rows at every
context). Fitting step time against rows and prompt tokens over the steps a server really ran says
what a served prompt token costs, which no probe can. Off unless ``HAWK_STEP_TRACE=FILE`` is set
in the engine's environment (each engine process appends to FILE, its pid in every line).

A line: ``{pid, rows, context, longest, prompt_tokens, chunks, spans, path, launch_ms, device_ms}``.
``context`` is the decode rows' cached tokens summed (their attention's reads), ``longest`` the most
one row has (one program streams a row's context alone past 16 rows); ``spans`` each chunk's ``[start,
q_len]`` (the prompt tokens cached before it, and its own); ``launch_ms`` the host time of the
runner's call; ``device_ms`` the time on the device between CUDA events recorded before and after
the step's launch (null off CUDA). With a step queued ahead, the first event waits behind the step
before, so ``device_ms`` is this step's run plus any gap while its launch was still under way.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

import torch

#: The environment variable naming the trace file.
ENV = "HAWK_STEP_TRACE"


@dataclass
class StepMark:
    """One step being traced: its start, and once launched, what it carried."""

    t0: float
    start: Any = None  # torch.cuda.Event or None
    end: Any = None
    launch_ms: float = 0.0
    fields: dict[str, Any] | None = None

    def launched(self, device: torch.device, **fields: Any) -> None:
        """The step's launch returned: close its host time and queue the event behind it."""
        self.launch_ms = 1e3 * (time.perf_counter() - self.t0)
        self.fields = fields
        if self.start is not None:
            with torch.cuda.device(device):
                self.end = torch.cuda.Event(enable_timing=True)
                self.end.record()


class StepTrace:
    """Appends one line per step to a file; the step loop's thread only (``write`` takes a lock so
    that a stop from another thread cannot interleave a close)."""

    def __init__(self, out: IO[str]) -> None:
        self._out, self._lock, self._pid = out, threading.Lock(), os.getpid()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(open(path, "a", buffering=1)) if path else None  # noqa: SIM115 - closed by close()

    def begin(self, device: torch.device) -> StepMark:
        """Before a step's launch."""
        mark = StepMark(time.perf_counter())
        if device.type == "cuda":
            with torch.cuda.device(device):
                mark.start = torch.cuda.Event(enable_timing=True)
                mark.start.record()
        return mark

    def write(self, mark: StepMark) -> None:
        """After the step's results were read (its end event has run, or is waited for here). A step
        the device failed is written without its time: tracing never fails a step."""
        device_ms = None
        if mark.start is not None and mark.end is not None:
            try:
                mark.end.synchronize()
                device_ms = round(mark.start.elapsed_time(mark.end), 4)
            except Exception:  # noqa: BLE001 - the step's own failure is reported where it is read
                device_ms = None
        line = {"pid": self._pid, **(mark.fields or {}), "launch_ms": round(mark.launch_ms, 4), "device_ms": device_ms}
        with self._lock:
            if not self._out.closed:
                self._out.write(json.dumps(line) + "\n")

    def close(self) -> None:
        with self._lock:
            self._out.close()
