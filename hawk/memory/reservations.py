"""Reservations inside one registered buffer: who holds which bytes, since when, until when.

Both ends of Algorithm 1 reserve space per request (P4 on the GPU, D3 on the NPU) and must give it
back on every path. This ledger is what proves they do: ``live()`` lists what is held right now.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class BufferFull(MemoryError):
    """No free range is large enough; the message says how much was asked and what is free."""


class NeverFits(BufferFull):
    """Larger than the whole buffer: no release can ever make room, so waiting would only delay the error."""


class NoRoomInTime(BufferFull):
    """A reservation waited for room (:class:`RoomQueue`) until its deadline, or until the queue closed."""


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
        self._listeners: list[Callable[[], None]] = []

    def reserve(self, size: int, owner: str, ttl_s: float | None = None) -> Reservation:
        """First fit, now or never: :class:`NeverFits` if ``size`` exceeds the buffer, else
        :class:`BufferFull` if no free range is large enough at the moment (a caller that can wait
        for releases does so through a :class:`RoomQueue`)."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"reservation size must be a positive int, got {size!r}")
        self.require_fits(size, owner)
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

    def require_fits(self, size: int, owner: str) -> None:
        """Raise :class:`NeverFits` unless ``size`` fits the empty buffer: a caller checks this before
        it queues for room, so a request that can never fit fails at once instead of after its wait."""
        if not self.fits_empty(size):
            raise NeverFits(f"buffer {self.name!r}: {owner!r} needs {size} B, more than the whole buffer's {self.capacity} B")

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (no arguments, outside the ledger's lock) after anything is released here,
        by whatever path: how a :class:`RoomQueue` wakes its waiters without polling the ledger."""
        with self._lock:
            self._listeners.append(listener)

    def _released(self, gone: int) -> None:
        if gone:
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                listener()

    def _round_up(self, n: int) -> int:
        """``n`` up to the next multiple of ``alignment`` (sizes and range starts alike)."""
        return -(-n // self.alignment) * self.alignment

    def release(self, res: Reservation, announce: bool = True) -> bool:
        """Give ``res`` back; False if it was already released (by expiry or another path).
        ``announce=False`` undoes a reservation just made as part of an all-or-none set: those bytes
        were free before, so waking the subscribers would only make a waiter retry in vain (a spin)."""
        with self._lock:
            gone = self._live.pop(res.id, None) is not None
        if announce:
            self._released(gone)
        return gone

    def release_owner(self, owner: str) -> list[Reservation]:
        with self._lock:
            gone = [r for r in self._live.values() if r.owner == owner]
            for r in gone:
                del self._live[r.id]
        self._released(len(gone))
        return gone

    def expire(self, now: float | None = None) -> list[Reservation]:
        """Release every reservation past its deadline; returns what was released."""
        now = self._clock() if now is None else now
        with self._lock:
            gone = [r for r in self._live.values() if r.deadline is not None and r.deadline <= now]
            for r in gone:
                del self._live[r.id]
        self._released(len(gone))
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


class RoomQueue:
    """Arrival-order turns for reservations that may wait for room instead of failing.

    A first-fit buffer shared by concurrent requests fragments: the bytes one request needs can be
    free in total but in no single range, or held for a moment by transfers about to finish. A request
    that fits the empty buffer therefore waits for releases rather than failing. Turns are taken in
    arrival order (only the head tries; later arrivals wait behind it even if they would fit), so a
    large request is not starved by a stream of small ones that keep re-fragmenting the buffer.
    Waiters wake on releases (:meth:`notify`, e.g. subscribed to the ledgers with
    :meth:`RangeReservations.subscribe`) and at least every ``poll_s`` for what nothing announces.
    """

    def __init__(self, poll_s: float = 0.05):
        self.poll_s = poll_s
        self._cond = threading.Condition(threading.Lock())
        self._line: collections.deque[tuple[object, str]] = collections.deque()
        self._generation = 0  # bumped by every release and every turn that ends
        self._closed = ""

    def take(self, attempt: Callable[[], T], owner: str, deadline: float, tick: Callable[[], None] | None = None) -> T:
        """``attempt()`` in ``owner``'s turn, again after each release, until it returns or
        ``deadline`` (``time.monotonic()``) passes. ``attempt`` raises :class:`BufferFull` while there
        is no room; any other error (:class:`NeverFits` included) ends the wait at once. ``tick`` runs
        between tries, outside the queue's lock (the caller's own time-based releases)."""
        ticket = object()
        with self._cond:
            if self._closed:
                raise NoRoomInTime(f"{owner!r}: {self._closed}")
            self._line.append((ticket, owner))
        last: BufferFull | None = None
        try:
            while True:
                with self._cond:
                    seen = self._generation
                    first = self._line[0][0] is ticket
                if first:
                    try:
                        return attempt()
                    except NeverFits:
                        raise
                    except BufferFull as e:
                        last = e
                if tick is not None:
                    tick()
                self._wait(ticket, owner, seen, deadline, last)
        finally:
            with self._cond:
                self._line = collections.deque(e for e in self._line if e[0] is not ticket)
                self._generation += 1  # the next in line tries now
                self._cond.notify_all()

    def _wait(self, ticket: object, owner: str, seen: int, deadline: float, last: BufferFull | None) -> None:
        """Until a release or a turn ends after ``seen`` (or ``poll_s``); :class:`NoRoomInTime` once
        the queue is closed or ``deadline`` has passed (with what the last try found, or how many are ahead)."""
        with self._cond:
            if self._closed:
                raise NoRoomInTime(f"{owner!r}: {self._closed} while it waited for room ({last or 'queued behind others'})")
            left = deadline - time.monotonic()
            if left <= 0:
                ahead = next(i for i, (t, _) in enumerate(self._line) if t is ticket)
                raise NoRoomInTime(f"{owner!r}: no room before its deadline ({last or f'{ahead} earlier requests still waiting'})")
            self._cond.wait_for(lambda: self._generation != seen or bool(self._closed), timeout=min(left, self.poll_s))

    def notify(self) -> None:
        """Something was released: the head of the line tries again."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def waiting(self) -> list[str]:
        """Owners waiting for room, in arrival order (accounting, and what tests wait on)."""
        with self._cond:
            return [o for _, o in self._line]

    def close(self, why: str = "closed") -> None:
        """End every wait now (:class:`NoRoomInTime` with ``why``) and refuse new ones."""
        with self._cond:
            self._closed = why
            self._cond.notify_all()
