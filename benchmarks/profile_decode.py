"""Where an 8B decode step's time goes: per-kernel GPU time of one eager step, and the graph step.

A tuning probe beside ``hawk bench engine``: the eager step under torch.profiler lists every kernel
with its GPU time and the number of kernels launched; the sum of kernel time against the replayed
graph's step time says whether a step is bound by kernels (tune them) or by the gaps between them
(fuse them). The replay alone (no host work before it) and the host time of a graph step
(``runner.step`` up to and including the replay launch, no sync) split the step's time between the
GPU and what the GPU waits for.

    python benchmarks/profile_decode.py --batches 1,64 --context 1024 [--paths npu-tile:bfp8_b] [--replay-trace]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hawk.bench import engine as eb
from hawk.engine.attention import SeqSlice
from hawk.engine.config import preset
from hawk.engine.model import LlamaModel
from hawk.engine.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--paths", default="gpu-paged:bf16,npu-tile:bfp8_b")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--replay-trace", action="store_true",
                   help="also trace graph replays: per kernel, its time in the replay and the idle gap before it")
    a = p.parse_args()
    dev = torch.device("cuda:0")
    cfg = preset("llama-3.1-8b")
    model = LlamaModel.from_config(cfg, dtype=torch.bfloat16, device=dev, fuse=True)
    for spec in a.paths.split(","):
        path, kvd = spec.split(":")
        for b in (int(x) for x in a.batches.split(",")):
            build = eb.build_paged if path == "gpu-paged" else eb.build_npu
            cache = build(cfg, kvd, b, a.context + 8, dev)
            slices = [SeqSlice(blocks, a.context, 1) for blocks in cache.blocks]
            toks = [[1] for _ in range(b)]
            eager = ModelRunner(model, cache.attn, max_batch=max(b, 1), graphs=False)
            for _ in range(3):
                eager.step(toks, slices)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                eager.step(toks, slices)
                torch.cuda.synchronize()
            ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
            total = sum(getattr(e, "self_device_time_total", 0) for e in ev) / 1e3
            kernels = sum(e.count for e in prof.events() if e.device_type.name == "CUDA")
            print(f"=== {path} {kvd} batch {b} context {a.context}: eager kernel time {total:.3f} ms, "
                  f"{kernels} GPU activities (kernels + copies) per step")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=a.rows, max_name_column_width=70))
            graphed = ModelRunner(model, cache.attn, max_batch=max(b, 1), graphs=True)
            graphed.warmup([eb_bucket(b)])
            for _ in range(3):
                graphed.step(toks, slices).greedy.tolist()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times, host = [], []
            for _ in range(20):
                e0.record()
                h0 = time.perf_counter()
                out = graphed.step(toks, slices)
                host.append((time.perf_counter() - h0) * 1e6)
                out.greedy.tolist()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            g = graphed._graphs[eb_bucket(b)].graph
            replay = []
            for _ in range(20):  # the graph alone, its inputs as the last step left them
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                replay.append(e0.elapsed_time(e1))
            print(f"=== graph step median {sorted(times)[10]:.3f} ms (kernels alone {total:.3f} ms, replay alone "
                  f"{sorted(replay)[10]:.3f} ms); host part of step() median {sorted(host)[10]:.0f} us")
            if a.replay_trace:
                print(replay_trace(g, a.rows))
            print("=== host phases of a graph step, median us: " + host_phases(graphed, cache.attn, toks, slices, b))
            cache.close()
            del cache, eager, graphed
            torch.cuda.empty_cache()


def replay_trace(graph: torch.cuda.CUDAGraph, rows: int, replays: int = 5) -> str:
    """Where a replay's time goes beyond its kernels: the replayed kernels in start order, per kernel
    name the time it ran and the idle time before it started (since the previous kernel ended),
    summed over ``replays`` replays and divided by them; the largest gaps first. The total leaves out
    the gap before each replay's first kernel (the launch and the host's sync between replays)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    by: dict[str, list[float]] = {}
    per = max(1, len(ev) // replays)  # kernels per replay
    inside = 0.0
    prev_end = None
    for i, e in enumerate(ev):
        gap = 0.0 if prev_end is None else max(0.0, e.time_range.start - prev_end)
        inside += gap if i % per else 0.0
        d = by.setdefault(e.name[:60], [0, 0.0, 0.0])
        d[0] += 1
        d[1] += e.time_range.end - e.time_range.start
        d[2] += gap
        prev_end = e.time_range.end if prev_end is None else max(prev_end, e.time_range.end)
    lines = [f"=== replay trace ({replays} replays, per replay): kernels {sum(v[1] for v in by.values()) / replays:.0f} us, "
             f"gaps {inside / replays:.0f} us"]
    for name, (n, dur, gap) in sorted(by.items(), key=lambda kv: -kv[1][2])[:rows]:
        lines.append(f"    {name:60s} x{n // replays:4d}  ran {dur / replays:8.1f} us  gaps before {gap / replays:7.1f} us")
    return "\n".join(lines)


def host_phases(runner: ModelRunner, attn: object, toks: list[list[int]], slices: list[SeqSlice], b: int) -> str:
    """What ``runner.step`` does on the host, phase by phase (its ``_replay`` unrolled), then the sync:
    which part of the host time before the replay is metadata, the ids' upload or the graph launch."""
    bucket = eb_bucket(b)
    g = runner._graphs[bucket]
    ids, starts = [t for (t,) in toks], [s.start for s in slices]
    names = ("begin", "write_io", "replay_launch", "sync_tolist")
    laps: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(30):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        attn.begin(slices, pad_to=bucket)
        t.append(time.perf_counter())
        runner._write_io(ids, starts, bucket)
        t.append(time.perf_counter())
        g.graph.replay()
        t.append(time.perf_counter())
        g.greedy[:b].tolist()
        t.append(time.perf_counter())
        for k, a, z in zip(names, t, t[1:]):
            laps[k].append((z - a) * 1e6)
    prof = cProfile.Profile()
    for _ in range(50):
        torch.cuda.synchronize()
        prof.enable()
        attn.begin(slices, pad_to=bucket)
        runner._write_io(ids, starts, bucket)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(buf.getvalue()[-3500:])
    return ", ".join(f"{k} {sorted(v)[len(v) // 2]:.0f}" for k, v in laps.items())


def eb_bucket(b: int) -> int:
    from hawk.engine.runner import decode_buckets

    return min(x for x in decode_buckets(max(b, 1)) if x >= b)


if __name__ == "__main__":
    main()
