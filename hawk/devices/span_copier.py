"""Many byte ranges on one CUDA device, copied by one kernel on a side stream, for a few raw calls.

A same-GPU transfer batch is tens to thousands of contiguous ranges of a few registered regions.
:func:`~hawk.devices.batched_copy.copy_spans` already moves them in one launch; what it still paid per
batch on the host was torch's: a stream switch and a cross-stream wait, a fresh address table
(pinned allocation, upload) and a base tensor, a new event. On the H200 host each of those torch
calls costs microseconds (:mod:`hawk.devices.cuda_runtime`), and a batch's submit measured 0.4-0.5 ms
whatever its size (2026-12-01, ``benchmarks/profile_transfer_host.py``).

Here a :class:`SpanCopier` owns, per (transport, device), what every batch reuses: the side stream,
a base tensor the word offsets are taken from, device address tables grown as needed with pinned
twins (:class:`~hawk.devices.staging.HostStaging`), and a pool of raw events. A batch is: record an
event on the caller's stream and make the side stream wait for it (the copy sees what earlier
kernels wrote), fill and upload the tables on the side stream, launch, record the batch's event.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from hawk.devices.batched_copy import _BLOCK, span_words, vector_align
from hawk.devices.cuda_runtime import Runtime, raw_stream, runtime
from hawk.devices.staging import HostStaging


class RawEvent:
    """Completion of one batch: a pooled raw event (back to its copier's pool when dropped)."""

    def __init__(self, copier: SpanCopier, handle: int) -> None:
        self._copier, self.handle = copier, handle

    def query(self) -> bool:
        return self._copier.rt.event_done(self.handle)

    def synchronize(self) -> None:
        self._copier.rt.event_synchronize(self.handle)

    def __del__(self) -> None:
        try:
            self._copier._recycle(self.handle)
        except Exception:  # noqa: BLE001 - at teardown the copier may be half gone
            pass


class SpanCopier:
    """Copies of ``(src address, dst address, bytes)`` ranges inside CUDA device ``side.device``,
    run on the side stream ``side`` after the caller's current stream. See the module docstring."""

    def __init__(self, side: Any, rt: Runtime) -> None:
        self.side, self.rt = side, rt
        self.device = side.device
        self.index = int(self.device.index if self.device.index is not None else 0)
        self._side_raw = int(side.cuda_stream)
        self._base = torch.empty(2, dtype=torch.int64, device=self.device)  # offsets are taken from its address
        self._lock = threading.Lock()
        self._free: list[int] = []
        with torch.cuda.device(self.index):
            self._ready = rt.event_create()
        self._cap = 0
        self._tables: list[torch.Tensor] = []
        self._staging: HostStaging | None = None

    @classmethod
    def for_stream(cls, side: Any) -> SpanCopier | None:
        """A copier on side stream ``side``, or None where the raw runtime cannot be loaded."""
        rt = runtime()
        return cls(side, rt) if rt is not None else None

    def copy(self, src_addr: np.ndarray, dst_addr: np.ndarray, lengths: np.ndarray) -> RawEvent | None:
        """Issue the copies; returns the batch's completion, or None (nothing issued) where one launch
        cannot take them: an empty batch, a range that is empty or too long, or an address or length
        that is not a multiple of 8 bytes."""
        words = span_words(src_addr, dst_addr, lengths, self._base.data_ptr())
        if words is None:
            return None
        from hawk.devices._copy_kernel import copy_words

        s, d, lens = words
        n = len(lens)
        if n > self._cap:
            self._grow(n)
        assert self._staging is not None
        rt, side = self.rt, self._side_raw
        rt.event_record(self._ready, raw_stream(self.index))
        rt.stream_wait_event(side, self._ready)
        hs, hd, hl = self._staging.next()
        hs[:n], hd[:n], hl[:n] = s, d, lens
        self._staging.upload((n, n, n), stream=side)
        src_t, dst_t, len_t = self._tables
        copy_words(self._base, src_t, dst_t, len_t, int(lens.max()), _BLOCK, vector_align(s, d, lens), count=n, stream=side)
        ev = self._event()
        rt.event_record(ev, side)
        return RawEvent(self, ev)

    def _grow(self, n: int) -> None:
        """Tables for ``n`` ranges (doubling); the old ones go once the side stream's work on them ran."""
        cap = max(64, 1 << (n - 1).bit_length())
        if self._staging is not None:
            self.side.synchronize()
            self._staging.close()
        self._tables = [torch.empty(cap, dtype=torch.int64, device=self.device) for _ in range(3)]
        self._staging = HostStaging(self._tables, slots=2, grow_to=64)  # never waits on the device while it can grow
        self._cap = cap

    def _event(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
        with torch.cuda.device(self.index):  # an event is made on the current device
            return self.rt.event_create()

    def _recycle(self, handle: int) -> None:
        with self._lock:
            self._free.append(handle)

    def close(self) -> None:
        """After the side stream's work has run: free the raw events (the tables go with the object)."""
        self.side.synchronize()
        if self._staging is not None:
            self._staging.close()
        with self._lock:
            free, self._free = self._free, []
        for h in [*free, self._ready]:
            self.rt.event_destroy(h)
        self._ready = 0
