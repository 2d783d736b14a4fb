"""Where a step loop's working time goes: waiting on the device, running on the CPU, or blocked.

Why: with async scheduling a GPU decode thread should spend most of its time waiting on the device (one
step is queued ahead). Time it spends neither on the CPU nor waiting on the device is time it is blocked,
on a lock or on the interpreter (the GIL, which the instance's HTTP thread takes to stream tokens); then
the next step launches late and the GPU idles. The thread's CPU clock tells the two apart: blocked time
does not run it, work does, and so does a CUDA event's spin-wait, which is why device waits are timed
apart (:meth:`LoopClock.device_wait`).

Only the loop's own thread enters the clock; :meth:`LoopClock.stats` may be read from any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager


class LoopClock:
    """Wall and thread-CPU seconds of a loop's iterations, and of the idle and device waits inside them."""

    def __init__(self, wall: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time) -> None:
        self._wall, self._cpu = wall, cpu
        self._s = {"loop": [0.0, 0.0], "idle": [0.0, 0.0], "device": [0.0, 0.0]}  # wall, CPU

    @contextmanager
    def _span(self, kind: str) -> Iterator[None]:
        t, c = self._wall(), self._cpu()
        try:
            yield
        finally:
            acc = self._s[kind]
            acc[0] += self._wall() - t
            acc[1] += self._cpu() - c

    def iteration(self) -> AbstractContextManager[None]:
        """One pass of the loop."""
        return self._span("loop")

    def idle(self) -> AbstractContextManager[None]:
        """A wait for work (requests, blocks): not counted at all."""
        return self._span("idle")

    def device_wait(self) -> AbstractContextManager[None]:
        """A wait for the device (a step's tokens, an event behind a forward, a modelled step time)."""
        return self._span("device")

    def stats(self) -> dict[str, float]:
        """Seconds so far: busy (the iterations less their idle waits), of which waiting on the device,
        and of the rest, blocked (not on the CPU)."""
        (loop, loop_cpu), (idle, idle_cpu), (dev, dev_cpu) = (self._s[k] for k in ("loop", "idle", "device"))
        busy, busy_cpu = loop - idle, loop_cpu - idle_cpu
        return {"loop_busy_s": busy, "loop_device_wait_s": dev, "loop_blocked_s": max(0.0, (busy - dev) - (busy_cpu - dev_cpu))}
