"""NPU-tile decode attention kernels alone, one layer, graph-timed, against the GPU paged kernel (a tuning probe).

Each point captures ``REPS`` calls of a backend in one CUDA graph and times replays, so launch overhead
does not hide kernel time; the stream-read ceiling is measured in the same process. Every NPU-tile
variant (launch shape, asm decode, split count) is checked against the generic per-row-tile kernel on
the same bytes before it is timed.

    python benchmarks/npu_attention_probe.py [--quick]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from hawk.engine.attention import SeqSlice

HQ, HKV, D = 32, 8, 128
REPS = 20


def graph_us(fn: Callable[[], object], reps: int = REPS, iters: int = 10) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def read_gbps() -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    us = graph_us(lambda: x.sum(), reps=3, iters=5)
    return x.numel() * 2 / us / 1e3


def paged_point(batch: int, ctx: int, q, k, v) -> dict:
    from hawk.engine.paged_attention import PagedAttention
    from hawk.layouts.gpu import GpuKVLayout

    bs = 16
    per = -(-(ctx + 1) // bs)
    lay = GpuKVLayout(1, batch * per, bs, HKV, D, "bf16")
    attn = PagedAttention(lay, lay.allocate(torch.device("cuda")), max_batch=max(batch, 8), max_model_len=ctx + 64)
    attn.begin([SeqSlice(list(range(i * per, (i + 1) * per)), ctx, 1) for i in range(batch)], pad_to=batch)
    us = graph_us(lambda: attn(0, q, k, v))
    kv = batch * (ctx + 1) * HKV * D * 2 * 2
    return {"path": "gpu-paged", "batch": batch, "ctx": ctx, "us": round(us, 2), "kv_bytes": kv, "gbps": round(kv / us / 1e3)}


def npu_points(batch: int, ctx: int, dtype: str, q, k, v, variants: list[tuple[str, dict]]) -> list[dict]:
    from hawk.devices.emulated import open_npu
    from hawk.engine import triton_npu_attention as tk
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.layouts.npu import NpuKVLayout, get_arch
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory

    bs = 64
    per = -(-(ctx + 1) // bs)
    probe = NpuKVLayout(get_arch("blackhole-p150a"), 1, batch * per, HKV, bs, D, dtype)
    bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + (8 << 20)
    npu = open_npu("npu-emu:cuda", bank_capacity=-(-bank // (1 << 20)) * (1 << 20))
    lay = NpuKVLayout(npu.arch, 1, batch * per, HKV, bs, D, dtype)
    mem = NpuKVCacheMemory(npu, lay)
    g = torch.Generator(device="cuda").manual_seed(1)
    # random but well-formed tiles: bf16 from randn, bfloat8_b exponents 120..130 and random value bytes
    for t in range(2):
        view = mem.pages(t)
        if dtype == "bf16":
            x = torch.randn(view.shape[0], view.shape[1], lay.page_size // 2, device="cuda", generator=g).to(torch.bfloat16)
            view[:, :, : lay.page_size].copy_(x.view(torch.uint8))
        else:
            view[:, :, 64 : lay.page_size] = torch.randint(0, 256, (view.shape[0], view.shape[1], 1024), device="cuda", generator=g, dtype=torch.uint8)
            view[:, :, :64] = torch.randint(120, 131, (view.shape[0], view.shape[1], 64), device="cuda", generator=g, dtype=torch.uint8)
    attn = NpuTileAttention(mem, max_batch=max(batch, 8), max_model_len=ctx + 64)
    attn.begin([SeqSlice(list(range(i * per, (i + 1) * per)), ctx, 1) for i in range(batch)], pad_to=batch)
    kv = batch * -(-(ctx + 1) // 32) * HKV * (D // 32) * lay.page_size * 2
    snapshot = npu.memory.clone()
    attn.generic = True
    ref = attn(0, q, k, v).float()
    rows = []
    for name, var in variants:
        npu.memory.copy_(snapshot)
        attn.generic = var.get("generic", False)
        attn.decode_config = tk.DecodeConfig(**var["cfg"]) if "cfg" in var else None
        attn.num_splits = var.get("splits")
        r = {"path": f"npu-{dtype}", "variant": name, "batch": batch, "ctx": ctx}
        try:
            out = attn(0, q, k, v).float()
            r["max_err"] = float((out - ref).abs().max())
            r["bitwise_vs_generic"] = bool(torch.equal(out, ref))  # True expected unless the variant forces splits or 8 warps
            us = graph_us(lambda: attn(0, q, k, v))
            r.update(us=round(us, 2), kv_bytes=kv, gbps=round(kv / us / 1e3))
        except Exception as e:  # noqa: BLE001 - a probe reports and goes on
            r["error"] = repr(e)[:400]
        rows.append(r)
        print(json.dumps(r), flush=True)
    mem.close()
    return rows


def variants_for(batch: int, quick: bool) -> list[tuple[str, dict]]:
    """The launch shapes worth comparing at this batch (split counts bracket the heuristic)."""
    v: list[tuple[str, dict]] = [("generic", {"generic": True}), ("default", {}), ("chunked-w4", {"cfg": {}})]
    if quick:
        return v
    # chunks are the paged decode's (64 tokens); 8 warps is not bitwise-equal to paged (see DecodeConfig)
    v.append(("chunked-w8", {"cfg": {"num_warps": 8}}))
    v.append(("asm", {"cfg": {"asm": True}}))
    v.append(("stages2", {"cfg": {"num_stages": 2}}))
    for sp in ((8, 16, 32, 64) if batch == 1 else (1, 2, 4)):
        v.append((f"splits{sp}", {"splits": sp}))
    return v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--points", default="1x1024,64x1024,1x8192,64x8192")
    a = p.parse_args()
    print(json.dumps({"read_gbps": round(read_gbps())}), flush=True)
    for pt in a.points.split(","):
        b, c = (int(x) for x in pt.split("x"))
        torch.manual_seed(0)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        try:
            r = paged_point(b, c, q, k, v)
        except Exception as e:  # noqa: BLE001 - the paged backend is edited elsewhere; go on with ours
            r = {"path": "gpu-paged", "batch": b, "ctx": c, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
        for dt in ("bf16", "bfp8_b"):
            npu_points(b, c, dt, q, k, v, variants_for(b, a.quick or (b == 1 and c == 8192)))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
