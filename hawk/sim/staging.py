"""A prefill instance's staging buffer: a pull's KV holds bytes there from P4 until D9.

HAWK's prefill stages a host-staged pull's KV in one registered buffer (``--staging-mb``) and
keeps it there until the decode says it is done. A pull that finds the buffer full waits, in
arrival order, for earlier pulls to finish (``hawk/connector/algorithm1.py``, the stager), so
large prompts under load queue behind each other at the prefill. This pool is that queue.
"""

from __future__ import annotations

from collections import deque

import simpy


class StagingPool:
    """``capacity`` bytes handed out first come, first served: a request waits until everything
    before it has been served and its bytes are free (a small request does not overtake a large one)."""

    def __init__(self, env: simpy.Environment, capacity: float):
        if capacity <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity}")
        self.env, self.capacity = env, float(capacity)
        self.used = 0.0
        self.peak_queue = 0
        self._queue: deque[tuple[float, simpy.Event]] = deque()

    def acquire(self, nbytes: float) -> simpy.Event:
        """An event that fires once ``nbytes`` (at most the capacity: one request alone always fits,
        as the real prefill refuses larger prompts before their prefill) are held for the caller."""
        ev = self.env.event()
        self._queue.append((min(float(nbytes), self.capacity), ev))
        self.peak_queue = max(self.peak_queue, len(self._queue))
        self._serve()
        return ev

    def release(self, nbytes: float) -> None:
        self.used -= min(float(nbytes), self.capacity)
        assert self.used >= -1e-6, "staging released twice"
        self._serve()

    def _serve(self) -> None:
        while self._queue and self.used + self._queue[0][0] <= self.capacity:
            n, ev = self._queue.popleft()
            self.used += n
            ev.succeed()
