"""Host time of a layer-wise push's pieces on the forward's thread (issue 9), one GPU, no model.

A 1k-token request of the Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128, 16-token GPU blocks) is
pushed the way ``Algorithm1Prefill._push_layer_inline`` pushes it into an emulated p150a's DRAM on the
same GPU: plan (``plan_layerwise`` over the shared plan cache), bind (``bind_triton_layers``: layer 0's
launch prepared), then per group of 4 layers the side stream ordered after the forward and entered
(``SideStream.posting``), the group's transforms launched in one call (layer 0 as bound, the others
moved), its completion marked. Host
microseconds per push for each piece, median over ``--pushes``, for requests whose blocks repeat (as
in ``hawk bench ttft``) and for fresh blocks each time (as in serving).

    python benchmarks/layer_post_probe.py --pushes 30 --json layer_post.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from hawk.connector.layer_stream import SideStream
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.layer_plan import plan_layerwise
from hawk.plan.plan_cache import PLANS
from hawk.transform.triton_kernel import bind_triton_layers

LAYERS, HEADS, D, GPU_BLOCK, NPU_BLOCK, GROUP = 32, 8, 128, 16, 64, 4


def one_push(caches, g, n, memory, channel_bytes, bases, tokens, gids, nids, side) -> dict[str, float]:
    t = {}
    t0 = time.perf_counter()
    plan = plan_layerwise(tokens, gids, nids, g, n, bases, PLANS.kv_plan)
    t1 = time.perf_counter()
    dest = plan.plan.memory_dest(channel_bytes)
    shifts = [plan.shift(layer) for layer in range(LAYERS)]
    t2 = time.perf_counter()
    run = bind_triton_layers(caches, plan.plan, memory, shifts, dest)
    t3 = time.perf_counter()
    t.update(plan=t1 - t0, dest=t2 - t1, bind=t3 - t2)
    for start in range(0, LAYERS, GROUP):
        b = time.perf_counter()
        with side.posting():
            c = time.perf_counter()
            run(*range(start, start + GROUP))
            d = time.perf_counter()
            side.written()
            e = time.perf_counter()
        f = time.perf_counter()
        t["layers"] = t.get("layers", 0.0) + d - c
        t["posting"] = t.get("posting", 0.0) + (c - b) + (f - e)
        t["written"] = t.get("written", 0.0) + e - d
    t["total"] = time.perf_counter() - t0
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pushes", type=int, default=30)
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "bfp8_b"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda:0", help="cpu: a smoke test under TRITON_INTERPRET=1")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gblocks, nblocks = 8 * -(-a.tokens // GPU_BLOCK), 8 * -(-a.tokens // NPU_BLOCK)
    g = GpuKVLayout(LAYERS, gblocks, GPU_BLOCK, HEADS, D, "bf16")
    n = NpuKVLayout(get_arch("blackhole-p150a", 1 << 30), LAYERS, nblocks, HEADS, NPU_BLOCK, D, a.kv_dtype)
    caches = [torch.randn(g.layer_shape, device=dev).to(torch.bfloat16) for _ in range(LAYERS)]
    layer_bytes = n.tensor_buffer(0).bytes_per_bank
    step = -(-layer_bytes // 4096) * 4096
    bases = [t * step for t in range(n.num_tensors)]  # lockstep: evenly spaced in every channel
    channel_bytes = step * n.num_tensors
    memory = torch.zeros(channel_bytes * n.arch.num_channels, dtype=torch.uint8, device=dev)
    side = SideStream(dev)
    rng = np.random.default_rng(0)
    fixed = (rng.permutation(gblocks)[: -(-a.tokens // GPU_BLOCK)], rng.permutation(nblocks)[: -(-a.tokens // NPU_BLOCK)])
    out = {}
    for kind in ("repeated", "fresh"):
        rows = defaultdict(list)
        for i in range(a.pushes + 3):
            ids = fixed if kind == "repeated" else (rng.permutation(gblocks)[: len(fixed[0])], rng.permutation(nblocks)[: len(fixed[1])])
            sync()
            t = one_push(caches, g, n, memory, channel_bytes, bases, a.tokens, *ids, side)
            sync()
            if i >= 3:
                for k, v in t.items():
                    rows[k].append(v * 1e6)
        out[kind] = {k: round(statistics.median(v), 1) for k, v in rows.items()}
        out[kind]["layer_each"] = round(out[kind]["layers"] / LAYERS, 1)
        print(kind, "host us per push:", json.dumps(out[kind]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": a.tokens, "kv_dtype": a.kv_dtype, "pushes": a.pushes, "us": out,
                       "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}, f, indent=1)


if __name__ == "__main__":
    main()
