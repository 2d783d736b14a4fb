"""Transform throughput against a plain device copy of the same bytes, measured in the same run.

Why this shape: the transform reads the request's KV rows once and writes the send buffer once,
so a ``dst.copy_(src)`` moving the same read+write bytes is its ceiling (DESIGN §4). The cache is
the Llama-3.1-70B TP4 rank shape (80 layers, 2 KV heads, head_dim 128, bf16, GPU block 16) going
to a Blackhole p150a cache (NPU block 64), with the GPU block ids in order or shuffled.

    python -m hawk.bench.transform --sizes-mb 10,80,320,1280 --dtypes bf16,bfp8_b --json PATH

The JSON is a list of records (one per size, dtype, block order and impl) with ``size_mb``,
``dtype``, ``impl``, ``gbps``, ``copy_gbps``, ``ratio``, ``ms`` and the device name.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.kv_plan import KVTransferPlan, plan_kv_transfer
from hawk.transform import transform

MiB = 1 << 20

#: Model shapes per TP rank: layers, KV heads, head_dim, GPU block size, NPU block size.
SHAPES: dict[str, dict[str, int]] = {
    "llama70b-tp4": {"layers": 80, "heads": 2, "head_dim": 128, "gbs": 16, "nbs": 64},
    "tiny": {"layers": 2, "heads": 2, "head_dim": 64, "gbs": 16, "nbs": 64},  # CPU smoke tests
}


@dataclass
class Problem:
    """One request's caches and plan, and the bytes a transform of it must read and write."""

    caches: list[torch.Tensor]
    plan: KVTransferPlan
    tokens: int
    read_bytes: int
    write_bytes: int


def tokens_for_size(size_mb: float, shape: dict[str, int]) -> int:
    """Tokens whose bf16 KV cache is about ``size_mb`` MiB, whole NPU blocks (so nothing is padding)."""
    per_token = shape["layers"] * 2 * shape["heads"] * shape["head_dim"] * 2
    nbs = shape["nbs"]
    return max(nbs, round(size_mb * MiB / per_token / nbs) * nbs)


def build_problem(
    tokens: int,
    layers: int = 80,
    heads: int = 2,
    head_dim: int = 128,
    gbs: int = 16,
    nbs: int = 64,
    ndtype: str = "bf16",
    shuffled: bool = False,
    device: str | torch.device = "cuda",
    seed: int = 0,
    arch: str = "blackhole-p150a",
) -> Problem:
    """A bf16 NHD GPU cache holding exactly the request's blocks, and its plan to the NPU cache.

    ``shuffled`` permutes the block ids on both sides (what a long-running allocator hands out).
    """
    rng = np.random.default_rng(seed)
    g_blocks, n_blocks = -(-tokens // gbs), -(-tokens // nbs)
    gids = rng.permutation(g_blocks) if shuffled else np.arange(g_blocks)
    nids = rng.permutation(n_blocks) if shuffled else np.arange(n_blocks)
    src = GpuKVLayout(layers, g_blocks, gbs, heads, head_dim, "bf16", "NHD")
    dst = NpuKVLayout(get_arch(arch), layers, n_blocks, heads, nbs, head_dim, ndtype)
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    plan = plan_kv_transfer(tokens, gids, nids, src, dst, [t * per_bank for t in range(dst.num_tensors)])
    gen = torch.Generator(device=device).manual_seed(seed)
    caches = [torch.randn(src.layer_shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
              for _ in range(layers)]
    read = tokens * layers * 2 * heads * head_dim * src.elem_bytes
    return Problem(caches, plan, tokens, read, plan.total_bytes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA (it flushes L2 between
    runs and uses CUDA events), a perf_counter loop elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=max(100, 10 * repeats), return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_gbps(nbytes_rw: int, device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """``(ms, GB/s)`` of ``dst.copy_(src)`` moving ``nbytes_rw`` read+write bytes (half each way)."""
    n = max(1, nbytes_rw // 2)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.fill_(1)
    ms = time_ms(lambda: b.copy_(a), device, warmup, repeats)
    return ms, 2 * n / ms / 1e6


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def _runner(impl: str, prob: Problem, out: torch.Tensor, num_warps: int) -> Callable[[], object]:
    """One transform call as the benchmark times it (Triton directly, to pass ``num_warps``)."""
    if impl == "triton":
        from hawk.transform.triton_kernel import transform_triton

        return lambda: transform_triton(prob.caches, prob.plan, out, num_warps=num_warps)
    return lambda: transform(prob.caches, prob.plan, out, impl=impl)


def run_benchmark(
    sizes_mb: Sequence[float] = (10, 80, 320, 1280),
    dtypes: Sequence[str] = ("bf16", "bfp8_b"),
    impls: Sequence[str] | None = None,
    device: str | None = None,
    blocks: Sequence[str] = ("contiguous", "shuffled"),
    shape: str = "llama70b-tp4",
    repeats: int = 10,
    warmup: int = 3,
    verbose: bool = True,
    num_warps: int = 4,
) -> list[dict]:
    """Measure every (size, dtype, block order, impl); each record carries its copy ceiling.

    Before timing, the Triton output is compared with the torch reference (``match``); the
    token counts are whole NPU blocks, so the bytes must be equal with no exception.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    impls = list(impls or (["triton", "torch"] if dev.type == "cuda" else ["torch"]))
    shp = SHAPES[shape]
    name = device_name(dev)
    records: list[dict] = []
    for size in sizes_mb:
        tokens = tokens_for_size(size, shp)
        for dtype in dtypes:
            copy_ms = copy_rate = None
            for order in blocks:
                prob = build_problem(tokens, shp["layers"], shp["heads"], shp["head_dim"], shp["gbs"], shp["nbs"],
                                     dtype, order == "shuffled", dev)
                rw = prob.read_bytes + prob.write_bytes
                if copy_ms is None:
                    copy_ms, copy_rate = copy_gbps(rw, dev, warmup, repeats)
                out = torch.empty(prob.plan.total_bytes, dtype=torch.uint8, device=dev)
                ref = transform(prob.caches, prob.plan, impl="torch") if "triton" in impls else None
                for impl in impls:
                    run = _runner(impl, prob, out, num_warps)
                    run()  # compile, build and cache the plan's tables
                    match = ref is None or bool(torch.equal(out, ref))
                    ms = time_ms(run, dev, warmup, repeats)
                    gbps = rw / ms / 1e6
                    rec = {
                        "size_mb": size, "cache_mb": round(prob.read_bytes / MiB, 3), "tokens": tokens,
                        "dtype": dtype, "blocks": order, "impl": impl, "ms": round(ms, 4),
                        "gbps": round(gbps, 2), "copy_ms": round(copy_ms, 4), "copy_gbps": round(copy_rate, 2),
                        "ratio": round(gbps / copy_rate, 4), "read_bytes": prob.read_bytes,
                        "write_bytes": prob.write_bytes, "match": match, "device": name, "shape": shape,
                        "num_warps": num_warps if impl == "triton" else None,
                    }
                    records.append(rec)
                    if verbose:
                        print(f"{size:>8} MB {dtype:7} {order:10} {impl:6} {ms:9.3f} ms {gbps:9.1f} GB/s "
                              f"copy {copy_rate:9.1f} GB/s ratio {gbps / copy_rate:5.2f} match {match}", flush=True)
                del prob, out, ref
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return records


def print_table(records: list[dict]) -> None:
    """A rich table of the records (plain text if rich is missing)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in records:
            print(r)
        return
    dev = records[0]["device"] if records else "?"
    table = Table(title=f"KV transform vs device copy (read+write bytes) on {dev}")
    for col in ("size MB", "dtype", "blocks", "impl", "ms", "GB/s", "copy GB/s", "ratio", "match"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["size_mb"]), r["dtype"], r["blocks"], r["impl"], f"{r['ms']:.3f}", f"{r['gbps']:.1f}",
                      f"{r['copy_gbps']:.1f}", f"{r['ratio']:.2f}", "yes" if r["match"] else "NO")
    Console(width=max(110, Console().width)).print(table)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m hawk.bench.transform", description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", default="10,80,320,1280", help="comma-separated KV cache sizes (MiB)")
    p.add_argument("--dtypes", default="bf16,bfp8_b", help="NPU dtypes: bf16, bfp8_b")
    p.add_argument("--impls", default=None, help="triton,torch (default: both on CUDA, torch on CPU)")
    p.add_argument("--blocks", default="contiguous,shuffled", help="GPU/NPU block-id orders")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--shape", default="llama70b-tp4", choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-warps", type=int, default=4, help="Triton kernel warps per program")
    p.add_argument("--json", default=None, help="write the records here (a JSON list)")
    a = p.parse_args(argv)
    records = run_benchmark(
        sizes_mb=[float(x) if "." in x else int(x) for x in _csv(a.sizes_mb)],
        dtypes=_csv(a.dtypes),
        impls=_csv(a.impls) if a.impls else None,
        device=a.device,
        blocks=_csv(a.blocks),
        shape=a.shape,
        repeats=a.repeats,
        warmup=a.warmup,
        num_warps=a.num_warps,
    )
    print_table(records)
    if a.json:
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
    if not all(r["match"] for r in records):
        raise SystemExit("Triton output differs from the torch reference (see 'match')")
    return records


if __name__ == "__main__":
    main()
