"""A link shared by overlapping transfers: fair (processor-sharing) bandwidth division.

A transfer's *shared* work is the time its bytes would take alone on the link. With k transfers
active, each progresses at 1/k of the link's speed, so two equal transfers that start together
both finish after twice the solo time — the total bytes/second of the link never exceeds what one
transfer alone measured. This is the simplest model that makes concurrent transfers cost what
they should: it does not let overlap create bandwidth that a single transfer could not use.
"""

from __future__ import annotations

import itertools

import simpy

#: remaining solo seconds below which a transfer counts as done: well above the float resolution
#: of simulated time (~1e-11 s at t = 1e5 s), else a tiny remainder livelocks the loop
_EPS = 1e-9


class SharedLink:
    """Processor-sharing server over simpy time; ``transfer(work_s)`` returns an event."""

    def __init__(self, env: simpy.Environment, name: str = "link"):
        self.env, self.name = env, name
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
        """Charge the time since the last event to every active transfer, at 1/k speed each."""
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt <= 0 or not self._active:
            return
        self.busy_s += dt
        share = dt / len(self._active)
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
            yield self.env.timeout(max(0.0, soonest * k)) | self._wake
            if self._wake.triggered:
                self._wake = self.env.event()
            self._advance()
            for key in [key for key, item in self._active.items() if item[0] <= _EPS]:
                self._active.pop(key)[1].succeed()
