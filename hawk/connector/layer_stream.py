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

from hawk.triton_launch import current_device_index


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

    def posting(self, marker: Any = None) -> contextlib.AbstractContextManager[Any]:
        """This stream, ordered after everything enqueued so far on the calling thread's stream (the
        forward's, when the forward's own thread posts a group of layers) or after ``marker`` (a CUDA
        event: a prefill graph's layer, whose replay is already launched), as that thread's current
        stream: what the forward's thread enters once per post, in one stream lookup and two switches
        (torch's stream context and a separate ``wait_stream`` took ~1.4x its host time on an H200 host:
        ``benchmarks/layer_post_probe.py``)."""
        return _Posting(self, marker) if self.stream is not None else contextlib.nullcontext()

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


class _Posting:
    """:meth:`SideStream.posting`'s context (CUDA). ``set_stream`` also makes the stream's device the
    current one, so a thread on another device is switched there and back with a device guard."""

    __slots__ = ("side", "marker", "prev", "guard")

    def __init__(self, side: SideStream, marker: Any = None) -> None:
        self.side, self.marker = side, marker

    def __enter__(self) -> None:
        dev = self.side.device
        self.prev = torch.cuda.current_stream(dev)
        if self.marker is None:
            self.side.stream.wait_stream(self.prev)
        else:
            self.side.stream.wait_event(self.marker)
        self.guard = torch.cuda.device(dev) if dev.index is not None and current_device_index() != dev.index else None
        if self.guard is not None:
            self.guard.__enter__()
        torch.cuda.set_stream(self.side.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.prev)
        if self.guard is not None:
            self.guard.__exit__(None, None, None)


class DeviceWrite:
    """Bytes a kernel writes straight into a peer's memory, done when ``event`` is (None: already done)."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
