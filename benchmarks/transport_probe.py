"""Two-process throughput and per-descriptor cost of the real transfer engines on this machine.

A peer process registers one region; this process pulls (READ) from it or pushes (WRITE) into it,
as one batch of ``--descs`` descriptors per size (8 = one request per NPU channel, as HAWK does).
Per-descriptor cost: the same 16 MB moved as 4096 x 4 KB versus 8 x 2 MB in one batch.

    python benchmarks/transport_probe.py --engines nixl,mooncake --sizes-mb 10,160

Not a test: numbers depend on the machine (cores, loopback, UCX transports chosen).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hawk.transport import Desc, make_transport  # noqa: E402


def _pattern(n: int, device: str) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.int32, device=device) % 251).to(torch.uint8)


def _peer(conn: Any, engine: str, options: dict[str, Any], nbytes: int, device: str) -> None:
    """Register one region with a known pattern, publish metadata, wait for 'exit'."""
    t = make_transport(engine, **options)
    t.register("remote", _pattern(nbytes, device))
    conn.send(t.metadata())
    conn.poll(3600)
    t.close()


def _even(total: int, n: int) -> list[tuple[int, int]]:
    """n (offset, length) pieces covering total bytes."""
    step = total // n
    return [(i * step, step if i < n - 1 else total - i * step) for i in range(n)]


def _time_batch(t: Any, peer: str, op: str, descs: list[Desc], repeats: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        h = t.submit(op, peer, descs)
        t.wait(h, timeout_s=120)
        dt = time.perf_counter() - t0
        t.release(h)
        if i >= warmup:
            out.append(dt)
    return out


def probe(engine: str, options: dict[str, Any], sizes_mb: list[int], ndesc: int, ops: list[str], repeats: int,
          warmup: int, device: str = "cpu", peer_device: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    cap = max(max(sizes_mb) << 20, 16 << 20)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, engine, options, cap, peer_device or device), daemon=True)
    proc.start()
    if not conn.poll(120):
        raise TimeoutError(f"{engine} peer did not start")
    meta = conn.recv()
    t = make_transport(engine, **options)
    local = torch.zeros(cap, dtype=torch.uint8, device=device)
    t.register("local", local)
    peer = t.connect(meta)
    rows: list[dict[str, Any]] = []
    where = {"engine": engine, "device": device, "peer_device": peer_device or device}
    try:
        for op in ops:
            for mb in sizes_mb:
                total = mb << 20
                descs = [Desc("local", o, "remote", o, n) for o, n in _even(total, ndesc)]
                times = _time_batch(t, peer, op, descs, repeats, warmup)
                if op == "READ":  # bytes check on the pulled data
                    assert torch.equal(local[:total], _pattern(total, device)), "READ bytes differ"
                med = statistics.median(times)
                rows.append({**where, "op": op, "size_mb": mb, "descriptors": ndesc, "median_ms": med * 1e3,
                             "best_ms": min(times) * 1e3, "gb_s": total / med / 1e9, "best_gb_s": total / min(times) / 1e9})  # fmt: skip
            # per-descriptor cost: 16 MB as 4096 x 4 KB vs as 8 x 2 MB
            many = [Desc("local", o, "remote", o, n) for o, n in _even(16 << 20, 4096)]
            few = [Desc("local", o, "remote", o, n) for o, n in _even(16 << 20, 8)]
            t_many = statistics.median(_time_batch(t, peer, op, many, repeats, warmup))
            t_few = statistics.median(_time_batch(t, peer, op, few, repeats, warmup))
            rows.append({**where, "op": op, "size_mb": 16, "descriptors": 4096, "median_ms": t_many * 1e3,
                         "ms_as_8_descriptors": t_few * 1e3, "us_per_descriptor": t_many / 4096 * 1e6,
                         "overhead_us_per_descriptor": (t_many - t_few) / (4096 - 8) * 1e6})  # fmt: skip
    finally:
        t.close()
        conn.send("exit")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="nixl,mooncake")
    ap.add_argument("--sizes-mb", default="10,160")
    ap.add_argument("--descs", type=int, default=8)
    ap.add_argument("--ops", default="READ,WRITE")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mooncake-protocol", default="tcp")
    ap.add_argument("--device", default="cpu", help="where this side's region lives: cpu, cuda, cuda:1, ...")
    ap.add_argument("--peer-device", default=None, help="where the peer's region lives (default: --device)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    rows = []
    for engine in a.engines.split(","):
        opts = {"protocol": a.mooncake_protocol} if engine == "mooncake" else {}
        rows += probe(engine, opts, sizes, a.descs, a.ops.split(","), a.repeats, a.warmup, a.device, a.peer_device)
    print(f"{'engine':9} {'op':5} {'MB':>5} {'descs':>6} {'median ms':>10} {'GB/s':>7} {'best GB/s':>9}  per-desc")
    for r in rows:
        if "gb_s" in r:
            print(f"{r['engine']:9} {r['op']:5} {r['size_mb']:>5} {r['descriptors']:>6} {r['median_ms']:>10.2f} "
                  f"{r['gb_s']:>7.2f} {r['best_gb_s']:>9.2f}")  # fmt: skip
        else:
            print(f"{r['engine']:9} {r['op']:5} {r['size_mb']:>5} {r['descriptors']:>6} {r['median_ms']:>10.2f} "
                  f"{'':>7} {'':>9}  {r['us_per_descriptor']:.2f} us/desc; +{r['overhead_us_per_descriptor']:.2f} us "
                  f"over 8 x 2 MB ({r['ms_as_8_descriptors']:.2f} ms)")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
