"""`hawk bench engine`: records, the floor's byte count, the prefill flops, skips, the CLI and the JSON file.

Runs the "tiny" preset on the CPU with preset ceilings and one torch thread (the box is shared:
spinning OpenMP threads make tiny matmuls slow), so the whole file takes a few seconds.
"""

from __future__ import annotations

import gc
import json
import math
import weakref
import time
from collections.abc import Iterator

import pytest
import torch
from typer.testing import CliRunner

from hawk.bench import engine as eb
from hawk.engine.config import preset
from hawk.engine.model import LlamaModel

TINY = preset("tiny")  # vocab 512, hidden 128, ffn 256, 2 layers, 4 q heads, 2 kv heads, head_dim 32
CEILINGS = {"read_gbps": 10.0, "gemm_tflops": 0.05}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    return LlamaModel.from_config(TINY, dtype=torch.float32)


def _spec(**kw) -> eb.EngineBenchSpec:
    base = dict(model="tiny", device="cpu", batches=(1, 2), contexts=(40,), prefill_tokens=(16,), steps=2,
                warmup=0, point_budget_s=1.0, hf_baseline="off", ceilings=dict(CEILINGS))
    base.update(kw)
    return eb.EngineBenchSpec(**base)


def test_floor_bytes_match_a_hand_count() -> None:
    # Per layer: q 128x128, k 128x64, v 128x64, o 128x128, gate/up/down 3 x 128x256, two norms of 128.
    per_layer = 16384 + 8192 + 8192 + 16384 + 3 * 32768 + 2 * 128
    weights = 2 * per_layer + 128 + 512 * 128  # + final norm + the whole LM head; no embedding table
    assert eb.decode_weight_bytes(TINY, 4) == weights * 4 == 1_444_352
    # Paged bf16: batch 2 x 100 tokens x 2 layers x (K, V) x 2 heads x 32 dims x 2 bytes.
    assert eb.kv_read_bytes(TINY, "gpu-paged", "bf16", 2, 100) == 2 * 100 * 2 * 2 * 2 * 32 * 2
    # NPU tiles: ceil(100 / 32) = 4 tile rows x 1 tile column per head; bfp8_b tiles are 1088 bytes.
    tiles = 2 * 2 * 2 * 2 * 4 * 1
    assert eb.kv_read_bytes(TINY, "npu-tile", "bfp8_b", 2, 100) == tiles * 1088
    assert eb.kv_read_bytes(TINY, "npu-tile", "bf16", 2, 100) == tiles * 2048
    assert eb.decode_floor_bytes(TINY, 2, "gpu-paged", "bf16", 2, 100) == weights * 2 + 102_400


def test_weight_bytes_are_the_model_without_its_embedding_table(tiny_model: LlamaModel) -> None:
    params = sum(p.numel() for n, p in tiny_model.named_parameters() if n != "embed.weight")
    assert eb.decode_weight_bytes(TINY, 4) == params * 4
    tied = preset("smollm2-135m")  # tied: the LM head is the embedding table, counted once
    m = LlamaModel.from_config(tied, device="meta")
    assert eb.decode_weight_bytes(tied, 2) == sum(p.numel() for p in m.parameters()) * 2


def test_prefill_flops_hand_count() -> None:
    t = 64
    matmuls = 2 * 2 * (16384 + 8192 + 8192 + 16384 + 3 * 32768) * t + 2 * 128 * 512  # LM head: last token
    attention = 2 * 2 * 4 * 32 * t * (t + 1)  # QK^T and PV over T(T+1)/2 causal pairs, 4 q heads
    assert eb.prefill_flops(TINY, t) == matmuls + attention


def test_records_have_the_fields_and_sane_values(tiny_model: LlamaModel) -> None:
    recs = eb.run_benchmark(_spec(), model=tiny_model, verbose=False)
    decode = [r for r in recs if r["kind"] == "decode"]
    prefill = [r for r in recs if r["kind"] == "prefill"]
    assert {(r["path"], r["kv_dtype"]) for r in decode} == {("gpu-paged", "bf16"), ("npu-tile", "bf16"), ("npu-tile", "bfp8_b")}
    assert len(decode) == 3 * 2 and len(prefill) == 1
    for r in recs:
        assert not r.get("skipped")
        assert r["ms"] > 0 and r["device"].startswith("cpu") and r["model"] == "tiny" and r["dtype"] == "fp32"
        assert r["path"] in ("gpu-paged", "npu-tile") and "note" in r
    for r in decode:
        assert r["interleaved"] == 3 and r["steps"] == 2  # the three paths of a batch, timed in rounds
        assert r["overlap"] is False and "sync_ms" not in r  # a CPU engine's steps are synchronous
        assert r["floor_ms"] > 0 and r["read_gbps"] == CEILINGS["read_gbps"] and r["context"] == 40
        assert math.isclose(r["ratio"], r["ms"] / r["floor_ms"], rel_tol=1e-3)
        nbytes = eb.decode_floor_bytes(TINY, 4, r["path"], r["kv_dtype"], r["batch"], 40)
        assert r["floor_bytes"] == nbytes
        assert math.isclose(r["floor_ms"], nbytes / 10e9 * 1e3, rel_tol=1e-3)
        assert ("emulated NPU: memory on cpu" in r["note"]) == (r["path"] == "npu-tile")
        if r["path"] == "gpu-paged":
            assert "vs_paged" not in r
        else:  # paired with the paged step of its batch, round by round
            v = r["vs_paged"]
            assert v["rounds"] == 2 and v["q25"] <= v["median"] <= v["q75"] and v["median"] > 0
    (p,) = prefill
    assert p["tokens"] == 16 and p["flops"] == eb.prefill_flops(TINY, 16) and p["gemm_tflops"] == CEILINGS["gemm_tflops"]
    achieved = p["flops"] / (p["ms"] * 1e-3) / 1e12
    assert math.isclose(p["ratio"], achieved / CEILINGS["gemm_tflops"], rel_tol=1e-2)


def test_overlapped_steps_chain_the_tokens_a_synchronous_loop_feeds_back(tiny_model: LlamaModel) -> None:
    """The GPU's timed loop (each step launched on the previous step's device tokens) computes
    what k synchronous steps compute; here on the CPU, where its fetches are immediate."""
    cache = eb.build_paged(TINY, "bf16", 2, 41, torch.device("cpu"))
    try:
        runner, _, _ = eb.make_runner(tiny_model, cache.attn, 2, torch.device("cpu"))
        _, step = eb.make_step(runner, 2)
        slices = [eb.SeqSlice(b, 40, 1) for b in cache.blocks]
        tokens = [[3], [7]]
        for _ in range(5):
            tokens = [[t] for t in step(tokens, slices)]
        chained = eb.make_overlapped_steps(runner, 2, k=5)(([3], [7]), slices)
    finally:
        cache.close()
    assert chained == [t for (t,) in tokens]


def test_a_group_lets_go_of_its_runners_before_it_frees_memory(tiny_model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner kept alive past the group's memory release keeps its cache and graphs reserved, and the
    next group's fit check then skips points that fit (it once did: 8B, batch 64 at 8k on an H200)."""
    made: list[weakref.ref] = []
    real = eb.make_runner

    def spy(*a, **k):
        out = real(*a, **k)
        made.append(weakref.ref(out[0]))
        return out

    alive: list[int] = []

    def free(device: torch.device) -> None:
        gc.collect()
        alive.append(sum(r() is not None for r in made))

    monkeypatch.setattr(eb, "make_runner", spy)
    monkeypatch.setattr(eb, "_free", free)
    recs = eb.run_benchmark(_spec(batches=(1,), prefill_tokens=()), model=tiny_model, verbose=False)
    assert len(recs) == 3 and len(made) == 3 and alive and alive[-1] == 0


def test_rounds_rotate_the_first_step_and_keep_each_steps_own_times() -> None:
    calls: list[str] = []
    naps = {"a": 0.06, "b": 0.01, "c": 0.03}  # 20 ms apart: a loaded box oversleeps 1-ms naps by several ms

    def make(name: str):
        def step() -> None:
            calls.append(name)
            time.sleep(naps[name])
        return step

    out = eb.time_rounds([make("a"), make("b"), make("c")], torch.device("cpu"), warmup=1, rounds=4, budget_s=60)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up call of each
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert [n for _, n in out] == [4, 4, 4]
    (ma, _), (mb, _), (mc, _) = out
    assert mb < mc < ma and ma >= 60.0


def test_replicas_are_built_in_turns_and_paired_replica_by_replica(tiny_model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, str]] = []
    prepare = eb._prepare_decode

    def spy(ctx, path, kv, batch, context):
        built.append((path, kv))
        return prepare(ctx, path, kv, batch, context)

    monkeypatch.setattr(eb, "_prepare_decode", spy)
    recs = eb.run_benchmark(_spec(batches=(1,), prefill_tokens=(), replicas=2), model=tiny_model, verbose=False)
    one = [("gpu-paged", "bf16"), ("npu-tile", "bf16"), ("npu-tile", "bfp8_b")]
    assert built == one + one  # replica 1 of each, then replica 2 of each
    assert [(r["path"], r["kv_dtype"]) for r in recs] == one
    for r in recs:
        assert r["replicas"] == 2 and r["steps"] == 4  # two replicas' two rounds, pooled
        if r["path"] == "npu-tile":
            v = r["vs_paged"]
            assert v["rounds"] == 4 and len(v["by_replica"]) == 2
            assert min(v["by_replica"]) <= v["q75"] and max(v["by_replica"]) >= v["q25"]
    with pytest.raises(ValueError, match="replicas"):
        eb.resolve(_spec(replicas=0))


def test_paired_ratio_is_taken_round_by_round() -> None:
    # round 2 ran both twice as slow: each round's own ratio counts (0.9, 1.0, 0.95, 1.0)
    a, b = [0.9, 2.0, 0.95, 1.0], [1.0, 2.0, 1.0, 1.0]
    v = eb.paired_ratio(a, b)
    assert v == {"median": 0.975, "q25": 0.9125, "q75": 1.0, "rounds": 4}
    assert eb.paired_ratio([3.0], [2.0]) == {"median": 1.5, "q25": 1.5, "q75": 1.5, "rounds": 1}
    with pytest.raises(ValueError, match="equal"):
        eb.paired_ratio([1.0], [1.0, 2.0])


def test_a_group_too_big_side_by_side_runs_its_points_one_at_a_time(tiny_model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    one = eb.cache_bytes(TINY, "npu-tile", "bfp8_b", 1, 41)
    monkeypatch.setattr(eb, "free_bytes", lambda device: one * 2 + 512 * eb.MiB)  # room for one cache, not three
    recs = eb.run_benchmark(_spec(batches=(1,), prefill_tokens=()), model=tiny_model, verbose=False)
    assert len(recs) == 3 and all(not r.get("skipped") and "interleaved" not in r for r in recs)


def test_a_point_that_does_not_fit_is_skipped_with_a_note(tiny_model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eb, "free_bytes", lambda device: 1 << 20)
    recs = eb.run_benchmark(_spec(paths=("npu-tile",), kv_dtypes=("bf16",), batches=(1,)), model=tiny_model, verbose=False)
    assert len(recs) == 1 and recs[0]["skipped"] and recs[0]["ms"] is None
    assert "skipped: needs" in recs[0]["note"] and recs[0]["floor_ms"] > 0


def test_time_budget_skips_the_rest(tiny_model: LlamaModel) -> None:
    recs = eb.run_benchmark(_spec(time_budget_s=1e-9), model=tiny_model, verbose=False)
    assert recs and all(r["skipped"] and r["note"] == "skipped: time budget spent" for r in recs)


def test_ceilings_are_measured() -> None:
    cpu = torch.device("cpu")
    assert eb.measure_read_gbps(cpu, 8 << 20, repeats=2) > 0
    assert eb.measure_gemm_tflops(cpu, torch.float32, 128, repeats=2) > 0


def test_cli_help_lists_every_option() -> None:
    from hawk.cli import app

    out = CliRunner().invoke(app, ["bench", "engine", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}, terminal_width=200)
    assert out.exit_code == 0, out.output
    opts = ("--model", "--device", "--dtype", "--batches", "--contexts", "--prefill-tokens", "--paths", "--kv-dtypes",
            "--steps", "--json", "--hf-baseline")
    for o in opts:
        assert o in out.output, o
    module_help = eb.build_parser().format_help()
    for o in opts:
        assert o in module_help, o


def test_cli_writes_the_json_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hawk.cli import app

    monkeypatch.setattr(eb, "measure_read_gbps", lambda device: 10.0)
    monkeypatch.setattr(eb, "measure_gemm_tflops", lambda device, dtype: 0.05)
    path = tmp_path / "out" / "engine.json"
    args = ["bench", "engine", "--model", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "32",
            "--prefill-tokens", "16", "--paths", "gpu-paged", "--steps", "1", "--warmup", "0", "--json", str(path)]
    out = CliRunner().invoke(app, args, terminal_width=200)
    assert out.exit_code == 0, out.output
    recs = json.loads(path.read_text())
    assert [(r["kind"], r["path"]) for r in recs] == [("prefill", "gpu-paged"), ("decode", "gpu-paged")]
    assert recs[0]["ratio"] > 0 and recs[1]["ratio"] > 0


def test_bad_options_fail_clearly() -> None:
    with pytest.raises(ValueError, match="unknown path"):
        eb.resolve(eb.EngineBenchSpec(paths=("tpu",), device="cpu"))
    with pytest.raises(ValueError, match="kv dtype"):
        eb.resolve(eb.EngineBenchSpec(kv_dtypes=("int4",), device="cpu"))


def test_runs_summary_reads_each_runs_paired_ratio() -> None:
    from benchmarks.engine_runs_summary import summarize

    def run(paired: float, skip_paged: bool = False) -> list[dict]:
        base = {"kind": "decode", "batch": 1, "context": 1024}
        paged = {**base, "path": "gpu-paged", "kv_dtype": "bf16", "ms": 5.0}
        npu = {**base, "path": "npu-tile", "kv_dtype": "bfp8_b", "ms": 4.9,
               "vs_paged": {"median": paired, "q25": paired - 0.01, "q75": paired + 0.01, "rounds": 9}}
        return [npu] if skip_paged else [paged, npu]

    (row,) = summarize([run(0.99), run(1.01), run(0.98), run(0.5, skip_paged=True)], target=1.0)
    assert (row["path"], row["kv_dtype"], row["batch"], row["n_runs"]) == ("npu-tile", "bfp8_b", 1, 3)
    assert row["paired_median_of_runs"] == 0.99 and (row["paired_min"], row["paired_max"]) == (0.98, 1.01)
    assert row["runs_at_or_below_target"] == 2 and row["runs"][0]["ratio_of_medians"] == 0.98


def test_decode_point_feeds_its_tokens_back_and_takes_the_decode_config_before_capture(tiny_model: LlamaModel) -> None:
    """``build_decode_point`` (the benchmark's and the probes' builder): each step's input is the previous
    step's sampled tokens, and a given ``decode_config`` is on the backend before the runner is built."""
    from hawk.engine.triton_npu_attention import DecodeConfig

    cfg = DecodeConfig(num_warps=2)
    pt = eb.build_decode_point(tiny_model, "npu-tile", "bfp8_b", 2, 40, torch.device("cpu"), cfg)
    try:
        assert pt.cache.attn.decode_config is cfg and pt.runner.attn is pt.cache.attn
        inputs: list[list[int]] = []
        outputs: list[list[int]] = []

        def run(tokens, slices):  # noqa: ANN001, ANN202 - a Step
            inputs.append([t[0] for t in tokens])
            outputs.append([(t[0] * 7 + 3) % 50 for t in tokens])  # not the input: a fed-back token shows
            return outputs[-1]

        step = pt.feed(run)
        step()
        step()
        step()
        assert inputs == [[1, 1], outputs[0], outputs[1]] and outputs[0] == [10, 10]
        pt.step()  # the point's own step: the engine's, on the same fed-back tokens
    finally:
        pt.cache.close()
