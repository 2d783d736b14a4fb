"""The serving sweeps of ``scripts/gpu_suite.sh sweeps`` as the paper's Figs. 10-12 analogues: one
figure per (workload, timing) with the four configurations, and a Markdown table of every point.

    python benchmarks/plot_sweeps.py benchmarks/results/serving_h200x2 --out docs/figures --prefix serving_h200x2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hawk.sim.report import plot_sweep

#: Server names that ran with timing emulation (gpu_suite.sh: gn-* with p150a + link, gg-* link only).
TIMED = ("_p150a", "_link200")
WHAT = {
    "measured": "as fast as the H200s run; NPU emulated on GPU1 (gn-*)",
    "timed": "NPU timing emulated as p150a (gn-*), 200 Gb/s link emulated (all)",
}


def load(folder: Path) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for f in sorted(folder.glob("serving_*.json")):
        tag = "timed" if any(t in f.stem for t in TIMED) else "measured"
        for r in json.loads(f.read_text()):
            groups.setdefault((r["workload"], tag), []).append(r)
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/figures"))
    p.add_argument("--prefix", default="serving_h200x2")
    a = p.parse_args()
    print("| workload | timing | config | rate | done | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | server TTFT p50 | KV transfer p50 | SLO |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (wl, tag), rs in sorted(load(a.folder).items()):
        plot_sweep(rs, a.out / f"{a.prefix}_{wl}_{tag}.png", title=f"{wl}, Llama-3.1-8B shape, prefill GPU0 -> decode GPU1: {WHAT[tag]}")
        for r in sorted(rs, key=lambda r: (r["config"], r["rate"])):
            kv = r.get("kv_transfer_p50_ms")
            print(f"| {wl} | {tag} | {r['config']} | {r['rate']:g} | {r['completed']}/{r['num_requests']} | {r['ttft_p50_ms']:.1f} | "
                  f"{r['ttft_p90_ms']:.1f} | {r['tpot_p50_ms']:.2f} | {r['tpot_p90_ms']:.2f} | {r['server_ttft_p50_ms']:.1f} | "
                  f"{'-' if kv is None else f'{kv:.2f}'} | {r['slo_attainment']:.0%} |")


if __name__ == "__main__":
    main()
