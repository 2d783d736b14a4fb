"""Does a decode graph's replay time depend on how many graphs the process made before it?

A replay trace (``replay_trace`` below) found the first CUDA graph of a process idling less
between kernels than the later ones, whichever attention path it ran. This probe separates the
candidates, one 8B batch-1 decode graph (paged, context 1k) at a time, in one process:

* A: the first graph; B: a second one while A is alive; then A again (does A slow down once B exists?);
* A after B is destroyed and the allocator's cache emptied (does it recover?); C: a graph made after that.

Each line: median replay ms over 30 replays (CUDA events), and the idle time between kernels per replay
(``replay_trace``).

    python benchmarks/graph_order_probe.py
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hawk.bench import engine as eb  # noqa: E402
from hawk.engine.attention import SeqSlice  # noqa: E402
from hawk.engine.config import preset  # noqa: E402
from hawk.engine.model import LlamaModel  # noqa: E402
from hawk.engine.runner import ModelRunner  # noqa: E402

CONTEXT = 1024


def replay_trace(graph: torch.cuda.CUDAGraph, rows: int, replays: int = 5) -> str:
    """Where a replay's time goes beyond its kernels: the replayed kernels in start order, per kernel
    name the time it ran and the idle time before it started (since the previous kernel ended),
    summed over ``replays`` replays and divided by them; the largest gaps first. The total leaves out
    the gap before each replay's first kernel (the launch and the host's sync between replays)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    by: dict[str, list[float]] = {}
    per = max(1, len(ev) // replays)  # kernels per replay
    inside = 0.0
    prev_end = None
    for i, e in enumerate(ev):
        gap = 0.0 if prev_end is None else max(0.0, e.time_range.start - prev_end)
        inside += gap if i % per else 0.0
        d = by.setdefault(e.name[:60], [0, 0.0, 0.0])
        d[0] += 1
        d[1] += e.time_range.end - e.time_range.start
        d[2] += gap
        prev_end = e.time_range.end if prev_end is None else max(prev_end, e.time_range.end)
    lines = [f"=== replay trace ({replays} replays, per replay): kernels {sum(v[1] for v in by.values()) / replays:.0f} us, "
             f"gaps {inside / replays:.0f} us"]
    for name, (n, dur, gap) in sorted(by.items(), key=lambda kv: -kv[1][2])[:rows]:
        lines.append(f"    {name:60s} x{n // replays:4d}  ran {dur / replays:8.1f} us  gaps before {gap / replays:7.1f} us")
    return "\n".join(lines)

def graph(model: LlamaModel, cfg, dev: torch.device) -> tuple[object, ModelRunner]:
    """A paged batch-1 decode runner with its graph captured and replayed a few times."""
    cache = eb.build_paged(cfg, "bf16", 1, CONTEXT + 8, dev)
    slices = [SeqSlice(blocks, CONTEXT, 1) for blocks in cache.blocks]
    runner = ModelRunner(model, cache.attn, max_batch=1, graphs=True)
    runner.warmup([1])
    for _ in range(3):
        runner.step([[1]], slices).greedy.tolist()
    torch.cuda.synchronize()
    return cache, runner


def measure(label: str, runner: ModelRunner) -> None:
    g = runner._graphs[1].graph
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    gaps = replay_trace(g, 0).splitlines()[0].split("gaps ")[-1]
    print(f"{label:34s} replay median {sorted(times)[15]:.3f} ms, idle between kernels {gaps} per replay", flush=True)


def main() -> None:
    dev = torch.device("cuda:0")
    cfg = preset("llama-3.1-8b")
    model = LlamaModel.from_config(cfg, dtype=torch.bfloat16, device=dev, fuse=True)
    ca, a = graph(model, cfg, dev)
    measure("A (first graph)", a)
    cb, b = graph(model, cfg, dev)
    measure("B (second graph, A alive)", b)
    measure("A again (B alive)", a)
    del b, cb
    gc.collect()
    torch.cuda.empty_cache()
    measure("A after B destroyed", a)
    cc, c = graph(model, cfg, dev)
    measure("C (made after B destroyed)", c)
    measure("A again (C alive)", a)


if __name__ == "__main__":
    main()
