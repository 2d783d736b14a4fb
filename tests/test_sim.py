"""The simulator's invariants, its calibration, the shared metrics and the efficiency arithmetic."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hawk.bench.efficiency import DEVICES, Deployment, efficiency_table
from hawk.sim.calibration import (
    MiB,
    TransferCurve,
    curves_from_records,
    load_transfer_curves,
)
from hawk.sim.cluster import make_config, simulate, sweep
from hawk.sim.defaults import (
    TRANSFER_FILE,
    TRANSFER_MEDIANS_MS,
    TRANSFER_SIZES_MB,
    default_transfer_curves,
)
from hawk.sim.link import SharedLink
from hawk.sim.metrics import RequestResult, at_attainment, summarize
from hawk.sim.workload import LengthDist, Workload, generate_requests

# ============================================================================ calibration


@pytest.mark.skipif(not TRANSFER_FILE.exists(), reason="measured transfer results not in this checkout")
def test_interpolation_is_exact_at_every_calibration_point():
    records = json.loads(TRANSFER_FILE.read_text())
    curves = load_transfer_curves(TRANSFER_FILE)
    assert records and {r["config"] for r in records} == set(curves)
    for r in records:
        assert curves[r["config"]].latency(r["size_mb"] * MiB) == pytest.approx(r["median_ms"] / 1e3, rel=1e-12, abs=0)


@pytest.mark.skipif(not TRANSFER_FILE.exists(), reason="measured transfer results not in this checkout")
def test_embedded_defaults_match_the_results_file():
    from_file = load_transfer_curves(TRANSFER_FILE)
    embedded = default_transfer_curves(prefer_file=False)
    assert set(embedded) == set(from_file) == set(TRANSFER_MEDIANS_MS)
    for name, c in embedded.items():
        assert c.sizes_bytes == tuple(s * MiB for s in TRANSFER_SIZES_MB) == from_file[name].sizes_bytes
        for a, b in zip(c.latency_s, from_file[name].latency_s):
            assert a == pytest.approx(b, abs=1e-9)  # 1 ns: rounding of the copied medians


def test_interpolation_between_below_and_beyond_the_points():
    c = TransferCurve("x", (10.0, 20.0, 40.0), (1.0, 3.0, 4.0))
    assert c.latency(15.0) == pytest.approx(2.0)  # linear between points
    assert c.latency(30.0) == pytest.approx(3.5)
    assert c.latency(1.0) == 1.0  # flat below the smallest size
    assert c.latency(60.0) == pytest.approx(5.0)  # last segment's slope beyond the largest
    falling = TransferCurve("y", (10.0, 20.0), (3.0, 2.0))
    assert falling.latency(100.0) == 2.0  # never extrapolates downwards
    fixed, shared = c.split(30.0)
    assert fixed == 1.0 and fixed + shared == pytest.approx(c.latency(30.0))
    assert c.scaled(2.0).latency(15.0) == pytest.approx(4.0)


def test_curves_average_repeated_sizes_and_reject_bad_input():
    recs = [{"config": "a", "size_mb": 10, "median_ms": 2.0}, {"config": "a", "size_mb": 10, "median_ms": 4.0}, {"config": "a", "size_mb": 20, "median_ms": 5.0}]
    c = curves_from_records(recs, "test")["a"]
    assert c.latency(10 * MiB) == pytest.approx(3e-3) and c.measured
    with pytest.raises(ValueError):
        TransferCurve("bad", (2.0, 1.0), (1.0, 1.0))


def test_linear_curve():
    c = TransferCurve.linear("ib", fixed_ms=1.0, gbytes_per_s=25.0)
    assert c.latency(250 * MiB) == pytest.approx(1e-3 + 250 * MiB / 25e9)


# ============================================================================ link contention


def _finish_times(starts_and_work: list[tuple[float, float]]) -> list[float]:
    env = simpy.Environment()
    link = SharedLink(env)
    out = [0.0] * len(starts_and_work)

    def job(i: int, start: float, work: float):
        yield env.timeout(start)
        yield link.transfer(work)
        out[i] = env.now

    for i, (s, w) in enumerate(starts_and_work):
        env.process(job(i, s, w))
    env.run()
    return out


def test_link_shares_bandwidth_fairly():
    assert _finish_times([(0.0, 1.0)]) == [pytest.approx(1.0)]
    assert _finish_times([(0.0, 1.0), (0.0, 1.0)]) == [pytest.approx(2.0), pytest.approx(2.0)]
    # B joins at 0.5: A has 0.5 left, both at half speed -> A ends at 1.5; B then alone: 1.0-0.5 left -> 2.0
    assert _finish_times([(0.0, 1.0), (0.5, 1.0)]) == [pytest.approx(1.5), pytest.approx(2.0)]
    # the link never moves more than one solo transfer's worth per second
    assert max(_finish_times([(0.0, 0.3)] * 5)) == pytest.approx(1.5)


# ============================================================================ workload


def test_workload_is_seeded_and_rates_only_compress_time():
    a = generate_requests("chatbot", 50, 1.0, seed=3)
    b = generate_requests("chatbot", 50, 4.0, seed=3)
    assert [(r.input_len, r.output_len) for r in a] == [(r.input_len, r.output_len) for r in b]
    assert all(y.arrival_s == pytest.approx(x.arrival_s / 4) for x, y in zip(a, b))
    assert generate_requests("chatbot", 50, 1.0, seed=4) != a
    assert all(r.arrival_s == 0 for r in generate_requests("chatbot", 5, math.inf))
    fixed = LengthDist(7)
    assert {r.input_len for r in generate_requests(Workload("w", fixed, fixed, 1, 1), 10, 1.0)} == {7}


# ============================================================================ simulator invariants


def test_littles_law():
    r = simulate("gn-hawk", 3.0, "chatbot", 400, seed=1)
    assert r["completed"] == 400
    lam, w, l_avg = r["arrival_rate_observed"], r["mean_sojourn_s"], r["mean_in_system"]
    assert l_avg == pytest.approx(lam * w, rel=1e-6)  # occupancy and per-request times agree
    assert 0.5 * 3.0 < r["request_throughput_rps"] <= 3.0 * 1.3  # rate in ~ rate out in a stable regime


def test_more_decode_instances_never_reduce_throughput_when_saturated():
    thr = [simulate("gn-hawk", 12.0, "chatbot", 300, seed=2, num_prefill=4, num_decode=d)["output_throughput_tok_s"] for d in (1, 2, 3, 4)]
    assert all(b >= a * 0.99 for a, b in itertools.pairwise(thr)), thr
    assert thr[-1] > 1.5 * thr[0]  # decode-bound: more decode instances help a lot


def test_slower_transfer_raises_ttft():
    fast = simulate("gn-hawk", 2.0, "summarization", 150, seed=0)
    slow = simulate("gn-hawk", 2.0, "summarization", 150, seed=0, transfer_scale=20.0)
    assert slow["kv_transfer_mean_ms"] > 10 * fast["kv_transfer_mean_ms"]
    for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms"):
        assert slow[k] > fast[k]
    host = simulate("gn-host", 2.0, "summarization", 150, seed=0)
    assert host["ttft_mean_ms"] > fast["ttft_mean_ms"]  # measured: gn-host is slower than gn-hawk


def test_slo_attainment_is_non_increasing_in_rate():
    for cfg in ("gg-direct", "gn-hawk"):
        att = [r["slo_attainment"] for r in sweep([cfg], [1, 2, 3, 4, 5, 6, 8], "chatbot", 300, seed=0)]
        assert att[0] == 1.0 and att[-1] < 0.5
        assert all(b <= a + 0.02 for a, b in itertools.pairwise(att)), att


def test_contention_only_slows_transfers():
    kw = {"workload": "summarization", "num_requests": 150, "seed": 0, "transfer_scale": 10.0}
    shared = simulate("gg-host", 3.0, contention="decode", **kw)
    alone = simulate("gg-host", 3.0, contention="none", **kw)
    assert shared["kv_transfer_mean_ms"] >= alone["kv_transfer_mean_ms"]
    assert shared["link_peak_concurrency"] >= 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1_200, 6_000),
    max_batch=st.integers(1, 8),
    rate=st.sampled_from([2.0, 8.0, 50.0]),
    num_decode=st.integers(1, 2),
    seed=st.integers(0, 3),
)
def test_admission_control_never_exceeds_memory_or_batch(capacity, max_batch, rate, num_decode, seed):
    base = make_config("gn-hawk", 1, num_decode)
    cfg = replace(base, decode=replace(base.decode, kv_capacity_tokens=capacity, max_batch=max_batch))
    r = simulate(cfg, rate, "chatbot", 40, seed)
    assert all(p <= capacity for p in r["decode_kv_peak_tokens"])
    assert all(b <= max_batch for b in r["decode_batch_peak"])
    assert r["completed"] + r["rejected"] == 40  # nothing deadlocks: too-large requests are refused up front
    assert r["failed"] == r["rejected"]


def test_prefill_memory_backpressure_holds_its_limit():
    base = make_config("gn-hawk")
    cfg = replace(base, prefill=replace(base.prefill, kv_capacity_tokens=3000))
    r = simulate(cfg, 20.0, "chatbot", 60, 0)
    assert max(r["prefill_kv_peak_tokens"]) <= 3000
    assert r["completed"] + r["rejected"] == 60


# ============================================================================ metrics


def _res(i: int, ttft: float, tpot: float, n: int, ok: bool = True) -> RequestResult:
    sent = float(i)
    return RequestResult(i, 10, n, sent, sent + ttft, sent + ttft + tpot * (n - 1), n, ok, None if ok else "boom")


def test_summarize_by_hand():
    rs = [_res(0, 0.1, 0.02, 11), _res(1, 0.5, 0.02, 11), _res(2, 0.1, 0.3, 11), _res(3, 0.1, 0.02, 1), _res(4, 9, 9, 5, ok=False)]
    s = summarize(rs, slo_ttft_ms=200, slo_tpot_ms=100)
    assert s["num_requests"] == 5 and s["completed"] == 4 and s["failed"] == 1
    # meets: 0 (yes), 1 (TTFT no), 2 (TPOT no), 3 (one token: TPOT undefined -> meets), 4 (failed)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["ttft_attainment"] == pytest.approx(3 / 5) and s["tpot_attainment"] == pytest.approx(3 / 5)
    assert s["tpot_p50_ms"] == pytest.approx(20.0)
    assert s["ttft_p50_ms"] == pytest.approx(100.0)
    duration = max(r.last_s for r in rs if r.ok) - 0.0
    assert s["duration_s"] == pytest.approx(duration)
    assert s["output_throughput_tok_s"] == pytest.approx(34 / duration)
    assert s["goodput_tok_s"] == pytest.approx(12 / duration)
    assert s["goodput_rps"] == pytest.approx(2 / duration)


def test_at_attainment():
    recs = [{"rate": 1, "slo_attainment": 1.0, "output_throughput_tok_s": 100}, {"rate": 2, "slo_attainment": 0.95, "output_throughput_tok_s": 200},
            {"rate": 3, "slo_attainment": 0.75, "output_throughput_tok_s": 260}]
    p = at_attainment(recs, 0.9)
    assert p["status"] == "interpolated"
    assert p["rate"] == pytest.approx(2.25) and p["output_throughput_tok_s"] == pytest.approx(215.0)
    assert at_attainment(recs[:2], 0.9)["status"] == "lower-bound"
    assert at_attainment([{"rate": 1, "slo_attainment": 0.5}], 0.9)["status"] == "none"


# ============================================================================ efficiency


def test_efficiency_arithmetic():
    rows = efficiency_table({"gg-direct": 100.0, "gn-hawk": 90.0}, baseline="gg-direct")
    a100, p150 = DEVICES["a100-pcie-80gb"], DEVICES["p150a"]
    gg, gn = rows
    assert gg["power_w"] == 8 * a100.power_w and gg["price_usd"] == 8 * a100.price_usd
    assert gn["power_w"] == 4 * a100.power_w + 4 * p150.power_w
    assert gn["price_usd"] == 4 * a100.price_usd + 4 * p150.price_usd
    assert gn["tok_s_per_w"] == pytest.approx(90 / gn["power_w"])
    assert gn["tok_s_per_usd"] == pytest.approx(90 / gn["price_usd"])
    assert gn["throughput_ratio"] == pytest.approx(0.9)
    assert gn["power_eff_ratio"] == pytest.approx((90 / gn["power_w"]) / (100 / gg["power_w"]))
    assert gn["cost_eff_ratio"] == pytest.approx((90 / gn["price_usd"]) / (100 / gg["price_usd"]))
    assert gg["power_eff_ratio"] == 1.0


def test_efficiency_from_records_and_explicit_devices():
    recs = [{"config": "gn-hawk", "rate": r, "slo_attainment": a, "output_throughput_tok_s": t, "num_prefill": 1, "num_decode": 2}
            for r, a, t in ((1, 1.0, 100.0), (2, 0.8, 180.0))]
    (row,) = efficiency_table({"gn-hawk": recs})
    assert row["status"] == "interpolated" and row["throughput_tok_s"] == pytest.approx(140.0)
    assert row["devices"] == {"a100-pcie-80gb": 4, "p150a": 8}  # the deployment scales with num_decode
    (row,) = efficiency_table({"x": 50.0}, {"x": {"p150a": 2}})
    assert row["power_w"] == 2 * DEVICES["p150a"].power_w and row["tok_s_per_w"] == pytest.approx(50 / row["power_w"])
    with pytest.raises(ValueError):
        efficiency_table({"unknown-config": 1.0})
    assert Deployment("a", 1, "a", 2).counts(2, 3) == {"a": 8}


# ============================================================================ calibration files and commands


def test_calibration_file_overrides_compute_models(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"decode_models": {"p150a-tp4": {"max_batch": 4, "source": "test"}}}))
    cfg = make_config("gn-hawk", calibration=path)
    assert cfg.decode.max_batch == 4 and cfg.decode.source == "test"
    assert cfg.decode.base_s == make_config("gn-hawk").decode.base_s  # the rest stays
    r = simulate("gn-hawk", 20.0, "chatbot", 30, calibration=path)
    assert max(r["decode_batch_peak"]) <= 4 and r["decode_source"] == "test"


def test_sweep_over_pd_ratios_and_the_command(tmp_path):
    from hawk.bench.efficiency import efficiency_report
    from hawk.sim.command import main

    recs = sweep(["gn-hawk"], [2.0], "chatbot", 50, pd_ratios=[(1, 1), (2, 3)])
    assert [(r["num_prefill"], r["num_decode"], r["pd_ratio"]) for r in recs] == [(1, 1, "1:1"), (2, 3, "2:3")]
    cfg = make_config("gn-hawk", 2, 2)
    assert [r["pd_ratio"] for r in sweep([cfg], [2.0], "chatbot", 20)] == ["2:2"]
    out = tmp_path / "sim.json"
    recs = main(["--configs", "gg-direct,gn-hawk", "--rates", "1,8", "--num-requests", "60", "--json", str(out), "--plot", str(tmp_path / "s.png")])
    assert len(recs) == 4 and json.loads(out.read_text())[0]["simulated"] is True
    rows = efficiency_report([str(out)], baseline="gg-direct", out_json=str(tmp_path / "eff.json"))
    assert {r["config"] for r in rows} == {"gg-direct", "gn-hawk"} and all(r["baseline"] == "gg-direct" for r in rows)
