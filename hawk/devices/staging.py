"""Per-step metadata from host to device: pinned twins of device buffers, uploaded without stalls.

A decode step writes its metadata (block tables, lengths, slots, token ids) on the host and copies
it into device buffers whose addresses a captured CUDA graph has baked in. The host side must not
stall the GPU (``torch.as_tensor(..., device="cuda")`` synchronizes) and must not rewrite a pinned
buffer whose copy has not run yet. Here each device buffer has a pinned twin per slot; slots
rotate, and a slot is written again only once the copy that last read it has run (two steps ago
with two slots: normally long done, so the wait costs nothing).

On CUDA the copies and the slot's event go through the raw runtime (:mod:`hawk.devices.cuda_runtime`)
on the current stream: one ``cudaMemcpyAsync`` per buffer and one ``cudaEventRecord`` per upload,
a few microseconds each, where torch's ``copy_`` and ``Event.record`` cost several times that on the
host (measured there). Without a loadable runtime, torch's calls do the same. On the host (CPU
buffers) the buffers are their own staging: :meth:`HostStaging.next` hands their arrays and
:meth:`HostStaging.upload` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hawk.devices.cuda_runtime import HOST_TO_DEVICE, Runtime, raw_stream, runtime


class HostStaging:
    """Pinned host twins of ``buffers`` (same shapes and dtypes, one device), in ``slots`` rotating sets.

    Use: ``arrays = staging.next()`` (numpy views of the next slot's twins; waits until that slot's
    last upload has run), fill the leading elements, then ``staging.upload(counts)``: the first
    ``counts[i]`` elements (flat order) of twin ``i`` go to ``buffers[i]`` on the current stream, so
    work enqueued after it on that stream sees them. ``slot`` is the slot ``next`` handed out, for
    callers that keep per-slot state (what each slot's rows held; their slot count stays ``slots``).

    ``grow_to`` > ``slots``: where the next slot's upload has not run yet, a new slot is added (up to
    ``grow_to``) instead of waiting. For callers that must never block the host on the device: a
    layer-wise push posts its copies from the forward's own thread, and waiting there for a copy
    queued behind the forward's kernels would stop the thread from running ahead of the GPU.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], slots: int = 2, grow_to: int = 0) -> None:
        if not buffers or len({b.device for b in buffers}) != 1 or slots < 1:
            raise ValueError("HostStaging needs buffers on one device and at least one slot")
        if any(not b.is_contiguous() for b in buffers):
            raise ValueError("HostStaging buffers must be contiguous")
        self.buffers = list(buffers)
        self.device = buffers[0].device
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self._host = [[torch.zeros(b.shape, dtype=b.dtype, pin_memory=True) for b in buffers] for _ in range(slots)]
        else:
            self._host = [self.buffers]
        self._arrays = [[h.numpy() for h in twins] for twins in self._host]
        self._rt: Runtime | None = runtime() if self.cuda else None
        self._index = int(self.device.index if self.device.index is not None else 0) if self.cuda else -1
        self._events: list[Any] = [None] * len(self._host)  # raw handles, or torch events without a runtime
        self._pending = [False] * len(self._host)
        self._grow_to = grow_to if self.cuda else 0
        self.slot = 0

    def _done(self, i: int) -> bool:
        ev = self._events[i]
        return not self._pending[i] or (self._rt.event_done(ev) if self._rt is not None else ev.query())

    def next(self) -> list[np.ndarray]:
        """The next slot's host arrays, once the upload that last read them has run (or a new slot)."""
        nxt = (self.slot + 1) % len(self._host)
        if len(self._host) < self._grow_to and not self._done(nxt):
            nxt = self.slot + 1  # a fresh slot in the ring, right after the current one
            self._host.insert(nxt, [torch.zeros(b.shape, dtype=b.dtype, pin_memory=True) for b in self.buffers])
            self._arrays.insert(nxt, [h.numpy() for h in self._host[nxt]])
            self._events.insert(nxt, None)
            self._pending.insert(nxt, False)
        self.slot = nxt
        if self._pending[self.slot]:
            ev = self._events[self.slot]
            if self._rt is not None:
                self._rt.event_synchronize(ev)
            else:
                ev.synchronize()
            self._pending[self.slot] = False
        return self._arrays[self.slot]

    def upload(self, counts: Sequence[int], stream: int | None = None) -> None:
        """Copy the leading ``counts[i]`` elements of each twin of the current slot to its buffer, on
        the current stream or on raw stream ``stream`` (which only the raw runtime can take)."""
        if not self.cuda:
            return
        twins = self._host[self.slot]
        if self._rt is None:
            if stream is not None:
                raise ValueError("HostStaging.upload(stream=...) needs the raw CUDA runtime")
            for buf, twin, n in zip(self.buffers, twins, counts):
                if n:
                    buf.view(-1)[:n].copy_(twin.view(-1)[:n], non_blocking=True)
            ev = self._events[self.slot]
            if ev is None:
                ev = self._events[self.slot] = torch.cuda.Event()
            ev.record()
            self._pending[self.slot] = True
            return
        if stream is None:
            stream = raw_stream(self._index)
        for buf, twin, n in zip(self.buffers, twins, counts):
            if n:
                self._rt.memcpy_async(buf.data_ptr(), twin.data_ptr(), n * twin.element_size(), HOST_TO_DEVICE, stream)
        ev = self._events[self.slot]
        if ev is None:
            with torch.cuda.device(self._index):  # an event belongs to the device current at creation
                ev = self._events[self.slot] = self._rt.event_create()
        self._rt.event_record(ev, stream)
        self._pending[self.slot] = True

    def close(self) -> None:
        """Wait for pending uploads and free the raw events (the pinned twins go with this object)."""
        for i, ev in enumerate(self._events):
            if ev is None:
                continue
            if self._rt is not None:
                if self._pending[i]:
                    self._rt.event_synchronize(ev)
                self._rt.event_destroy(ev)
            elif self._pending[i]:
                ev.synchronize()
            self._events[i] = None
            self._pending[i] = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter teardown the runtime may be gone
            pass
