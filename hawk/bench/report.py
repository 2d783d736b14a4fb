"""``hawk report``: every result file in one Markdown report, with tables and plots.

Results come from several producers (transfer, transform, engine, serving and equivalence
benchmarks; the simulator; ``--reproduce-paper``; ``--plan``), each with its own JSON. The report
recognises a file's kind from its *content* (the fields its records carry), not its name, so it
works on renamed files and on a folder of mixed results; files it does not recognise are listed
with the reason and skipped. Output: ``report.md`` plus a few small PNGs (matplotlib, Agg).

    python -m hawk report benchmarks/results --out docs/report
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DPI = 80  # small PNGs: the report is meant to be committed


@dataclass
class Source:
    """One input file, what it is, and what the report made of it."""

    path: Path
    kind: str
    data: Any
    note: str = ""

    @property
    def records(self) -> list[dict[str, Any]]:
        """The file's records, whether it is a bare list or carries a header beside them."""
        return _records(self.data) or []


@dataclass
class Report:
    """The Markdown being written and the plots written beside it."""

    out: Path
    lines: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)


# ============================================================================ recognising files


def _records(data: Any) -> list[dict[str, Any]] | None:
    """A list of dicts (or ``{"records": [...]}``), else None."""
    if isinstance(data, dict) and isinstance(data.get("records"), list):
        data = data["records"]
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data
    return None


def _saturation_runs(data: Any) -> list[dict[str, Any]]:
    """The ramps of a ``hawk bench serving --saturation`` file: one ramp, or the runs a summary or a
    comparison lays side by side (``python -m hawk.bench.saturation summarize / compare``)."""
    if not isinstance(data, dict):
        return []
    runs = [data] if "ramp" in data else data.get("runs") or []
    return [r for r in runs if isinstance(r, dict) and isinstance(r.get("ramp"), list) and "saturation_rps" in r]


def _has(rs: Sequence[dict[str, Any]], *keys: str) -> bool:
    return all(all(k in r for k in keys) for r in rs)


def classify(data: Any) -> str | None:
    """The kind of a parsed result file, from the fields it carries (None: unknown)."""
    if isinstance(data, dict) and isinstance(data.get("rows"), list) and data["rows"] and \
            _has(data["rows"], "figure", "quantity", "paper", "ours", "unit"):
        return "reproduce"
    if isinstance(data, dict) and data.get("kind") == "plan" and isinstance(data.get("candidates"), list):
        return "plan"
    if _saturation_runs(data):
        return "saturation"
    rs = _records(data)
    if rs is None:
        return None
    if _has(rs, "rate", "slo_attainment"):
        return "sim" if all(r.get("simulated") for r in rs) else "serving"
    if _has(rs, "kind", "path", "kv_dtype", "ms") and {r["kind"] for r in rs} <= {"decode", "prefill"}:
        return "engine"
    if _has(rs, "config", "size_mb", "median_ms"):
        return "transfer"
    if _has(rs, "impl", "size_mb", "gbps", "copy_gbps"):
        return "transform"
    if _has(rs, "config", "identical", "ttft_ms", "tpot_ms"):
        return "equivalence"
    return None


def gather(paths: Sequence[str | Path]) -> tuple[list[Source], list[tuple[Path, str]]]:
    """Read every file (folders: their ``*.json``, not recursing), classify, and list what was skipped."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.iterdir() if q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    sources, skipped = [], []
    for f in files:
        if f.suffix.lower() != ".json":
            skipped.append((f, "not a JSON file"))
            continue
        try:
            data = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            skipped.append((f, f"not valid JSON ({e})"))
            continue
        kind = classify(data)
        if kind is None:
            skipped.append((f, "unknown kind of result (no known record fields)"))
        else:
            sources.append(Source(f, kind, data))
    return sources, skipped


# ============================================================================ helpers


def fmt(x: Any, digits: int = 3) -> str:
    """Numbers to 3 significant digits, None as '-'; the rest as text (pipes escaped)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x).replace("|", "\\|")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out + [""]


def _figure(rep: Report, name: str, draw: Callable[[Any], None], title: str, size: tuple[float, float] = (6.0, 3.8)) -> str:
    """Draw one plot into ``out/name`` and return its Markdown image line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = rep.out / name
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    rep.plots.append(path)
    return f"![{title}]({name})"


def _where(r: dict[str, Any]) -> str:
    """Provenance of a measured record: devices, with an emulated NPU named as such."""
    parts = [str(r[k]) for k in ("prefill_device", "decode_device", "device") if r.get(k)]
    if r.get("npu"):
        parts.append(f"NPU {r['npu']}")
    return " → ".join(parts) or "unknown devices"


# ============================================================================ one section per kind


def section_transfer(rep: Report, src: Source) -> None:
    rs = src.records
    configs = list(dict.fromkeys(r["config"] for r in rs))
    sizes = sorted({r["size_mb"] for r in rs})
    med = {(r["config"], r["size_mb"]): r["median_ms"] for r in rs}
    rep.add(f"Measured KV-transfer latency, median ms (decode request → KV in the cache pool); {_where(rs[0])}, "
            f"transport {rs[0].get('transport', '?')}. Emulated-NPU numbers are GPU/host-memory numbers.", "")
    rep.add(*table(["size MB", *configs], [[s, *(med.get((c, s)) for c in configs)] for s in sizes]))

    def draw(ax: Any) -> None:
        for c in configs:
            pts = sorted((r["size_mb"], r["median_ms"]) for r in rs if r["config"] == c)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=c)
        ax.set(xscale="log", yscale="log", xlabel="KV size (MB)", ylabel="median latency (ms)")
        ax.legend(fontsize=7)

    rep.add(_figure(rep, f"{src.path.stem}.png", draw, f"KV transfer latency: {src.path.name}"), "")


def section_transform(rep: Report, src: Source) -> None:
    rs = src.records
    keys = list(dict.fromkeys((r["impl"], r.get("dtype", ""), r.get("blocks", "")) for r in rs))
    sizes = sorted({r["size_mb"] for r in rs})
    g = {(r["impl"], r.get("dtype", ""), r.get("blocks", ""), r["size_mb"]): r for r in rs}
    rep.add(f"Transform throughput (GB/s) and its ratio to a plain device copy; device {rs[0].get('device', '?')}.", "")
    big = sizes[-1]
    rep.add(*table(["impl", "dtype", "blocks", f"GB/s @ {big} MB", "copy GB/s", "ratio", "byte-exact"],
                   [[*k, g[(*k, big)]["gbps"], g[(*k, big)]["copy_gbps"], g[(*k, big)]["ratio"], g[(*k, big)].get("match")]
                    for k in keys if (*k, big) in g]))

    def draw(ax: Any) -> None:
        for k in keys:
            pts = sorted((r["size_mb"], r["gbps"]) for r in rs if (r["impl"], r.get("dtype", ""), r.get("blocks", "")) == k)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=" ".join(x for x in k if x))
        ax.set(xscale="log", yscale="log", xlabel="KV size (MB)", ylabel="GB/s")
        ax.legend(fontsize=6)

    rep.add(_figure(rep, f"{src.path.stem}.png", draw, f"Transform throughput: {src.path.name}"), "")


def section_engine(rep: Report, src: Source) -> None:
    rs = src.records
    rep.add(f"Engine step times beside ceilings measured in the same run ({_where(rs[0])}); decode ratio = ms / floor "
            "(1 = at the read-bandwidth floor), prefill ratio = achieved fraction of GEMM peak.", "")
    rows = [[r["kind"], r["path"], r["kv_dtype"], r.get("batch"), r.get("context", r.get("tokens")), r.get("ms"), r.get("floor_ms"),
             r.get("ratio"), r.get("note", "")] for r in rs]
    rep.add(*table(["kind", "path", "kv", "batch", "ctx / tokens", "ms", "floor ms", "ratio", "note"], rows))
    dec = [r for r in rs if r["kind"] == "decode" and r.get("ms") is not None]
    if not dec:
        return

    def draw(ax: Any) -> None:
        series = dict.fromkeys((r["path"], r["kv_dtype"], r["batch"]) for r in dec)
        for s in series:
            pts = sorted((r["context"], r["ms"], r.get("floor_ms")) for r in dec if (r["path"], r["kv_dtype"], r["batch"]) == s)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{s[0]} {s[1]} b{s[2]}")
            if all(p[2] is not None for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", color=line.get_color(), linewidth=0.8)
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode step (ms); dashed = floor")
        ax.legend(fontsize=6)

    rep.add(_figure(rep, f"{src.path.stem}.png", draw, f"Decode step vs floor: {src.path.name}"), "")


def section_serving(rep: Report, src: Source) -> None:
    from hawk.sim.metrics import at_attainment
    from hawk.sim.report import plot_sweep, provenance, series_label

    rs = src.records
    rep.add(f"{provenance(rs).capitalize()}.", "")
    rows = [[series_label(r), r.get("workload"), r.get("rate"), f"{r.get('completed')}/{r.get('num_requests')}", r.get("ttft_p90_ms"),
             r.get("tpot_p90_ms"), r.get("slo_attainment"), r.get("output_throughput_tok_s"), r.get("goodput_tok_s")] for r in rs]
    rep.add(*table(["config", "workload", "rate", "done", "TTFT p90 ms", "TPOT p90 ms", "SLO att.", "out tok/s", "goodput tok/s"], rows))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rs:
        groups.setdefault(f"{series_label(r)} / {r.get('workload')}", []).append(r)
    ops = [[k, (p := at_attainment(g))["status"], p["rate"], p["output_throughput_tok_s"]] for k, g in groups.items()]
    rep.add("At 90 % SLO attainment (interpolated between swept rates):", "")
    rep.add(*table(["series", "status", "rate", "out tok/s"], ops))
    name = f"{src.path.stem}.png"
    plot_sweep(rs, rep.out / name)
    rep.plots.append(rep.out / name)
    rep.add(f"![serving sweep: {src.path.name}]({name})", "")


def section_saturation(rep: Report, src: Source) -> None:
    runs = _saturation_runs(src.data)
    d = src.data
    where = f" on {d['device']}" if d.get("device") else ""
    how = f"command: `{d['command']}`" if d.get("command") else f"one ramp of `hawk bench serving --saturation`, {d.get('workload', '?')} workload"
    rep.add(f"Measured{where}; {how}.", "")
    rep.add(*table(["config", "saturation req/s", "at offered", "over bound", "bound req/s", "90 % SLO up to"],
                   [[r.get("config"), r["saturation_rps"], r.get("saturation_rate"), r.get("saturation_over_bound"),
                     (r.get("bound") or {}).get("bound_rps"), r.get("slo90_rate_rps")] for r in runs]))
    rows = [[r.get("config"), x.get("rate"), x.get("steady_throughput_rps"), x.get("ttft_median_ms"), x.get("tpot_median_ms"),
             x.get("itl_p99_ms"), x.get("slo_attainment")] for r in runs for x in r["ramp"]]
    rep.add(*table(["config", "offered", "steady req/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms", "SLO att."], rows))
    if isinstance(d.get("acceptance"), dict):
        rep.add(*table(["ratio", "value", "limit", "holds"],
                       [[k, v.get("value"), v.get("limit"), v.get("holds")] for k, v in d["acceptance"].items() if isinstance(v, dict)]))

    def draw(ax: Any) -> None:
        for r in runs:
            ramp = sorted(r["ramp"], key=lambda x: x["rate"])
            ax.plot([x["rate"] for x in ramp], [x.get("steady_throughput_rps") or 0.0 for x in ramp], marker="o", label=r.get("config"))
        top = max(x["rate"] for r in runs for x in r["ramp"])
        ax.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--")
        ax.set(xlabel="offered req/s", ylabel="steady completions req/s")
        ax.legend(fontsize=7)

    rep.add(_figure(rep, f"{src.path.stem}.png", draw, "Throughput against offered load (dashed: all served)"), "")


def section_reproduce(rep: Report, src: Source) -> None:
    d = src.data
    rows = d["rows"]
    rep.add(f"The paper's evaluation vs the simulator on the `{d.get('testbed', '?')}` testbed (simulated; "
            f"settings {json.dumps(d.get('settings', {}))}).", "")
    rep.add(*table(["figure", "quantity", "paper", "ours", "unit", "deviation"],
                   [[r["figure"], r["quantity"], r["paper"], r["ours"], r["unit"], r.get("deviation", "")] for r in rows]))
    pairs = [r for r in rows if isinstance(r.get("paper"), (int, float)) and isinstance(r.get("ours"), (int, float)) and r["paper"] > 0 and r["ours"] > 0]
    if not pairs:
        return

    def draw(ax: Any) -> None:
        for fig_name in dict.fromkeys(r["figure"] for r in pairs):
            sub = [r for r in pairs if r["figure"] == fig_name]
            ax.scatter([r["paper"] for r in sub], [r["ours"] for r in sub], s=14, label=fig_name)
        lo = min(min(r["paper"], r["ours"]) for r in pairs)
        hi = max(max(r["paper"], r["ours"]) for r in pairs)
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--")
        ax.set(xscale="log", yscale="log", xlabel="paper", ylabel="ours (simulated)")
        ax.legend(fontsize=6)

    rep.add(_figure(rep, f"{src.path.stem}.png", draw, "Paper vs simulator, every numeric row (dashed: equal)", (5.0, 4.0)), "")


def section_equivalence(rep: Report, src: Source) -> None:
    rs = src.records
    rep.add(f"Token-exact equivalence against the colocated oracle ({_where(rs[0])}, model {rs[0].get('model', '?')}).", "")
    rep.add(*table(["config", "prompt", "identical", "tokens", "TTFT ms", "TPOT ms", "colocated TTFT", "colocated TPOT", "KV ms", "KV bytes"],
                   [[r["config"], r.get("prompt"), r["identical"], r.get("tokens"), r["ttft_ms"], r["tpot_ms"], r.get("colocated_ttft_ms"),
                     r.get("colocated_tpot_ms"), r.get("kv_transfer_ms"), r.get("kv_bytes")] for r in rs]))


def section_plan(rep: Report, src: Source) -> None:
    d = src.data
    rep.add(f"Deployments for {d.get('workload')} (SLO {d.get('slo_ttft_ms')}/{d.get('slo_tpot_ms')} ms), simulated on the "
            f"`{d.get('testbed')}` testbed, ranked by goodput per $ (#$) and per W (#W).", "")
    rows = [[c.get("rank_cost") or "-", c.get("rank_power") or "-", c["label"] + (" (paper)" if c.get("paper_setup") else ""), c.get("devices"),
             c.get("rate90"), c.get("throughput"), c.get("tok_s_per_kusd"), c.get("tok_s_per_kw"), c.get("binds") or c.get("why_infeasible")]
            for c in d["candidates"]]
    rep.add(*table(["#$", "#W", "deployment", "devices", "req/s @90%", "tok/s", "tok/s/k$", "tok/s/kW", "what binds"], rows))
    if d.get("verdict"):
        rep.add(d["verdict"], "")


SECTIONS: dict[str, tuple[str, Callable[[Report, Source], None]]] = {
    "reproduce": ("Paper vs simulator", section_reproduce),
    "transfer": ("KV transfer benchmark", section_transfer),
    "transform": ("Transform benchmark", section_transform),
    "engine": ("Engine benchmark", section_engine),
    "serving": ("Serving benchmark (measured)", section_serving),
    "saturation": ("Throughput at saturation (measured)", section_saturation),
    "sim": ("Simulated serving sweep", section_serving),
    "equivalence": ("Equivalence (end to end)", section_equivalence),
    "plan": ("Deployment planner", section_plan),
}


def write_report(paths: Sequence[str | Path], out: str | Path, title: str = "HAWK results") -> Path:
    """Gather, classify and write ``out/report.md`` with its plots; returns the report's path."""
    sources, skipped = gather(paths)
    rep = Report(Path(out))
    rep.out.mkdir(parents=True, exist_ok=True)
    rep.add(f"# {title}", "", "Generated by `python -m hawk report` from the files below; each file's kind is recognised "
            "from its content. Measured numbers say where they were measured; an emulated NPU is named as such; "
            "simulated numbers are labelled simulated.", "")
    rep.add(*table(["file", "kind"], [[s.path.name, s.kind] for s in sources]))
    if skipped:
        rep.add("Skipped:", "", *[f"- `{p.name}`: {why}" for p, why in skipped], "")
    order = list(SECTIONS)
    for s in sorted(sources, key=lambda s: (order.index(s.kind), s.path.name)):
        heading, fn = SECTIONS[s.kind]
        rep.add(f"## {heading}: `{s.path.name}`", "")
        fn(rep, s)
    path = rep.out / "report.md"
    path.write_text("\n".join(rep.lines).rstrip() + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m hawk report", description=__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("paths", nargs="*", default=["benchmarks/results"], help="result files or folders (default: benchmarks/results)")
    p.add_argument("--out", default="report", help="folder for report.md and its plots")
    p.add_argument("--title", default="HAWK results")
    a = p.parse_args(argv)
    try:
        path = write_report(a.paths, a.out, a.title)
    except FileNotFoundError as e:
        p.error(str(e))
    print(f"wrote {path} ({len(list(path.parent.glob('*.png')))} plots)")
    return path


if __name__ == "__main__":
    main()
