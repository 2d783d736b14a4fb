"""Several `hawk bench engine` runs of the same decode points, read together.

Why: at batch 1 the bfloat8_b and paged steps differ by less than one run's spread between
processes (on an H200 0.995-1.006 across five runs), so one run cannot say on which
side of 1.0 their ratio is. Each run records, per NPU point, its step over the paged step round by
round (``vs_paged``, :func:`hawk.bench.engine.paired_ratio`); this reads N runs and reports, per
point, each run's ratio of medians and paired median, and across runs the median of the paired
medians, their range and how many runs are at or below ``--target``.

    python benchmarks/engine_runs_summary.py run1.json run2.json ... [--target 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

Key = tuple[str, str, int, int]  # path, kv dtype, batch, context


def _key(r: dict[str, Any]) -> Key:
    return (r["path"], r["kv_dtype"], r["batch"], r["context"])


def summarize(runs: list[list[dict[str, Any]]], target: float = 1.0) -> list[dict[str, Any]]:
    """One row per NPU decode point present in every run with a paired ratio: each run's figures and
    the figures across runs. A run whose group had no paged point (or was skipped) is left out of its rows."""
    rows: dict[Key, dict[str, Any]] = {}
    for i, recs in enumerate(runs):
        decode = [r for r in recs if r.get("kind") == "decode" and not r.get("skipped")]
        paged = {(r["batch"], r["context"]): r for r in decode if r["path"] == "gpu-paged" and r["kv_dtype"] == "bf16"}
        for r in decode:
            base = paged.get((r["batch"], r["context"]))
            if "vs_paged" not in r or base is None:
                continue
            row = rows.setdefault(_key(r), {"path": r["path"], "kv_dtype": r["kv_dtype"], "batch": r["batch"],
                                            "context": r["context"], "runs": []})
            row["runs"].append({"run": i, "ms": r["ms"], "paged_ms": base["ms"], "ratio_of_medians": round(r["ms"] / base["ms"], 4),
                                **{f"paired_{k}": v for k, v in r["vs_paged"].items()}})
    out = []
    for row in rows.values():
        med = [x["paired_median"] for x in row["runs"]]
        row.update(n_runs=len(med), paired_median_of_runs=round(statistics.median(med), 4),
                   paired_min=min(med), paired_max=max(med), target=target,
                   runs_at_or_below_target=sum(m <= target for m in med))
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="`hawk bench engine` JSON files (one per process)")
    p.add_argument("--target", type=float, default=1.0, help="the ratio to count runs against (issue 7: bfloat8_b <= 1.0)")
    p.add_argument("--json", default=None, help="write the summary here")
    a = p.parse_args(argv)
    rows = summarize([json.loads(Path(f).read_text()) for f in a.runs], a.target)
    for r in rows:
        per_run = " ".join(f"{x['paired_median']:.4f}" + (f" ({' '.join(f'{v:.4f}' for v in x['paired_by_replica'])})"
                                                          if "paired_by_replica" in x else "") for x in r["runs"])
        print(f"{r['path']:9} {r['kv_dtype']:6} b{r['batch']:<3} ctx {r['context']:<5} paired / paged per run: {per_run}  "
              f"median {r['paired_median_of_runs']:.4f} [{r['paired_min']:.4f}, {r['paired_max']:.4f}]  "
              f"<= {r['target']}: {r['runs_at_or_below_target']}/{r['n_runs']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
