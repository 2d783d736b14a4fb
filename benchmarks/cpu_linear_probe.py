"""The CPU decode step with and without ``model.linear``'s few-rows detour, in one process, in rounds.

Why: torch's CPU ``F.linear`` (MKL) ran slowly for 1-8 rows on this project's CPU box, and
``hawk.engine.model.linear`` computes those as ``w @ x.T``; this times SmolLM2's decode step (paged
cache, the engine benchmark's point) both ways at several batch sizes, alternating the two every
round, and the raw matmuls over the model's own weights.

    python benchmarks/cpu_linear_probe.py --batches 1,2,4,8 --json cpu_linear.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from hawk.bench import engine as eb
from hawk.engine import model as model_mod
from hawk.engine.loader import load_model


def decode_steps(model: Any, batch: int, context: int, rounds: int) -> dict[str, float]:
    """Median ms of the engine benchmark's decode step, detour on and off alternately per round."""
    pt = eb.build_decode_point(model, "gpu-paged", "bf16", batch, context, torch.device("cpu"))
    try:
        times: dict[str, list[float]] = {"detour": [], "F.linear": []}
        few = model_mod.CPU_FEW_ROWS
        for r in range(rounds + 1):
            for name in (["detour", "F.linear"] if r % 2 == 0 else ["F.linear", "detour"]):
                model_mod.CPU_FEW_ROWS = few if name == "detour" else 0
                t0 = time.perf_counter()
                pt.step()
                if r:  # round 0 warms both up
                    times[name].append((time.perf_counter() - t0) * 1e3)
        model_mod.CPU_FEW_ROWS = few
    finally:
        pt.cache.close()
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


def raw_matmuls(model: Any, rows: int, repeats: int) -> dict[str, float]:
    """Every matmul weight of the model once (the fused projections, wo, down, the LM head) at ``rows``: ms."""
    ws = [w for layer in model.layers for w in (layer.attn.wqkv, layer.attn.wo.weight, layer.mlp.w_gate_up,
                                                layer.mlp.down.weight)] + [model.lm_head.weight]
    xs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in ws}}

    def run(f: Any) -> float:
        f()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, (time.perf_counter() - t0) * 1e3)
        return round(best, 2)

    return {"F.linear": run(lambda: [F.linear(xs[w.shape[1]], w) for w in ws]),
            "detour": run(lambda: [model_mod.linear(xs[w.shape[1]], w) for w in ws])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, torch.device("cpu"), torch.float32, 0).model
    out: dict[str, Any] = {"model": a.model, "threads": a.threads, "context": a.context, "few_rows": model_mod.CPU_FEW_ROWS,
                           "decode_ms": {}, "matmuls_ms": {}}
    for b in (int(x) for x in a.batches.split(",")):
        out["decode_ms"][b] = decode_steps(model, b, a.context, a.rounds)
        out["matmuls_ms"][b] = raw_matmuls(model, b, 5)
        d, m = out["decode_ms"][b], out["matmuls_ms"][b]
        print(f"batch {b}: decode step {d['F.linear']:.1f} ms as F.linear, {d['detour']:.1f} ms with the detour; "
              f"the matmuls alone {m['F.linear']:.1f} / {m['detour']:.1f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
