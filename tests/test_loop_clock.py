"""The step loop's clock (hawk/engine/loop_clock.py): time off the CPU and outside device waits is what
it reports as blocked; idle waits do not count; and a decode engine's stats carry it."""

import time

from hawk.engine.loop_clock import LoopClock


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_sleeping_in_an_iteration_is_blocked_spinning_is_not_and_device_and_idle_waits_are_apart():
    clock = LoopClock()
    with clock.iteration():
        _spin(0.05)  # work on the CPU
        time.sleep(0.1)  # blocked: off the CPU, no device wait
        with clock.device_wait():
            _spin(0.05)  # a CUDA event's spin-wait runs the CPU clock: a device wait all the same
            time.sleep(0.05)
        with clock.idle():
            time.sleep(0.2)  # waiting for requests: not busy at all
    s = clock.stats()
    assert 0.24 <= s["loop_busy_s"] < 0.45  # 0.25 of spans, not the idle 0.2
    assert 0.095 <= s["loop_device_wait_s"] < 0.2
    assert 0.09 <= s["loop_blocked_s"] < 0.18  # the 0.1-s sleep, not the device wait's


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
