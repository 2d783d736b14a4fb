"""A link shared by overlapping transfers: processor sharing, with a measured speed-up.

A transfer's *shared* work is the time its bytes would take alone on the link. With k transfers
active, together they progress at ``s(k)`` times the speed of one alone, each at ``s(k) / k``. The
default, ``s = 1``, is fair division of a fixed bandwidth: two equal transfers that start together
both finish after twice the solo time, and overlap never creates bandwidth that a single transfer
could not use. A resource that one transfer cannot fill has ``s(k) > 1``: a host CPU running
several host-staged fix-ups at once on its cores, where one fix-up's threads keep only some of
them busy. Such an ``s`` is measured (probes of k simultaneous transfers, ``hawk/sim/crossval.py``),
never assumed; it is kept within [1, k].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import simpy

#: remaining solo seconds below which a transfer counts as done: well above the float resolution
#: of simulated time (~1e-11 s at t = 1e5 s), else a tiny remainder livelocks the loop
_EPS = 1e-9


def speedup_at(speedup: Sequence[float], k: int) -> float:
    """``s(k)`` from ``speedup[k - 1]`` (the last entry beyond the list), kept within [1, k]."""
    if k <= 1 or not speedup:
        return 1.0
    return min(float(k), max(1.0, float(speedup[min(k, len(speedup)) - 1])))


class SharedLink:
    """Processor-sharing server over simpy time; ``transfer(work_s)`` returns an event.
    ``speedup[k - 1]``: the aggregate speed of k active transfers over one alone (default: 1)."""

    def __init__(self, env: simpy.Environment, name: str = "link", speedup: Sequence[float] = (1.0,)):
        self.env, self.name, self.speedup = env, name, tuple(speedup)
        self._active: dict[int, list] = {}  # id -> [remaining solo seconds, done event]
        self._ids = itertools.count()
        self._wake = env.event()
        self._last = env.now
        self.busy_s = 0.0  # time with at least one transfer active
        self.peak_concurrency = 0
        env.process(self._run())

    @property
    def active(self) -> int:
        return len(self._active)

    def transfer(self, work_s: float) -> simpy.Event:
        """Move ``work_s`` seconds' worth of bytes (solo time); the event fires when done."""
        done = self.env.event()
        if work_s <= 0:
            done.succeed()
            return done
        self._advance()
        self._active[next(self._ids)] = [work_s, done]
        self.peak_concurrency = max(self.peak_concurrency, len(self._active))
        if not self._wake.triggered:
            self._wake.succeed()
        return done

    def _advance(self) -> None:
        """Charge the time since the last event to every active transfer, at s(k)/k speed each."""
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt <= 0 or not self._active:
            return
        self.busy_s += dt
        k = len(self._active)
        share = dt * speedup_at(self.speedup, k) / k
        for item in self._active.values():
            item[0] -= share

    def _run(self):  # simpy process
        while True:
            if not self._active:
                yield self._wake
                self._wake = self.env.event()
                continue
            k = len(self._active)
            soonest = min(item[0] for item in self._active.values())
            yield self.env.timeout(max(0.0, soonest * k / speedup_at(self.speedup, k))) | self._wake
            if self._wake.triggered:
                self._wake = self.env.event()
            self._advance()
            for key in [key for key, item in self._active.items() if item[0] <= _EPS]:
                self._active.pop(key)[1].succeed()
