"""Trace loaders (ShareGPT, Azure, Mooncake) on hand-made records, and traces as workloads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hawk.sim.cluster import simulate
from hawk.sim.command import main as sim_main
from hawk.sim.traces import CHARS_PER_TOKEN, TraceError, TraceLimits, TraceWorkload, guess_format, load_trace, trace_workload
from hawk.sim.workload import generate_requests

TRACES = Path(__file__).parent / "data" / "traces"
SHAREGPT, AZURE, MOONCAKE = TRACES / "sharegpt_sample.json", TRACES / "azure_sample.csv", TRACES / "mooncake_sample.jsonl"


def test_sharegpt_first_human_turn_and_its_reply():
    t = load_trace(SHAREGPT)
    assert t.format == "sharegpt" and not t.timed
    # conversation 3 has no reply: skipped; conversation 4 starts with gpt: its first human turn counts
    assert t.skipped == 1 and len(t.requests) == 3
    first = t.requests[0]
    assert first.input_len == math.ceil(len("Write a haiku about a kettle.") / CHARS_PER_TOKEN)
    assert t.requests[1].output_len == 1  # "4"
    assert t.length_source.startswith("estimate")


def test_sharegpt_with_a_tokenizer():
    t = load_trace(SHAREGPT, count_tokens=lambda s: len(s.split()))
    assert t.requests[0].input_len == 6 and t.length_source == "tokenizer"


def test_azure_arrivals_and_zero_output_skipped():
    t = load_trace(AZURE)
    assert t.timed and t.skipped == 1  # GeneratedTokens = 0
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 0.5, 4.0, 5.0])
    assert [r.input_len for r in t.requests] == [374, 396, 1521, 96]
    assert t.native_rate() == pytest.approx(3 / 5.0)


def test_mooncake_ms_timestamps_and_hashes():
    t = load_trace(MOONCAKE)
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 0.25, 1.0, 1.5])
    assert t.requests[3].hash_ids == (0, 1, 2, 4)
    assert t.summary()["trace_block_reuse"] == pytest.approx(0.5)


def test_limits_skip_and_restart_the_clock():
    t = load_trace(AZURE, limits=TraceLimits(max_input_len=1000, max_requests=2))
    assert [r.input_len for r in t.requests] == [374, 396]
    t = load_trace(MOONCAKE, limits=TraceLimits(min_input_len=1100))
    assert t.requests[0].arrival_s == 0.0 and t.requests[0].input_len == 1536


def test_rates_native_target_and_scale():
    tw = TraceWorkload(load_trace(AZURE))
    assert tw.rates(None, 100) == pytest.approx([0.6])
    specs = tw.requests(100, 2.0)  # compressed to a mean of 2 req/s, shape kept
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.15, 1.2, 1.5])
    assert (len(specs) - 1) / specs[-1].arrival_s == pytest.approx(2.0)
    fast = TraceWorkload(load_trace(AZURE), rate_scale=2.0)
    assert fast.rates(None, 100) == pytest.approx([1.2]) and fast.rates([1.0, 3.0], 100) == pytest.approx([2.0, 6.0])
    assert all(s.arrival_s == 0 for s in tw.requests(10, math.inf))


def test_untimed_trace_gets_seeded_poisson_arrivals():
    tw = TraceWorkload(load_trace(SHAREGPT))
    with pytest.raises(ValueError, match="no timestamps"):
        tw.rates(None, 10)
    a, b = generate_requests(tw, 10, 2.0, seed=3), generate_requests(tw, 10, 4.0, seed=3)
    assert len(a) == 3 and a[0].arrival_s == 0.0
    assert [x.arrival_s / 2 for x in a] == pytest.approx([y.arrival_s for y in b])  # same requests, faster


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("bad.json", "{not json", "not valid JSON"),
        ("obj.json", '{"conversations": []}', "JSON list"),
        ("empty.json", "[]", "no usable requests"),
        ("cols.csv", "time,in,out\n1,2,3\n", "missing column"),
        ("ts.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "neither seconds nor"),
        ("num.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,five,5\n", "is not a number"),
        ("frac.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,5.5,5\n", "whole number"),
        ("line.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 2}\nnope\n', r"line\.jsonl:2"),
        ("field.jsonl", '{"timestamp": 0, "input_length": 3}\n', "needs timestamp, input_length, output_length"),
        ("trace.txt", "x", "cannot tell the trace format"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path, name, text, match):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceError, match=match):
        load_trace(p)


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(AZURE, "parquet")
    with pytest.raises(TraceError, match="must be positive"):
        trace_workload(AZURE, rate_scale=0)
    assert guess_format("x.JSONL") == "mooncake"


def test_format_given_explicitly_overrides_the_extension(tmp_path):
    p = tmp_path / "trace.log"
    p.write_text(json.dumps({"timestamp": 5, "input_length": 7, "output_length": 3}) + "\n")
    assert load_trace(p, "mooncake").requests[0].input_len == 7


def test_simulator_and_cli_replay_a_trace(tmp_path):
    tw = trace_workload(MOONCAKE, slo_ttft_ms=5000)
    rec = simulate("gn-hawk", 2.0, tw, 100)
    assert rec["workload"] == "trace:mooncake_sample" and rec["num_requests"] == 4 and rec["slo_ttft_ms"] == 5000
    out = tmp_path / "sim.json"
    recs = sim_main(["--trace", str(AZURE), "--configs", "gn-hawk", "--trace-rate-scale", "2", "--json", str(out)])
    assert [r["rate"] for r in recs] == pytest.approx([1.2]) and recs[0]["trace_format"] == "azure"
    assert json.loads(out.read_text())[0]["trace_rate_scale"] == 2.0
    with pytest.raises(SystemExit):
        sim_main(["--trace", str(tmp_path / "missing.csv")])


def test_serving_bench_takes_trace_options():
    from hawk.bench.serving import trace_rates
    from hawk.sim.command import workload_from_args
    import argparse

    a = argparse.Namespace(trace=str(SHAREGPT), trace_format=None, trace_rate_scale=1.0, trace_max_input=None,
                           trace_max_output=None, slo_ttft_ms=None, slo_tpot_ms=None, workload="chatbot-tiny")
    wl = workload_from_args(a)
    assert trace_rates(None, wl, 20) == [0.5, 1.0, 2.0] and trace_rates([3.0], wl, 20) == [3.0]
    assert wl.scaled(0.5, 1.0).requests(3, 1.0)[2].input_len == round(wl.trace.requests[2].input_len * 0.5)
