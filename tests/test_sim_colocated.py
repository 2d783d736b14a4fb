"""Known-answer tests of the colocated engine's mixed steps in simulation (hawk/sim/colocated.py).

The model mirrors ``DecodeEngine`` stepping a ``PrefillEngine``; these check its step arithmetic by
hand on flat step costs, that its budget rule is the engine's own, and that it reads the probe's
table as recorded."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.config import defaults
from hawk.config_cli import parse_config
from hawk.engine.capacity import GPU_MAX_NUM_SEQS
from hawk.engine.decode_engine import MIXED_PREFILL_SEQS, DecodeEngine
from hawk.sim.colocated import GPU_MAX_BATCH, MAX_PIECES, MixedPolicy, MixedStepCost, RowStreams, StepLog, interp, simulate_colocated
from hawk.sim.workload import RequestSpec

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "mixed_step_chunks_h200.json"
D = 10.0  # ms, every step of the flat table


def flat(decode_ms: float = D, per_token_ms: float = 0.0, prefill_ms: float = D) -> MixedStepCost:
    """Every decode step ``decode_ms``; prompt tokens add ``per_token_ms`` each beside rows; a prompt-only step ``prefill_ms``."""
    return MixedStepCost((16, 256), (decode_ms, decode_ms), (1, 1000), ((per_token_ms, 1000 * per_token_ms),) * 2,
                         (1, 1000), (prefill_ms, prefill_ms))


def test_interp_is_linear_inside_and_extends_its_end_segments():
    assert interp(1.5, (1, 2, 4), (10, 20, 40)) == pytest.approx(15)
    assert interp(3, (1, 2, 4), (10, 20, 40)) == pytest.approx(30)
    assert interp(0, (1, 2, 4), (10, 20, 40)) == pytest.approx(0)  # first segment extended
    assert interp(6, (1, 2, 4), (10, 20, 40)) == pytest.approx(60)  # last segment extended
    assert interp(7, (5,), (3,)) == 3


def test_a_lone_request_takes_its_chunks_then_one_step_a_token():
    """1000 prompt tokens at a 640 budget: two prompt steps (first token at 2 steps), then the four
    other tokens one step each; with nothing else in flight it joins the very next step."""
    log = StepLog()
    (r,) = simulate_colocated([RequestSpec(0, 0.0, 1000, 5)], flat(), MixedPolicy(640), log)
    assert log.prompt_tokens == [640, 360, 0, 0, 0, 0]
    assert r.ttft_s == pytest.approx(2 * D / 1e3)
    assert r.tpot_s == pytest.approx(D / 1e3)
    assert r.output_tokens == 5 and r.ok
    assert r.itl_s == pytest.approx([D / 1e3] * 4)


def test_a_prompt_done_beside_running_rows_decodes_from_the_step_after_next():
    """Async scheduling: the step after the one that finished a prompt was launched before that step
    was read, so the new sequence's second token comes two steps after its first (one with a
    synchronous loop); the running sequence keeps one token a step throughout."""
    for lag, gap in ((1, 2), (0, 1)):
        a = RequestSpec(0, 0.0, 10, 40)
        b = RequestSpec(1, 0.035, 100, 4)  # arrives during A's 4th step
        ra, rb = simulate_colocated([a, b], flat(), MixedPolicy(join_lag_steps=lag))
        assert rb.ttft_s == pytest.approx((5 * D - 35) / 1e3)  # its one chunk rides step 5 (40-50 ms)
        assert rb.itl_s[0] == pytest.approx(gap * D / 1e3)
        assert ra.itl_s == pytest.approx([D / 1e3] * 39)


def test_a_finished_sequence_rides_one_more_step():
    """A sequence that got its last token in step N is a row of step N+1 (launched before N was read)."""
    log = StepLog()
    simulate_colocated([RequestSpec(0, 0.0, 10, 3), RequestSpec(1, 0.0, 10, 8)], flat(), MixedPolicy(), log)
    # step 1: both prompts; 2: both join; A's last token at step 3, it rides step 4
    assert log.rows[:6] == [0, 2, 2, 2, 1, 1]
    log0 = StepLog()
    simulate_colocated([RequestSpec(0, 0.0, 10, 3), RequestSpec(1, 0.0, 10, 8)], flat(), MixedPolicy(join_lag_steps=0), log0)
    assert log0.rows[:5] == [0, 2, 2, 1, 1]


def test_prompt_tokens_lengthen_the_step_by_the_table():
    """A step's time is the decode step plus what its prompt tokens add, at those rows."""
    log = StepLog()
    simulate_colocated([RequestSpec(0, 0.0, 10, 30), RequestSpec(1, 0.05, 200, 2)], flat(per_token_ms=0.01), MixedPolicy(), log)
    mixed = [s for s, p in zip(log.seconds, log.prompt_tokens) if p == 200]
    assert mixed == [pytest.approx((D + 2.0) / 1e3)]


def test_a_later_chunk_pays_for_its_pairs_with_the_earlier_ones():
    """1000 prompt tokens at a 640 budget: the second chunk's 360 queries each see the first 640
    tokens (230,400 pairs), which ``pair_ns`` prices; the first chunk has none."""
    log = StepLog()
    cost = dataclasses.replace(flat(), pair_ns=10.0)
    simulate_colocated([RequestSpec(0, 0.0, 1000, 2)], cost, MixedPolicy(640), log)
    assert log.pairs[:2] == [0, 360 * 640]
    assert log.seconds[:2] == [pytest.approx(D / 1e3), pytest.approx(D / 1e3 + 360 * 640 * 10e-9)]


def test_later_chunk_records_set_the_pair_cost(tmp_path):
    """A probe file with a chunk at offsets 0 and 512: the extra time over (chunk x offset) pairs."""
    recs = [{"kind": "decode", "batch": 48, "chunk": 128, "offset": o, "gpu_ms": 6.0} for o in (0, 512)]
    recs += [{"kind": "mixed", "batch": 48, "chunk": 128, "offset": 0, "gpu_ms": 8.0},
             {"kind": "mixed", "batch": 48, "chunk": 128, "offset": 512, "gpu_ms": 8.0 + 128 * 512 * 20e-6},
             {"kind": "prefill", "batch": 48, "chunk": 128, "offset": 0, "gpu_ms": 5.0}]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"mixed_graphs": recs}))
    cost = MixedStepCost.from_probe(path, "mixed_graphs")
    assert cost.pair_ns == pytest.approx(20.0)
    assert cost.step_s(48, 128) == pytest.approx(8.0e-3)  # the grid holds the fresh chunk only
    lines = tmp_path / "probe.jsonl"  # the probe's lines as gpu_suite.sh keeps them
    lines.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert MixedStepCost.from_probe(lines, "offsets") == dataclasses.replace(cost, source=cost.source.replace("probe.json, its mixed_graphs", "probe.jsonl, its offsets"))
    assert MixedStepCost.from_probe(PROBE, "mixed_graphs").pair_ns == 0.0  # the committed probe has no later chunks


def test_at_most_max_pieces_prompts_ride_a_step_and_the_batch_caps_the_prompts_started():
    reqs = [RequestSpec(i, 0.0, 8, 2) for i in range(40)]
    log = StepLog()
    simulate_colocated(reqs, flat(), MixedPolicy(), log)
    assert log.chunks[0] == MAX_PIECES
    log = StepLog()
    simulate_colocated(reqs, flat(), MixedPolicy(max_batch=5), log)
    assert log.chunks[0] == 5
    assert max(r + c for r, c in zip(log.rows, log.chunks)) <= 5 + 5  # rows: at most 5 sequences, plus their riders


def test_every_request_finishes_with_all_its_tokens():
    reqs = [RequestSpec(i, i * 0.003, 50 + 37 * i % 400, 1 + 13 * i % 60) for i in range(120)]
    out = simulate_colocated(reqs, flat(per_token_ms=0.01), MixedPolicy(step_token_target=64))
    assert [r.index for r in out] == list(range(120))
    assert all(r.ok and r.output_tokens == s.output_len for r, s in zip(out, reqs))


def test_the_budget_is_the_engines():
    """``MixedPolicy.budget`` is ``DecodeEngine._prefill_budget`` for every rows / backlog / setting."""

    class Prefill:
        def __init__(self, backlog: int):
            self.backlog = backlog

        def backlog_exceeds(self, tokens: int) -> bool:
            return self.backlog > tokens

    @settings(max_examples=300, deadline=None)
    @given(st.integers(0, 300), st.integers(0, 20_000), st.integers(257, 1024), st.integers(0, 1023), st.integers(1, 64))
    def check(rows: int, backlog: int, budget: int, target: int, steps: int) -> None:
        target = target % budget
        engine = types.SimpleNamespace(prefill=Prefill(backlog), _running=[None] * rows, max_num_batched_tokens=budget,
                                       step_token_target=target, step_target_backlog=steps)
        assert MixedPolicy(budget, target, steps).budget(rows, backlog) == DecodeEngine._prefill_budget(engine)  # type: ignore[arg-type]

    check()


def test_the_policy_reads_the_serve_options():
    """The simulator keeps torch out, so it restates two engine constants; they must stay the engine's."""
    assert MAX_PIECES == MIXED_PREFILL_SEQS
    assert GPU_MAX_BATCH == GPU_MAX_NUM_SEQS
    d = defaults()
    p = MixedPolicy.from_config(d)
    on_gpu = dataclasses.replace(d, transfer="colocated", prefill_device="cuda:0")
    assert (p.max_num_batched_tokens, p.step_token_target, p.step_target_backlog, p.decode_split_tokens) == (
        on_gpu.step_budget, d.step_token_target, d.step_target_backlog, d.decode_split_tokens)
    assert MixedPolicy() == p  # the dataclass's defaults are the options' (GPU batch and budget)
    cfg = parse_config("serve", ["--transfer", "colocated", "--mixed-graphs", "--step-token-target", "192", "--max-num-seqs", "128",
                                 "--max-num-batched-tokens", "256", "--step-target-backlog", "64"])
    assert MixedPolicy.from_config(cfg) == MixedPolicy(256, 192, 64, 128)


def test_the_table_is_the_probes_records():
    """Read back, the table gives each probed point's own time: a decode batch with a chunk beside it,
    and a decode step at each batch (the median of the decode probes there)."""
    data = json.loads(PROBE.read_text())
    for section in ("pieces", "mixed_graphs"):
        cost = MixedStepCost.from_probe(PROBE, section)
        decode: dict[int, list[float]] = {}
        for r in data[section]:
            if r.get("kind") == "mixed":
                assert cost.step_s(r["batch"], r["chunk"]) * 1e3 == pytest.approx(r["gpu_ms"])
            elif r.get("kind") == "decode":
                decode.setdefault(r["batch"], []).append(r["gpu_ms"])
        for b, ms in decode.items():
            assert cost.decode_s(b) * 1e3 == pytest.approx(sorted(ms)[len(ms) // 2])
            assert cost.step_s(b, 0) == cost.decode_s(b)
    graphs = MixedStepCost.from_probe(PROBE, "mixed_graphs")
    pre = sorted(r["gpu_ms"] for r in data["mixed_graphs"] if r.get("kind") == "prefill" and r["chunk"] == 256)
    assert graphs.step_s(0, 256) * 1e3 == pytest.approx(pre[len(pre) // 2])
    assert graphs.step_s(0, 0) == 0.0


def test_a_table_must_be_whole():
    with pytest.raises(ValueError, match="every batch"):
        MixedStepCost((16, 48), (5.0,), (64,), ((1.0,), (1.0,)), (64,), (5.0,))
    with pytest.raises(ValueError, match="one value per chunk"):
        MixedStepCost((16,), (5.0,), (64, 128), ((1.0,),), (64,), (5.0,))
    with pytest.raises(ValueError, match="ascend"):
        MixedStepCost((48, 16), (5.0, 6.0), (64,), ((1.0,), (1.0,)), (64,), (5.0,))


def test_hawk_sim_colocated_sweeps_the_engine_its_serve_args_name(tmp_path, capsys):
    """``hawk sim --colocated PROBE --serve-args ...``: records of the serving schema, simulated, with the
    settings the flags give and the table their step path reads; a bad flag is a usage error."""
    from hawk.sim.command import main

    out = tmp_path / "colocated.json"
    recs = main(["--colocated", str(PROBE), "--serve-args", "--mixed-graphs --step-token-target 192", "--rates", "5,20",
                 "--num-requests", "120", "--json", str(out)])
    assert [r["rate"] for r in recs] == [5.0, 20.0] and json.loads(out.read_text()) == json.loads(json.dumps(recs, default=str))
    for r in recs:
        assert r["simulated"] and r["completed"] == 120 and "mixed_graphs table" in r["step_costs"]
        assert r["policy"]["step_token_target"] == 192 and r["config"] == "colocated --mixed-graphs --step-token-target 192"
    graphs = MixedStepCost.from_probe(PROBE, "mixed_graphs")
    assert recs[0]["tpot_p50_ms"] >= graphs.decode_s(16) * 1e3  # no step is faster than the table's smallest decode
    assert recs[1]["tpot_p50_ms"] > recs[0]["tpot_p50_ms"]  # more load, longer steps
    default = main(["--colocated", str(PROBE), "--rates", "5", "--num-requests", "60"])
    assert "pieces table" in default[0]["step_costs"] and default[0]["policy"] == dataclasses.asdict(MixedPolicy())
    with pytest.raises(SystemExit):
        main(["--colocated", str(PROBE), "--serve-args", "--step-token-target 9999", "--rates", "5"])
    assert "--step-token-target" in capsys.readouterr().err


def test_hawk_sim_colocated_costs_the_rows_contexts_on_request(tmp_path, capsys):
    """``--row-streams ENGINE``: chatbot rows' contexts spread past the probe's 850, so the same run's TPOT
    grows; ``--decode-split-tokens`` in the serve args gives it back; a probe file without its
    rows' context cannot be set beside them."""
    from hawk.sim.command import main

    engine = PROBE.parent / "engine_h200.json"
    args = ["--colocated", str(PROBE), "--rates", "20", "--num-requests", "200"]
    plain = main(args)[0]
    rows = main([*args, "--row-streams", str(engine)])[0]
    split = main([*args, "--row-streams", str(engine), "--serve-args", "--decode-split-tokens 512"])[0]
    assert "engine_h200.json" in rows["step_costs"] and "at most 512 tokens" in split["step_costs"]
    assert split["policy"]["decode_split_tokens"] == 512
    assert plain["tpot_p50_ms"] < rows["tpot_p50_ms"] and split["tpot_p50_ms"] < rows["tpot_p50_ms"]
    bare = tmp_path / "probe.jsonl"
    data = json.loads(PROBE.read_text())
    kept = [r for r in data["pieces"] if r.get("kind") in ("decode", "mixed")] + [r for r in data["mixed_graphs"] if r.get("kind") == "prefill"]
    bare.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "context"}) + "\n" for r in kept))
    with pytest.raises(SystemExit):
        main(["--colocated", str(bare), "--rates", "5", "--row-streams", str(engine)])
    assert "context is not recorded" in capsys.readouterr().err


# ---- the rows' contexts (RowStreams) ------------------------------------------------------------

#: 1 GB/s a program, 200 GB/s the device, a probe at context 100; a token's K and V of one head are 512 bytes
STREAMS = RowStreams(1.0, 200.0, 100, layers=2, kv_heads=8, head_dim=128, sms=132)


def test_the_longest_row_sets_a_layer_until_the_bytes_do():
    """One split a row past 16 rows (132 SMs, 8 KV heads); a layer takes its longest program or every
    program's bytes at the device's rate, whichever is longer: by hand."""
    assert [STREAMS.splits(b) for b in (1, 8, 16, 17, 256)] == [17, 3, 2, 1, 1]
    assert STREAMS.layer_s([1000] * 20) == pytest.approx(1000 * 512 / 1e9)  # the program (0.512 ms) over the bytes (0.41 ms)
    assert STREAMS.layer_s([1000] * 40) == pytest.approx(40 * 1000 * 8 * 512 / 200e9)  # now the bytes (0.82 ms)
    assert STREAMS.layer_s([170] * 1) == pytest.approx(10 * 512 / 1e9)  # 17 splits of 10 tokens
    # a batch at the probe's context adds nothing; one long row among them adds its program's time
    assert STREAMS.extra_s([100] * 20) == 0.0
    assert STREAMS.extra_s([100] * 19 + [3000]) == pytest.approx(2 * (3000 - 100) * 512 / 1e9)
    # rows split into programs of at most 500 tokens: the long row's program covers 500 (a grid of 8
    # splits, the row needing 6)
    split = dataclasses.replace(STREAMS, split_tokens=500)
    assert split.grid(20, 500) == 8
    assert split.extra_s([100] * 19 + [3000]) == pytest.approx(2 * (500 - 100) * 512 / 1e9)
    # past the grid: a 6000-token row in 8 splits of 750 tokens
    assert split.extra_s([100] * 19 + [6000]) == pytest.approx(2 * (750 - 100) * 512 / 1e9)
    assert STREAMS.extra_s([]) == 0.0


def test_the_rows_split_rule_is_the_kernels():
    """The simulator restates ``decode_num_splits`` and ``decode_splits`` (it keeps torch out); they must agree."""
    ta = pytest.importorskip("hawk.engine.triton_attention")
    assert STREAMS.split_grid == ta.SPLIT_GRID
    for rows in (1, 2, 5, 8, 16, 17, 33, 40, 64, 256):
        assert STREAMS.splits(rows) == ta.decode_num_splits(rows, STREAMS.kv_heads, STREAMS.sms)
        for split_tokens in (0, 256, 512, 1024):
            want = ta.decode_splits(rows, STREAMS.kv_heads, STREAMS.sms, STREAMS.max_len, split_tokens)[0]
            assert STREAMS.grid(rows, split_tokens) == want


def test_both_rates_come_back_from_decode_steps_they_made(tmp_path):
    """Engine records written by the model itself (batch 1: its programs below the device's rate;
    batch 64: its bytes above the programs') give the model's two rates back."""
    truth = RowStreams(17.0, 3500.0, 850, layers=32)
    base = {1: 4.0, 64: 7.0}
    recs = [{"kind": "decode", "path": "gpu-paged", "kv_dtype": "bf16", "batch": b, "context": c,
             "ms": base[b] + 1e3 * (truth.layer_s([c] * b) - truth.layer_s([1024] * b)) * truth.layers}
            for b in base for c in (1024, 8192)]
    recs.append({"kind": "prefill", "path": "gpu-paged", "batch": 1, "tokens": 512, "ms": 20.0})
    f = tmp_path / "engine.json"
    f.write_text(json.dumps(recs))
    got = RowStreams.from_engine(f, 850)
    assert got.program_gb_s == pytest.approx(17.0, rel=1e-3)  # the batch-1 ceilings round to whole tokens
    assert got.device_gb_s == pytest.approx(3500.0)
    assert got.probe_context == 850
    with pytest.raises(ValueError, match="two contexts"):
        f.write_text(json.dumps(recs[:1]))
        RowStreams.from_engine(f, 850)


def test_a_step_costs_what_its_rows_contexts_add():
    """A lone request decodes at the flat table's step plus what its context adds over the probe's,
    step by step as its context grows (by one token a step)."""
    cost = dataclasses.replace(flat(), streams=STREAMS)
    log = StepLog()
    (r,) = simulate_colocated([RequestSpec(0, 0.0, 340, 4)], cost, MixedPolicy(), log)
    # one prompt step, then three decode steps of contexts 341, 342, 343 (17 splits: 21 tokens a program)
    assert log.seconds[0] == pytest.approx(D / 1e3)
    for ctx, s in zip((341, 342, 343), log.seconds[1:]):
        assert s == pytest.approx(D / 1e3 + STREAMS.extra_s([ctx]))
    assert r.output_tokens == 4 and r.ok
    # without streams, the same table: every step the table's
    plain = StepLog()
    simulate_colocated([RequestSpec(0, 0.0, 340, 4)], flat(), MixedPolicy(), plain)
    assert plain.seconds == pytest.approx([D / 1e3] * 4)
