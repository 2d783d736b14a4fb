"""Does a decode graph's replay time depend on how many graphs the process made before it?

`benchmarks/profile_decode.py --replay-trace` found the first CUDA graph of a process idling less
between kernels than the later ones, whichever attention path it ran. This probe separates the
candidates, one 8B batch-1 decode graph (paged, context 1k) at a time, in one process:

* A: the first graph; B: a second one while A is alive; then A again (does A slow down once B exists?);
* A after B is destroyed and the allocator's cache emptied (does it recover?); C: a graph made after that.

Each line: median replay ms over 30 replays (CUDA events), and the idle time between kernels per replay
(`profile_decode.replay_trace`).

    python benchmarks/graph_order_probe.py
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_decode import replay_trace  # noqa: E402

from hawk.bench import engine as eb  # noqa: E402
from hawk.engine.attention import SeqSlice  # noqa: E402
from hawk.engine.config import preset  # noqa: E402
from hawk.engine.model import LlamaModel  # noqa: E402
from hawk.engine.runner import ModelRunner  # noqa: E402

CONTEXT = 1024


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
