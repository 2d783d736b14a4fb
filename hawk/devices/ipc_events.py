"""CUDA IPC events: "your bytes are in place once this event fires", from one process to another on the same GPU.

Why: a landed pull's prefill used to wait for its transform before answering D2, so the decode heard of
the KV a control hop after it was there. An interprocess event recorded right after the transform lets
the answer leave while the transform still runs; the decode waits on the event instead (D7), and the hop
overlaps the device's work. Only across processes: a process does not open its own events' handles, and
one process has cheaper ways (the event object itself) that the callers here do not need.

Who owns what: :class:`EventRecorder` (the sender) owns its events and reuses them in a ring per stream;
:class:`EventWaiter` (the receiver) opens each handle once and keeps it while it lives. A ring slot is
recorded again only on the stream it was recorded on before, so a receiver that waits late on a reused
event waits for later work on that stream too: longer, never too short.
"""

from __future__ import annotations

import threading

import torch

from hawk.devices.streams import current_stream

#: Events per (device, stream) ring: a receiver that has not waited after this many newer transfers on
#: the same stream waits for the newest of them (still correct; see the module docstring).
RING = 8


class EventRecorder:
    """Records interprocess events on a device's current stream and hands out their IPC handles."""

    def __init__(self, ring: int = RING) -> None:
        if ring < 1:
            raise ValueError(f"ring must be >= 1, got {ring}")
        self.ring = ring
        self._lock = threading.Lock()
        self._slots: dict[tuple[int, int], list[tuple[torch.cuda.Event, bytes]]] = {}
        self._next: dict[tuple[int, int], int] = {}

    def record(self, device: torch.device | int) -> bytes:
        """Record an event after the work queued so far on ``device``'s current stream; its IPC handle.
        (The stream object is the kept one, :func:`~hawk.devices.streams.current_stream`: every
        transfer that answers early records here.)"""
        index = device if isinstance(device, int) else torch.cuda.current_device() if device.index is None else device.index
        stream = current_stream(index)
        key = (index, stream.cuda_stream)
        with self._lock:
            slots = self._slots.setdefault(key, [])
            i = self._next.get(key, 0)
            self._next[key] = (i + 1) % self.ring
            if i == len(slots):
                with torch.cuda.device(index):
                    ev = torch.cuda.Event(interprocess=True)
                    ev.record(stream)
                    slots.append((ev, bytes(ev.ipc_handle())))
                return slots[i][1]
            ev, handle = slots[i]
        ev.record(stream)
        return handle


class EventWaiter:
    """Waits on a peer's interprocess events, each handle opened once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, torch.cuda.Event] = {}

    def wait(self, handle: bytes, device: int) -> None:
        """Block the calling thread until the peer's event ``handle`` (on CUDA device ``device``) has fired."""
        with self._lock:
            ev = self._open.get(handle)
            if ev is None:
                ev = self._open[handle] = torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
        ev.synchronize()
