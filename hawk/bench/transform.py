"""Transform throughput against a plain device copy of the same bytes, measured in the same run.

Why this shape: the transform reads the request's KV rows once and writes the send buffer once,
so a ``dst.copy_(src)`` moving the same read+write bytes is its ceiling (DESIGN §4). The cache is
the Llama-3.1-70B TP4 rank shape (80 layers, 2 KV heads, head_dim 128, bf16, GPU block 16) going
to a Blackhole p150a cache (NPU block 64), with the GPU block ids in order or shuffled.

    python -m hawk.bench.transform --sizes-mb 10,80,320,1280 --dtypes bf16,bfp8_b --json PATH
    python -m hawk.bench.transform --impls triton --kernels v1,v2 --check-edges   # both kernels, edge bytes first
    python -m hawk.bench.transform --src-layout LBNHC   # the source laid out as vLLM 0.32's FlashAttention default

``--src-layout`` is HAWK's ``NHD`` (default) or a vLLM 0.32 ``KVCacheLayout`` name (LBNHC, LBHNC, ...):
per-layer ``[blocks, heads, block_size, 2 * head_dim]`` views of one buffer, exactly as vLLM's GPU
backends register them (``hawk.layouts.vllm``).

The JSON is a list of records (one per size, dtype, block order, impl and Triton kernel) with
``size_mb``, ``dtype``, ``impl``, ``kernel``, ``gbps``, ``copy_gbps``, ``ratio``, ``ms`` and the device name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hawk.layouts import vllm
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.layouts.paged import PagedKVLayout
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
    gdtype: str = "bf16",
    src_layout: str = "NHD",
) -> Problem:
    """A (bf16 by default) GPU cache holding exactly the request's blocks, and its plan to the NPU cache:
    HAWK's NHD, or (``src_layout`` a KVCacheLayout name) vLLM 0.32's FLASH_ATTN views of one buffer.

    ``shuffled`` permutes the block ids on both sides (what a long-running allocator hands out).
    """
    rng = np.random.default_rng(seed)
    g_blocks, n_blocks = -(-tokens // gbs), -(-tokens // nbs)
    gids = rng.permutation(g_blocks) if shuffled else np.arange(g_blocks)
    nids = rng.permutation(n_blocks) if shuffled else np.arange(n_blocks)
    src: GpuKVLayout | PagedKVLayout
    if src_layout == "NHD":
        src = GpuKVLayout(layers, g_blocks, gbs, heads, head_dim, gdtype, "NHD")
    else:
        src = vllm.gpu_layout("FLASH_ATTN", src_layout, layers, g_blocks, gbs, heads, head_dim, gdtype)
    dst = NpuKVLayout(get_arch(arch), layers, n_blocks, heads, nbs, head_dim, ndtype)
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    plan = plan_kv_transfer(tokens, gids, nids, src, dst, [t * per_bank for t in range(dst.num_tensors)])
    gen = torch.Generator(device=device).manual_seed(seed)
    if isinstance(src, GpuKVLayout):
        caches = [torch.randn(src.layer_shape, generator=gen, device=device, dtype=torch.float32).to(src.torch_dtype)
                  for _ in range(layers)]
    else:
        buf = torch.randn(layers * g_blocks * gbs * heads * 2 * head_dim, generator=gen, device=device, dtype=torch.float32)
        caches = vllm.allocate(src, src_layout, device, buf.to(src.torch_dtype))
    read = tokens * layers * 2 * heads * head_dim * src.elem_bytes
    return Problem(caches, plan, tokens, read, plan.total_bytes)


# -- edge values: every bf16/fp16 bit pattern at every interesting distance from its row's max -------

#: Distances ``d = E - e`` (shared minus own exponent) every pattern is placed at: each rounding shift
#: up to and past the last that can leave a nonzero magnitude (7), and the extremes of the range.
EDGE_DISTANCES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 100, 132, 133, 134, 200, 254)

_BITS = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}


def fp32_bits_of(pats: np.ndarray, gdtype: str) -> np.ndarray:
    """uint32 fp32 bit patterns of ``gdtype`` bit patterns (exact widening)."""
    if gdtype == "bf16":
        return pats.astype(np.uint32) << 16
    if gdtype == "fp16":
        return pats.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    return pats.astype(np.uint32)


def _fp32_tie_patterns(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """fp32 patterns whose bfloat8_b rounding sits on or next to a tie, and the distance d each needs.

    With distance d the magnitude keeps the 24-bit mantissa's top ``7 - d`` bits after the implicit
    one; the dropped ``17 + d`` bits are set to exactly half, half -+ 1, 0 and all ones.
    """
    pats, dists = [], []
    for d in range(10):
        shift = 17 + d
        half, full = 1 << (shift - 1), (1 << shift) - 1
        q = np.arange(0, 129, dtype=np.int64)[:, None]
        off = np.array([0, half - 1, half, half + 1, full], dtype=np.int64)[None, :]
        m = ((q << shift) + off).reshape(-1)
        m = m[(m >= 1 << 23) & (m < 1 << 24)]
        e = rng.integers(1, 255 - d, size=m.size)
        sign = rng.integers(0, 2, size=m.size) << 31
        pats.append((sign | (e << 23) | (m - (1 << 23))).astype(np.uint32))
        dists.append(np.full(m.size, d))
    return np.concatenate(pats), np.concatenate(dists)


def edge_rows(gdtype: str, seed: int = 0, nan: bool = True) -> np.ndarray:
    """Face rows (``[n, 16]`` bit patterns of ``gdtype``) that stress bfloat8_b and bf16 encoding.

    bf16 and fp16: every bit pattern (zeros, subnormals, normals, both infinities and, with ``nan``,
    every NaN) at every distance of :data:`EDGE_DISTANCES` below its row's max exponent that the
    format can reach, so every rounding tie, saturation (127) and magnitude that rounds to 0 (+0,
    also for negative inputs) occurs; rows whose max is inf/NaN (exponent 255) and rows of only
    zeros/subnormals (exponent 0) included. fp32: random patterns plus constructed ties.
    Each row holds one "setter" of the row's max exponent and 15 tested values, shuffled; the rest
    of a row is +0 or -0.
    """
    rng = np.random.default_rng(seed)
    if gdtype == "fp32":
        rnd = rng.integers(0, 1 << 32, size=60_000, dtype=np.uint64).astype(np.uint32)
        ties, tie_d = _fp32_tie_patterns(rng)
        pool = np.concatenate([rnd, ties])
    else:
        pool = np.arange(1 << 16, dtype=np.uint32).astype(_BITS[gdtype])
    b32 = fp32_bits_of(pool, gdtype)
    exp = ((b32 >> 23) & 0xFF).astype(np.int64)
    is_nan = (exp == 255) & ((b32 & 0x7FFFFF) != 0)
    if not nan:
        pool, b32, exp = pool[~is_nan], b32[~is_nan], exp[~is_nan]
        if gdtype == "fp32":
            tie_d = tie_d[~is_nan[len(rnd):]]
    # Setters: patterns of each exponent; fp32 builds any exponent it needs.
    by_exp: dict[int, np.ndarray] = {int(e): pool[exp == e] for e in np.unique(exp)}
    if gdtype == "fp32":
        for e in range(256):
            m = rng.integers(0, 1 << 23, size=8) if (e < 255 or nan) else np.zeros(8, dtype=np.int64)
            by_exp[e] = (rng.integers(0, 2, size=8) << 31 | e << 23 | m).astype(np.uint32)
    # (pattern, row exponent) pairs.
    idx = np.arange(len(pool))
    pair_i, pair_e = [], []
    for d in EDGE_DISTANCES:
        tgt = exp + d
        ok = np.isin(tgt, list(by_exp))
        pair_i.append(idx[ok])
        pair_e.append(tgt[ok])
    if gdtype == "fp32":
        tie_i = np.arange(len(pool) - len(tie_d), len(pool))
        pair_i.append(tie_i)
        pair_e.append(exp[tie_i] + tie_d)
    pi, pe = np.concatenate(pair_i), np.concatenate(pair_e)
    order = np.argsort(pe, kind="stable")
    pi, pe = pi[order], pe[order]
    rows = []
    for e in np.unique(pe):
        members = pool[pi[pe == e]]
        members = members[rng.permutation(len(members))]
        n = -(-len(members) // 15)
        block = np.zeros((n, 16), dtype=pool.dtype)
        flat = block[:, 1:].reshape(-1)
        flat[: len(members)] = members
        if gdtype == "fp32":
            neg0 = np.uint32(0x80000000)
        else:
            neg0 = np.uint16(0x8000)
        flat[len(members):] = np.where(rng.random(len(flat) - len(members)) < 0.5, neg0, 0).astype(pool.dtype)
        block[:, 1:] = flat.reshape(n, 15)
        setters = by_exp[int(e)]
        block[:, 0] = setters[rng.integers(0, len(setters), size=n)]
        rows.append(block)
    rows = np.concatenate(rows)
    rows = rng.permuted(rows, axis=1)  # the setter anywhere in its row
    rows = rows[rng.permutation(len(rows))]
    zeros = np.zeros((4, 16), dtype=pool.dtype)
    zeros[1] = 0x80000000 if gdtype == "fp32" else 0x8000  # a row of -0
    zeros[2, ::2] = zeros[1, ::2]  # mixed +-0
    # Rows whose max exponent is 1..7 (magnitudes 2^-126..2^-120) or 255 (inf, NaN) last, together: a
    # kernel may take a slower path for the part of a request holding one, and the rest must
    # exercise the fast one.
    row_exp = ((fp32_bits_of(rows, gdtype) >> 23) & 0xFF).max(axis=1)
    rare = ((row_exp >= 1) & (row_exp <= 7)) | (row_exp == 255)
    return np.concatenate([zeros, rows[~rare], rows[rare]])


def edge_problem(gdtype: str, ndtype: str, device: str | torch.device, seed: int = 0, nan: bool = True,
                 shuffled: bool = True) -> Problem:
    """A one-layer, one-head cache (head_dim 128) whose every face row is one of :func:`edge_rows`,
    all of it in the request (whole blocks), so every row reaches the send buffer."""
    rows = edge_rows(gdtype, seed, nan)
    per_token = 2 * 128 // 16  # face rows per token (K and V)
    tokens = -(-len(rows) // per_token)
    tokens += -tokens % 64
    prob = build_problem(tokens, layers=1, heads=1, head_dim=128, ndtype=ndtype, shuffled=shuffled, device="cpu",
                         seed=seed, gdtype=gdtype)
    need = tokens * per_token
    rng = np.random.default_rng(seed + 1)
    fill = rows[rng.integers(0, len(rows), size=need - len(rows))]
    bits = np.concatenate([fill, rows]).reshape(-1)  # edge_rows' last rows stay last
    cache = prob.caches[0]
    signed = np.int16 if bits.dtype == np.uint16 else np.int32
    cache.view(-1).copy_(torch.from_numpy(bits.view(signed)).view(cache.dtype))
    prob.caches = [cache.to(device)]
    return prob


def check_edges(kernels: Sequence[str | None] = (None,), device: str | torch.device = "cuda",
                gdtypes: Sequence[str] = ("bf16", "fp16", "fp32"), ndtypes: Sequence[str] = ("bfp8_b", "bf16"),
                verbose: bool = True) -> list[dict]:
    """Triton bytes against the torch reference on :func:`edge_problem` for each kernel and dtype pair.

    NaNs are left out where an fp16/fp32 -> bf16 or fp16 -> fp32 conversion is involved (the kernels
    and the reference may canonicalize NaN payloads differently there); bf16 and fp32 sources keep
    them for bfloat8_b output, bf16 keeps them for bf16 output (a bit copy).
    """
    from hawk.transform.triton_kernel import transform_triton

    out = []
    for g in gdtypes:
        for n in ndtypes:
            nan = g == "bf16" or (g == "fp32" and n == "bfp8_b")
            prob = edge_problem(g, n, device, nan=nan)
            ref = transform(prob.caches, prob.plan, impl="torch")
            for k in kernels:
                got = transform_triton(prob.caches, prob.plan, kernel=k)
                diff = int((got != ref).sum())
                rows = prob.read_bytes // (16 * prob.caches[0].element_size())
                rec = {"gdtype": g, "ndtype": n, "kernel": k or "default", "rows": rows, "bytes": int(ref.numel()),
                       "differ": diff, "match": diff == 0}
                out.append(rec)
                if verbose:
                    print(f"edges {g:5} -> {n:7} kernel {rec['kernel']:7} face rows {rec['rows']:8} "
                          f"bytes differing {diff}", flush=True)
    return out


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


def _runner(impl: str, prob: Problem, out: torch.Tensor, num_warps: int, kernel: str | None = None,
            tpp: int | None = None) -> Callable[[], object]:
    """One transform call as the benchmark times it (Triton directly, to pass the kernel options)."""
    if impl == "triton":
        from hawk.transform.triton_kernel import transform_triton

        return lambda: transform_triton(prob.caches, prob.plan, out, num_warps=num_warps, kernel=kernel, tpp=tpp)
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
    kernels: Sequence[str | None] = (None,),
    tpp: int | None = None,
    src_layout: str = "NHD",
) -> list[dict]:
    """Measure every (size, dtype, block order, impl, Triton kernel); each record carries its copy ceiling.

    Before timing, the Triton output is compared with the torch reference (``match``); the
    token counts are whole NPU blocks, so the bytes must be equal with no exception. ``kernels``
    are :func:`hawk.transform.triton_kernel.transform_triton` kernel names (None: its default).
    """
    from hawk.transform.triton_kernel import ENV_LAUNCH, resolve_kernel

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    impls = list(impls or (["triton", "torch"] if dev.type == "cuda" else ["torch"]))
    shp = SHAPES[shape]
    name_dev = device_name(dev)
    records: list[dict] = []
    for size in sizes_mb:
        tokens = tokens_for_size(size, shp)
        for dtype in dtypes:
            copy_ms = copy_rate = None
            for order in blocks:
                prob = build_problem(tokens, shp["layers"], shp["heads"], shp["head_dim"], shp["gbs"], shp["nbs"],
                                     dtype, order == "shuffled", dev, src_layout=src_layout)
                rw = prob.read_bytes + prob.write_bytes
                if copy_ms is None:
                    copy_ms, copy_rate = copy_gbps(rw, dev, warmup, repeats)
                out = torch.empty(prob.plan.total_bytes, dtype=torch.uint8, device=dev)
                ref = transform(prob.caches, prob.plan, impl="torch") if "triton" in impls else None
                runs = [(impl, k) for impl in impls for k in (kernels if impl == "triton" else [None])]
                for impl, kernel in runs:
                    run = _runner(impl, prob, out, num_warps, kernel, tpp)
                    match = True
                    for _ in range(2):  # the first call compiles and builds the plan's tables, the second is a timed one
                        out.fill_(0xAB)  # a kernel must write every byte; earlier runs' bytes must not count
                        run()
                        match = match and (ref is None or bool(torch.equal(out, ref)))
                    ms = time_ms(run, dev, warmup, repeats)
                    gbps = rw / ms / 1e6
                    name = impl
                    if impl == "triton":
                        name = f"triton-{resolve_kernel(kernel, shp['head_dim'], dtype)}"
                    rec = {
                        "size_mb": size, "cache_mb": round(prob.read_bytes / MiB, 3), "tokens": tokens,
                        "dtype": dtype, "blocks": order, "impl": impl, "ms": round(ms, 4),
                        "gbps": round(gbps, 2), "copy_ms": round(copy_ms, 4), "copy_gbps": round(copy_rate, 2),
                        "ratio": round(gbps / copy_rate, 4), "read_bytes": prob.read_bytes,
                        "write_bytes": prob.write_bytes, "match": match, "device": name_dev, "shape": shape,
                        "src_layout": src_layout,
                        "num_warps": num_warps if impl == "triton" else None,
                        "kernel": resolve_kernel(kernel, shp["head_dim"], dtype) if impl == "triton" else None,
                        "tpp": tpp if impl == "triton" else None,
                        "launch": os.environ.get(ENV_LAUNCH, "direct") if impl == "triton" else None,
                    }
                    records.append(rec)
                    if verbose:
                        print(f"{size:>8} MB {dtype:7} {order:10} {name:10} {ms:9.4f} ms {gbps:9.1f} GB/s "
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
    for col in ("size MB", "dtype", "blocks", "impl", "kernel", "ms", "GB/s", "copy GB/s", "ratio", "match"):
        table.add_column(col, justify="right")
    for r in records:
        table.add_row(str(r["size_mb"]), r["dtype"], r["blocks"], r["impl"], str(r.get("kernel") or "-"),
                      f"{r['ms']:.4f}", f"{r['gbps']:.1f}", f"{r['copy_gbps']:.1f}", f"{r['ratio']:.2f}",
                      "yes" if r["match"] else "NO")
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
    p.add_argument("--kernels", default=None,
                   help="Triton kernels to time, comma-separated: v1, v2, v2e (default: the default kernel)")
    p.add_argument("--tpp", type=int, default=None, help="v2: K/V tensors per program (default: ~8 KiB of source)")
    p.add_argument("--check-edges", action="store_true",
                   help="first check each Triton kernel's bytes on edge-value caches (every bf16/fp16 pattern, "
                        "fp32 ties; zeros, subnormals, inf/NaN) against the torch reference")
    p.add_argument("--src-layout", default="NHD", choices=["NHD", *vllm.STRIDE_ORDERS],
                   help="the source cache: HAWK's NHD, or a vLLM 0.32 KVCacheLayout (FLASH_ATTN's views of one buffer)")
    p.add_argument("--json", default=None, help="write the records here (a JSON list)")
    a = p.parse_args(argv)
    kernels = _csv(a.kernels) if a.kernels else [None]
    if a.check_edges:
        dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        edges = check_edges(kernels, dev)
        if not all(e["match"] for e in edges):
            raise SystemExit("Triton output differs from the torch reference on edge values (see above)")
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
        kernels=kernels,
        tpp=a.tpp,
        src_layout=a.src_layout,
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
