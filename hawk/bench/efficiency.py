"""``hawk bench efficiency``: power and cost efficiency at 90 % SLO attainment (paper §5.4, Tables 8–9).

    power efficiency = output tokens/s at the target attainment / aggregate device power (W)
    cost efficiency  = output tokens/s at the target attainment / aggregate device price ($)

Throughput comes from serving records (``hawk bench serving``) or simulated ones (``hawk sim``):
for each configuration, the point where its SLO attainment falls to the target
(``hawk.sim.metrics.at_attainment``). Device power and price are **inputs**. The defaults below are
vendor TDP/TBP and list or market prices — **assumptions, not measurements**: the paper divides by
*measured ASIC power* (DCGM + a power simulator for the GPU, the Tenstorrent monitor for the NPU),
which we cannot measure here, and prices move with the market (the paper itself calls cost
efficiency "a reference rather than a definitive comparison"). Pass your own numbers when you have them.

    python -m hawk.bench.efficiency sim.json --baseline gg-direct --configs gg-direct,gn-hawk
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hawk.sim.metrics import at_attainment
from hawk.sim.report import console, load_json, series_label


@dataclass(frozen=True)
class Device:
    """One accelerator's power and price, with where each number came from."""

    name: str
    power_w: float
    price_usd: float
    power_source: str
    price_source: str


#: Defaults — ASSUMPTIONS (vendor board power and list/market prices), not measurements.
DEVICES: dict[str, Device] = {
    "a100-pcie-80gb": Device(
        "NVIDIA A100 PCIe 80GB", 300.0, 10_000.0,
        "assumption: TDP 300 W (NVIDIA A100 PCIe datasheet); the paper uses measured ASIC power instead",
        "assumption: ~$10k market price for a used/secondary-market A100 80GB PCIe (varies widely)",
    ),
    "h100-sxm": Device(
        "NVIDIA H100 SXM5 80GB", 700.0, 30_000.0,
        "assumption: TDP 700 W (NVIDIA H100 datasheet, SXM5); the paper uses measured ASIC power instead",
        "assumption: ~$30k market price (varies widely)",
    ),
    "h100-pcie": Device(
        "NVIDIA H100 PCIe 80GB", 350.0, 25_000.0,
        "assumption: TDP 350 W (NVIDIA H100 datasheet, PCIe)",
        "assumption: ~$25k market price (varies widely)",
    ),
    "h200-sxm": Device(
        "NVIDIA H200 SXM 141GB", 700.0, 32_000.0,
        "assumption: TDP up to 700 W (NVIDIA H200 datasheet, SXM)",
        "assumption: ~$32k market price (varies widely)",
    ),
    "p150a": Device(
        "Tenstorrent Blackhole p150a", 300.0, 1_399.0,
        "assumption: TBP 300 W (Tenstorrent Blackhole specifications page); the paper uses measured NPU core power",
        "assumption: $1,399 Tenstorrent list price ($1,299 at the April 2025 launch)",
    ),
}


@dataclass(frozen=True)
class Deployment:
    """Devices per instance: the paper runs one prefill and one decode instance, 4 devices each (TP4)."""

    prefill_device: str
    prefill_per_instance: int
    decode_device: str
    decode_per_instance: int

    def counts(self, num_prefill: int = 1, num_decode: int = 1) -> dict[str, int]:
        out: dict[str, int] = {}
        out[self.prefill_device] = out.get(self.prefill_device, 0) + self.prefill_per_instance * num_prefill
        out[self.decode_device] = out.get(self.decode_device, 0) + self.decode_per_instance * num_decode
        return out


#: The paper's configurations (§5.1.1, §5.4.3): A100 PCIe prefill; A100, p150a or H100 decode; TP4.
DEPLOYMENTS: dict[str, Deployment] = {
    "gg-host": Deployment("a100-pcie-80gb", 4, "a100-pcie-80gb", 4),
    "gg-direct": Deployment("a100-pcie-80gb", 4, "a100-pcie-80gb", 4),
    "gn-host": Deployment("a100-pcie-80gb", 4, "p150a", 4),
    "gn-hawk": Deployment("a100-pcie-80gb", 4, "p150a", 4),
    "gn-direct-single": Deployment("a100-pcie-80gb", 4, "p150a", 4),
    "ggh-direct": Deployment("a100-pcie-80gb", 4, "h100-sxm", 4),
}


def aggregate(counts: Mapping[str, int], devices: Mapping[str, Device] = DEVICES) -> tuple[float, float]:
    """(total W, total $) of a device mix."""
    missing = [d for d in counts if d not in devices]
    if missing:
        raise ValueError(f"no power/price for device(s) {missing}; known: {', '.join(devices)}")
    return sum(devices[d].power_w * n for d, n in counts.items()), sum(devices[d].price_usd * n for d, n in counts.items())


def _counts_for(config: str, spec: Deployment | Mapping[str, int] | None, records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Device counts of one configuration; a Deployment scales with the records' instance counts."""
    if isinstance(spec, Mapping):
        return dict(spec)
    dep = spec or DEPLOYMENTS.get(config.split(" ")[0])
    if dep is None:
        raise ValueError(f"no deployment for {config!r}: pass devices_by_config[{config!r}] (e.g. {{'a100-pcie-80gb': 8}})")
    first = records[0] if records else {}
    return dep.counts(int(first.get("num_prefill", 1)), int(first.get("num_decode", 1)))


def efficiency_table(
    records_by_config: Mapping[str, Sequence[dict[str, Any]] | float],
    devices_by_config: Mapping[str, Deployment | Mapping[str, int]] | None = None,
    *,
    baseline: str | None = None,
    target: float = 0.9,
    devices: Mapping[str, Device] = DEVICES,
) -> list[dict[str, Any]]:
    """One row per configuration: throughput at ``target`` SLO attainment, W, $, tokens/s/W,
    tokens/s/$ (and per $1k), and ratios against ``baseline`` (the paper's Tables 8–9).

    ``records_by_config`` maps a configuration to its records over request rates, or directly to a
    throughput (tokens/s) you measured some other way. ``devices_by_config`` maps it to a
    :class:`Deployment` (scaled by the records' ``num_prefill``/``num_decode``) or to explicit
    device counts; by default the paper's deployments are used."""
    rows = []
    for cfg, recs in records_by_config.items():
        spec = (devices_by_config or {}).get(cfg)
        if isinstance(recs, (int, float)):
            point = {"status": "given", "rate": None, "output_throughput_tok_s": float(recs)}
            recs_list: Sequence[dict[str, Any]] = []
        else:
            recs_list = recs
            point = at_attainment(recs_list, target)
        counts = _counts_for(cfg, spec, recs_list)
        power, price = aggregate(counts, devices)
        thr = point.get("output_throughput_tok_s")
        rows.append({
            "config": cfg,
            "workload": next((r.get("workload") for r in recs_list), None),
            "target_attainment": target,
            "status": point["status"],
            "rate_at_target": point.get("rate"),
            "throughput_tok_s": thr,
            "devices": counts,
            "power_w": power,
            "price_usd": price,
            "tok_s_per_w": None if thr is None else thr / power,
            "tok_s_per_usd": None if thr is None else thr / price,
            "tok_s_per_kusd": None if thr is None else thr / price * 1e3,
            "simulated": bool(recs_list) and all(r.get("simulated") for r in recs_list),
        })
    if baseline is not None:
        base = next((r for r in rows if r["config"] == baseline), None)
        if base is None:
            raise ValueError(f"baseline {baseline!r} is not among {[r['config'] for r in rows]}")
        for r in rows:
            for key, ratio in (("throughput_tok_s", "throughput_ratio"), ("tok_s_per_w", "power_eff_ratio"), ("tok_s_per_usd", "cost_eff_ratio")):
                r[ratio] = None if r[key] is None or not base[key] else r[key] / base[key]
            r["baseline"] = baseline
    return rows


def group_records(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records grouped by (workload, configuration label) — one efficiency row each."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault((str(r.get("workload")), series_label(r)), []).append(r)
    return out


def print_efficiency(rows: Sequence[dict[str, Any]], title: str | None = None) -> None:
    from rich.table import Table

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else fmt.format(x)

    t = Table(title=title or "Serving efficiency at the target SLO attainment (device power/price = assumptions)")
    for c in ("workload", "config", "point", "rate", "tok/s", "W", "$", "tok/s/W", "tok/s/$1k", "thr. ratio", "power-eff ratio", "cost-eff ratio"):
        t.add_column(c, justify="left" if c in ("workload", "config", "point") else "right")
    for r in rows:
        t.add_row(
            str(r.get("workload") or "-"), r["config"], r["status"], f(r["rate_at_target"], "{:.2f}"), f(r["throughput_tok_s"], "{:.1f}"),
            f(r["power_w"], "{:.0f}"), f(r["price_usd"], "{:,.0f}"), f(r["tok_s_per_w"], "{:.3f}"), f(r["tok_s_per_kusd"], "{:.2f}"),
            f(r.get("throughput_ratio"), "{:.2f}x"), f(r.get("power_eff_ratio"), "{:.2f}x"), f(r.get("cost_eff_ratio"), "{:.2f}x"),
        )
    con = console()
    con.print(t)
    con.print("point: interpolated/exact = where attainment crosses the target; lower-bound = every swept rate met it "
              "(sweep higher); none = no rate met it (excluded, as the paper excludes GN-Host)")


def efficiency_report(
    json_paths: Sequence[str],
    *,
    baseline: str | None = "gg-direct",
    configs: Sequence[str] | None = None,
    target: float = 0.9,
    devices_json: str | None = None,
    out_json: str | None = None,
) -> list[dict[str, Any]]:
    """What ``hawk bench efficiency`` does: read records, one table per workload, optional JSON.

    ``devices_json`` overrides/extends the device table and deployments:
    ``{"devices": {"p150a": {"power_w": 120, ...}}, "deployments": {"gn-hawk": {"p150a": 4, ...}}}``."""
    records = [r for p in json_paths for r in load_json(p)]
    devices = dict(DEVICES)
    deployments: dict[str, Deployment | Mapping[str, int]] = {}
    if devices_json:
        extra = json.loads(Path(devices_json).read_text())
        for k, v in extra.get("devices", {}).items():
            base = devices.get(k)
            merged = {**(base.__dict__ if base else {"name": k, "power_source": "user input", "price_source": "user input"}), **v}
            devices[k] = Device(**merged)
        deployments.update(extra.get("deployments", {}))
    rows = []
    groups = group_records(records)
    for wl in sorted({w for w, _ in groups}):
        by_cfg = {c: rs for (w, c), rs in groups.items() if w == wl and (not configs or c in configs)}
        if not by_cfg:
            continue
        dev_map = {c: deployments[c] for c in by_cfg if c in deployments}
        rows += efficiency_table(by_cfg, dev_map, baseline=baseline if baseline in by_cfg else None, target=target, devices=devices)
    print_efficiency(rows)
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m hawk.bench.efficiency", description=__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("records", nargs="+", help="JSON files of serving or simulated records")
    p.add_argument("--baseline", default="gg-direct")
    p.add_argument("--configs", default=None, help="comma-separated configurations to include (default: all)")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment at which throughput is taken")
    p.add_argument("--devices-json", default=None, help="device power/price and deployment overrides")
    p.add_argument("--json", default=None, help="write the table rows here")
    a = p.parse_args(argv)
    return efficiency_report(
        a.records, baseline=a.baseline, configs=[c for c in a.configs.split(",") if c] if a.configs else None,
        target=a.target, devices_json=a.devices_json, out_json=a.json,
    )


if __name__ == "__main__":
    main()
