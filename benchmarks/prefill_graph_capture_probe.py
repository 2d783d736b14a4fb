"""What a prefill forward costs the first time its CUDA-graph bucket is used while serving.

Why: the prefill engine replays one CUDA graph per (token bucket, sequence bucket)
(``hawk/engine/runner.py``); the server captures the one-prompt buckets before traffic
(``warmup_prefill``), and any other bucket on its first use: ``WARMUP_RUNS`` eager runs of the
forward, then the capture, then the replay. A batch of two prompts is such a first use. This builds
the prefill's runner as the prefill instance does (same model shape, cache layout and graph
settings), captures the one-prompt buckets, then times, per token count, the first forward of two
prompts (the capture) and the same forward again (the replay). The simulator's first-use cost
(``hawk/sim/prefill.py``, ``GraphCapture``) is read from this file, never from a serving run.

    python benchmarks/prefill_graph_capture_probe.py --json benchmarks/results/prefill_graph_capture_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from hawk.engine.attention import SeqSlice
from hawk.engine.loader import load_model
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.runner import ModelRunner
from hawk.layouts.gpu import GpuKVLayout


def timed(runner: ModelRunner, pieces: list[int], first_block: int) -> float:
    """Seconds of one prefill forward of prompts of these lengths (fresh positions, own blocks)."""
    slices, tokens, nb = [], [], first_block
    for n in pieces:
        need = -(-n // 16)
        slices.append(SeqSlice(list(range(nb, nb + need)), 0, n))
        tokens.append([1] * n)
        nb += need
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.forward(tokens, slices)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--graph-tokens", type=int, default=2048, help="the prefill's --prefill-graph-tokens (default 2048)")
    p.add_argument("--totals", default="256,512,1024,1536,2027", help="total prompt tokens of the two-prompt forwards")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    loaded = load_model(a.model, "cuda:0", torch.bfloat16, 0)
    mc = loaded.config
    layout = GpuKVLayout(mc.num_layers, 2048, 16, mc.num_kv_heads, mc.head_dim, "bf16")
    runner = ModelRunner(loaded.model, PagedAttention(layout, layout.allocate("cuda:0")), graphs=False, prefill_graph_tokens=a.graph_tokens)
    t0 = time.perf_counter()
    startup = runner.warmup_prefill()
    warm_s = time.perf_counter() - t0
    rows = []
    for total in (int(x) for x in a.totals.split(",")):
        pieces = [total - total // 2, total // 2]
        solo = [timed(runner, [total], 0) for _ in range(a.replays)]  # a one-prompt bucket: captured at start
        first = timed(runner, pieces, 0)  # a new (tokens, 2) bucket: warm-up runs + capture + replay
        again = [timed(runner, pieces, 0) for _ in range(a.replays)]
        replay = statistics.median(again)
        rows.append({"total_tokens": total, "pieces": pieces, "first_ms": first * 1e3, "replay_ms": replay * 1e3,
                     "one_prompt_ms": statistics.median(solo) * 1e3, "extra_ms": (first - replay) * 1e3,
                     "extra_over_replay": (first - replay) / replay})
        print(rows[-1], flush=True)
    out = {"what": "first use of a two-prompt prefill graph bucket (capture) vs its replay, per total tokens",
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "node": platform.node(),
           "model": a.model, "warmup_runs": ModelRunner.WARMUP_RUNS, "startup_buckets": len(startup), "startup_capture_s": warm_s,
           "rows": rows, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
