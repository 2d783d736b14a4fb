"""HAWK's CPU forward gives vLLM's CPU forward's bits, op by op and whole (vllm-cpu, SmolLM2 in bf16).

``benchmarks/vllm_cpu_numerics_probe.py`` runs vLLM in one process, captures every op's inputs and
outputs on a prefill and the decode steps after it, feeds each HAWK op vLLM's own inputs of that op, and
runs HAWK's whole prefill and whole decode (over vLLM's KV) against vLLM's logits. Greedy decoding gives
one vLLM instance's tokens only if all of that is bit for bit: a near-tie flips on one ulp. With HAWK's own
fp32 attention 16 of 138,240 decode attention outputs differed here (the AVX-512 box), and the whole
decode's logits with them; through vLLM's CPU kernel none does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/install.sh --with-vllm)", allow_module_level=True)

from hawk.engine.vllm_cpu_kernel import kernel_isa  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    if kernel_isa(64, torch.bfloat16) is None:
        pytest.skip("vLLM's CPU attention kernel is not fed here (see hawk/engine/vllm_cpu_kernel.py): HAWK's torch form")
    from hawk.engine.loader import load_model, save_hf_dir

    root = tmp_path_factory.mktemp("numerics")
    save_hf_dir(load_model("smollm2-135m", dtype=torch.bfloat16), str(root / "model"))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = root / "numerics.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_cpu_numerics_probe.py"), "--model", str(root / "model"),
                        "--prompt-lens", "32,256", "--steps", "3", "--json", str(out)], env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_op_gives_vllms_bits(probe: dict) -> None:
    ops = {op: s for op, s in probe["ops"].items() if not op.startswith("logits_dtype")}
    assert {"attention", "attention (prompt)", "rope_q", "add_rms_norm", "lm_head(logits)"} <= set(ops)
    assert all(s["elements"] > 0 for s in ops.values())
    assert {op: s["differ"] for op, s in ops.items() if s["differ"]} == {}


def test_whole_prefill_and_decode_give_vllms_logits(probe: dict) -> None:
    """HAWK's model on the prompt (as its colocated engine prefills) and over vLLM's KV (as its decode
    continues a vLLM prefill): the logits vLLM computed, every one."""
    for w in probe["whole_decode"]:
        assert w["prefill"]["differ"] == 0 and w["prefill"]["n"] > 0, w
        assert w["steps"] and all(s["differ"] == 0 for s in w["steps"]), w
