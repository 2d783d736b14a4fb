"""bfloat8_b NPU-tile decode variants side by side (issue 7): checked, then timed against the paged bf16 decode.

At the Llama-3.1-8B shape (32 q heads, 8 KV heads, head_dim 128) on one GPU, for each point (batch x
context, default 1/8/32/64 x 1k/8k) this builds one emulated p150a cache of random well-formed bfloat8_b
tiles and, on those bytes:

* the torch reference (``NpuTileAttention(backend="torch")``: the codecs' values, fp32 attention);
* every variant of ``BFP8_VARIANTS`` (plus split-count overrides, ``--split-variants``), called once on
  the cache as it was before any new row was written: its max error against the reference; whether
  it left the cache bytes the reference's row write left (``mem_unchanged``; the "-fw" variants write
  the rows in the decode launch); whether its output is bit for bit the "bytes" kernel's (expected for
  the variants that keep the paged decode's bits); ``ok`` when all that holds and the error is within
  tolerance; then microseconds per call (write the new rows + decode [+ merge], however many launches
  that takes) from a CUDA graph of ``--reps`` calls, median of ``--iters`` replays;
* the GPU paged decode over a bf16 cache (``PagedAttention``, same batch and contexts) and the NPU
  bf16-tile decode, timed the same way.

``ratio`` is a variant's time over the paged decode's at the same point: the issue asks for <= 1.0 at
batch 1 and 64, context 1k. A failing variant is reported and the run goes on; if one leaves the CUDA
context unusable, the probe restarts itself without it (a child process runs the points).

Split overrides (``+sN`` rows; not the paged decode's bits, so candidates for speed only) use an
occupancy rule instead of the paged decode's ``2 * SMs / (batch * kv_heads)``: enough splits for
``--split-programs-per-sm`` programs on every SM (4: what a 128-register, 4-warp program allows).

``--flush-mb N`` reads an N MiB buffer before every timed call (in the same graph) and subtracts the
time of that read alone, so the KV and metadata come from DRAM as in a model step, where the weights
of the other layers pass through L2 in between (at batch 1, context 1k, the whole bfloat8_b cache of a
layer, 2.3 MB, otherwise stays in L2 across replays).

    python benchmarks/bfp8_kernel_probe.py --json bfp8_probe.json
    python benchmarks/bfp8_kernel_probe.py --points 64x1024 --variants bytes,words --json out.json
    python benchmarks/bfp8_kernel_probe.py --points 1x1024,64x1024 --flush-mb 256 --json cold.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hawk.engine.attention import SeqSlice  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEFAULT_POINTS = "1x1024,64x1024,8x1024,32x1024,1x8192,8x8192,32x8192,64x8192"  # the acceptance points first
#: split-count overrides timed for these variants (not the paged decode's bits; see --split-variants)
DEFAULT_SPLIT_VARIANTS = "words-pipe2-r128,tok-pipe3-r128-fw"


#: "cuda", or "cpu" for --cpu-smoke (a tiny run under the Triton interpreter that checks this script)
DEV = "cuda"
#: ``--flush-mb``'s buffer (None: no flush) and the microseconds of one read of it alone, per point
FLUSH: dict = {"buf": None, "us": 0.0}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def graph_us(fn: Callable[[], object], reps: int, iters: int) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls (the
    tuning probe's timer); on the CPU smoke run, one timed call."""
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
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


def flush_l2() -> None:
    """Read the whole flush buffer (evicts the cache's KV and metadata from L2)."""
    FLUSH["buf"].sum()


def call_us(fn: Callable[[], object], reps: int, iters: int) -> tuple[float, float | None]:
    """``(us, us with the flush)`` per call of ``fn``: ``graph_us``; with ``--flush-mb``, each call follows a
    read of the flush buffer and the read alone (``FLUSH["us"]``) is subtracted."""
    if FLUSH["buf"] is None:
        return graph_us(fn, reps, iters), None

    def cold() -> None:
        flush_l2()
        fn()

    both = graph_us(cold, reps, iters)
    return both - FLUSH["us"], both


def timing(fn: Callable[[], object], args, kv: int) -> dict:
    us, both = call_us(fn, args.reps, args.iters)
    r = {"us": round(us, 2), "kv_bytes": kv, "gbps": round(kv / max(us, 1e-3) / 1e3)}
    if both is not None:
        r.update(us_with_flush=round(both, 2), flush_us=round(FLUSH["us"], 2))
    return r


def read_gbps() -> float:
    n = 1 << 30 if DEV == "cuda" else 1 << 20
    x = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    us = graph_us(lambda: x.sum(), reps=3, iters=5)
    return n * 2 / us / 1e3


def cuda_alive() -> bool:
    """False when the CUDA context is broken (a sticky error such as an illegal address)."""
    try:
        sync()
        torch.ones(1, device=DEV).add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def _batch(batch: int, ctx: int, bs: int) -> tuple[list[SeqSlice], int]:
    per = -(-(ctx + 1) // bs)
    return [SeqSlice(list(range(i * per, (i + 1) * per)), ctx, 1) for i in range(batch)], per


def paged_point(batch: int, ctx: int, q, k, v, args) -> dict:
    from hawk.engine.paged_attention import PagedAttention
    from hawk.layouts.gpu import GpuKVLayout

    slices, per = _batch(batch, ctx, 16)
    lay = GpuKVLayout(1, batch * per, 16, HKV, D, "bf16")
    caches = lay.allocate(torch.device(DEV))
    caches[0].normal_()
    attn = PagedAttention(lay, caches, max_batch=max(batch, 8), max_model_len=ctx + 64, use_triton=True)
    attn.begin(slices, pad_to=batch)
    kv = batch * (ctx + 1) * HKV * D * 2 * 2
    return {"path": "gpu-paged", "variant": "paged-bf16", **timing(lambda: attn(0, q, k, v), args, kv)}


def npu_cache(batch: int, ctx: int, dtype: str):
    """An emulated p150a (memory on this GPU), one layer of random well-formed tiles, and the batch."""
    from hawk.devices.emulated import open_npu
    from hawk.layouts.npu import NpuKVLayout, get_arch
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory

    bs = 64
    slices, per = _batch(batch, ctx, bs)
    probe = NpuKVLayout(get_arch("blackhole-p150a"), 1, batch * per, HKV, bs, D, dtype)
    bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + (8 << 20)
    npu = open_npu(f"npu-emu:{DEV}", bank_capacity=-(-bank // (1 << 20)) * (1 << 20))
    lay = NpuKVLayout(npu.arch, 1, batch * per, HKV, bs, D, dtype)
    mem = NpuKVCacheMemory(npu, lay)
    g = torch.Generator(device=DEV).manual_seed(1)
    for t in range(2):
        view = mem.pages(t)
        if dtype == "bf16":
            x = torch.randn(view.shape[0], view.shape[1], lay.page_size // 2, device=DEV, generator=g).to(torch.bfloat16)
            view[:, :, : lay.page_size].copy_(x.view(torch.uint8))
        else:  # exponents 120..130 (values up to ~16), random sign-magnitude bytes
            shape = (view.shape[0], view.shape[1])
            view[:, :, 64 : lay.page_size] = torch.randint(0, 256, (*shape, 1024), device=DEV, generator=g, dtype=torch.uint8)
            view[:, :, :64] = torch.randint(120, 131, (*shape, 64), device=DEV, generator=g, dtype=torch.uint8)
    kv = batch * -(-(ctx + 1) // 32) * HKV * (D // 32) * lay.page_size * 2
    return npu, mem, slices, kv


def occupancy_splits(batch: int, programs_per_sm: int) -> int:
    """Splits so that ``batch * HKV * splits`` programs fill every SM with ``programs_per_sm`` programs
    (at most 64, as the paged rule): the occupancy rule of the ``+sN`` rows."""
    from hawk.engine import triton_attention as ta

    sms = ta.decode_sm_count(torch.device(DEV))
    return max(1, min(64, math.ceil(programs_per_sm * sms / (batch * HKV))))


def variant_list(names: list[str], split_variants: list[str], batch: int, programs_per_sm: int = 4,
                 split_counts: tuple[int, ...] = ()) -> list[tuple[str, str, int | None]]:
    """``(label, variant, splits override)``: each variant at its own split count, then the split
    overrides: at the occupancy rule's count (``occupancy_splits``) where that differs from the paged
    decode's, or at each of ``split_counts`` when given."""
    from hawk.engine import triton_npu_attention as tk

    out = [(n, n, None) for n in names]
    default = tk.choose_splits(batch, HKV, torch.device(DEV))
    alt = occupancy_splits(batch, programs_per_sm)
    alts = split_counts or ((alt,) if alt != default else ())
    for n in split_variants:
        if n in names:
            out += [(f"{n}+s{a}", n, a) for a in alts]
    return out


def npu_bfp8_rows(batch: int, ctx: int, q, k, v, names: list[str], split_variants: list[str], args, deadline: float,
                  emit: Callable[[dict], None]) -> None:
    from hawk.engine import triton_npu_attention as tk
    from hawk.engine.npu_attention import NpuTileAttention

    npu, mem, slices, kv = npu_cache(batch, ctx, "bfp8_b")
    try:
        ref_attn = NpuTileAttention(mem, max_batch=max(batch, 8), max_model_len=ctx + 64, backend="torch")
        ref_attn.begin(slices, pad_to=batch)
        sync()
        before = npu.memory.clone()  # each variant's checked call starts here: it writes the rows itself
        ref = ref_attn(0, q.float(), k, v)  # writes the new rows (the same bytes every backend writes)
        del ref_attn
        sync()
        snapshot = npu.memory.clone()
        scale = float(ref.abs().max())
        tol = 1e-2 * max(1.0, scale)
        attn = NpuTileAttention(mem, max_batch=max(batch, 8), max_model_len=ctx + 64, backend="triton")
        attn.begin(slices, pad_to=batch)
        bytes_out = None
        counts = tuple(int(x) for x in args.split_counts.split(",") if x)
        for label, name, splits in variant_list(names, split_variants, batch, args.split_programs_per_sm, counts):
            cfg = tk.BFP8_VARIANTS[name]
            nsplits = splits or tk.choose_splits(batch, HKV, q.device, tk.tile_geometry(mem), cfg, D, HQ // HKV)
            fused = tk.fuses_row_write(tk.tile_geometry(mem), cfg)
            r = {"path": "npu-bfp8_b", "variant": label, "splits": nsplits,
                 "keeps_paged_bits": cfg.keeps_paged_bits and splits is None,
                 "launches": (1 if fused else 2) + (nsplits > 1)}  # [write] + decode [+ merge]
            try:
                npu.memory.copy_(before)
                attn.decode_config = cfg
                attn.num_splits = splits
                t0 = time.time()
                out = attn(0, q, k, v)
                sync()
                r["first_call_s"] = round(time.time() - t0, 2)  # mostly compilation
                # the row write is the reference's (from the old bytes: a fused write that attended the
                # stale row instead of the new one shows in max_err, as it would in a model step)
                r["mem_unchanged"] = bool(torch.equal(npu.memory, snapshot))
                err = float((out.float() - ref.float()).abs().max())
                r.update(max_err=err, tol=round(tol, 5), ok=bool(err <= tol and torch.isfinite(out).all() and r["mem_unchanged"]))
                if name == "bytes" and splits is None:
                    bytes_out = out.clone()
                if bytes_out is not None:
                    r["bitwise_vs_bytes"] = bool(torch.equal(out, bytes_out))
                    if r["keeps_paged_bits"] and not r["bitwise_vs_bytes"]:
                        r["ok"] = False  # a variant that keeps the paged decode's bits must give the byte kernel's
                if time.time() > deadline:
                    r["skipped"] = "time budget"
                else:
                    r.update(timing(lambda: attn(0, q, k, v), args, kv))
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                r["error"] = repr(e)[:400]
                r["trace"] = traceback.format_exc()[-1500:]
                if not cuda_alive():
                    r["fatal"] = True
                    emit(r)
                    raise SystemExit(3) from None
            emit(r)
    finally:
        mem.close()


def npu_bf16_row(batch: int, ctx: int, q, k, v, args) -> dict:
    from hawk.engine.npu_attention import NpuTileAttention

    npu, mem, slices, kv = npu_cache(batch, ctx, "bf16")
    try:
        attn = NpuTileAttention(mem, max_batch=max(batch, 8), max_model_len=ctx + 64, backend="triton")
        attn.begin(slices, pad_to=batch)
        return {"path": "npu-bf16", "variant": "npu-bf16 (default)", **timing(lambda: attn(0, q, k, v), args, kv)}
    finally:
        mem.close()


def child(args) -> None:
    """Run the points, appending one JSON line per result to ``args.rows``."""
    out = open(args.rows, "a")

    def emit(r: dict) -> None:
        out.write(json.dumps(r) + "\n")
        out.flush()
        if r.get("point_done") or "env" in r:
            return
        keys = ("variant", "us", "max_err", "ok", "bitwise_vs_bytes", "error")
        print(f"  {r.get('batch')}x{r.get('ctx')} " + " ".join(f"{k}={r[k]}" for k in keys if k in r), flush=True)

    global DEV
    DEV = "cpu" if args.cpu_smoke else "cuda"
    deadline = args.deadline
    names = [n for n in args.variants.split(",") if n]
    split_variants = [n for n in args.split_variants.split(",") if n]
    if args.first:
        emit({"env": {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)", "torch": torch.__version__,
                      "triton": __import__("triton").__version__, "python": sys.version.split()[0],
                      "read_gbps": round(read_gbps())}})
    if args.flush_mb > 0:
        FLUSH["buf"] = torch.ones((args.flush_mb << 20) // 8, dtype=torch.int64, device=DEV)
    for pt in args.points.split(","):
        b, c = (int(x) for x in pt.split("x"))
        torch.manual_seed(0)
        q = torch.randn(b, HQ, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def tagged(r: dict, b=b, c=c) -> None:
            emit({"batch": b, "ctx": c, **r})

        if FLUSH["buf"] is not None:  # the read alone, once per point (subtracted from every row's time)
            FLUSH["us"] = graph_us(flush_l2, args.reps, args.iters)
        if not args.skip_reference_paths and time.time() < deadline:
            for fn in (lambda: paged_point(b, c, q, k, v, args), lambda: npu_bf16_row(b, c, q, k, v, args)):
                try:
                    tagged(fn())
                except Exception as e:  # noqa: BLE001 - go on with the variants
                    tagged({"path": "reference-path", "error": repr(e)[:300]})
                if DEV == "cuda":
                    torch.cuda.empty_cache()
        try:
            npu_bfp8_rows(b, c, q, k, v, names, split_variants, args, deadline, tagged)
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - setup of this point failed; go on
            tagged({"path": "npu-bfp8_b", "error": "point setup: " + repr(e)[:300]})
            if not cuda_alive():
                raise SystemExit(3) from None
        if DEV == "cuda":
            torch.cuda.empty_cache()
        tagged({"point_done": True})


def table(rows: list[dict]) -> str:
    paged = {(r["batch"], r["ctx"]): r["us"] for r in rows if r.get("path") == "gpu-paged" and "us" in r}
    lines = [f"{'point':>8} {'variant':<24} {'splits':>6} {'L':>2} {'us':>9} {'x paged':>8} {'max_err':>9} {'ok':>3} {'=bytes':>6} {'bits':>4}"]
    for r in rows:
        if "variant" not in r or "batch" not in r:
            continue
        pt = f"{r['batch']}x{r['ctx']}"
        us = r.get("us")
        ratio = f"{us / paged[(r['batch'], r['ctx'])]:.3f}" if us and (r["batch"], r["ctx"]) in paged else "-"
        err = f"{r['max_err']:.2e}" if "max_err" in r else "-"
        ok = {True: "yes", False: "NO"}.get(r.get("ok"), "-")
        bw = {True: "yes", False: "no"}.get(r.get("bitwise_vs_bytes"), "-")
        bits = {True: "b", False: ""}.get(r.get("keeps_paged_bits"), "")
        tail = f"  ERROR {r['error'][:90]}" if "error" in r else (f"  ({r['skipped']})" if "skipped" in r else "")
        launches = r.get("launches") or ""
        lines.append(f"{pt:>8} {r['variant']:<24} {str(r.get('splits', '')):>6} {launches:>2} {us if us else '-':>9} {ratio:>8} {err:>9} {ok:>3} {bw:>6} {bits:>4}{tail}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Per bfloat8_b variant: ratio to paged at each point, all-ok, and the worst ratio at the acceptance
    points (batch 1 and 64, context 1024); the best variant is the one whose worst ratio is lowest."""
    paged = {(r["batch"], r["ctx"]): r["us"] for r in rows if r.get("path") == "gpu-paged" and "us" in r}
    per: dict[str, dict] = {}
    for r in rows:
        if r.get("path") != "npu-bfp8_b" or "variant" not in r:
            continue
        s = per.setdefault(r["variant"], {"ratios": {}, "all_ok": True, "keeps_paged_bits": r.get("keeps_paged_bits")})
        s["all_ok"] &= bool(r.get("ok")) and "error" not in r
        key = (r["batch"], r["ctx"])
        if "us" in r and key in paged:
            s["ratios"][f"{key[0]}x{key[1]}"] = round(r["us"] / paged[key], 3)
    for s in per.values():
        acc = [s["ratios"].get(p) for p in ("1x1024", "64x1024")]
        s["worst_acceptance_ratio"] = max(acc) if all(a is not None for a in acc) else None
        s["meets_issue_7"] = bool(s["all_ok"] and s["worst_acceptance_ratio"] is not None and s["worst_acceptance_ratio"] <= 1.0)
    ranked = sorted((s["worst_acceptance_ratio"], n) for n, s in per.items() if s["worst_acceptance_ratio"] is not None and s["all_ok"])
    return {"variants": per, "best": ranked[0][1] if ranked else None,
            "best_keeping_paged_bits": next((n for _, n in ranked if per[n]["keeps_paged_bits"]), None)}


def main() -> None:
    from hawk.engine import triton_npu_attention as tk

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bfp8_kernel_probe.json", help="where to write the results")
    p.add_argument("--points", default=DEFAULT_POINTS, help="comma-separated BATCHxCONTEXT")
    p.add_argument("--variants", default=",".join(tk.BFP8_VARIANTS), help="comma-separated BFP8_VARIANTS names")
    p.add_argument("--split-variants", default=DEFAULT_SPLIT_VARIANTS,
                   help="variants also timed at the occupancy rule's split count (not the paged decode's bits)")
    p.add_argument("--split-programs-per-sm", type=int, default=4,
                   help="programs per SM the occupancy split rule fills (4: 128 registers, 4 warps)")
    p.add_argument("--split-counts", default="",
                   help="comma-separated split counts for the --split-variants (instead of the occupancy rule)")
    p.add_argument("--flush-mb", type=int, default=0,
                   help="read this many MiB before each timed call and subtract that read's time (cold L2; 0: off)")
    p.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--iters", type=int, default=10, help="graph replays (median)")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop timing (still checking) after this long")
    p.add_argument("--skip-reference-paths", action="store_true", help="do not time paged / NPU bf16")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check this script on a CPU: Triton interpreter, tiny points (e.g. --points 1x96,3x130)")
    # internal: the child process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--first", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    unknown = [n for n in a.variants.split(",") if n and n not in tk.BFP8_VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(tk.BFP8_VARIANTS)}")
    t0 = time.time()
    rows_path = Path(a.json).with_suffix(".rows.jsonl")
    rows_path.unlink(missing_ok=True)
    variants = [n for n in a.variants.split(",") if n]
    points = [x for x in a.points.split(",") if x]
    excluded: list[str] = []
    first = True
    while points:
        cmd = [sys.executable, __file__, "--child", "--rows", str(rows_path), "--deadline", str(t0 + a.budget_s),
               "--points", ",".join(points), "--variants", ",".join(v for v in variants if v not in excluded),
               "--split-variants", a.split_variants, "--reps", str(a.reps), "--iters", str(a.iters),
               "--split-programs-per-sm", str(a.split_programs_per_sm), "--split-counts", a.split_counts,
               "--flush-mb", str(a.flush_mb)]
        cmd += ["--first"] if first else []
        cmd += ["--skip-reference-paths"] if a.skip_reference_paths else []
        env = dict(os.environ)
        if a.cpu_smoke:
            cmd += ["--cpu-smoke"]
            env["TRITON_INTERPRET"] = "1"
        rc = subprocess.run(cmd, env=env).returncode
        first = False
        rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
        done = {f"{r['batch']}x{r['ctx']}" for r in rows if r.get("point_done")}
        points = [x for x in points if x not in done]
        if rc == 0 or not points:
            break
        fatal = [r["variant"] for r in rows if r.get("fatal") and r["variant"].split("+")[0] not in excluded]
        if not fatal:  # died without naming a variant: give up on the rest
            print(f"child exited {rc} without a fatal variant; points not done: {points}", flush=True)
            break
        excluded.append(fatal[0].split("+")[0])
        print(f"variant {fatal[0]} broke the CUDA context; restarting without it", flush=True)
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    seen, clean = set(), []
    for r in rows:  # a restarted point's rows appear twice: keep the first of each
        key = (r.get("batch"), r.get("ctx"), r.get("path"), r.get("variant"), r.get("point_done"))
        if key in seen and "env" not in r:
            continue
        seen.add(key)
        clean.append(r)
    env = next((r["env"] for r in clean if "env" in r), {})
    result = {"env": env, "excluded_after_fatal_error": excluded, "elapsed_s": round(time.time() - t0, 1),
              "rows": [r for r in clean if "env" not in r and not r.get("point_done")], "summary": None}
    result["summary"] = summary(result["rows"])
    Path(a.json).write_text(json.dumps(result, indent=1))
    print()
    print(json.dumps(env))
    print(table(result["rows"]))
    print()
    s = result["summary"]
    for n, v in s["variants"].items():
        print(f"{n:<24} worst(1x1k, 64x1k) {v['worst_acceptance_ratio']}  all_ok {v['all_ok']}  meets issue 7 {v['meets_issue_7']}")
    print(f"best: {s['best']}  best keeping the paged decode's bits: {s['best_keeping_paged_bits']}")
    print(f"wrote {a.json} ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
