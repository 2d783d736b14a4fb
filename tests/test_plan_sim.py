"""``hawk sim --plan`` on a tiny search space: feasibility, ranking, the paper's setup and why it binds."""

from __future__ import annotations

import json

import pytest

from hawk.sim.command import main as sim_main
from hawk.sim.plan import PlanSpace, binding_constraint, build, decode_model, plan, prefill_model
from hawk.sim.testbeds import paper_testbed


def test_models_at_tp4_are_the_testbeds():
    tb = paper_testbed()
    assert decode_model(tb, "p150a", 4) == tb.decode_models["p150a-tp4"]
    assert prefill_model(tb, "a100", 4).per_token_s == pytest.approx(tb.prefill_models["a100-tp4"].per_token_s)
    # more devices: faster steps, more KV room; H100 prefills faster than A100
    assert decode_model(tb, "p150a", 8).base_s == pytest.approx(tb.decode_models["p150a-tp4"].base_s / 2)
    assert decode_model(tb, "a100", 8).kv_capacity_tokens > tb.decode_models["a100-tp4"].kv_capacity_tokens
    assert prefill_model(tb, "h100", 4).per_token_s < prefill_model(tb, "a100", 4).per_token_s


def test_tp2_does_not_fit_the_70b_and_price_counts_devices():
    tb = paper_testbed()
    c, cfg = build(tb, ("a100", "p150a", 2, 1, 1))
    assert cfg is None and not c.feasible and "p150a TP2" in c.why_infeasible
    c, cfg = build(tb, ("a100", "p150a", 4, 1, 2))
    assert cfg is not None and c.devices == 12 and c.transfer == "gn-hawk"
    assert cfg.admit_between_steps and cfg.first_token_on_decode  # the paper testbed serves with vLLM
    assert c.price_usd == pytest.approx(4 * tb.devices["a100-tp4"].price_usd + 8 * tb.devices["p150a-tp4"].price_usd)


def test_tiny_plan_ranks_and_explains():
    cands = plan(PlanSpace(prefill=("a100",), decode=("a100", "p150a"), tp=(4,), pd=((1, 1),)), "chatbot", num_requests=80)
    assert len(cands) == 2 and sorted(c.rank_cost for c in cands) == [1, 2]
    paper = next(c for c in cands if c.is_paper)
    assert paper.rate90 and paper.rate90 > 0 and paper.tok_s_per_kusd > 0 and paper.binds.startswith(("TTFT", "TPOT"))
    best = min(cands, key=lambda c: c.rank_cost)
    assert best.tok_s_per_kusd >= max(c.tok_s_per_kusd for c in cands)


def test_binding_constraint_reads_the_record():
    rec = {"ttft_attainment": 0.5, "tpot_attainment": 1.0, "decode_admit_wait_p90_ms": 900, "prefill_queue_p90_ms": 10,
           "decode_batch_peak": [32], "decode_max_batch": 32}
    assert "decode batch slots" in binding_constraint(rec)
    assert binding_constraint({"ttft_attainment": 1.0, "tpot_attainment": 0.2, "decode_batch_peak": [8], "tpot_p90_ms": 300}).startswith("TPOT")


def test_cli_plan_json_includes_the_paper_setup(tmp_path):
    out = tmp_path / "plan.json"
    sim_main(["--plan", "--plan-prefill", "h100", "--plan-decode", "p150a", "--plan-tp", "4", "--pd", "1:1",
              "--num-requests", "60", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["kind"] == "plan" and len(doc["candidates"]) == 2  # the paper's setup is always added
    assert any(c["paper_setup"] for c in doc["candidates"]) and "ranks #" in doc["verdict"]
