"""Paged decode attention per layer against its split count (GPU only): the probe behind
``decode_num_splits``.

Graph-timed over 32 layers' caches (so each layer reads its KV from DRAM, as in a model step), one
decode layer = the attention launch that also writes the new K/V, plus the split reduce; Llama-3.1-8B
shape (32 query heads, 8 KV heads, head_dim 128, vLLM blocks of 16).

    python -m benchmarks.decode_splits_probe --batches 1,8 --context 1024 --splits 4,8,16,24,33,48,64
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.npu_attention_probe import graph_us
from hawk.engine import triton_attention as ta

LAYERS, HKV, HQ, D, BS = 32, 8, 32, 128, 16


def per_layer_us(batch: int, ctx: int, splits: int, dev: torch.device) -> float:
    nblk = batch * (ctx // BS + 1)
    caches = [torch.randn(2, nblk, BS, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    bt = torch.arange(nblk, dtype=torch.int32, device=dev).view(batch, -1).contiguous()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    slots = (bt[:, (ctx - 1) // BS] * BS + (ctx - 1) % BS).to(torch.int32).contiguous()
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    po = torch.empty(batch, HQ, splits, D, dtype=torch.float32, device=dev)
    pl = torch.empty(batch, HQ, splits, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)

    layers = itertools.cycle(caches)  # each call of the captured graph reads the next layer's cache

    def one_layer() -> None:
        ta.paged_decode_fused(q, k, v, next(layers), bt, seq, slots, "NHD", splits, out=out, part_out=po, part_lse=pl,
                              merge=False)

    return graph_us(one_layer, reps=LAYERS, iters=20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--splits", default="4,8,16,24,33,48,64")
    a = p.parse_args()
    dev = torch.device("cuda:0")
    for b in (int(x) for x in a.batches.split(",")):
        rule = ta.decode_num_splits(b, HKV, ta.decode_sm_count(dev))
        for s in (int(x) for x in a.splits.split(",")):
            mark = "  <- decode_num_splits" if s == rule else ""
            print(f"batch {b} context {a.context} splits {s}: {per_layer_us(b, a.context, s, dev):.2f} us per layer{mark}", flush=True)


if __name__ == "__main__":
    main()
