"""The step loop's clock (hawk/engine/loop_clock.py): time off the CPU and outside device waits is what
it reports as blocked; idle waits do not count; and a decode engine's stats carry it."""

import time

import pytest

from hawk.engine.loop_clock import LoopClock


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Clocks:
    """A wall clock and a thread-CPU clock the test advances: exact answers, whatever else the box runs."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def spin(self, s: float) -> None:  # on the CPU
        self.wall += s
        self.cpu += s

    def sleep(self, s: float) -> None:  # off it
        self.wall += s


def test_sleeping_in_an_iteration_is_blocked_spinning_is_not_and_device_and_idle_waits_are_apart():
    t = _Clocks()
    clock = LoopClock(wall=lambda: t.wall, cpu=lambda: t.cpu)
    with clock.iteration():
        t.spin(0.05)  # work on the CPU
        t.sleep(0.1)  # blocked: off the CPU, no device wait
        with clock.device_wait():
            t.spin(0.05)  # a CUDA event's spin-wait runs the CPU clock: a device wait all the same
            t.sleep(0.05)
        with clock.idle():
            t.sleep(0.2)  # waiting for requests: not busy at all
    s = clock.stats()
    assert s["loop_busy_s"] == pytest.approx(0.25)  # the spans, not the idle 0.2
    assert s["loop_device_wait_s"] == pytest.approx(0.1)
    assert s["loop_blocked_s"] == pytest.approx(0.1)  # the 0.1-s sleep, not the device wait's


def test_the_default_clocks_tell_a_sleep_from_a_spin():
    """What the class relies on: the thread's CPU clock stands still while it sleeps and runs while it spins."""
    clock = LoopClock()
    with clock.iteration():
        time.sleep(0.1)
    with clock.iteration():
        _spin(0.1)
    s = clock.stats()
    assert s["loop_busy_s"] >= 0.2 and 0.095 <= s["loop_blocked_s"] < s["loop_busy_s"]  # the spin ran on the CPU


def test_a_decode_engines_stats_carry_its_loop_clock_and_a_blocked_host_shows(monkeypatch):
    """The engine's own loop: a host step that sleeps (as a thread waiting for the GIL would) adds its
    sleep to ``loop_blocked_s``."""
    import torch

    from hawk.engine.instances import ColocatedInstance, InstanceConfig
    from hawk.engine.sequence import SamplingParams

    torch.set_num_threads(1)
    inst = ColocatedInstance(InstanceConfig(model="tiny", transfer="colocated", kv_tokens=1024))
    try:
        engine = inst.decode
        real = engine._emit
        slept = []

        def slow_emit(*a, **k):
            time.sleep(0.01)
            slept.append(0.01)
            return real(*a, **k)

        monkeypatch.setattr(engine, "_emit", slow_emit)
        before = engine.stats()
        res = inst.prefill.submit("r", [5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True)).result(60)
        done = []
        engine.submit("r", res.num_prompt_tokens, res.first_token, SamplingParams(max_tokens=12, ignore_eos=True),
                      inst.take_blocks("r"), lambda ev: ev.finish_reason and done.append(ev))
        deadline = time.monotonic() + 60
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done and done[0].finish_reason == "length"
        after = engine.stats()
        assert sum(slept) >= 0.1
        assert after["loop_blocked_s"] - before["loop_blocked_s"] >= 0.8 * sum(slept)
        assert after["loop_busy_s"] - before["loop_busy_s"] >= sum(slept)
    finally:
        inst.close()


def test_a_steps_event_waited_for_by_the_prefill_counts_as_a_device_wait():
    """The decode engine hands the prefill its step's event wrapped: the prefill decides whether to wait
    (only when a prompt completes), and the wait, when it comes, is the device's, not blocked time."""
    from hawk.engine.decode_engine import _DeviceWaited

    class Event:
        def synchronize(self):
            time.sleep(0.05)

    clock = LoopClock()
    with clock.iteration():
        _DeviceWaited(Event(), clock).synchronize()
    s = clock.stats()
    assert s["loop_device_wait_s"] >= 0.045 and s["loop_blocked_s"] < 0.02
