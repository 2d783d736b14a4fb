"""Known-answer tests of the reachability bounds (hawk/sim/feasibility.py, paper_bounds.py)."""

from __future__ import annotations

import pytest

from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.cluster import SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.feasibility import (
    extra_s_per_token,
    implied_throughput_ratio,
    lone_request,
    mean_decode_batch,
    prompt_quantile,
)
from hawk.sim.paper_bounds import table9_bound
from hawk.sim.workload import LengthDist, Workload

PREFILL = PrefillModel(0.02, 3e-4)
DECODE = DecodeModel(0.05, 0.0, 0.0)
CURVE = TransferCurve("lin", (1.0 * MiB, 100.0 * MiB), (0.004, 0.104))


def test_implied_throughput_ratio_of_the_papers_gaps():
    """Fig. 13 (GN-HAWK 0.48 % / 7.88 % below GG-Direct) with Table 9 (6.53 % / 6.50 % below
    GGH-Direct): GGH-Direct is 0.9952 / 0.9347 of GG-Direct on Chatbot and 0.9212 / 0.9350 on
    Summarization, the second below 1."""
    assert implied_throughput_ratio(0.48, 6.53) == pytest.approx(0.9952 / 0.9347)
    assert implied_throughput_ratio(7.88, 6.50) == pytest.approx(0.9212 / 0.9350)
    assert implied_throughput_ratio(7.88, 6.50) < 1 < implied_throughput_ratio(0.48, 6.53)
    assert implied_throughput_ratio(3.0, 3.0) == 1.0


def test_table9_bound_reads_the_papers_gaps_and_our_throughputs():
    points = {wl: {"throughput90": {"gg-direct": 100.0, "ggh-direct": 110.0}} for wl in ("chatbot", "summarization")}
    b = table9_bound(points)
    assert b["chatbot"]["ours_ggh_over_gg"] == pytest.approx(1.1)
    assert b["summarization"]["paper_implied_ggh_over_gg"] == pytest.approx(0.9212 / 0.9350)


def test_extra_time_per_token_scales_capacity_by_the_rate_ratio():
    """Busy 1 s per 1000-token request: halving the rate takes another 1 s per request, 1 ms per token."""
    assert extra_s_per_token(1.0, 0.5, 1.0, 1000) == pytest.approx(1e-3)
    assert extra_s_per_token(0.65, 0.65, 1.45, 1750) == 0.0
    with pytest.raises(ValueError):
        extra_s_per_token(0.5, 0.6, 1.0, 1000)


def test_lone_request_by_hand():
    """Alone: TTFT = prefill + transfer; each later token one decode step."""
    cfg = SimConfig("known", CURVE, PREFILL, DECODE, bytes_per_token=1000, contention="none")
    lone = lone_request(cfg, 1000, output_tokens=11)
    assert lone.ttft_s == pytest.approx(PREFILL.batch_time([1000]) + CURVE.latency(1000 * 1000), abs=1e-12)
    assert lone.tpot_s == pytest.approx(DECODE.base_s, abs=1e-12)
    assert lone.meets(lone.ttft_s, lone.tpot_s) and not lone.meets(lone.ttft_s * 0.99, 1.0)


def test_prompt_quantile_of_a_fixed_length_workload():
    wl = Workload("fixed", LengthDist(700), LengthDist(10), 1000.0, 100.0)
    assert prompt_quantile(wl, 0.9, n=50) == 700


def test_bounds_are_in_the_reproduce_json(tmp_path):
    """--reproduce-paper --json carries the bounds (40 requests per run, as the other JSON tests)."""
    import json

    from hawk.sim.paper_command import reproduce_paper

    out = tmp_path / "r.json"
    reproduce_paper(num_requests=40, json_path=str(out), quiet=True)
    b = json.loads(out.read_text())["bounds"]
    assert set(b) == {"table9", "gn_host_lone", "gn_host_fig9_fixup", "gg_host_per_token", "gg_host_chatbot_pinned", "npu_tpot"}
    assert b["npu_tpot"]["step_factor"] >= 1.0
    assert b["table9"]["summarization"]["paper_implied_ggh_over_gg"] == pytest.approx(0.9212 / 0.9350)
    assert set(b["gg_host_chatbot_pinned"]["placements"]) == {"prefill worker", "decode worker"}


def test_fig9_fixup_rate_by_hand():
    """GG-Direct at 1280 MiB is 1 ms + bytes at 25 GB/s; GG-Host is that / 0.1477 and GN-Host 3.79x GG-Host
    (the paper's Fig. 9): the fix-up can take at most GN-Host - GG-Host = 2.79 GG-Host, about 1.30 GB/s."""
    from hawk.sim.paper import Runner
    from hawk.sim.paper_bounds import fig9_fixup_gb_s
    from hawk.sim.testbeds import paper_testbed

    nbytes = 1280 * MiB
    gg_host = (0.001 + nbytes / 25e9) / 0.1477
    assert fig9_fixup_gb_s(Runner(paper_testbed(), 10)) == pytest.approx(nbytes / ((3.79 - 1) * gg_host) / 1e9)
    assert fig9_fixup_gb_s(Runner(paper_testbed(), 10)) == pytest.approx(1.30, abs=0.005)


def test_mean_decode_batch_is_littles_law():
    """0.65 req/s x 200 tokens x 0.1 s = 13 sequences; Summarization's 0.60 x 90 x 0.1 = 5.4: at the
    same step Chatbot carries 2.4x the batch."""
    assert mean_decode_batch(0.65, 200, 0.1) == pytest.approx(13.0)
    assert mean_decode_batch(0.65, 200, 0.1) / mean_decode_batch(0.60, 90, 0.1) == pytest.approx(130 / 54)
    with pytest.raises(ValueError):
        mean_decode_batch(-1.0, 1, 1)


def test_npu_tpot_bound_solves_the_step_factor():
    """On a deterministic one-request-at-a-time workload the P90 TPOT is the step time itself, so the
    factor that puts it at 200 ms is 200 ms over the base step."""
    from dataclasses import replace

    from hawk.sim import paper_bounds
    from hawk.sim.paper import Runner
    from hawk.sim.testbeds import paper_testbed

    run = Runner(paper_testbed(), 3)
    fixed = {w: Workload(w, LengthDist(100), LengthDist(4), 1e9, 200.0) for w in ("chatbot", "summarization")}
    orig = paper_bounds.WORKLOADS
    paper_bounds.WORKLOADS = {**orig, **fixed}
    sim = paper_bounds._sim
    paper_bounds._sim = lambda run, cfg, wl, r: sim(run, cfg, fixed[wl], 0.001)
    try:
        b = paper_bounds.npu_tpot_bound(run, steps=30)
    finally:
        paper_bounds.WORKLOADS, paper_bounds._sim = orig, sim
    step = replace(run.configs["gn-hawk"]).decode.step_time(1, 100)
    assert b["step_factor"] == pytest.approx(0.2 / step, rel=1e-3)
