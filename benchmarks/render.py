"""Render the committed benchmark JSON files as the Markdown tables in docs/benchmarks.md.

    python benchmarks/render.py transform benchmarks/results/transform_h200.json
    python benchmarks/render.py transfer benchmarks/results/transfer_h200x2.json
    python benchmarks/render.py equivalence benchmarks/results/e2e_8b_h200x2.json
"""

from __future__ import annotations

import json
import sys


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def transform(records: list[dict]) -> str:
    rows = [
        [str(r["size_mb"]), r["dtype"], r.get("blocks", ""), r["impl"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['copy_gbps']:.0f}", f"{r['ratio']:.2f}", "yes" if r.get("match") else "no"]
        for r in records
    ]
    return _table(["MiB", "NPU dtype", "block ids", "impl", "ms", "GB/s (r+w)", "copy GB/s", "ratio", "bytes match"], rows)


def transfer(records: list[dict]) -> str:
    sizes = sorted({r["size_mb"] for r in records})
    configs = list(dict.fromkeys(r["config"] for r in records))
    by = {(r["config"], r["size_mb"]): r for r in records}
    rows = [[c] + [f"{by[(c, s)]['median_ms']:.2f}" for s in sizes] + [str(by[(c, sizes[-1])]["requests"])] for c in configs]
    table = _table(["config \\ MiB"] + [str(s) for s in sizes] + ["requests"], rows)
    if ("gn-hawk", sizes[0]) in by and ("gg-direct", sizes[0]) in by:
        ratio = [["gn-hawk / gg-direct"] + [f"{by[('gn-hawk', s)]['median_ms'] / by[('gg-direct', s)]['median_ms']:.2f}" for s in sizes] + [""]]
        if ("gn-host", sizes[0]) in by:
            ratio.append(["gn-host / gn-hawk"] + [f"{by[('gn-host', s)]['median_ms'] / by[('gn-hawk', s)]['median_ms']:.1f}" for s in sizes] + [""])
        table += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in ratio)
    return table


def equivalence(records: list[dict]) -> str:
    rows = [
        [r["config"], str(r["prompt"]), "yes" if r["identical"] else "NO", str(r["tokens"]), f"{r['ttft_ms']:.1f}", f"{r['tpot_ms']:.1f}", f"{r['colocated_tpot_ms']:.1f}", f"{r['kv_transfer_ms']:.1f}", f"{r['kv_bytes'] / 2**20:.1f}", r["kv_mode"], r["decode_device"]]
        for r in records
    ]
    return _table(["config", "prompt", "tokens = colocated", "tokens", "TTFT ms", "TPOT ms", "colocated TPOT ms", "KV transfer ms", "KV MiB", "landing", "decode device"], rows)


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    print({"transform": transform, "transfer": transfer, "equivalence": equivalence}[kind](json.load(open(path))))
