"""Known-answer tests of host staging as worker time (hawk/sim/host.py) and of the calibration protocol."""

from __future__ import annotations

import json

import pytest

from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.host import HostStaging
from hawk.sim.protocol import INPUTS, input_parameter, within
from hawk.sim.request import SimRequest
from hawk.sim.workload import RequestSpec

PREFILL = PrefillModel(0.02, 3e-4)
DECODE = DecodeModel(0.05, 0.0, 0.0)
CURVE = TransferCurve("lin", (1.0 * MiB, 100.0 * MiB), (0.004, 0.104))


def _cfg(host: HostStaging | None) -> SimConfig:
    return SimConfig("known", CURVE, PREFILL, DECODE, bytes_per_token=1000, contention="none", host=host)


def test_rates_give_the_worker_seconds_per_byte():
    h = HostStaging.from_rates(2.0, 0.5)
    assert h.prefill_s(1e9) == pytest.approx(0.5)  # one copy at 2 GB/s
    assert h.decode_s(1e9) == pytest.approx(0.5 + 2.0)  # the copy, then the tilize at 0.5 GB/s
    assert HostStaging.from_rates(2.0).decode_s(1e9) == pytest.approx(0.5)
    for bad in ((0.0, None), (1.0, -1.0)):
        with pytest.raises(ValueError):
            HostStaging.from_rates(*bad)


def test_one_staged_request_pays_both_workers_by_hand():
    """Alone: TTFT = prefill + the prefill worker's copy + the transfer + the decode worker's landing."""
    h = HostStaging(prefill_s_per_byte=1e-7, decode_s_per_byte=3e-7)
    r = SimRequest(RequestSpec(0, 0.0, 1000, 3))
    Cluster(_cfg(h)).run([r])
    nbytes = 1000 * 1000
    ttft = PREFILL.batch_time([1000]) + h.prefill_s(nbytes) + CURVE.latency(nbytes) + h.decode_s(nbytes)
    assert r.t_first == pytest.approx(ttft, abs=1e-12)
    assert r.t_last - r.t_first == pytest.approx(2 * DECODE.base_s, abs=1e-12)  # its own steps are not slowed


def test_a_landing_stalls_the_running_requests_steps():
    """A request that is decoding waits, between two steps, for another request's landing: its
    token gap is one step plus exactly the landing time; without staging it is one step."""
    h = HostStaging(0.0, 1e-6)
    gaps = {}
    for name, host in (("staged", h), ("direct", None)):
        first = SimRequest(RequestSpec(0, 0.0, 100, 40))
        second = SimRequest(RequestSpec(1, 0.5, 2000, 2))
        Cluster(_cfg(host)).run([first, second])
        gaps[name] = first.t_last - first.t_first
    landing = h.decode_s(2000 * 1000)
    assert gaps["direct"] == pytest.approx(39 * DECODE.base_s, abs=1e-9)
    assert gaps["staged"] == pytest.approx(39 * DECODE.base_s + landing, abs=1e-9)


def test_prefill_worker_copies_delay_the_next_prompt():
    """Two prompts queued at once, one per batch: the second starts after the first's forward and its copy."""
    h = HostStaging(2e-7, 0.0)
    one_per_batch = PrefillModel(0.02, 3e-4, max_batch_tokens=1000)
    a, b = SimRequest(RequestSpec(0, 0.0, 1000, 2)), SimRequest(RequestSpec(1, 0.0, 1000, 2))
    Cluster(SimConfig("known", CURVE, one_per_batch, DECODE, bytes_per_token=1000, contention="none", host=h)).run([a, b])
    assert b.t_prefill_start == pytest.approx(one_per_batch.batch_time([1000]) + h.prefill_s(1000 * 1000), abs=1e-12)


def test_tolerances_and_roles():
    assert within("req/s", 0.65, 0.74) and not within("req/s", 0.65, 0.76)  # 15 % relative
    assert within("%", 7.69, 4.7) and not within("%", 7.69, 4.6)  # 3 percentage points
    assert within("req/s", None, None) and not within("req/s", None, 0.1)  # "never" reproduced only by never
    assert not within("req/s", 0.6, float("inf"))
    assert len(INPUTS) <= 3
    assert input_parameter("Fig. 12", "Chatbot: gg-host rate at 90 % SLO attainment") == "host_copy_gb_s"
    assert input_parameter("Fig. 12", "Chatbot: gg-direct rate at 90 % SLO attainment") is None


def test_reproduce_rows_carry_roles_score_and_claims(tmp_path):
    from hawk.sim.command import main

    out = tmp_path / "rp.json"
    main(["--reproduce-paper", "--num-requests", "40", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["role"] for r in rows} == {"input", "prediction"}
    inputs = [r for r in rows if r["role"] == "input"]
    assert all(r["sets"] for r in inputs)
    serving_inputs = {r["paper"] for r in inputs if r["figure"] not in ("Fig. 9", "Table 1")}
    assert serving_inputs <= {i.paper for i in INPUTS}  # at most three numbers from the serving results
    preds = [r for r in rows if r["role"] == "prediction"]
    assert doc["score"]["predictions"] == len(preds) >= 15
    assert doc["score"]["within"] == sum(bool(r["within"]) for r in preds)
    assert len(doc["claims"]) == 6 and all(isinstance(c["holds"], bool) for c in doc["claims"])
    assert doc["sources"]["host_staging"]["gn-host"]["decode_s_per_byte"] > doc["sources"]["host_staging"]["gg-host"]["decode_s_per_byte"]


def test_pulls_beyond_the_pull_threads_wait_for_one():
    """One pull thread: of two requests prefilled together, the second's pull starts when the first's ends."""
    cfg = SimConfig("known", CURVE, PrefillModel(0.02, 3e-4, max_batch_tokens=1 << 20), DECODE, bytes_per_token=1000,
                    contention="none", transfer_slots=1)
    a, b = SimRequest(RequestSpec(0, 0.0, 1000, 2)), SimRequest(RequestSpec(1, 0.0, 1000, 2))
    Cluster(cfg).run([a, b])
    one = CURVE.latency(1000 * 1000)
    assert a.t_kv_done == pytest.approx(a.t_admitted + one, abs=1e-12)
    assert b.t_admitted == pytest.approx(a.t_kv_done, abs=1e-12)


def test_crossval_models_the_engines_pull_threads_and_a_shared_host_for_staged_pulls():
    import inspect

    from hawk.engine.decode_engine import DecodeEngine
    from hawk.sim.crossval import PULL_THREADS, Calibrated, calibrated_config

    assert inspect.signature(DecodeEngine.__init__).parameters["transfer_threads"].default == PULL_THREADS
    c = Calibrated(PREFILL, DECODE, CURVE, 1000, 0.0)
    assert calibrated_config(c, "gn-host").contention == "decode"
    assert calibrated_config(c, "gn-hawk").contention == "none"
    assert calibrated_config(c, "gn-hawk").transfer_slots == PULL_THREADS
