"""``hawk sim``: sweep configurations x P:D ratios x request rates, print, save, plot.

    python -m hawk.sim --configs gg-host,gn-host,gg-direct,gn-hawk --rates 1,2,3,4,5,6 \
        --workload chatbot --num-requests 500 --json sim.json --plot sim.png
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from hawk.sim.cluster import SimConfig, sweep
from hawk.sim.report import report


def parse_pd(s: str) -> list[tuple[int, int]]:
    """``"1:1,1:2,2:1"`` -> [(1, 1), (1, 2), (2, 1)] (prefill:decode instance counts)."""
    out = []
    for part in s.split(","):
        if part.strip():
            p, _, d = part.strip().partition(":")
            out.append((int(p), int(d or 1)))
    return out


def run_sim(
    configs: Sequence[str | SimConfig] = ("gg-host", "gn-host", "gg-direct", "gn-hawk"),
    rates: Sequence[float] = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
    workload: str = "chatbot",
    num_requests: int = 500,
    seed: int = 0,
    *,
    pd_ratios: Sequence[tuple[int, int]] = ((1, 1),),
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    transfer_scale: float = 1.0,
    contention: str = "decode",
    router_policy: str = "round_robin",
    calibration: str | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """What ``hawk sim`` does: :func:`hawk.sim.cluster.sweep`, then table, JSON and figure."""
    records = sweep(
        configs, rates, workload, num_requests, seed, pd_ratios=pd_ratios, slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms, transfer_scale=transfer_scale, contention=contention, router_policy=router_policy,
        calibration=calibration,
    )
    report(records, json_path, plot_path, quiet)
    return records


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m hawk.sim", description="Discrete-event simulation of the disaggregated cluster.")
    p.add_argument("--configs", default="gg-host,gn-host,gg-direct,gn-hawk", help="gg-host, gn-host, gg-direct, gn-hawk, ggh-direct, gn-direct-single")
    p.add_argument("--rates", default="1,2,3,4,5,6", help="comma-separated request rates (req/s)")
    p.add_argument("--workload", default="chatbot")
    p.add_argument("--num-requests", type=int, default=None, help="default 500 (--reproduce-paper: 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pd", default="1:1", help="prefill:decode instance counts, comma-separated (e.g. 1:1,1:2,2:1)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--transfer-scale", type=float, default=1.0, help="multiply every measured transfer latency (what-if)")
    p.add_argument("--contention", default="decode", help="links shared per: decode | prefill | pair | none")
    p.add_argument("--router", default="round_robin", help="round_robin | least_loaded")
    p.add_argument("--calibration", default=None, help="JSON overriding compute models, presets or the transfer file (see hawk.sim.defaults)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--testbed", default=None, help="paper | here (default: here, the --calibration tables)")
    p.add_argument("--reproduce-paper", action="store_true", help="the paper's Figs. 9-13 and Tables 1, 8, 9 beside ours (--json: rows)")
    p.add_argument("--plots", default=None, help="with --reproduce-paper: a folder for Figs. 9-13-shaped plots")
    a = p.parse_args(argv)
    if a.reproduce_paper:
        from hawk.sim.paper import reproduce_paper

        n = 1000 if a.num_requests is None else a.num_requests
        return [{"row": r} for r in reproduce_paper(n, a.seed, a.json, a.plots)]
    if a.num_requests is None:
        a.num_requests = 500
    if a.testbed:
        from hawk.sim.paper import config_for
        from hawk.sim.testbeds import get_testbed

        tb = get_testbed(a.testbed)
        cfgs = [config_for(tb, c) for c in a.configs.split(",") if c]
        return run_sim(cfgs, [float(x) for x in a.rates.split(",") if x], a.workload, a.num_requests, a.seed,
                       pd_ratios=parse_pd(a.pd), slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, contention=a.contention,
                       router_policy=a.router, json_path=a.json, plot_path=a.plot)
    return run_sim(
        [c for c in a.configs.split(",") if c], [float(x) for x in a.rates.split(",") if x], a.workload, a.num_requests, a.seed,
        pd_ratios=parse_pd(a.pd), slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, transfer_scale=a.transfer_scale,
        contention=a.contention, router_policy=a.router, calibration=a.calibration, json_path=a.json, plot_path=a.plot,
    )
