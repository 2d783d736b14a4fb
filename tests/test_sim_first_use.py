"""Issue 32's paced cross-validation: what the simulator now models of the real run's first token.

* the prefill's CUDA graph captured on a bucket's first use (``hawk/sim/prefill.py``, ``GraphCapture``);
* the front end's growth with the prompt, fitted from the probes (``crossval.frontend_line``);
* a request the real decode lost as its pull started is lost there in the simulation too
  (``crossval.lost_at_pull``, ``simulate(lost_at_pull=...)``).
"""

from dataclasses import replace

import pytest
import simpy

from hawk.sim.calibration import TransferCurve
from hawk.sim.cluster import SimConfig, simulate
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.crossval import Probes, calibrate, calibrated_config, frontend_line, graph_capture, lost_at_pull, per_request, probe_captures
from hawk.engine.graph_buckets import PREFILL_GRAPH_SEQS, WARMUP_RUNS, prefill_seq_buckets, prefill_token_buckets
from hawk.sim.prefill import GraphCapture, PrefillInstance
from hawk.sim.request import SimRequest
from hawk.sim.workload import LengthDist, RequestSpec, Workload

PREFILL = PrefillModel(0.010, 1e-5, 0.0, 2048, 1 << 30, "test", chunk_tokens=2048)


def test_the_bucket_rules_are_the_engines():
    """The simulator charges first uses by the rules the runner captures by (``graph_buckets``)."""
    from hawk.engine import runner

    assert runner.ModelRunner.WARMUP_RUNS == WARMUP_RUNS
    import inspect

    assert inspect.signature(runner.ModelRunner.__init__).parameters["prefill_graph_seqs"].default == PREFILL_GRAPH_SEQS
    g = GraphCapture(2048)
    for n in (16, 100, 640, 2048):
        assert g.bucket(n, 3) == (next(b for b in prefill_token_buckets(2048) if b >= n), 4)
    assert g.startup() == {(t, 1) for t in prefill_token_buckets(2048)}
    assert g.bucket(3000, 1) is None and g.bucket(100, prefill_seq_buckets(PREFILL_GRAPH_SEQS)[-1] + 1) is None


def _forwards(graphs: GraphCapture | None, batches: list[list[int]]) -> list[float]:
    """Seconds of each forward when each batch's prompts arrive together at an idle instance, one batch
    after another."""
    env = simpy.Environment()
    done: list[float] = []
    inst = PrefillInstance(env, 0, PREFILL, lambda r: done.append(r.t_prefilled - r.t_prefill_start), graphs=graphs)

    def arrivals():
        for i, batch in enumerate(batches):
            yield env.timeout(10.0)
            for n in batch:
                inst.submit(SimRequest(RequestSpec(i, env.now, n, 1)))

    env.process(arrivals())
    env.run()
    return done


def test_a_new_two_prompt_bucket_costs_the_warm_up_runs_and_the_capture_once():
    g = GraphCapture(2048, 0.030, "test")
    forward = PREFILL.batch_time([1064, 963])
    t = _forwards(g, [[1064, 963], [1064, 963], [2027]])
    assert t[0] == pytest.approx(forward * (1 + WARMUP_RUNS) + 0.030) and t[1] == t[0]  # one forward, both prompts
    assert t[2] == pytest.approx(forward)  # the same bucket again: a replay
    assert t[4] == pytest.approx(PREFILL.batch_time([2027]))  # one prompt: captured at the server's start
    assert _forwards(None, [[1064, 963]])[0] == pytest.approx(forward)  # no graph model: no first-use cost


def test_buckets_captured_before_the_run_cost_nothing_and_eager_forwards_never_capture():
    g = GraphCapture(2048, 0.030, "test")
    env = simpy.Environment()
    inst = PrefillInstance(env, 0, PREFILL, lambda r: None, graphs=g, captured=[(2048, 2)])
    assert inst._first_use_s([(None, 1064), (None, 963)], 0.05) == 0.0
    assert inst._first_use_s([(None, 100)] * 17, 0.05) == 0.0  # 17 sequences: past the graphs, eager
    assert inst._first_use_s([(None, 100), (None, 100)], 0.05) == pytest.approx(0.13) and inst.captures == [(256, 2)]


def test_probe_captures_plays_the_first_prompt_alone_and_the_rest_together():
    g = GraphCapture(2048, 0.0, "test")
    assert probe_captures(g, PREFILL, [(1, 48), (2, 48)]) == ()  # each forward holds one prompt
    assert probe_captures(g, PREFILL, [(3, 100)]) == ((256, 2),)
    # two of 1750 after the first: 1750 + 298 (chunked at 2048), then the rest of the second alone
    assert probe_captures(g, PREFILL, [(3, 1750)]) == ((2048, 2),)


def test_graph_capture_reads_the_capture_from_the_probe_record():
    rec = {"device": "d", "warmup_runs": WARMUP_RUNS, "rows": [
        {"first_ms": (1 + WARMUP_RUNS) * 50.0 + 20.0, "replay_ms": 50.0},
        {"first_ms": (1 + WARMUP_RUNS) * 10.0 + 24.0, "replay_ms": 10.0},
        {"first_ms": (1 + WARMUP_RUNS) * 30.0 + 22.0, "replay_ms": 30.0}]}
    assert graph_capture(rec).capture_s == pytest.approx(0.022)
    with pytest.raises(ValueError, match="warm-up runs"):
        graph_capture({**rec, "warmup_runs": WARMUP_RUNS + 1})


def test_the_front_end_line_comes_from_the_probes_prompt_lengths():
    p = Probes()
    for n in (16, 256, 1024, 2048):
        p.prefill += [(n, 0.01)] * 2
        p.frontend += [0.008 + 2e-6 * n] * 2
    assert frontend_line(p) == pytest.approx((0.008, 2e-6))
    assert frontend_line(replace(p, frontend=p.frontend[:3])) == pytest.approx((0.008 + 2e-6 * 16, 0.0))  # unpaired: the median
    assert frontend_line(Probes()) == (0.0, 0.0)


def _one_request(cfg: SimConfig, n: int) -> dict:
    wl = Workload("one", LengthDist(n), LengthDist(4), 1e9, 1e9)
    return simulate(cfg, 1.0, wl, 1, per_request=True)


def _config(**kw) -> SimConfig:
    return SimConfig(name="gn-hawk", transfer=TransferCurve("t", (1.0, 1e9), (0.002, 0.012)), prefill=PREFILL,
                     decode=DecodeModel(0.02, 0.0, 0.0, 8, 1 << 20, "test"), bytes_per_token=1000, contention="none", **kw)


def test_the_front_end_per_token_adds_to_ttft_and_leaves_the_server_stages():
    base = _one_request(_config(frontend_s=0.008), 1000)
    grown = _one_request(_config(frontend_s=0.008, frontend_per_token_s=2e-6), 1000)
    assert grown["requests"][0]["ttft_s"] == pytest.approx(base["requests"][0]["ttft_s"] + 2e-3)
    # per_request takes the whole front end out of the simulated prefill queue
    real = {"rate": 1.0, "requests": [{"index": 0, "input_len": 1000, "ttft_s": 0.05, "extra": {"hawk": {"prefill_queue_s": 0.0}}}]}
    row = per_request(real, grown)[0]
    assert row["stages_ms"]["prefill_queue_s"]["sim"] == pytest.approx(0.0, abs=1e-9)


def test_calibrated_config_carries_the_front_end_line_and_the_graphs():
    p = Probes(prefill=[(16, 0.01), (1024, 0.02)], transfer=[(16e3, 0.003), (1.024e6, 0.004)], kv_tokens=[(16, 16e3), (1024, 1.024e6)],
               decode=[(1, 0.03)], frontend=[0.008 + 2e-6 * 16, 0.008 + 2e-6 * 1024])
    c = calibrate(p, max_batch=8, kv_tokens=1 << 20)
    g = GraphCapture(2048, 0.03, "test")
    cfg = calibrated_config(c, "gn-hawk", prefill_graphs=g, captured=[(2048, 2)])
    assert cfg.frontend_per_token_s == pytest.approx(2e-6) and cfg.frontend_s == pytest.approx(0.008)
    assert cfg.prefill_graphs == g and cfg.prefill_graphs_captured == ((2048, 2),)


def test_a_request_lost_at_its_pull_takes_no_share_of_the_decode_host():
    """Two prompts pulled at once share the decode host's link; with the second lost as its pull starts
    (the real run's failed host-rx reservation), the first pulls alone, and only the second fails."""
    cfg = replace(_config(), contention="decode", transfer=TransferCurve("t", (1.0, 1e6), (0.001, 0.101)))  # 1 ms + 100 ms of bytes
    wl = Workload("two", LengthDist(1000), LengthDist(4), 1e9, 1e9)
    both = simulate(cfg, 1e6, wl, 2, per_request=True)
    lost = simulate(cfg, 1e6, wl, 2, per_request=True, lost_at_pull={1: "decode failed: buffer 'host-rx': no room"})
    solo = cfg.transfer.latency(1000 * cfg.bytes_per_token)
    assert both["requests"][0]["extra"]["kv_transfer_s"] > solo + 0.05  # the two pulls overlapped
    assert lost["requests"][0]["extra"]["kv_transfer_s"] == pytest.approx(solo)
    assert lost["completed"] == 1 and lost["requests"][1]["ok"] is False and "host-rx" in lost["requests"][1]["error"]


def test_lost_at_pull_reads_only_decode_buffer_failures():
    real = {"requests": [
        {"index": 0, "ok": True, "ttft_s": 0.1},
        {"index": 5, "ok": False, "ttft_s": None, "error": "decode failed: request x: buffer 'host-rx': 'x' needs 5 B"},
        {"index": 6, "ok": False, "ttft_s": None, "error": "HTTP 500: prefill failed"},
        {"index": 7, "ok": False, "ttft_s": None, "error": "decode failed: request y: prefill refused: buffer 'staging': 'y' needs 5 B"},
    ]}
    assert list(lost_at_pull(real)) == [5]


def test_the_paced_summarization_run_captures_its_two_prompt_bucket_at_1_req_s_only():
    """The committed gn-hawk run of 2026-12-04: requests 2 and 3 (1064 + 963 tokens) share one forward
    at both rates; its (2048, 2) bucket is new at 1 req/s (the probes sent at most 48-token prompts
    together), captured there, and replayed at 2 req/s: the same server's state carries over."""
    import json
    from pathlib import Path

    from benchmarks import cross_validate as cv
    from hawk.devices.timing import StepModel
    from hawk.sim.workload import get_workload

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/crossval_h200/paced_bfp8_summarization_gn-hawk_20261204.json"
    saved = json.loads(path.read_text())
    s, a = saved["scenarios"][0], saved["args"]
    probes = Probes(**{k: [tuple(x) if isinstance(x, list) else x for x in v] for k, v in s["probes"].items()})
    lim = s["served_limits"]
    cal = calibrate(probes, max_batch=lim["max_batch"], kv_tokens=lim["decode_kv_tokens"], prefill_chunk=2048,
                    prefill_kv_tokens=lim["prefill_kv_tokens"])
    g = cv.prefill_graphs("cuda:0", 2048)
    cfg = calibrated_config(cal, "gn-hawk", npu_step=StepModel(**s["npu_step_model"]), link_gbps=200.0, prefill_graphs=g)
    one, two = cv.simulate_rates(cfg, probes, None, s["real"], get_workload(a["workload"]), a["rates"], a["num_requests"], a["seed"])
    assert one["prefill_graph_captures"] == [[[2048, 2]]] and two["prefill_graph_captures"] == [[]]
    forward = cal.prefill.batch_time([1064, 963])
    pf = {r["index"]: r["extra"]["prefill_s"] for r in one["requests"]}
    assert pf[2] == pf[3] == pytest.approx(g.extra_s(forward) + forward)
    assert {r["index"]: r["extra"]["prefill_s"] for r in two["requests"]}[2] == pytest.approx(forward)


def test_prefill_graphs_are_the_gpus_only():
    from benchmarks import cross_validate as cv

    assert cv.prefill_graphs("cpu", 2048) is None and cv.prefill_graphs("cuda:0", 0) is None
    g = cv.prefill_graphs("cuda:0", 2048)
    assert g.max_tokens == 2048 and g.capture_s >= 0.0
