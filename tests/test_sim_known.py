"""Known-answer tests of the simulator: queueing theory, one request by hand, Fig. 9, the reproduce JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.request import SimRequest
from hawk.sim.testbeds import PaperFacts, kv_bytes_per_token, paper_testbed, paper_transfer_curves
from hawk.sim.workload import RequestSpec


def _config(prefill: PrefillModel, decode: DecodeModel, transfer: TransferCurve) -> SimConfig:
    return SimConfig("known", transfer, prefill, decode, contention="none")


def test_mm1_mean_wait_matches_theory():
    """Prefill = one FIFO server taking one prompt at a time, service ∝ prompt length ~ Exp:
    an M/M/1 queue, whose mean wait is rho / (mu - lambda)."""
    rng = np.random.default_rng(7)
    n, lam, mean_s = 40_000, 0.5, 1.0  # rho = 0.5
    per_token = 1e-3
    gaps = rng.exponential(1 / lam, n)
    lens = np.maximum(1, np.rint(rng.exponential(mean_s / per_token, n))).astype(int)
    reqs = [SimRequest(RequestSpec(i, float(t), int(L), 1)) for i, (t, L) in enumerate(zip(np.cumsum(gaps), lens))]
    cfg = _config(
        PrefillModel(0.0, per_token, max_batch_tokens=1),
        DecodeModel(0.0, 0.0, 0.0, max_batch=1 << 20),
        TransferCurve("zero", (1.0, 2.0), (0.0, 0.0)),
    )
    Cluster(cfg).run(reqs)
    waits = [r.t_prefill_start - r.spec.arrival_s for r in reqs]
    mu = 1 / (per_token * lens.mean())  # the sample's service rate (rounding to whole tokens)
    theory = (lam / mu) / (mu - lam)
    assert np.mean(waits) == pytest.approx(theory, rel=0.05)


def test_one_request_ttft_and_tpot_by_hand():
    """Alone in the cluster: TTFT = prefill + KV transfer (the prefill computed the first token, which
    goes out when the request joins the decode batch); every later token takes one decode step."""
    prefill = PrefillModel(0.02, 3e-4, 1e-9)
    decode = DecodeModel(0.05, 1e-3, 1e-7)
    curve = TransferCurve("lin", (1.0 * MiB, 100.0 * MiB), (0.004, 0.104))
    cfg = _config(prefill, decode, curve)
    r = SimRequest(RequestSpec(0, 0.0, 1000, 4))
    Cluster(cfg).run([r])
    ttft = prefill.batch_time([1000]) + curve.latency(1000 * cfg.bytes_per_token)
    assert r.t_first == pytest.approx(ttft, abs=1e-12)
    steps = sum(decode.step_time(1, 1000 + k) for k in (1, 2, 3))  # contexts 1001, 1002, 1003
    assert r.t_last - r.t_first == pytest.approx(steps, abs=1e-12)


def test_fig9_model_reproduces_the_paper_ratios():
    f = PaperFacts()
    c = paper_transfer_curves(f)
    for i, mb in enumerate(f.fig9_sizes_mb):
        s = mb * MiB
        host = c["gg-host"].latency(s)
        assert c["gn-host"].latency(s) / host == pytest.approx(f.gn_host_over_gg_host[i], rel=1e-9)
        assert c["gg-direct"].latency(s) / host == pytest.approx(f.gg_direct_over_gg_host[i], rel=1e-9)
        assert c["gn-hawk"].latency(s) / host == pytest.approx(f.gn_hawk_over_gg_host[i], rel=1e-9)
    # GN-HAWK within 0.65 % of GG-Direct at 1280 MB (the paper's §1), and 10 MB = 64 tokens (§5.2)
    assert abs(c["gn-hawk"].latency(1280 * MiB) / c["gg-direct"].latency(1280 * MiB) - 1) < 0.0065
    assert 64 * kv_bytes_per_token(f) == 10 * MiB


def test_paper_testbed_keeps_table1_ratios():
    tb = paper_testbed()
    pa, pn = tb.prefill_models["a100-tp4"], tb.prefill_models["p150a-tp4"]
    assert pn.per_token_s / pa.per_token_s == pytest.approx(2.52)
    assert tb.decode_models["p150a-tp4"].step_time(32, 20_000) / tb.decode_models["a100-tp4"].step_time(32, 20_000) == pytest.approx(1.16)
    assert all(m.source.startswith("derived") for m in [*tb.prefill_models.values(), *tb.decode_models.values()])


def test_reproduce_paper_json_schema(tmp_path):
    from hawk.sim.command import main

    out = tmp_path / "rp.json"
    main(["--reproduce-paper", "--num-requests", "40", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert len(rows) >= 15
    for r in rows:
        assert {"figure", "quantity", "paper", "ours", "unit"} <= set(r)
        assert r["ours"] is None or isinstance(r["ours"], (int, float))
    figures = {r["figure"] for r in rows}
    assert {"Fig. 9", "Fig. 10", "Fig. 12", "Fig. 13", "Table 8", "Table 9"} <= figures
