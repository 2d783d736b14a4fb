"""What a mixed step costs on a GPU against its parts: a decode batch, a prefill chunk, and both in
one forward (as the colocated engine's mixed steps run them), each timed on the device (CUDA events)
and on the host (the launch: the call until it returns, before any sync).

    python benchmarks/mixed_step_probe.py --model llama-3.1-8b --batches 16,64,128 --context 850 --chunk 512

One JSON line per point: ``{kind, batch, chunk, gpu_ms, host_ms, path}``; kind is ``decode`` (the batch
alone, as the engine runs it: graphs where captured), ``prefill`` (the chunk alone, eager),
``mixed`` (both, the runner's choice of path) and ``sum`` (decode + prefill).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hawk.engine.attention import SeqSlice
from hawk.engine.loader import load_model
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.runner import ModelRunner
from hawk.layouts.gpu import GpuKVLayout

BLOCK = 16


def _time(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """Median device ms (events around the launch and the work) and median host launch ms."""
    gpu, host = [], []
    for i in range(reps + 2):
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize(device)
        if i >= 2:
            gpu.append(a.elapsed_time(b))
            host.append(1e3 * (t1 - t0))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="16,64,128,256")
    ap.add_argument("--context", type=int, default=850)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefill-graph-tokens", type=int, default=640)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    device = torch.device(a.device)
    loaded = load_model(a.model, device, torch.bfloat16, 0)
    cfg = loaded.config
    batches = [int(x) for x in a.batches.split(",")]
    top = max(batches)
    per_seq = -(-(a.context + 2) // BLOCK)
    chunk_blocks = -(-(a.chunk + 1) // BLOCK)
    layout = GpuKVLayout(cfg.num_layers, top * per_seq + chunk_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, "bf16")
    caches = layout.allocate(device)
    attn = PagedAttention(layout, caches, max_batch=top + 17, max_model_len=a.context + a.chunk + 8)
    runner = ModelRunner(loaded.model, attn, max_batch=top, prefill_graph_tokens=a.prefill_graph_tokens)
    runner.warmup()
    chunk_ids = list(range(top * per_seq, top * per_seq + chunk_blocks))
    for b in batches:
        dec = [SeqSlice(list(range(i * per_seq, (i + 1) * per_seq)), a.context, 1) for i in range(b)]
        pre = SeqSlice(chunk_ids, 0, a.chunk)
        dtok, ptok = [[1]] * b, [list(range(1, a.chunk + 1))]
        rows = {}
        for kind, toks, slices in (("decode", dtok, dec), ("prefill", ptok, [pre]), ("mixed", dtok + ptok, dec + [pre])):
            path = []
            gpu, host = _time(lambda: path.append(runner.step(toks, slices).path.name), device, a.reps)
            rows[kind] = (gpu, host)
            print(json.dumps({"kind": kind, "batch": b, "chunk": a.chunk, "context": a.context, "gpu_ms": round(gpu, 3),
                              "host_ms": round(host, 3), "path": path[-1]}), flush=True)
        print(json.dumps({"kind": "sum", "batch": b, "chunk": a.chunk, "gpu_ms": round(rows["decode"][0] + rows["prefill"][0], 3),
                          "mixed_over_sum": round(rows["mixed"][0] / (rows["decode"][0] + rows["prefill"][0]), 3)}), flush=True)


if __name__ == "__main__":
    main()
