"""Host staging for the ``*-host`` baselines: device -> (pinned) host -> peer host -> device.

The paper's host-staged baselines move KV through host memory on both sides. A :class:`HostMirror`
owns a host buffer the size of a device region; the connector registers ``mirror.host`` with the
transport, stages with ``to_host`` before a peer pulls (or after a push lands, ``to_device``), and
calls ``synchronize`` before the bytes are used. The host buffer is pinned when CUDA is available so
that the copies are asynchronous DMA at full host<->device bandwidth.

For a CPU "device" the device bytes already are host memory: by default the mirror aliases them and
the copies are no-ops (``copy_on_cpu=True`` gives a separate buffer and real memcpys, to emulate the
extra copy's cost).
"""

from __future__ import annotations

import torch

from hawk.transport.base import byte_view


class HostMirror:
    """A host copy of one device region, with async copies in both directions."""

    def __init__(self, device_tensor: torch.Tensor, *, pin: bool | None = None, copy_on_cpu: bool = False) -> None:
        if not device_tensor.is_contiguous():
            raise ValueError("HostMirror needs a contiguous device tensor")
        self.device_bytes = byte_view(device_tensor)
        self.nbytes = self.device_bytes.numel()
        self.device = device_tensor.device
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._events: list[torch.cuda.Event] = []
        if self.device.type == "cpu" and not copy_on_cpu:
            self.host = self.device_bytes  # aliasing: staging costs nothing on a CPU device
            self.aliased = True
        else:
            pin = torch.cuda.is_available() if pin is None else pin
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
            self.aliased = False

    def _range(self, offset: int, length: int | None) -> slice:
        n = self.nbytes - offset if length is None else length
        if offset < 0 or n <= 0 or offset + n > self.nbytes:
            raise ValueError(f"offset={offset} length={length} outside the mirrored {self.nbytes} bytes")
        return slice(offset, offset + n)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.aliased:
            return
        if self._stream is None:
            dst.copy_(src)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # see what earlier kernels wrote
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        self._events.append(ev)

    def to_host(self, offset: int = 0, length: int | None = None) -> None:
        """Start copying device[offset:+length] into the host buffer (async on CUDA)."""
        r = self._range(offset, length)
        self._copy(self.host[r], self.device_bytes[r])

    def to_device(self, offset: int = 0, length: int | None = None) -> None:
        """Start copying host[offset:+length] back into the device region (async on CUDA)."""
        r = self._range(offset, length)
        self._copy(self.device_bytes[r], self.host[r])

    def done(self) -> bool:
        """Whether every copy started so far has finished."""
        self._events = [e for e in self._events if not e.query()]
        return not self._events

    def synchronize(self) -> None:
        """Block until every copy started so far has finished (call before using either side)."""
        for e in self._events:
            e.synchronize()
        self._events.clear()
