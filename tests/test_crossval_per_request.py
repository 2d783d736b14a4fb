"""Issue 10, the paced GPU cross-validation: what the simulator mirrors of HAWK's engines (admission
between decode steps, chunked prefill) and the per-request comparison that names a real run's one-off."""

from dataclasses import replace

import pytest

from hawk.sim.calibration import TransferCurve
from hawk.sim.cluster import Cluster, SimConfig, simulate
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.crossval import ONE_OFF_S, Probes, calibrate, calibrated_config, format_one_offs, per_request
from hawk.sim.request import SimRequest
from hawk.sim.workload import LengthDist, RequestSpec, Workload

STEP = 0.030  # a paced p150a-like decode step


def _config(**kw) -> SimConfig:
    flat = TransferCurve("flat", (1.0, 1e10), (0.004, 0.004), "test: 4 ms whatever the size", measured=True)
    base = dict(
        name="t", transfer=flat, prefill=PrefillModel(0.010, 0.0), decode=DecodeModel(STEP, 0.0, 0.0),
        bytes_per_token=1, contention="none",
    )
    return SimConfig(**{**base, **kw})


def _run(cfg: SimConfig, specs: list[RequestSpec]) -> list[SimRequest]:
    reqs = [SimRequest(s) for s in specs]
    Cluster(cfg).run(reqs)
    assert all(r.finished for r in reqs)
    return reqs


def test_a_request_that_arrives_during_a_decode_step_is_admitted_when_the_step_ends():
    # A decodes from t = 0.014 in 30 ms steps; B is prefilled at 0.060, in the middle of a step.
    specs = [RequestSpec(0, 0.0, 100, 20), RequestSpec(1, 0.050, 100, 5)]
    a, b = _run(_config(admit_between_steps=True), specs)
    assert b.t_prefilled == pytest.approx(0.060)
    steps_since_a = (b.t_admitted - a.t_first) / STEP
    assert steps_since_a == pytest.approx(round(steps_since_a))  # a step boundary of A's batch
    assert b.t_prefilled < b.t_admitted < b.t_prefilled + STEP
    # ... where the simulator without it admits at once (the testbeds' published behaviour)
    a0, b0 = _run(_config(), specs)
    assert b0.t_admitted == pytest.approx(b0.t_prefilled)
    assert b.t_first > b0.t_first


def test_an_idle_decode_admits_at_once_either_way():
    (r,) = _run(_config(admit_between_steps=True), [RequestSpec(0, 0.0, 100, 3)])
    assert r.t_admitted == pytest.approx(r.t_prefilled)


def test_calibrated_configs_admit_between_steps_and_chunk_like_the_engine():
    p = Probes(prefill=[(8, 0.02), (128, 0.05)], transfer=[(1e6, 0.01), (2e6, 0.02)], kv_tokens=[(8, 1e6), (128, 2e6)],
               decode=[(1, 0.03), (2, 0.031)], frontend=[0.01])
    cfg = calibrated_config(calibrate(p, max_batch=8, kv_tokens=4096, prefill_chunk=2048), "gn-hawk")
    assert cfg.admit_between_steps
    assert cfg.prefill.chunk_tokens == 2048 and cfg.prefill.budget == 2048
    assert cfg.describe()["admit_between_steps"] is True and cfg.describe()["prefill_chunk_tokens"] == 2048


def test_a_long_prompt_is_prefilled_in_chunks():
    pm = PrefillModel(0.005, 1e-5, chunk_tokens=2048)
    (r,) = _run(_config(prefill=pm), [RequestSpec(0, 0.0, 3972, 2)])
    assert r.t_prefill_start == 0.0
    assert r.t_prefilled == pytest.approx(2 * 0.005 + 3972 * 1e-5)  # two iterations: 2048 + 1924 tokens
    (whole,) = _run(_config(prefill=replace(pm, chunk_tokens=0)), [RequestSpec(0, 0.0, 3972, 2)])
    assert whole.t_prefilled == pytest.approx(0.005 + 3972 * 1e-5)


def test_a_prompt_arriving_during_a_chunk_takes_what_is_left_of_the_next_iterations_budget():
    pm = PrefillModel(0.005, 1e-5, chunk_tokens=2048)
    long, short = _run(_config(prefill=pm), [RequestSpec(0, 0.0, 3000, 2), RequestSpec(1, 0.001, 1500, 2)])
    first = 0.005 + 2048e-5  # long's first chunk, alone
    second = 0.005 + (952 + 1096) * 1e-5  # long's last 952 tokens + short's first 1096
    assert long.t_prefilled == pytest.approx(first + second)
    assert short.t_prefill_start == pytest.approx(first)
    assert short.t_prefilled == pytest.approx(first + second + 0.005 + 404e-5)  # its last 404 tokens
    assert short.t_prefilled > long.t_prefilled


def test_without_chunking_the_prefill_batches_as_before():
    # the token budget holds whole prompts: the first always goes, the next joins while it fits
    pm = PrefillModel(0.005, 1e-5, max_batch_tokens=2048)
    a, b, c = _run(_config(prefill=pm), [RequestSpec(0, 0.0, 3000, 2), RequestSpec(1, 0.001, 1000, 2), RequestSpec(2, 0.002, 1000, 2)])
    assert a.t_prefilled == pytest.approx(0.005 + 3000e-5)
    assert b.t_prefill_start == c.t_prefill_start == pytest.approx(a.t_prefilled)  # batched together
    assert b.t_prefilled == c.t_prefilled == pytest.approx(a.t_prefilled + 0.005 + 2000e-5)


def _real(rate, ttfts, stages):
    reqs = []
    for i, (t, st) in enumerate(zip(ttfts, stages)):
        reqs.append({"index": i, "input_len": 1000 + i, "sent_s": float(i), "ttft_s": t, "extra": {"hawk": st}})
    return {"rate": rate, "requests": reqs}


def test_per_request_matches_by_index_and_names_the_one_off_and_its_stage():
    sim_cfg = _config(prefill=PrefillModel(0.010, 2e-5), frontend_s=0.012)
    wl = Workload("w", LengthDist(1000, 0.0), LengthDist(4, 0.0), 1e9, 1e9)
    sim = simulate(sim_cfg, 0.5, wl, 3, 0, per_request=True)
    s = [q["extra"] for q in sim["requests"]]
    fast = {"prefill_queue_s": 0.001, "prefill_s": s[0]["prefill_s"], "decode_admit_wait_s": 0.0, "kv_transfer_s": 0.004}
    stall = {**fast, "prefill_s": 1.0}  # e.g. a kernel compiled on first use
    sim_ttft = [q["ttft_s"] for q in sim["requests"]]
    real = _real(0.5, [sim_ttft[0] + 0.01, sim_ttft[1] + 0.97, sim_ttft[2] + 0.05], [fast, stall, fast])
    rows = per_request(real, sim)
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["one_off"] for r in rows] == [False, True, False]
    assert rows[1]["worst_stage"] == "prefill_s" and rows[1]["worst_excess_ms"] > 900
    assert rows[1]["excess_ms"] == pytest.approx(970)
    q = rows[0]["stages_ms"]["prefill_queue_s"]
    assert q["sim"] == pytest.approx(1e3 * (s[0]["prefill_queue_s"] - 0.012))  # without the front end
    assert rows[0]["stages_ms"]["rest"]["sim"] == pytest.approx(rows[0]["sim_ttft_ms"] - sum(
        v["sim"] for k, v in rows[0]["stages_ms"].items() if k != "rest"))
    (line,) = format_one_offs(rows, "[paced] gn-hawk")
    assert "request 1" in line and "prefill_s" in line and line.startswith("[paced] gn-hawk rate 0.5")


def test_a_slow_request_is_not_a_one_off_unless_it_is_far_off_in_both_terms():
    sim = {"frontend_s": 0.0, "requests": [
        {"index": 0, "ttft_s": 0.010, "extra": {}}, {"index": 1, "ttft_s": 0.5, "extra": {}}]}
    real = {"rate": 1.0, "requests": [
        {"index": 0, "input_len": 8, "ttft_s": 0.010 + ONE_OFF_S * 0.9, "extra": {}},  # 23x, but < 0.25 s
        {"index": 1, "input_len": 8, "ttft_s": 1.2, "extra": {}},  # +0.7 s, but 2.4x
        {"index": 7, "input_len": 8, "ttft_s": 9.0, "extra": {}}]}  # no simulated twin: left out
    rows = per_request(real, sim)
    assert [r["index"] for r in rows] == [0, 1]
    assert not any(r["one_off"] for r in rows)
    assert format_one_offs(rows) == []
    rows[1]["one_off"] = True
    assert format_one_offs(rows) == ["rate 1: request 1 (8 prompt tokens): TTFT 1200 ms, simulated 500 ms; rest 1200 ms vs 500 ms simulated"]
