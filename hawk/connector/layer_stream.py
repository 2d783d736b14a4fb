"""Where a layer-wise push meets the device: knowing that a layer's KV is written, and producing the
layer's send bytes beside the forward instead of behind it.

On CUDA the forward only enqueues work, so "layer l is done" is an event recorded on the forward's
stream when the engine passes layer l; the push worker makes a side stream wait for that event, runs
the layer's transform there (overlapping the next layers' compute) and waits for the side stream
alone before posting the layer's WRITE. On a CPU the forward has run by the time the engine passes
a layer, so there is nothing to wait for: the worker thread's transform overlaps the next layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


def mark(device: torch.device) -> Any:
    """A marker of everything enqueued so far on ``device``'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class SideStream:
    """Runs layer work after a marker, on a stream of its own (CUDA) or inline (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, marker: Any, work: Callable[[], None]) -> None:
        """``work`` after ``marker``; returns when its device work has finished."""
        if self.stream is None:
            work()
            return
        if marker is not None:
            self.stream.wait_event(marker)
        with torch.cuda.stream(self.stream):
            work()
        self.stream.synchronize()

    def after_current(self) -> None:
        """Order this stream after everything enqueued so far on the calling thread's stream (the
        forward's, when the forward's own thread posts a layer)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def written(self) -> DeviceWrite:
        """Completion of everything enqueued on this stream so far (writes a kernel made straight into a
        peer's memory: no transport handle tracks them)."""
        if self.stream is None:
            return DeviceWrite(None)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return DeviceWrite(ev)

    def current(self) -> contextlib.AbstractContextManager[Any]:
        """This stream as the calling thread's current one (and its device as the current device):
        a same-host transport's copies order themselves after the current stream, and the thread's
        default stream holds the whole forward enqueued so far, later layers included."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


class DeviceWrite:
    """Bytes a kernel writes straight into a peer's memory, done when ``event`` is (None: already done)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
