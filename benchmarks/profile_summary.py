"""What a `benchmarks/serving_host_profile.sh` run says, as numbers: the GPU's busy share, the engine's
step counters over the window, and where each engine thread's samples went.

    python benchmarks/profile_summary.py DIR [--thread hawk-decode] [--under DecodeEngine._iterate] [--depth 2]

DIR holds the script's outputs (gpu_util.csv, profile.tgz with metrics_before/after.txt and the py-spy raw
stacks); the engine's loop clock (hawk/engine/loop_clock.py) comes from the two /metrics reads. The py-spy part groups a thread's samples (py-spy's default: active samples only, so a thread
spinning on a CUDA event counts, one blocked on a lock or the GIL does not) by the first ``--depth`` frames
below ``--under``; "active" is that thread's share of the samples the window allows (rate x seconds).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import tarfile
from pathlib import Path

ENGINE_COUNTERS = ("steps_overlapped", "steps_synchronous", "steps_mixed", "steps_piecewise",
                 "loop_busy_s", "loop_device_wait_s", "loop_blocked_s")  # the last three: hawk/engine/loop_clock.py


def gpu_busy(path: Path) -> tuple[float, int]:
    """Mean of nvidia-smi's utilization.gpu samples (percent of time a kernel ran), and their count."""
    vals = [float(r[1].split()[0]) for r in csv.reader(path.open()) if len(r) > 1 and r[1].strip()]
    return (sum(vals) / len(vals) if vals else float("nan")), len(vals)


def counters(text: str) -> dict[str, float]:
    """The engine's step counters and loop clock in a /metrics page (summed over instances)."""
    out: dict[str, float] = collections.Counter()
    for line in text.splitlines():
        for name in ENGINE_COUNTERS:
            if not line.startswith("#") and f"_engine_{name}" in line:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def frame(f: str) -> str:
    """``func (path:line)`` as ``func line`` for HAWK's frames, the bare function elsewhere."""
    m = re.match(r"(.*?) \((.*):(\d+)\)$", f)
    if not m:
        return f
    return f"{m.group(1)} {m.group(3)}" if "hawk/" in m.group(2) else m.group(1)


def thread_samples(raw: str) -> dict[str, list[tuple[list[str], int]]]:
    """py-spy raw (collapsed, ``--threads``) stacks by thread name."""
    by: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        by[name].append((frames[1:], int(n)))
    return by


def breakdown(samples: list[tuple[list[str], int]], under: str, depth: int) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for frames, n in samples:
        names = [frame(f) for f in frames]
        at = next((i for i, f in enumerate(names) if f.split(" ")[0] == under), None)
        key = " > ".join(names[at + 1 : at + 1 + depth]) if at is not None else "(outside " + under + ")"
        c[key or "(in " + under + ")"] += n
    return c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--thread", default="hawk-decode")
    p.add_argument("--under", default="DecodeEngine._iterate")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--rate", type=float, default=50.0, help="py-spy's sampling rate (the script's -r)")
    p.add_argument("--seconds", type=float, default=0.0, help="py-spy's window (default: from cpu.txt)")
    a = p.parse_args()
    if (a.dir / "gpu_util.csv").exists():
        busy, n = gpu_busy(a.dir / "gpu_util.csv")
        print(f"GPU busy (nvidia-smi utilization.gpu, mean of {n} samples): {busy:.1f} %")
    seconds = a.seconds
    if not seconds and (a.dir / "cpu.txt").exists():
        m = re.search(r"window (\d+) s", (a.dir / "cpu.txt").read_text())
        seconds = float(m.group(1)) if m else 0.0
    with tarfile.open(a.dir / "profile.tgz") as tar:
        files = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    if "metrics_before.txt" in files and "metrics_after.txt" in files:
        before, after = counters(files["metrics_before.txt"]), counters(files["metrics_after.txt"])
        d = {k: after[k] - before[k] for k in ENGINE_COUNTERS}
        steps = d["steps_overlapped"] + d["steps_synchronous"]
        if steps:
            print(f"steps between the two /metrics reads: {steps:.0f}, synchronous {d['steps_synchronous'] / steps:.1%}, "
                  f"carrying prompt chunks {d['steps_mixed'] / steps:.1%}, graph pieces {d['steps_piecewise'] / steps:.1%}")
        if d["loop_busy_s"]:
            print(f"decode loop busy {d['loop_busy_s']:.1f} s: waiting on the device {d['loop_device_wait_s'] / d['loop_busy_s']:.1%}, "
                  f"blocked (a lock or the GIL) {d['loop_blocked_s'] / d['loop_busy_s']:.1%}")
    for name, raw in sorted(files.items()):
        if not (name.startswith("pyspy_engine_") and name.endswith(".txt")):
            continue
        samples = thread_samples(raw).get(a.thread)
        if not samples:
            continue
        total = sum(n for _, n in samples)
        share = f" ({total / (a.rate * seconds):.1%} of the {a.rate * seconds:.0f} the window allows)" if seconds else ""
        print(f"{name}: thread {a.thread}, {total} active samples{share}; by the {a.depth} frames below {a.under}:")
        for key, n in breakdown(samples, a.under, a.depth).most_common(a.top):
            print(f"  {n / total:6.1%}  {key}")


if __name__ == "__main__":
    main()
