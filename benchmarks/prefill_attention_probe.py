"""The prefill attention kernel on a served prompt's later chunks: its time and throughput per launch
configuration, against a same-run ceiling (torch's SDPA on the same queries and keys, contiguous).

A served prompt is prefilled in chunks; each chunk after the first attends to the prompt's earlier
tokens in the paged cache (bottom-right causal). ``paged_prefill`` runs one program per (query block,
query head), so a 128-224-token chunk is two query blocks: 64 programs on an 8B shape, whatever the
cached length. This probe says what such a launch costs per layer and per query-key pair (the unit
``hawk/sim/colocated.py``'s ``pair_ns`` reading of the served runs uses), for the engine's configuration
and for others, so that a slow later chunk shows with what would make it faster.

    python benchmarks/prefill_attention_probe.py                                # 8B shape, chunks 128,224 after 0-768 cached
    python benchmarks/prefill_attention_probe.py --chunks 192 --offsets 0,576 --seqs 1,2
    TRITON_INTERPRET=1 python benchmarks/prefill_attention_probe.py --device cpu --check-only \
        --heads 4 --kv-heads 2 --head-dim 32 --chunks 20 --offsets 0,37 --configs 16x16x4x1

Each point is first checked against SDPA (bf16; every configuration's output within ``--atol`` of it),
then timed on the GPU (``triton.testing.do_bench``: L2 cleared before each run, median). One JSON line per
(chunks, cached, configuration): ``us`` per layer, ``tflops`` (4·pairs·head_dim·heads over the time),
``over_sdpa`` (SDPA's time over this one: 1 is the ceiling's speed), ``ns_per_pair_step`` (the layer's
time × ``--layers`` per query-key pair: a step's attention cost per pair, comparable to pair_ns) and
``engine`` (the configuration the engine launches: ``prefill_block_m`` and ``prefill_config``). Then a
``summary`` line per chunk: the engine configuration's added time per cached pair, between the smallest
and the largest offset, and the fastest configuration at the largest.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from hawk.engine import triton_attention as ta

BLOCK = 16


@dataclass(frozen=True)
class LaunchConfig:
    """One launch shape of ``paged_prefill``: query rows per program, key tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    @classmethod
    def parse(cls, text: str) -> LaunchConfig:
        m, n, w, s = (int(x) for x in text.lower().split("x"))
        return cls(m, n, w, s)

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.warps}x{self.stages}"


@dataclass
class Case:
    """``seqs`` prompts, each a ``chunk``-token chunk after ``cached`` tokens, in a shuffled paged NHD cache."""

    q: torch.Tensor  # [seqs * chunk, Hq, D]
    cache: torch.Tensor  # [2, blocks, BLOCK, Hkv, D]
    block_tables: torch.Tensor  # [seqs, width] int32
    seq_lens: torch.Tensor  # [seqs] int32
    q_start: torch.Tensor  # [seqs + 1] int32
    keys: torch.Tensor  # [seqs, Hkv, cached + chunk, D], contiguous K for the reference
    values: torch.Tensor

    @property
    def pairs(self) -> int:
        """Query-key pairs the causal launch computes, per query head."""
        n, chunk = self.seq_lens.shape[0], self.q.shape[0] // self.seq_lens.shape[0]
        cached = int(self.seq_lens[0]) - chunk
        return n * (chunk * cached + chunk * (chunk + 1) // 2)


def build(seqs: int, chunk: int, cached: int, hq: int, hkv: int, d: int, device: torch.device, seed: int = 0) -> Case:
    """Random K/V written into shuffled blocks (a served cache is fragmented), and the queries."""
    g = torch.Generator().manual_seed(seed)
    total = cached + chunk
    per_seq = -(-total // BLOCK)
    order = torch.randperm(seqs * per_seq, generator=g).view(seqs, per_seq)
    cache = torch.zeros(2, seqs * per_seq, BLOCK, hkv, d, dtype=torch.bfloat16)
    keys = torch.randn(seqs, hkv, total, d, generator=g).to(torch.bfloat16)
    values = torch.randn(seqs, hkv, total, d, generator=g).to(torch.bfloat16)
    for s in range(seqs):
        for i in range(per_seq):
            lo, hi = i * BLOCK, min((i + 1) * BLOCK, total)
            cache[0, order[s, i], : hi - lo] = keys[s, :, lo:hi].transpose(0, 1)
            cache[1, order[s, i], : hi - lo] = values[s, :, lo:hi].transpose(0, 1)
    q = torch.randn(seqs * chunk, hq, d, generator=g).to(torch.bfloat16)
    q_start = torch.arange(0, (seqs + 1) * chunk, chunk, dtype=torch.int32)
    return Case(q.to(device), cache.to(device), order.to(torch.int32).to(device),
                torch.full((seqs,), total, dtype=torch.int32, device=device), q_start.to(device),
                keys.to(device), values.to(device))


def sdpa_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[seqs, Hq, chunk, D]`` and the contiguous K/V with the GQA heads expanded."""
    seqs, hkv = case.keys.shape[0], case.keys.shape[1]
    chunk, hq = case.q.shape[0] // seqs, case.q.shape[1]
    q = case.q.view(seqs, chunk, hq, -1).transpose(1, 2).contiguous()
    return q, case.keys.repeat_interleave(hq // hkv, dim=1), case.values.repeat_interleave(hq // hkv, dim=1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ceiling: torch's SDPA, bottom-right causal (query i of a chunk after c cached tokens sees keys
    0 .. c + i), which dispatches to its flash kernel on a GPU."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def launcher(case: Case, cfg: LaunchConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The launch of ``cfg`` on ``case`` into a given output, its program map built and on the device
    beforehand (as the engine's ``begin`` does): only the kernel is timed."""
    chunk = case.q.shape[0] // case.seq_lens.shape[0]
    q_lens = np.full(case.seq_lens.shape[0], chunk, dtype=np.int64)
    starts = case.seq_lens.cpu().numpy().astype(np.int64) - chunk
    seq, blk = (torch.from_numpy(x).to(case.q.device) for x in ta.prefill_programs(q_lens, starts, cfg.block_m))

    def run(out: torch.Tensor) -> torch.Tensor:
        return ta.paged_prefill(case.q, case.cache, case.block_tables, case.seq_lens, case.q_start, seq, blk, "NHD",
                                cfg.block_m, out=out, block_n=cfg.block_n, num_warps=cfg.warps, num_stages=cfg.stages)

    return run


def engine_config(q: torch.Tensor) -> LaunchConfig:
    bn, nw, ns = ta.prefill_config(q)
    return LaunchConfig(ta.prefill_block_m(q.device, q.shape[2]), bn, nw, ns)


DEFAULT_CONFIGS = "128x64x8x3,128x32x8x2,128x64x4x3,64x64x4x3,64x64x4x2,64x32x4x2,64x128x8x2,32x64x4x2,16x64x4x2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32, help="query heads (8B: 32)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="layers a step runs the launch for (ns_per_pair_step)")
    ap.add_argument("--chunks", default="128,224", help="query tokens per prompt")
    ap.add_argument("--offsets", default="0,256,512,768", help="prompt tokens cached before the chunk")
    ap.add_argument("--seqs", default="1", help="prompts per launch (a comma list times each)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="launch shapes block_m x block_n x warps x stages; the engine's is always added")
    ap.add_argument("--atol", type=float, default=2e-2)
    ap.add_argument("--check-only", action="store_true", help="check every configuration against SDPA, time nothing (runs on a CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    device = torch.device(a.device)
    probe = torch.empty(1, a.heads, a.head_dim, dtype=torch.bfloat16, device=device)
    eng = engine_config(probe)
    configs = [eng] + [c for c in map(LaunchConfig.parse, a.configs.split(",")) if c != eng]
    offsets = [int(x) for x in a.offsets.split(",")]
    for seqs in (int(x) for x in a.seqs.split(",")):
        for chunk in (int(x) for x in a.chunks.split(",")):
            per_offset = {}
            for cached in offsets:
                per_offset[cached] = _point(a, device, configs, eng, seqs, chunk, cached)
            if not a.check_only:
                _summary(a, eng, seqs, chunk, per_offset)


def _point(a: argparse.Namespace, device: torch.device, configs: list[LaunchConfig], eng: LaunchConfig,
           seqs: int, chunk: int, cached: int) -> dict[str, float]:
    """Check, then time, every configuration at one shape; returns µs per layer by configuration."""
    case = build(seqs, chunk, cached, a.heads, a.kv_heads, a.head_dim, device)
    q4, k4, v4 = sdpa_inputs(case)
    ref = sdpa(q4, k4, v4).transpose(1, 2).reshape(case.q.shape).float()
    out = torch.empty_like(case.q)
    flops = 4.0 * case.pairs * a.head_dim * a.heads
    times: dict[str, float] = {}
    base = None
    if not a.check_only:
        base = do_bench(lambda: sdpa(q4, k4, v4)) * 1e3
        print(json.dumps({"kind": "sdpa", "seqs": seqs, "chunk": chunk, "cached": cached, "us": round(base, 2),
                          "tflops": round(flops / base / 1e6, 1)}), flush=True)
    for cfg in configs:
        run = launcher(case, cfg)
        out.zero_()
        err = float((run(out).float() - ref).abs().max())
        row = {"kind": "config", "seqs": seqs, "chunk": chunk, "cached": cached, "config": str(cfg), "engine": cfg == eng,
               "max_abs_err": round(err, 5), "ok": err <= a.atol}
        if not math.isfinite(err) or err > a.atol:
            print(json.dumps(row), flush=True)
            raise SystemExit(f"{cfg} differs from SDPA by {err} at chunk {chunk}, cached {cached}")
        if base is not None:
            us = do_bench(lambda run=run: run(out)) * 1e3
            times[str(cfg)] = us
            row |= {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1), "over_sdpa": round(base / us, 3),
                    "ns_per_pair_step": round(us * 1e3 * a.layers / case.pairs, 3)}
        print(json.dumps(row), flush=True)
    return times


def _summary(a: argparse.Namespace, eng: LaunchConfig, seqs: int, chunk: int, per_offset: dict[int, dict[str, float]]) -> None:
    """The engine configuration's added cost per cached query-key pair, and the best configuration at the largest offset."""
    lo, hi = min(per_offset), max(per_offset)
    e = str(eng)
    extra_pairs = seqs * chunk * (hi - lo)
    added = (per_offset[hi][e] - per_offset[lo][e]) * 1e3 * a.layers / extra_pairs if extra_pairs else float("nan")
    best = min(per_offset[hi], key=per_offset[hi].get)
    print(json.dumps({"kind": "summary", "seqs": seqs, "chunk": chunk, "cached": [lo, hi], "engine": e,
                      "engine_added_ns_per_cached_pair_step": round(added, 3), "best_at_largest": best,
                      "best_us": round(per_offset[hi][best], 2), "engine_us": round(per_offset[hi][e], 2)}), flush=True)


if __name__ == "__main__":
    main()
