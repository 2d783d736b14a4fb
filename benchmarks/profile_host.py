"""Host-side cost of one graph decode step (cProfile over many steps): what the GPU waits for.

    python benchmarks/profile_host.py --batch 1 --context 1024
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from hawk.bench import engine as eb
from hawk.engine.attention import SeqSlice
from hawk.engine.config import preset
from hawk.engine.model import LlamaModel
from hawk.engine.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    cfg = preset("llama-3.1-8b")
    model = LlamaModel.from_config(cfg, dtype=torch.bfloat16, device=dev, fuse=True)
    cache = eb.build_paged(cfg, "bf16", a.batch, a.context + 8, dev)
    slices = [SeqSlice(blocks, a.context, 1) for blocks in cache.blocks]
    toks = [[1] for _ in range(a.batch)]
    r = ModelRunner(model, cache.attn, max_batch=max(a.batch, 1), graphs=True)
    r.warmup([r._bucket(a.batch)])
    for _ in range(5):
        r.step(toks, slices).greedy.tolist()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(a.steps):
        r.step(toks, slices).greedy.tolist()
    prof.disable()
    print(f"{(time.perf_counter() - t0) / a.steps * 1e3:.3f} ms per step incl. sync")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
