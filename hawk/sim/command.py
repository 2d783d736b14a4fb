"""``hawk sim``: sweep configurations x P:D ratios x request rates, print, save, plot.

    python -m hawk.sim --configs gg-host,gn-host,gg-direct,gn-hawk --rates 1,2,3,4,5,6 \
        --workload chatbot --num-requests 500 --json sim.json --plot sim.png
    python -m hawk.sim --trace azure.csv --trace-rate-scale 2          # replay a trace (traces.py)
    python -m hawk.sim --plan --workload chatbot --json plan.json        # rank deployments (plan.py)
    python -m hawk.sim --colocated benchmarks/results/mixed_step_chunks_h200.json --serve-args="--mixed-graphs" \
        --rates 10,20 --num-requests 420                                   # one colocated engine (colocated.py)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from hawk.sim.cluster import SimConfig, sweep
from hawk.sim.report import report
from hawk.sim.traces import FORMATS, TraceLimits, TraceWorkload, trace_workload
from hawk.sim.workload import RequestSource, Workload

DEFAULT_RATES = "1,2,3,4,5,6"


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
    workload: str | Workload | RequestSource = "chatbot",
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
    if isinstance(workload, TraceWorkload):  # say which trace, and how it was replayed
        extra = {**workload.trace.summary(), "trace_rate_scale": workload.rate_scale}
        records = [{**r, **extra} for r in records]
    report(records, json_path, plot_path, quiet)
    return records


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """``--trace`` and friends, shared by ``hawk sim`` and ``hawk bench serving``."""
    p.add_argument("--trace", default=None, help="replay a trace file instead of --workload (ShareGPT .json, Azure .csv, Mooncake .jsonl)")
    p.add_argument("--trace-format", default=None, choices=FORMATS, help="default: from the file extension")
    p.add_argument("--trace-rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (timed traces: their own mean rate, or each --rates value as a target)")
    p.add_argument("--trace-max-input", type=int, default=None, help="skip trace requests with longer prompts")
    p.add_argument("--trace-max-output", type=int, default=None, help="skip trace requests with longer outputs")


def workload_from_args(a: argparse.Namespace, count_tokens: Any = None) -> str | TraceWorkload:
    """The workload name, or the trace the options name (SLOs from --slo-* when given)."""
    if not a.trace:
        return a.workload
    limits = TraceLimits(max_input_len=a.trace_max_input, max_output_len=a.trace_max_output)
    return trace_workload(a.trace, a.trace_format, rate_scale=a.trace_rate_scale, slo_ttft_ms=a.slo_ttft_ms,
                          slo_tpot_ms=a.slo_tpot_ms, limits=limits, count_tokens=count_tokens)


def rates_from_args(rates: str | None, wl: Any, num_requests: int, default: str) -> list[float]:
    """``--rates`` as floats; a trace turns them into its own (see ``TraceWorkload.rates``)."""
    asked = [float(x) for x in rates.split(",") if x.strip()] if rates else None
    if isinstance(wl, TraceWorkload):  # untimed traces (ShareGPT) sweep the default rates
        return wl.rates(asked or (None if wl.trace.timed else [float(x) for x in default.split(",")]), num_requests)
    return asked or [float(x) for x in default.split(",")]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m hawk.sim", description="Discrete-event simulation of the disaggregated cluster.")
    p.add_argument("--configs", default="gg-host,gn-host,gg-direct,gn-hawk", help="gg-host, gn-host, gg-direct, gn-hawk, ggh-direct, gn-direct-single")
    p.add_argument("--rates", default=None, help=f"comma-separated request rates (req/s); default {DEFAULT_RATES}, a timed trace: its own")
    p.add_argument("--workload", default="chatbot")
    p.add_argument("--num-requests", type=int, default=None, help="default 500 (--reproduce-paper: 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pd", default=None, help="prefill:decode instance counts, comma-separated (e.g. 1:1,1:2,2:1); default 1:1 (--plan: 1:1,1:2,2:1)")
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
    p.add_argument("--calibrate-paper", action="store_true",
                   help="solve the paper testbed's three calibrated parameters from their input rows (hawk/sim/protocol.py) and print them")
    add_trace_options(p)
    p.add_argument("--colocated", default=None, metavar="STEP_COSTS",
                   help="one colocated engine's mixed steps instead of a cluster, each step costed by this mixed_step_probe.py "
                        "file (hawk/sim/colocated.py); --serve-args sets its budget, target, batch and step path")
    p.add_argument("--serve-args", default="", help="with --colocated: the hawk serve flags of the engine simulated (one flag alone: --serve-args=--mixed-graphs)")
    p.add_argument("--row-streams", default=None, metavar="ENGINE_RECORDS",
                   help="with --colocated: cost each step's decode rows by their contexts against the probe's, at the rates "
                        "this hawk bench engine file's decode steps at two contexts give (RowStreams; --decode-split-tokens in "
                        "--serve-args splits rows by length)")
    p.add_argument("--plan", action="store_true", help="rank deployments (devices, TP, P:D) by goodput per $ and per W on the paper testbed")
    p.add_argument("--plan-prefill", default="a100,h100", help="with --plan: prefill device types")
    p.add_argument("--plan-decode", default="a100,h100,p150a", help="with --plan: decode device types")
    p.add_argument("--plan-tp", default="4,8", help="with --plan: TP degrees (one per deployment, both sides)")
    a = p.parse_args(argv)
    try:
        wl = workload_from_args(a)
    except ValueError as e:
        p.error(str(e))
    if a.plan:
        from hawk.sim.plan import PlanSpace, run_plan

        space = PlanSpace(
            prefill=tuple(x for x in a.plan_prefill.split(",") if x), decode=tuple(x for x in a.plan_decode.split(",") if x),
            tp=tuple(int(x) for x in a.plan_tp.split(",") if x), pd=tuple(parse_pd(a.pd or "1:1,1:2,2:1")),
        )
        n = 300 if a.num_requests is None else a.num_requests
        return run_plan(space, wl, n, a.seed, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, json_path=a.json)
    if a.calibrate_paper:
        from dataclasses import asdict

        from hawk.sim.paper import calibrate

        n = 1000 if a.num_requests is None else a.num_requests
        return [asdict(calibrate(n, a.seed))]
    if a.reproduce_paper:
        from hawk.sim.paper_command import reproduce_paper

        n = 1000 if a.num_requests is None else a.num_requests
        return [{"row": r} for r in reproduce_paper(n, a.seed, a.json, a.plots)]
    if a.num_requests is None:
        a.num_requests = 500
    try:
        rates = rates_from_args(a.rates, wl, a.num_requests, DEFAULT_RATES)
    except ValueError as e:
        p.error(str(e))
    if a.colocated:
        return _colocated(a, wl, rates, p)
    pd = parse_pd(a.pd or "1:1")
    if a.testbed:
        from hawk.sim.paper import config_for
        from hawk.sim.testbeds import get_testbed

        tb = get_testbed(a.testbed)
        cfgs = [config_for(tb, c) for c in a.configs.split(",") if c]
        return run_sim(cfgs, rates, wl, a.num_requests, a.seed,
                       pd_ratios=pd, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, contention=a.contention,
                       router_policy=a.router, json_path=a.json, plot_path=a.plot)
    return run_sim(
        [c for c in a.configs.split(",") if c], rates, wl, a.num_requests, a.seed,
        pd_ratios=pd, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, transfer_scale=a.transfer_scale,
        contention=a.contention, router_policy=a.router, calibration=a.calibration, json_path=a.json, plot_path=a.plot,
    )


def _colocated(a: argparse.Namespace, wl: Any, rates: list[float], p: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """``--colocated``: the engine ``hawk serve --transfer colocated SERVE_ARGS`` runs, over the probe's step
    times (its ``mixed_graphs`` table with ``--mixed-graphs``, else ``pieces``; a ``.jsonl`` file is one table)."""
    from hawk.sim.colocated import MixedPolicy, MixedStepCost, sweep_colocated

    try:  # ConfigError is a ValueError
        policy, table = MixedPolicy.from_serve_args(a.serve_args)
        cost = MixedStepCost.from_probe(a.colocated, table)
        if a.row_streams:
            cost = cost.with_rows(a.row_streams, policy.decode_split_tokens)
    except (OSError, KeyError, ValueError) as e:
        p.error(f"--colocated: {e}")
    label = "colocated" + (f" {a.serve_args.strip()}" if a.serve_args.strip() else "")
    records = sweep_colocated(cost, policy, rates, wl, a.num_requests, a.seed, config=label,
                              slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms)
    report(records, a.json, a.plot)
    return records
