"""A transport whose batches take at least as long as a link of N Gb/s would (``--link-gbps N``).

Why: the real transfer engines here move KV over loopback or NVLink, far faster (or, on a CPU,
differently) than the paper's 200 Gb/s InfiniBand. To make a real serving run see a given link,
each batch completes no sooner than ``bytes x 8 / N`` seconds after it was submitted: the real
transfer runs as usual and, when it finishes early, completion is held back for the rest of that
time (:func:`hawk.devices.timing.link_time_s`). A batch that was already slower than the link
completes when it really does. Concurrent batches are paced independently (each as if it had the
link to itself): HAWK's decode pulls one request's KV as one batch, and the simulator is run with
the same assumption when it is compared against a paced run.

This is **timing emulation**; runs that use it are labelled so (``timing_label``). Wrapping is by
delegation: everything but ``submit`` / ``poll`` / ``wait`` / ``transfer`` goes to the real
transport unchanged, so regions, metadata, peers and stats are the real engine's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from hawk.devices.timing import link_time_s
from hawk.transport.base import Desc, Op, Status, Transport, TransferHandle, TransferTimeout


class PacedTransport:
    """``inner`` with every batch's completion held to the link's time (see the module docstring)."""

    def __init__(self, inner: Transport, link_gbps: float):
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be positive, got {link_gbps}")
        self.inner, self.link_gbps = inner, float(link_gbps)
        self._due: dict[int, float] = {}  # handle id -> monotonic time before which it is not done
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # regions, peers, metadata, stats, close ...: the real engine's
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"<PacedTransport {self.link_gbps:g} Gb/s over {self.inner!r}>"

    def peer_tensors(self, peer: str, names: Sequence[str]) -> None:
        """None: bytes written around the link would not be paced."""
        return None

    def peer_memory(self, peer: str, names: Sequence[str]) -> None:
        """None, as :meth:`peer_tensors`."""
        return None

    def submit(self, op: Op, peer: str, descs: Sequence[Desc]) -> TransferHandle:
        h = self.inner.submit(op, peer, descs)
        with self._lock:
            self._due[h.id] = h.submitted_at + link_time_s(h.nbytes, self.link_gbps)
        return h

    def due(self, handle: TransferHandle) -> float:
        """The monotonic time before which ``handle`` does not complete."""
        with self._lock:
            return self._due.get(handle.id, handle.submitted_at)

    def poll(self, handle: TransferHandle) -> Status:
        s = self.inner.poll(handle)
        if s == "DONE" and time.monotonic() < self.due(handle):
            return "PENDING"
        return s

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """The real wait, then the rest of the link's time (a timeout if that would pass the deadline)."""
        deadline = time.monotonic() + timeout_s
        self.inner.wait(handle, timeout_s)
        due = self.due(handle)
        if due > deadline:
            raise TransferTimeout(f"{self.inner.name}: batch #{handle.id} ({handle.nbytes} B) would take until "
                                  f"{due - deadline:.3g} s past its {timeout_s:.3g} s timeout at {self.link_gbps:g} Gb/s")
        while (left := due - time.monotonic()) > 0:
            time.sleep(left)

    transfer = Transport.transfer  # submit + (paced) wait + release

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            self._due.pop(handle.id, None)
        self.inner.release(handle)


def paced(transport: Transport, link_gbps: float | None) -> Transport:
    """``transport`` paced to ``link_gbps``, or ``transport`` itself when ``link_gbps`` is None
    (so that with the option off nothing of this module is on the path)."""
    if link_gbps is None:
        return transport
    return PacedTransport(transport, link_gbps)  # type: ignore[return-value]
