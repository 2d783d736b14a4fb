"""``hawk bench serving --saturation``: the ramp's stop rule, the SLO-90 rate, the bound's formula and
the decode probe's window, on made-up records (the live path runs in the GPU suite's part)."""

import json
import math

import pytest

from hawk.bench.saturation import (
    MIN_WINDOW_STEPS, SaturationOptions, bound_from, compare, decode_probe, fit_line, main, ramp, rows_of, slo90_rate, spread_probe,
    step_window,
    summarize,
)
from hawk.sim.metrics import RequestResult
from hawk.sim.workload import RequestSpec


def test_the_ramp_stops_once_throughput_stops_growing():
    served = {1.0: 1.0, 2.0: 1.9, 4.0: 3.0, 8.0: 3.1, 16.0: 3.1}
    recs = ramp(lambda r: {"rate": r, "request_throughput_rps": served[r], "slo_attainment": 1.0}, SaturationOptions(1.0, 2.0, 0.05, 8), log=lambda _: None)
    assert [r["rate"] for r in recs] == [1.0, 2.0, 4.0, 8.0]  # 3.1 < 3.0 * 1.05: stop
    capped = ramp(lambda r: {"rate": r, "request_throughput_rps": r}, SaturationOptions(1.0, 2.0, 0.05, 3), log=lambda _: None)
    assert len(capped) == 3


def test_the_slo90_rate_is_interpolated_between_the_last_pass_and_the_first_miss():
    recs = [{"rate": 1.0, "slo_attainment": 1.0}, {"rate": 2.0, "slo_attainment": 0.95}, {"rate": 4.0, "slo_attainment": 0.5}]
    assert slo90_rate(recs) == pytest.approx(2.0 + 2.0 * 0.05 / 0.45)
    assert slo90_rate([{"rate": 1.0, "slo_attainment": 0.2}]) is None
    assert slo90_rate([{"rate": 1.0, "slo_attainment": 1.0}, {"rate": 3.0, "slo_attainment": 0.92}]) == 3.0


def test_the_bound_adds_prefill_and_a_batch_share_of_the_decode_steps():
    specs = [RequestSpec(0, 0.0, 100, 11), RequestSpec(1, 0.0, 300, 21)]
    b = bound_from(specs, (0.002, 0.0001), 0.010, 10, "server prefill_s")
    prefill = ((0.002 + 0.01) + (0.002 + 0.03)) / 2
    decode = (10 * 0.010 / 10 + 20 * 0.010 / 10) / 2
    assert b.bound_rps == pytest.approx(1 / (prefill + decode))
    assert b.prefill_ms_mean == pytest.approx(prefill * 1e3) and b.decode_step_ms == pytest.approx(10.0)
    assert fit_line([(100, 0.012), (300, 0.032), (500, 0.052)]) == pytest.approx((0.002, 0.0001))
    assert fit_line([(100, 0.5)]) == (0.5, 0.0)


def _res(first: float, gaps: list[float]) -> RequestResult:
    return RequestResult(0, 10, len(gaps) + 1, 0.0, first_s=first, last_s=first + sum(gaps), output_tokens=len(gaps) + 1, ok=True, itl_s=gaps)


def test_the_step_window_counts_tokens_while_the_whole_batch_decodes():
    """Two requests, steps of 10 ms; the second starts at 0.05 s, the first ends at 0.3 s: in
    (0.05, 0.3] each gets 25 tokens, even where a client read them in bursts."""
    a = _res(0.0, [0.01] * 30)
    bursty = [0.0 if i % 5 else 0.05 for i in range(40)]  # five tokens at once, every 50 ms
    b = _res(0.05, bursty)
    span, counts = step_window([a, b])
    assert span == pytest.approx(0.25)
    assert counts[0] == 25 and abs(counts[1] - 25) <= 5
    with pytest.raises(RuntimeError, match="failed"):
        step_window([a, RequestResult(1, 10, 5, 0.0)])


def test_a_request_whose_text_came_once_bounds_the_window_but_is_not_counted():
    """A byte-level tokenizer may send a request's text in one chunk: no gaps to count, but the
    request was decoding, so it still ends the window."""
    a = _res(0.0, [0.01] * 30)
    once = RequestResult(1, 10, 31, 0.0, first_s=0.025, last_s=0.205, output_tokens=31, ok=True, itl_s=[])
    span, counts = step_window([a, once])
    assert span == pytest.approx(0.18)  # (0.025, 0.205]: the tokens at 0.03 ... 0.20
    assert counts == [18]


def test_the_step_window_counts_tokens_not_chunks_where_chunks_carry_usage():
    """Steps of 1/64 s; b's text is held back (no text chunk at all until its end), but every chunk
    reports usage: the window and the counts come from those, and the step is 1/64 s."""
    step = 1 / 64  # exact in binary: the window's edges fall on marks
    a = _res(0.0, [step] * 30)
    a.token_marks = [(step * i, i + 1) for i in range(31)]
    b = RequestResult(1, 10, 31, 0.0, first_s=32 * step, last_s=32 * step, output_tokens=31, ok=True, itl_s=[],
                      token_marks=[(step * (2 + i), i + 1) for i in range(31)])
    span, counts = step_window([a, b])
    assert span == 28 * step  # (2 steps, 30 steps]
    assert counts == [28, 28] and span / counts[0] == step
    b.token_marks = None  # no usage from the server: text chunks, and b's came at its end
    assert step_window([a, b])[0] == 0.0


def test_the_decode_probe_centres_its_window_on_the_workloads_context():
    specs = [RequestSpec(i, 0.0, 750, 200) for i in range(10)]
    n_in, n_out, ctx = decode_probe(256, specs, 640)
    assert ctx == pytest.approx(850, rel=0.01) and n_out >= MIN_WINDOW_STEPS
    assert n_in + n_out < 2000  # the whole batch fits a large cache


def test_the_spread_probe_gives_each_row_a_requests_context():
    """Row i's context mid-window is the workload's i-th request's mid-decode one (to the window's
    rounding); the batch's prefill still ends before the window, and the rows keep the spread."""
    specs = [RequestSpec(i, 0.0, n, 200) for i, n in enumerate((100, 750, 3000, 400))]
    lengths, n_out = spread_probe(8, specs, 640)
    pre = -(-sum(lengths) // (640 - 8)) + 8
    assert n_out >= pre + 2 * MIN_WINDOW_STEPS
    mids = [l + (pre + n_out) // 2 for l in lengths]
    want = [s.input_len + 100 for s in specs] * 2
    assert all(abs(m - w) <= 1 or l == 16 for m, w, l in zip(mids, want, lengths))
    assert max(lengths) - min(lengths) >= 2500 and len(lengths) == 8


def test_summary_rows_and_acceptance():
    def run(cfg, sat, bound):
        at80 = {"rate": 0.8 * sat, "request_throughput_rps": 0.8 * sat, "tpot_p50_ms": 10.0, "itl_p99_ms": 25.0, "slo_attainment": 1.0}
        return {"config": cfg, "saturation_rps": sat, "saturation_rate": sat * 1.5, "saturation_over_bound": sat / bound if bound else None,
                "slo90_rate_rps": sat, "bound": {"bound_rps": bound} if bound else None, "ramp": [{"rate": sat, "request_throughput_rps": sat}],
                "at_80": at80, "tpot_p50_over_step_at_80": 1.2, "itl_p99_over_tpot_p50_at_80": 2.5}

    out = summarize([run("colocated", 20.0, 24.0), run("gn-hawk", 19.0, None)], "H200", "cmd")
    acc = out["acceptance"]
    assert acc["colocated_saturation_over_bound"]["holds"] and acc["disaggregated_over_colocated"]["value"] == pytest.approx(0.95)
    assert acc["tpot_p50_over_step_at_80"]["holds"] and acc["itl_p99_over_tpot_p50_at_80"]["holds"]
    rows = rows_of(out["runs"][0])
    assert [r["at_80"] for r in rows] == [False, True] and set(rows[0]) >= {"config", "rate", "bound_rps", "itl_p99_ms", "slo_attainment"}
    variant = summarize([run("colocated", 20.0, 24.0), run("colocated-mixed-graphs", 21.0, 24.0), run("gn-hawk", 19.0, None)],
                        "H200", "cmd")
    assert variant["acceptance"]["disaggregated_over_colocated"]["value"] == pytest.approx(0.95) and len(variant["summary"]) == 3
    worse = summarize([run("colocated", 10.0, 24.0)], "H200", "cmd")["acceptance"]
    assert not worse["colocated_saturation_over_bound"]["holds"] and "disaggregated_over_colocated" not in worse
    assert math.isclose(worse["colocated_saturation_over_bound"]["value"], 10 / 24)


def test_compare_against_another_server_with_more_servers_of_the_same_run(tmp_path):
    def sat(cfg, rps):
        return {"config": cfg, "saturation_rps": rps}

    def half(ttft):
        return {"rate": 0.5, "request_throughput_rps": 0.5, "ttft_median_ms": ttft, "tpot_median_ms": 40.0, "slo_attainment": 0.95}

    out = compare(sat("hawk", 1.5), sat("vllm", 1.0), half(300.0), half(310.0), "box", "cmd", others=[(sat("hawk-gn", 0.5), half(900.0))])
    acc = out["acceptance"]
    assert acc["saturation_ours_over_theirs"]["value"] == pytest.approx(1.5) and acc["saturation_ours_over_theirs"]["holds"]
    assert acc["ttft_p50_ours_over_theirs_at_half"]["holds"]
    assert out["others"] == [{"config": "hawk-gn", "saturation_rps": 0.5, "over_theirs": 0.5, "at_half_of_theirs": {
        "rate": 0.5, "request_throughput_rps": 0.5, "ttft_median_ms": 900.0, "ttft_p99_ms": None, "tpot_median_ms": 40.0, "tpot_p99_ms": None,
        "itl_p99_ms": None, "slo_attainment": 0.95}}]
    assert [r["config"] for r in out["runs"]] == ["hawk", "vllm", "hawk-gn"] and len(out["half_rate_runs"]) == 3
    slower = compare(sat("hawk", 0.9), sat("vllm", 1.0), half(320.0), half(310.0), "box", "cmd")["acceptance"]
    assert not slower["saturation_ours_over_theirs"]["holds"] and not slower["ttft_p50_ours_over_theirs_at_half"]["holds"]
    # the CLI: --also adds a pair, read like the others (a list of records, or one record)
    for name, rec in {"o": sat("hawk", 1.5), "t": sat("vllm", 1.0), "oh": [half(300.0)], "th": [half(310.0)],
                      "d": sat("hawk-gn", 0.5), "dh": [half(900.0)]}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    f = [str(tmp_path / f"{n}.json") for n in ("o", "t", "oh", "th", "d", "dh")]
    cli = main(["compare", *f[:4], "--also", *f[4:], "--out", str(tmp_path / "out.json")])
    assert cli["others"][0]["config"] == "hawk-gn" and json.loads((tmp_path / "out.json").read_text())["others"][0]["over_theirs"] == 0.5


def _streamed(sent: float, tokens_at: list[float]) -> dict:
    """A finished request that streamed one token at each of ``tokens_at``."""
    gaps = [b - a for a, b in zip(tokens_at, tokens_at[1:])]
    return {"sent_s": sent, "ok": True, "first_s": tokens_at[0], "last_s": tokens_at[-1], "itl_s": gaps, "output_tokens": len(tokens_at)}


def test_steady_throughput_ignores_the_ramp_up_and_the_drain():
    """40 requests of 10 tokens at 10 req/s into a server that streams 40 tokens/s (4 req/s):
    queued one after another (FIFO), or all admitted at once and sharing its steps (each step one
    token to every running request, 40 tokens/s in all). Both sustain 4 req/s while the load lasts,
    though the second finishes nothing until the end (its middle completions are a burst: counting them
    read far more than 4). Below saturation the tokens follow the arrivals: 2 req/s."""
    from hawk.bench.saturation import steady_throughput

    fifo = [_streamed(i / 10, [i / 4 + k / 40 for k in range(1, 11)]) for i in range(40)]
    assert steady_throughput(fifo) == pytest.approx(4.0, rel=0.03)
    shared, t, left = [], 0.0, {i: 10 for i in range(40)}
    times: dict[int, list[float]] = {i: [] for i in range(40)}
    while left:  # steps of the running requests (those arrived), 1/40 s per token produced
        running = [i for i in left if i / 10 <= t] or [min(left)]
        t = max(t, min(running) / 10)
        for i in running:
            t += 1 / 40
            times[i].append(t)
            left[i] -= 1
            if not left[i]:
                del left[i]
    shared = [_streamed(i / 10, times[i]) for i in range(40)]
    assert max(r["last_s"] for r in shared[:30]) > 9.0  # finished in the drain, nearly all
    assert steady_throughput(shared) == pytest.approx(4.0, rel=0.03)
    under = [_streamed(i / 2, [i / 2 + k / 40 for k in range(1, 11)]) for i in range(40)]
    assert steady_throughput(under) == pytest.approx(2.0, rel=0.03)
    assert steady_throughput(fifo[:3]) is None
