"""benchmarks/step_trace_fit.py recovers known step costs from trace lines made with them."""

import json

import numpy as np

from benchmarks.step_trace_fit import fit, load


def test_the_fit_recovers_the_costs_the_steps_were_made_with(tmp_path):
    rng = np.random.default_rng(0)
    true = {"const": 4.0, "rows": 0.03, "context": 2e-5, "longest_k": 0.97, "prompt_tokens": 0.017, "chunks": 0.2, "chunk_pairs_k": 0.004}
    lines = []
    for _ in range(300):
        rows = int(rng.integers(1, 64))
        chunks = int(rng.integers(0, 4))
        spans = [[int(rng.integers(0, 1000)), int(rng.integers(1, 300))] for _ in range(chunks)]
        prompt = sum(q for _, q in spans)
        pairs = sum(q * (s + q / 2) for s, q in spans) / 1e3
        ctx = rows * int(rng.integers(100, 1500))
        longest = int(rng.integers(100, 4000))  # the longest row's context
        ms = (true["const"] + true["rows"] * rows + true["context"] * ctx + true["longest_k"] * longest / 1e3
              + true["prompt_tokens"] * prompt + true["chunks"] * chunks + true["chunk_pairs_k"] * pairs)
        lines.append({"rows": rows, "context": ctx, "longest": longest, "prompt_tokens": prompt, "chunks": chunks, "spans": spans,
                      "path": "GRAPH", "device_ms": ms})
    lines.append({"rows": 1, "context": 9, "prompt_tokens": 0, "chunks": 0, "spans": [], "path": "GRAPH", "device_ms": None})  # off CUDA: left out
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    steps = load(path, skip=0)
    assert len(steps) == 300
    out = fit(steps)
    for k, v in true.items():
        assert abs(out["coef_ms"][k] - v) < 1e-6 * max(1.0, abs(v)) + 1e-9
    assert out["prompt_token_us"] == 17.0
    prompt_ms = sum(0.017 * s["prompt_tokens"] + 0.2 * s["chunks"] + 0.004 * s["chunk_pairs_k"] for s in steps)
    assert abs(out["prompt_share_of_step_time"] - prompt_ms / sum(s["device_ms"] for s in steps)) < 1e-3
    assert abs(out["prompt_token_us_all_in"] - 1e3 * prompt_ms / sum(s["prompt_tokens"] for s in steps)) < 0.01
    assert load(path, skip=100) == steps[100:]
    assert steps[0]["chunk_pairs_k"] == sum(q * (s + q / 2) for s, q in lines[0]["spans"]) / 1e3
    assert steps[0]["longest_k"] == lines[0]["longest"] / 1e3
    mixed = [s["device_ms"] for s in steps if s["prompt_tokens"] and s["rows"]]
    assert out["step_ms_pct"]["mixed"]["p50"] == round(float(np.percentile(mixed, 50)), 3)
    assert out["step_ms_pct"]["all"]["p99"] <= max(s["device_ms"] for s in steps)


def test_a_cpu_trace_is_fitted_on_its_launch_time(tmp_path):
    """Off CUDA a line has no device time; ``time="launch_ms"`` fits the launch's, which a CPU step runs inside."""
    lines = [{"rows": r, "context": 100 * r, "prompt_tokens": p, "chunks": int(p > 0), "spans": [[0, p]] if p else [], "path": "EAGER",
              "launch_ms": 2.0 + 0.5 * r + 0.1 * p, "device_ms": None} for r in range(1, 9) for p in (0, 16, 48)]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert load(path) == []
    steps = load(path, time="launch_ms")
    assert len(steps) == len(lines) and [s["step_ms"] for s in steps] == [x["launch_ms"] for x in lines]
    assert abs(fit(steps)["step_s"] - sum(x["launch_ms"] for x in lines) / 1e3) < 1e-3
