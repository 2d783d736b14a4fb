"""Reservations inside one registered buffer: who holds which bytes, since when, until when.

Both ends of Algorithm 1 reserve space per request (P4 on the GPU, D3 on the NPU) and must give it
back on every path. This ledger is what proves they do: ``live()`` lists what is held right now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BufferFull(MemoryError):
    """No free range is large enough; the message says how much was asked and what is free."""


@dataclass(frozen=True)
class Reservation:
    id: int
    buffer: str
    offset: int
    size: int
    owner: str
    since: float
    deadline: float | None

    @property
    def end(self) -> int:
        return self.offset + self.size


class RangeReservations:
    """First-fit byte ranges of a buffer of ``capacity`` bytes, aligned to ``alignment``."""

    def __init__(self, name: str, capacity: int, alignment: int = 64, clock: Callable[[], float] = time.monotonic):
        if capacity <= 0:
            raise ValueError(f"buffer {name!r} capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.alignment = alignment
        self._clock = clock
        self._live: dict[int, Reservation] = {}
        self._next = 1
        self._lock = threading.Lock()

    def reserve(self, size: int, owner: str, ttl_s: float | None = None) -> Reservation:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"reservation size must be a positive int, got {size!r}")
        need = self._round_up(size)
        with self._lock:
            start = 0
            for r in sorted(self._live.values(), key=lambda r: r.offset):
                if r.offset - start >= need:
                    break
                start = self._round_up(r.end)
            if start + need > self.capacity:
                raise BufferFull(
                    f"buffer {self.name!r}: {owner!r} needs {size} B, {self.capacity - self._used()} of "
                    f"{self.capacity} B free and no free range is large enough"
                )
            now = self._clock()
            res = Reservation(self._next, self.name, start, size, owner, now, None if ttl_s is None else now + ttl_s)
            self._next += 1
            self._live[res.id] = res
            return res

    def fits_empty(self, size: int) -> bool:
        """Whether ``size`` bytes fit this buffer once everything is released (else waiting never helps)."""
        return self._round_up(size) <= self.capacity

    def _round_up(self, n: int) -> int:
        """``n`` up to the next multiple of ``alignment`` (sizes and range starts alike)."""
        return -(-n // self.alignment) * self.alignment

    def release(self, res: Reservation) -> bool:
        """Give ``res`` back; False if it was already released (by expiry or another path)."""
        with self._lock:
            return self._live.pop(res.id, None) is not None

    def release_owner(self, owner: str) -> list[Reservation]:
        with self._lock:
            gone = [r for r in self._live.values() if r.owner == owner]
            for r in gone:
                del self._live[r.id]
            return gone

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Release every reservation past its deadline; returns what was released."""
        now = self._clock() if now is None else now
        with self._lock:
            gone = [r for r in self._live.values() if r.deadline is not None and r.deadline <= now]
            for r in gone:
                del self._live[r.id]
            return gone

    def live(self) -> list[Reservation]:
        with self._lock:
            return sorted(self._live.values(), key=lambda r: r.offset)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        return sum(r.size for r in self._live.values())
