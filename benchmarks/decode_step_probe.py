"""Where a decode step's time goes, per path: host work around the graph, the graph itself, its kernels.

`hawk bench engine` times a whole step (metadata + graph replay + sampling + the host fetch of the
tokens), so two paths whose graphs differ by a few microseconds per layer can still differ by the host
work around them. For each path at one batch and context this probe builds the point as the benchmark
does and, in rounds (each round one call of each, the first rotating):

* ``step_ms``: the benchmark's step;
* ``graph_ms``: the captured graph alone, replayed on the metadata of the last step, between CUDA events
  recorded before and after the replay (the GPU is idle when it is launched, so the host's launch of
  the graph is inside it);
* ``host_ms``: ``step_ms - graph_ms``: metadata, upload, sampling, the token fetch;
* ``step_paired``, ``graph_paired``: each over the first point's, round by round (``paired_ratio``);

then, with ``--kernels``, a torch profiler trace of a few steps per path: GPU time per kernel name
(summed per step), to tell which kernels the paths differ in.

    python benchmarks/decode_step_probe.py --batch 1 --context 1024 --steps 200 --kernels \\
        --points gpu-paged:bf16,npu-tile:bfp8_b:regs-fw,npu-tile:bfp8_b:regs-fw-early --json step_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from hawk.bench import engine as eb


def prepare(model: Any, spec: str, batch: int, context: int, device: torch.device, name: str = "") -> dict[str, Any]:
    """The benchmark's point (cache, runner with its graph, step) plus the graph to replay alone.
    ``spec``: ``path:kv_dtype[:bfloat8_b variant]`` (the variant: a ``BFP8_VARIANTS`` name); ``name``:
    what results are keyed by (default ``spec``; a spec given twice is two points, each its own cache and graph)."""
    path, kv, *variant = spec.split(":")
    config = None
    if variant:
        from hawk.engine.triton_npu_attention import BFP8_VARIANTS

        config = BFP8_VARIANTS[variant[0]]
    pt = eb.build_decode_point(model, path, kv, batch, context, device, config)
    if not pt.graphs:
        pt.cache.close()
        raise RuntimeError(f"{path}/{kv}: no CUDA graphs ({pt.why})")
    pt.step()
    graph = pt.runner._graph_for(pt.runner._bucket(batch)).graph
    return {"name": name or spec, "cache": pt.cache, "step": pt.step, "graph": graph}


def time_rounds(points: list[dict[str, Any]], rounds: int, device: torch.device) -> dict[str, dict[str, float]]:
    steps: dict[str, list[float]] = defaultdict(list)
    graphs: dict[str, list[float]] = defaultdict(list)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = len(points)
    for r in range(rounds):
        for i in [(r + j) % n for j in range(n)]:
            p = points[i]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            p["step"]()
            torch.cuda.synchronize(device)
            steps[p["name"]].append((time.perf_counter() - t0) * 1e3)
            ev0.record()
            p["graph"].replay()
            ev1.record()
            torch.cuda.synchronize(device)
            graphs[p["name"]].append(ev0.elapsed_time(ev1))
    out = {}
    first = points[0]["name"]
    for p in points:
        s, g = statistics.median(steps[p["name"]]), statistics.median(graphs[p["name"]])
        out[p["name"]] = {"step_ms": round(s, 4), "graph_ms": round(g, 4), "host_ms": round(s - g, 4),
                          "step_paired": eb.paired_ratio(steps[p["name"]], steps[first])["median"],
                          "graph_paired": eb.paired_ratio(graphs[p["name"]], graphs[first])["median"]}
    return out


def kernel_times(p: dict[str, Any], steps: int) -> dict[str, float]:
    """GPU microseconds per step by kernel name (a torch profiler trace of ``steps`` steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            p["step"]()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:90]] += e.device_time / steps
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--points", default="gpu-paged:bf16,npu-tile:bfp8_b,npu-tile:bf16",
                    help="comma-separated path:kv_dtype[:bfloat8_b variant]; ratios are to the first; a spec given "
                         "again is another point (its own cache and graph, in other memory), named spec#2, #3, ...")
    ap.add_argument("--steps", type=int, default=200, help="rounds")
    ap.add_argument("--kernels", action="store_true", help="also a profiler trace of 5 steps per path")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from hawk.engine.loader import load_model

    dev = torch.device("cuda:0")
    model = load_model(a.model, dev, torch.bfloat16, 0).model
    specs = a.points.split(",")
    names = [s if specs[:i].count(s) == 0 else f"{s}#{specs[:i].count(s) + 1}" for i, s in enumerate(specs)]
    points = [prepare(model, pk, a.batch, a.context, dev, name) for pk, name in zip(specs, names)]
    try:
        time_rounds(points, 20, dev)  # warm-up
        res = time_rounds(points, a.steps, dev)
        base = res[points[0]["name"]]
        for name, r in res.items():
            print(f"{name:18} step {r['step_ms']:.4f} ms  graph {r['graph_ms']:.4f} ms  host {r['host_ms']:.4f} ms  "
                  f"step/first {r['step_ms'] / base['step_ms']:.4f}  graph/first {r['graph_ms'] / base['graph_ms']:.4f}  "
                  f"paired: step {r['step_paired']:.4f} graph {r['graph_paired']:.4f}")
        kernels = {}
        if a.kernels:
            for p in points:
                kernels[p["name"]] = kernel_times(p, 5)
                print(p["name"], "total GPU us per step", round(sum(kernels[p["name"]].values()), 1))
                for k, us in list(kernels[p["name"]].items())[:12]:
                    print(f"   {us:9.1f} us  {k}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"batch": a.batch, "context": a.context, "rounds": a.steps, "timings": res, "kernels_us": kernels,
                           "device": torch.cuda.get_device_name(dev)}, f, indent=1)
    finally:
        for p in points:
            p["cache"].close()


if __name__ == "__main__":
    main()
