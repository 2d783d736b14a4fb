"""Cross-validation plumbing (hawk/sim/crossval.py): fits from probes, the calibrated config, the
comparison. The real run itself is benchmarks/cross_validate.py (too slow for the suite)."""

from dataclasses import replace

import pytest
import simpy

from hawk.devices.timing import StepModel
from hawk.sim.cluster import simulate
from hawk.sim.crossval import (
    TOLERANCE,
    Probes,
    calibrate,
    calibrated_config,
    compare,
    deviation,
    fit_line,
    format_table,
)
from hawk.sim.link import SharedLink


def test_fit_line_recovers_a_line_and_stays_non_negative():
    assert fit_line([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    assert fit_line([5, 5], [1.0, 3.0]) == (2.0, 0.0)  # one distinct x: the mean
    assert fit_line([1, 2, 3], [3, 2, 1]) == (2.0, 0.0)  # a falling time: flat at the mean
    a, b = fit_line([10, 20], [0.5, 2.5])  # negative intercept: through the origin
    assert a == 0.0 and b > 0


def probes() -> Probes:
    """A machine with prefill 50 ms + 2 ms/token, decode 40 ms + 5 ms/seq, transfer 10 ms + 1 ms/MB."""
    p = Probes()
    for n in (8, 32, 64, 128):
        p.prefill.append((n, 0.05 + 0.002 * n))
        nbytes = 30_000 * n
        p.transfer.append((nbytes, 0.010 + nbytes * 1e-9))
        p.kv_tokens.append((n, nbytes))
        p.frontend.append(0.012)
    p.decode = [(b, 0.04 + 0.005 * b) for b in (1, 2, 4, 8)]
    return p


def test_calibrate_fits_each_model_from_its_probes():
    c = calibrate(probes(), max_batch=64, kv_tokens=8192)
    assert (c.prefill.base_s, c.prefill.per_token_s) == pytest.approx((0.05, 0.002))
    assert (c.decode.base_s, c.decode.per_seq_s) == pytest.approx((0.04, 0.005))
    assert c.transfer.latency(2e6) == pytest.approx(0.010 + 2e-3)
    assert c.bytes_per_token == 30_000 and c.frontend_s == pytest.approx(0.012)
    assert c.decode.max_batch == 64 and c.prefill.kv_capacity_tokens == 8192
    assert "measured" in c.prefill.source and "measured" in c.transfer.source


def test_one_request_on_the_calibrated_config_is_the_sum_of_its_stages():
    from hawk.sim.workload import LengthDist, Workload

    c = calibrate(probes(), max_batch=64, kv_tokens=8192)
    wl = Workload("one", LengthDist(40), LengthDist(4), 1e9, 1e9)
    r = simulate(calibrated_config(c, "gn-hawk"), 1.0, wl, 1, per_request=True)["requests"][0]
    assert r["ttft_s"] == pytest.approx(0.012 + 0.05 + 0.002 * 40 + 0.010 + 40 * 30_000 * 1e-9)
    assert r["tpot_s"] == pytest.approx(0.045)
    paced = calibrated_config(c, "gn-hawk", npu_step=StepModel(0.1, 0.0, 0.0), link_gbps=0.1)
    r = simulate(paced, 1.0, wl, 1, per_request=True)["requests"][0]
    assert r["ttft_s"] == pytest.approx(0.012 + 0.05 + 0.002 * 40 + 0.010 + 40 * 30_000 * 8 / 0.1e9)
    assert r["tpot_s"] == pytest.approx(0.1)


def test_compare_judges_p90s_within_the_tolerance():
    real = [{"rate": 1.0, "ttft_p90_ms": 100.0, "tpot_p90_ms": 50.0, "ttft_p50_ms": 80.0, "tpot_p50_ms": 40.0}]
    sim = [{"rate": 1.0, "ttft_p90_ms": 115.0, "tpot_p90_ms": 65.0, "ttft_p50_ms": 10.0, "tpot_p50_ms": 40.0}]
    rows = {r["metric"]: r for r in compare(real, sim, "plain")}
    assert rows["ttft_p90_ms"]["within"] is True and rows["ttft_p90_ms"]["deviation"] == pytest.approx(0.15)
    assert rows["tpot_p90_ms"]["within"] is False
    assert rows["ttft_p50_ms"]["within"] is None  # reported, not judged
    assert TOLERANCE == 0.2 and deviation(None, 1.0) is None
    assert "**no**" in format_table(list(rows.values()))


def test_fit_line_is_not_moved_by_one_slow_first_request():
    """Probes repeat each length; a first request that compiled kernels (seconds, not ms) must not
    become the model's fixed cost: each length counts by its median."""
    from hawk.sim.crossval import fit_line

    xs = [8, 8, 8, 128, 128, 128]
    ys = [2.6, 0.020, 0.020, 0.040, 0.040, 0.040]
    a, b = fit_line(xs, ys)
    assert abs(a - (0.020 - 8 * b)) < 1e-9 and abs(b - 0.020 / 120) < 1e-9


def test_resimulating_a_saved_run_gives_its_own_predictions():
    """A saved run fed back to the simulator with its probes: today's simulator is the one that made
    that file's predictions, so the rows come back equal (the committed H200 gn-hawk paced run)."""
    import json
    from pathlib import Path

    from benchmarks.cross_validate import resimulate

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/crossval_h200/paced_summarization_gn-hawk.json"
    saved = json.loads(path.read_text())["rows"]
    again = resimulate(str(path))
    assert [(r["rate"], r["metric"]) for r in again] == [(r["rate"], r["metric"]) for r in saved]
    for a, b in zip(again, saved):
        assert a["real"] == b["real"] and abs(a["sim"] - b["sim"]) < 1e-6 * max(1.0, b["sim"])


def test_the_transfer_curve_goes_through_each_probed_median_and_keeps_the_fixed_cost():
    """A convex cost (the per-byte cost rises with size, as a host CPU's fix-up does) is kept:
    exact at each probed size's median, the last slope beyond it; the fixed part is the line's intercept."""
    from hawk.sim.crossval import transfer_curve

    mb = 1e6
    pts = [(10 * mb, 0.11), (10 * mb, 0.13), (100 * mb, 1.0), (200 * mb, 2.5), (200 * mb, 2.5)]
    c = transfer_curve(pts, "test")
    assert c.latency(10 * mb) == pytest.approx(0.12) and c.latency(100 * mb) == pytest.approx(1.0)
    assert c.latency(200 * mb) == pytest.approx(2.5)
    assert c.latency(300 * mb) == pytest.approx(2.5 + 100 * mb * (1.5 / (100 * mb)))  # the last segment's slope
    assert c.latency(150 * mb) == pytest.approx(1.75)
    linear = transfer_curve([(n * mb, 0.01 + n * 1e-3) for n in (1, 10, 100)], "test")
    assert linear.fixed_s == pytest.approx(0.01) and linear.split(50 * mb) == pytest.approx((0.01, 0.05))


def test_the_probes_reach_the_sweeps_longest_prompt():
    """The chatbot sweep's longest prompts set its P90 TTFT: the probes include the longest one the
    sweep will send (its lengths follow the seed, whatever the rate), beside the workload's spread."""
    from benchmarks.cross_validate import longest_prompt, prefill_lengths
    from hawk.sim.workload import generate_requests, get_workload

    wl = get_workload("chatbot")
    base = prefill_lengths(wl)
    longest = longest_prompt(wl, 30, 0)
    assert longest == max(s.input_len for s in generate_requests(wl, 30, 4.0, 0))
    lens = prefill_lengths(wl, longest)
    assert max(lens) == max(longest, max(base)) and set(base) <= set(lens)
    assert prefill_lengths(wl, min(base)) == base  # a shorter one adds nothing


def test_simultaneous_pull_probes_give_the_speed_up_the_simulator_shares_the_link_with():
    """k pulls sent at once that end after fixed + k * shared / s: the calibration recovers s(k),
    interpolates unprobed k, keeps s within [1, k], and without such probes shares fairly (s = 1)."""
    p = probes()
    c0 = calibrate(p, max_batch=64, kv_tokens=8192)
    assert c0.link_speedup == (1.0, 1.0, 1.0, 1.0)
    nbytes = 30_000 * 64
    fixed, shared = c0.transfer.split(nbytes)
    for k, s in ((2, 1.6), (4, 2.4)):
        p.concurrent += [(k, nbytes, fixed + k * shared / s)] * k
    c = calibrate(p, max_batch=64, kv_tokens=8192)
    assert c.link_speedup == pytest.approx((1.0, 1.6, 2.0, 2.4))
    p.concurrent.append((2, nbytes, fixed + shared / 10))  # faster than k at once can be: capped at k
    p.concurrent = [x for x in p.concurrent if x[0] == 2][-1:]
    assert calibrate(p, max_batch=64, kv_tokens=8192).link_speedup[1] == 2.0


def test_two_simultaneous_pulls_end_when_the_measured_speed_up_says():
    """Two equal pulls of 1 s of shared work on one link: with s(2) = 1 (fair sharing) both end at
    2 s, with s(2) = 1.6 at 1.25 s, with s(2) = 2 at 1 s; a host config carries the calibrated s."""
    for s2 in (1.0, 1.6, 2.0):
        env = simpy.Environment()
        link = SharedLink(env, "host", (1.0, s2))
        done = [link.transfer(1.0), link.transfer(1.0)]
        env.run()
        assert all(d.processed for d in done)
        assert env.now == pytest.approx(2.0 / s2)
    cfg = calibrated_config(replace(calibrate(probes(), max_batch=64, kv_tokens=8192), link_speedup=(1.0, 1.6)), "gn-host")
    assert cfg.link_speedup == (1.0, 1.6) and cfg.contention == "decode"
