"""Per kernel launch in an Nsight Compute raw CSV: its duration and its largest warp-stall reasons.

    ncu --clock-control none -k regex:'_decode' --section WarpStateStats --section LaunchStats \\
        --metrics gpu__time_duration.sum --csv --page raw python3 benchmarks/ncu_decode_kernels.py 1x1024 > ncu.csv
    python benchmarks/ncu_stall_summary.py ncu.csv

Stalls are ncu's ``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``: warps waiting
on that reason per issued instruction (for a latency-bound kernel with one warp per scheduler, the
cycles per instruction its chain costs).
"""

from __future__ import annotations

import csv
import sys


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: str, top: int = 7) -> list[str]:
    rows = list(csv.reader(open(path)))
    head = next(k for k, r in enumerate(rows) if r and r[0] == "ID")
    h, data = rows[head], rows[head + 2:]  # the row after the header holds the units
    name, dur = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    stalls = [j for j, c in enumerate(h) if "issue_stalled" in c and c.endswith("per_issue_active.ratio")]
    out = []
    for r in data:
        worst = sorted(((_num(r[j]), h[j].split("issue_stalled_")[1].split("_per_issue")[0]) for j in stalls), reverse=True)[:top]
        out.append(f"{r[name][:26]} {r[dur]} ns " + " ".join(f"{n}={v:.1f}" for v, n in worst))
    return out


if __name__ == "__main__":
    print("\n".join(summarize(sys.argv[1])))
