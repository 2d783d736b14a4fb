"""Where a layer-wise push's cost to the prefill's forward goes on the GPU (issue 9), kernel by kernel.

``hawk bench ttft`` under ``torch.profiler`` (CUDA activity): each request (colocated, and each
configuration / KV flow) is annotated with its request id, and every kernel the GPU ran inside that
request's window is kept. Per request and stream: the span from its first kernel's start to its
last kernel's end, the busy time (kernel durations summed) and the kernel count; per configuration,
their medians over the measured repeats; and, for the forward's stream (the busiest stream of the
colocated requests), each kernel name's median total time per request beside colocated's, largest
differences first: whether the forward runs longer because its own kernels run slower beside the
push's (contention for SMs and memory), or because it waits between them. ``timeline_ms``: when
the graph was launched, the forward's first and last kernels ran, and the host heard it was over,
from the request's start (median): whether the host, not the GPU, is late.

    python benchmarks/ttft_kernel_timeline_probe.py --json timeline.json -- --model llama-3.1-8b --dtype bf16 \\
        --prefill-device cuda:0 --decode-device npu-emu:cuda:0 --prompts 1024 --configs gn-hawk \\
        --kv-flows layerwise --repeats 5 --warmup 2

``--switch-interval S``: the interpreter's switch interval for the run (is a thread waiting for the
GIL?). ``--host-profile FILE``: a cProfile of the prefill engine's iterations (on Python >= 3.12 it
sees every thread while enabled: read it for one-off costs, not per-thread times). On a CPU the
profile has no kernels; the probe still runs (a check of its plumbing).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any

import torch

import hawk.bench.equivalence as equivalence
from hawk.bench import ttft

_RID = re.compile(r"^ttft-(?P<key>.+)-(?P<n>\d+)-(?P<i>\d+)-\d+$")


def annotate() -> None:
    """Wrap each request of the benchmark in a profiler range named by its request id."""
    colocated, disaggregated = equivalence.run_colocated, equivalence.run_disaggregated

    def run_colocated(inst: Any, ids: Any, params: Any, rid: str) -> Any:
        with torch.profiler.record_function(rid):
            return colocated(inst, ids, params, rid)

    def run_disaggregated(p: Any, d: Any, ids: Any, params: Any, rid: str) -> Any:
        with torch.profiler.record_function(rid):
            return disaggregated(p, d, ids, params, rid)

    equivalence.run_colocated, equivalence.run_disaggregated = run_colocated, run_disaggregated


def profile_prefill_runs(prof: cProfile.Profile) -> None:
    """cProfile every prefill engine iteration: where the host time before the forward's launch goes
    (the wait for the forward shows as the stream's synchronize; on Python >= 3.12 the other threads'
    calls while it is enabled are in it too)."""
    from hawk.engine.prefill_engine import PrefillEngine

    run = PrefillEngine._run

    def profiled(self: Any, batch: Any) -> None:
        prof.enable()
        try:
            run(self, batch)
        finally:
            prof.disable()

    PrefillEngine._run = profiled  # type: ignore[method-assign]


def windows(trace: dict[str, Any], warmup: int) -> list[dict[str, Any]]:
    """The measured requests' windows and the kernels that started inside each."""
    events = trace.get("traceEvents", [])
    spans = []
    for e in events:
        m = _RID.match(str(e.get("name", "")))
        if e.get("ph") == "X" and m and int(m["i"]) >= warmup:
            spans.append({"key": m["key"], "tokens": int(m["n"]), "t0": float(e["ts"]), "t1": float(e["ts"]) + float(e["dur"]), "kernels": []})
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            _place(spans, "kernels", (float(e["ts"]), float(e["dur"]), int((e.get("args") or {}).get("stream", -1)), str(e["name"])))
        elif e.get("cat") == "cuda_runtime" and e.get("name") in _CALLS:
            _place(spans, "calls", (float(e["ts"]), float(e["dur"]), str(e["name"])))
    return spans


def _place(spans: list[dict[str, Any]], kind: str, event: tuple[Any, ...]) -> None:
    """Append ``event`` (its start first) to the list ``kind`` of the window it started in, if any."""
    for s in spans:
        if s["t0"] <= event[0] <= s["t1"]:
            s.setdefault(kind, []).append(event)
            return


#: Host calls placed on each request's timeline: the prefill graph's launch and the waits for the GPU.
_CALLS = ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def host_marks(s: dict[str, Any], fwd: list[tuple[float, float, int, str]]) -> dict[str, float]:
    """One request's timeline, ms from its window's start: the forward's first kernel and its last
    kernel's end (``fwd``: the forward stream's kernels, sorted), the graph's launch, the end of the
    first wait for the GPU that ends after the forward's last kernel (when the host heard the forward
    was over), and the window's end."""
    out: dict[str, float] = {"window_end": (s["t1"] - s["t0"]) / 1e3}
    if not fwd:
        return out
    first, last_end = fwd[0][0], max(k[0] + k[1] for k in fwd)
    out["gpu_first"], out["gpu_last_end"] = (first - s["t0"]) / 1e3, (last_end - s["t0"]) / 1e3
    calls = sorted(s.get("calls", []))
    launch = [c for c in calls if c[2] == "cudaGraphLaunch"]
    if launch:
        out["graph_launch"] = (launch[0][0] - s["t0"]) / 1e3
    waits = [c[0] + c[1] for c in calls if c[2] != "cudaGraphLaunch" and c[0] + c[1] >= last_end]
    if waits:
        out["host_heard"] = (min(waits) - s["t0"]) / 1e3
    return out


def per_stream(kernels: list[tuple[float, float, int, str]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    by: dict[int, list[tuple[float, float, int, str]]] = defaultdict(list)
    for k in kernels:
        by[k[2]].append(k)
    for stream, ks in by.items():
        start = min(k[0] for k in ks)
        end = max(k[0] + k[1] for k in ks)
        out[stream] = {"span_ms": (end - start) / 1e3, "busy_ms": sum(k[1] for k in ks) / 1e3, "kernels": len(ks)}
    return out


def summarize(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per configuration, and the forward stream's kernels against colocated's."""
    colo = [s for s in spans if s["key"] == "colocated"]
    busy: dict[int, float] = defaultdict(float)
    for s in colo:
        for k in s["kernels"]:
            busy[k[2]] += k[1]
    main = max(busy, key=busy.__getitem__) if busy else -1
    out: dict[str, Any] = {"forward_stream": main, "configs": {}}
    names: dict[str, dict[str, list[float]]] = {}
    for key in sorted({s["key"] for s in spans}):
        mine = [s for s in spans if s["key"] == key]
        streams = [per_stream(s["kernels"]) for s in mine]
        ids = sorted({st for x in streams for st in x})
        row: dict[str, Any] = {"requests": len(mine), "window_ms": statistics.median((s["t1"] - s["t0"]) / 1e3 for s in mine)}
        for st in ids:
            got = [x[st] for x in streams if st in x]
            row[f"stream {st}" + (" (forward)" if st == main else "")] = {k: round(statistics.median(g[k] for g in got), 4) for k in got[0]}
        fwd = [sorted(k for k in s["kernels"] if k[2] == main) for s in mine]
        gaps = [sum(max(0.0, b[0] - (a[0] + a[1])) for a, b in zip(ks, ks[1:])) / 1e3 for ks in fwd if ks]
        row["forward_gaps_ms"] = round(statistics.median(gaps), 4) if gaps else None
        marks = [host_marks(s, ks) for s, ks in zip(mine, fwd)]
        row["timeline_ms"] = {k: round(statistics.median(m[k] for m in marks if k in m), 4) for k in sorted({k for m in marks for k in m})}
        out["configs"][key] = row
        per: dict[str, list[float]] = defaultdict(list)
        for ks in fwd:
            tot: dict[str, float] = defaultdict(float)
            for k in ks:
                tot[k[3]] += k[1]
            for n, v in tot.items():
                per[n].append(v / 1e3)
        names[key] = per
        side = defaultdict(float)
        for s in mine:
            for k in s["kernels"]:
                if k[2] != main:
                    side[k[3][:80]] += k[1] / 1e3 / len(mine)
        row["other_streams_top"] = {n: round(v, 4) for n, v in sorted(side.items(), key=lambda kv: -kv[1])[:8]}
    base = names.get("colocated", {})
    for key, per in names.items():
        if key == "colocated":
            continue
        deltas = []
        for n, v in per.items():
            c = base.get(n)
            if c:
                deltas.append((statistics.median(v) - statistics.median(c), n[:80], statistics.median(c)))
        deltas.sort(reverse=True)
        out["configs"][key]["forward_kernel_delta_ms"] = [{"kernel": n, "colocated_ms": round(c, 4), "delta_ms": round(d, 4)} for d, n, c in deltas[:12]]
        out["configs"][key]["forward_kernel_delta_sum_ms"] = round(sum(d for d, _, _ in deltas), 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--trace", default=None, help="also keep the chrome trace here")
    p.add_argument("--host-profile", default=None, help="write a cProfile of the prefill engine's iterations here")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s) for the run: is a thread waiting for the GIL?")
    p.add_argument("ttft_args", nargs=argparse.REMAINDER, help="after --: hawk bench ttft's arguments")
    a = p.parse_args()
    args = [x for x in a.ttft_args if x != "--"]
    warmup = int(args[args.index("--warmup") + 1]) if "--warmup" in args else 1
    annotate()
    host = cProfile.Profile() if a.host_profile else None
    if host is not None:
        profile_prefill_runs(host)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=acts) as prof:
        records = ttft.main(args)
    path = a.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    summary = summarize(windows(trace, warmup))
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "ttft": records}, f, indent=1)
    if host is not None:
        ttft.write_profile(host, a.host_profile)


if __name__ == "__main__":
    main()
