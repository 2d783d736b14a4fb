"""Attention kernels alone, one layer, against ceilings measured in the same run (a tuning probe).

Decode: the GPU paged backend and the NPU-tile backend at the Llama-3.1-8B shape, GB/s of K/V read
against a stream read of a large tensor. Prefill: the paged varlen kernel's TFLOP/s against
torch's fused causal SDPA on dense tensors of the same shape. The whole-model figures live in
``hawk bench engine``; this probe says which kernel to tune.

    python benchmarks/attention_probe.py --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hawk.engine.attention import SeqSlice
from hawk.engine.paged_attention import PagedAttention
from hawk.layouts.gpu import GpuKVLayout

HQ, HKV, D = 32, 8, 128


def cuda_ms(fn: Callable[[], object], iters: int = 30) -> float:
    """Median of ``iters`` timed calls after warm-up (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def read_gbps(dev: torch.device) -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=dev)  # 2 GiB
    ms = cuda_ms(lambda: x.sum(), 10)
    return x.numel() * 2 / ms / 1e6


def decode_point(kind: str, batch: int, ctx: int, kv_dtype: str, dev: torch.device) -> dict:
    torch.manual_seed(0)
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if kind == "gpu-paged":
        bs = 16
        per = -(-(ctx + 1) // bs)
        lay = GpuKVLayout(1, batch * per, bs, HKV, D, "bf16")
        caches = lay.allocate(dev)
        attn = PagedAttention(lay, caches, max_batch=max(batch, 8), max_model_len=ctx + 64)
        kv_bytes = batch * ctx * HKV * D * 2 * 2
    else:
        from hawk.devices.emulated import open_npu
        from hawk.layouts.npu import NpuKVLayout, get_arch
        from hawk.engine.npu_attention import NpuTileAttention
        from hawk.memory.npu_kv_cache import NpuKVCacheMemory

        bs = 64
        per = -(-(ctx + 1) // bs)
        probe = NpuKVLayout(get_arch("blackhole-p150a"), 1, batch * per, HKV, bs, D, kv_dtype)
        bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + (8 << 20)
        npu = open_npu(f"npu-emu:{dev}", bank_capacity=-(-bank // (1 << 20)) * (1 << 20))
        lay = NpuKVLayout(npu.arch, 1, batch * per, HKV, bs, D, kv_dtype)
        mem = NpuKVCacheMemory(npu, lay)
        try:
            attn = NpuTileAttention(mem, max_batch=max(batch, 8), max_model_len=ctx + 64)
        except TypeError:
            attn = NpuTileAttention(mem)
        kv_bytes = batch * -(-ctx // 32) * HKV * (D // 32) * lay.page_size * 2
    slices = [SeqSlice(list(range(i * per, (i + 1) * per)), ctx, 1) for i in range(batch)]
    try:
        attn.begin(slices, pad_to=batch)
    except TypeError:
        attn.begin(slices)
    ms = cuda_ms(lambda: attn(0, q, k, v))
    return {"kind": "decode", "path": kind, "kv_dtype": kv_dtype, "batch": batch, "context": ctx, "ms": ms, "kv_bytes": kv_bytes, "gbps": kv_bytes / ms / 1e6}


def prefill_point(tokens: int, dev: torch.device) -> dict:
    bs = 16
    lay = GpuKVLayout(1, -(-tokens // bs), bs, HKV, D, "bf16")
    caches = lay.allocate(dev)
    attn = PagedAttention(lay, caches, max_batch=8, max_model_len=tokens)
    q = torch.randn(tokens, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(tokens, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    attn.begin([SeqSlice(list(range(lay.num_blocks)), 0, tokens)])
    ms = cuda_ms(lambda: attn(0, q, k, v), 10)
    qd = q.transpose(0, 1)[None]
    kd = k.transpose(0, 1)[None].repeat_interleave(HQ // HKV, 1)
    vd = v.transpose(0, 1)[None].repeat_interleave(HQ // HKV, 1)
    sdpa = cuda_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), 10)
    flops = 2 * tokens * tokens * HQ * D  # causal: half of 4·T²·H·D
    return {"kind": "prefill", "path": "gpu-paged", "tokens": tokens, "ms": ms, "sdpa_ms": sdpa, "tflops": flops / ms / 1e9, "vs_sdpa": sdpa / ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--paths", default="gpu-paged,npu-tile")
    a = p.parse_args()
    dev = torch.device("cuda:0")
    ceiling = read_gbps(dev)
    rows = []
    for path in a.paths.split(","):
        for kvd in (["bf16"] if path == "gpu-paged" else ["bf16", "bfp8_b"]):
            for b, c in [(1, 1024), (1, 8192), (8, 1024), (64, 1024), (64, 8192)]:
                try:
                    r = decode_point(path, b, c, kvd, dev)
                except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                    r = {"kind": "decode", "path": path, "kv_dtype": kvd, "batch": b, "context": c, "error": repr(e)[:300]}
                r["read_gbps"] = ceiling
                if "gbps" in r:
                    r["of_ceiling"] = r["gbps"] / ceiling
                print(json.dumps(r), flush=True)
                rows.append(r)
                torch.cuda.empty_cache()
    for t in (512, 2048, 8192):
        try:
            r = prefill_point(t, dev)
        except Exception as e:  # noqa: BLE001
            r = {"kind": "prefill", "tokens": t, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
