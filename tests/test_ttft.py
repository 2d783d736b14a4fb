"""``hawk bench ttft``: the command is wired, a tiny run produces complete records whose host-side
breakdown adds up to the transfer it describes."""

import os
import subprocess
import sys

import pytest

from hawk.bench.ttft_cli import main

#: The decode side's laps and the sender's steps that run inside its D1-D2 round trip: together, D1 -> D7.
STEPS = ("send", "plan_overlap", "control", "sender_plan", "sender_reserve", "sender_transform", "sender_transform_wait",
         "sender_other", "plan", "reserve", "descs", "submit", "transfer_wait", "finish")


def test_help_lists_the_benchmarks_and_the_serve_options():
    # wide enough that rich does not shorten a long option name to fit 80 columns (what is tested is the list)
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "hawk", "bench", "ttft", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    for flag in ("--prompts", "--configs", "--kv-flows", "--model", "--transport", "--max-prefill-chunk", "--kv-tokens"):
        assert flag in out.stdout, flag


@pytest.mark.parametrize("args, needle", [(["--kv-flows", "sideways"], "--kv-flows takes"), (["--prompts", "1k"], "--prompts takes"),
                                          (["--dtype", "fp7"], "dtype")])
def test_bad_options_are_one_line_and_exit_2(args, needle):
    out = subprocess.run([sys.executable, "-m", "hawk", "bench", "ttft", "--model", "tiny", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(300)
def test_tiny_run_records_and_breakdown(tmp_path):
    path = tmp_path / "ttft.json"
    records = main(["--model", "tiny", "--prompts", "40,130", "--repeats", "1", "--warmup", "1", "--configs", "gn-hawk,gg-direct", "--json", str(path)])
    assert path.exists()
    assert {(r["config"], r["prompt_tokens"]) for r in records} == {(c, n) for c in ("gn-hawk", "gg-direct") for n in (40, 130)}
    for r in records:
        for key in ("config", "identical", "ttft_ms", "colocated_ttft_ms", "ratio", "prompt_tokens", "host_breakdown_ms"):
            assert key in r
        assert r["identical"], r
        assert r["ratio"] == pytest.approx(r["ttft_ms"] / r["colocated_ttft_ms"])
        assert r["ratio_paired"] == pytest.approx(r["ttft_ms_all"][0] / r["colocated_ttft_ms_all"][0])  # one repeat: one pair
        b = r["host_breakdown_ms"]
        assert set(STEPS) | {"release", "notify", "total"} <= set(b)
        assert all(v >= 0 for v in b.values())
        # One repeat: the steps partition the pull exactly (up to rounding), and the pull fits in TTFT.
        assert sum(b[k] for k in STEPS) == pytest.approx(b["total"], rel=1e-6, abs=1e-3)
        assert b["total"] < r["ttft_ms"]
        # where the TTFT went: before the prefill call, the call, after it (one repeat: they add up)
        for pieces, ttft in ((r["pieces_ms"], r["ttft_ms"]), (r["colocated_pieces_ms"], r["colocated_ttft_ms"])):
            assert sum(pieces[k] for k in ("before_prefill_ms", "prefill_call_ms", "after_prefill_ms")) == pytest.approx(ttft, rel=1e-6)
            assert 0 < pieces["prefill_engine_ms"] < pieces["prefill_call_ms"]
    hawk = [r for r in records if r["config"] == "gn-hawk"]
    assert all(r["host_breakdown_ms"]["sender_transform"] > 0 for r in hawk)


@pytest.mark.timeout(300)
def test_profile_posts_names_the_forward_threads_posts(tmp_path, monkeypatch):
    """--profile-posts: with posts on the forward's thread (forced on the CPU), the profile file holds
    the inline post and the records are still token-identical to colocated."""
    monkeypatch.setenv("HAWK_LAYERWISE_INLINE", "always")
    path = tmp_path / "posts.txt"
    records = main(["--model", "tiny", "--prompts", "64", "--repeats", "1", "--warmup", "0", "--configs", "gn-hawk",
                    "--kv-flows", "layerwise", "--transport", "local", "--profile-posts", str(path)])
    assert records and all(r["identical"] and r["transport"] == "local" for r in records)  # a serve option reached the run
    text = path.read_text()
    assert "_push_layer_inline" in text and "cumulative" in text
