"""Tables, plots and JSON for serving records — measured (``hawk.bench.serving``) or simulated.

Both producers emit the same record schema (see ``metrics.summarize``), so one table and one set of
figures (the paper's Figs. 10–12 analogues: P90 TTFT, P90 TPOT and SLO attainment vs request rate)
serve both. Every figure carries a provenance line — "NPU emulated on a CPU box" or "simulated,
transfer measured / compute assumed" — because these are not the paper's hardware numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def series_label(r: dict[str, Any]) -> str:
    """One line per configuration (and P:D ratio when it is not 1:1)."""
    label = str(r.get("config") or "?")
    if r.get("pd_ratio") and r["pd_ratio"] != "1:1":
        label += f" ({r['pd_ratio']})"
    return label


def provenance(records: Sequence[dict[str, Any]]) -> str:
    """What the numbers are, in words, for titles and table captions."""
    if not records:
        return ""
    if all(r.get("simulated") for r in records):
        if all(r.get("step_costs") for r in records):
            return "simulated: one colocated engine, step times " + "; ".join(sorted({str(r["step_costs"]) for r in records}))
        measured = all(r.get("transfer_measured") for r in records)
        return "simulated: KV transfer " + ("measured (H200x2, NPU emulated)" if measured else "model") + ", compute models assumed"
    devs = sorted({str(r.get("decode_device")) for r in records if r.get("decode_device")})
    models = sorted({str(r.get("model")) for r in records if r.get("model")})
    emulated = any("emulated" in d or d.startswith("npu-emu") for d in devs)
    where = ", ".join(devs) if devs else "decode device unknown"
    what = f"{', '.join(models)}; " if models else ""
    return f"measured: {what}decode on {where}" + ("; the NPU is emulated (not Tenstorrent hardware)" if emulated else "")


def console() -> Any:
    """A rich console that does not squeeze tables when output is a file or pipe."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=220)


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_table(records: Sequence[dict[str, Any]], title: str | None = None) -> None:
    """A rich table: one row per (configuration, rate)."""
    from rich.table import Table

    t = Table(title=title or f"Serving ({provenance(records)})")
    cols = ("config", "workload", "rate", "done", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "SLO att.", "out tok/s", "goodput tok/s")
    for c in cols:
        t.add_column(c, justify="left" if c in ("config", "workload") else "right")
    for r in records:
        t.add_row(
            series_label(r), str(r.get("workload", "")), _f(r.get("rate"), "{:g}"),
            f"{r.get('completed', 0)}/{r.get('num_requests', 0)}",
            _f(r.get("ttft_p50_ms")), _f(r.get("ttft_p90_ms")), _f(r.get("tpot_p50_ms")), _f(r.get("tpot_p90_ms")),
            _f(r.get("slo_attainment"), "{:.0%}"), _f(r.get("output_throughput_tok_s")), _f(r.get("goodput_tok_s")),
        )
    con = console()
    con.print(t)
    con.print("times in ms; SLO att. = requests meeting both the TTFT and the TPOT SLO / requests sent")


def plot_sweep(records: Sequence[dict[str, Any]], path: str | Path, title: str | None = None, target: float = 0.9) -> Path:
    """P90 TTFT, P90 TPOT (with the SLO lines) and SLO attainment (with the target) vs request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        series.setdefault(series_label(r), []).append(r)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = (
        ("ttft_p90_ms", "P90 TTFT (ms)", "slo_ttft_ms", "Fig. 10 analogue: P90 TTFT"),
        ("tpot_p90_ms", "P90 TPOT (ms)", "slo_tpot_ms", "Fig. 11 analogue: P90 TPOT"),
        ("slo_attainment", "SLO attainment", None, "Fig. 12 analogue: SLO attainment"),
    )
    for ax, (key, ylabel, slo_key, name) in zip(axes, panels):
        for label, rs in series.items():
            rs = sorted(rs, key=lambda r: r["rate"])
            pts = [(r["rate"], r[key]) for r in rs if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        if slo_key:
            slos = {r.get(slo_key) for r in records if r.get(slo_key) is not None}
            top = max((r[key] for r in records if r.get(key) is not None), default=0.0)
            for s in slos:
                if top and s > 3 * top:  # far above every point: drawing it would flatten them all
                    ax.text(0.98, 0.95, f"SLO {s:g} ms (off scale)", transform=ax.transAxes, ha="right", va="top", fontsize=8, color="red")
                    continue
                ax.axhline(s, color="red", linestyle="--", linewidth=1, label=f"SLO {s:g} ms")
        else:
            ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"{target:.0%} target")
            ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8, loc="lower left")
    wl = sorted({str(r.get("workload")) for r in records})
    fig.suptitle(title or f"{', '.join(wl)} — {provenance(records)}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def save_json(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(list(records), indent=1, default=str) + "\n")
    return out


def report(records: Sequence[dict[str, Any]], json_path: str | Path | None = None, plot_path: str | Path | None = None, quiet: bool = False) -> None:
    """What every sweep ends with: the table, and the JSON and plot when asked for."""
    if not quiet:
        print_table(records)
    if json_path:
        save_json(records, json_path)
    if plot_path:
        plot_sweep(records, plot_path)


def load_json(path: str | Path) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return data["records"] if isinstance(data, dict) else list(data)
