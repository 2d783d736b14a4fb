"""The colocated engine's mixed steps simulated beside committed H200 runs of the same settings.

Each committed run (chatbot, its rate, request count and seed: the same requests; its ``serve_args``:
the same budget, target, backlog, batch and step path) is simulated with ``hawk/sim/colocated.py``
over the step times the mixed-step probe measured (``mixed_step_chunks_h200.json``: its
``mixed_graphs`` table for ``--mixed-graphs``, else ``pieces``). Printed and written: simulated and
measured TPOT p50, ITL p50/p90/p99 and throughput, and two readings of what a served step adds to
the table, each one number solved per run to give its measured TPOT p50: **k**, a factor on every
prompt-token cost (what prompt tokens add to a step, and a prompt-only step), or **pair_ns**, the
table as measured plus a cost per query-key pair of a later chunk against its prompt's earlier
tokens (the probe's chunks are fresh). The reading whose number holds across settings is the
likelier one; the GPU's ``--chunk-offsets`` probe measures the second directly. Beside them, with no
number solved at all, **the rows' contexts** (``simulated_rows``): the probe's rows all had one context,
a served batch's spread, and past 16 rows the decode kernel streams each row's context in one program,
so the longest row can set the step (``RowStreams``, its two rates from the engine benchmark's decode
steps at two contexts, ``engine_h200.json``). ``--sweep`` adds the settings a next run could try, at
the 80 % rate, with the table as measured, with each path's median k and pair_ns, with the rows'
contexts (the kernel as probed, and with ``--decode-split-tokens 512``), and the k and pair_ns at which
TPOT p50 would be 1.5 decode steps.

    python benchmarks/colocated_sim_check.py --json benchmarks/results/colocated_sim_check.json --sweep
    python benchmarks/colocated_sim_check.py --offsets mixed_step_offsets_h200.jsonl   # a later chunk's pair cost as measured

CPU only, about 75 s on the 2-core VM. Every simulated number is a prediction from measured step times; the
measured ones are the committed files'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hawk.sim.colocated import MixedPolicy, MixedStepCost, StepLog, simulate_colocated
from hawk.sim.metrics import summarize
from hawk.sim.workload import generate_requests, get_workload

RESULTS = Path(__file__).resolve().parent / "results"
PROBE = RESULTS / "mixed_step_chunks_h200.json"
#: the decode steps at two contexts the rows' streaming rates come from (``RowStreams.from_engine``)
ENGINE = RESULTS / "engine_h200.json"
#: a kernel whose decode splits follow the rows' lengths: programs of at most this many tokens
SPLIT_TOKENS = 512
#: the defaults the committed runs were served under, before each run's own flags (budget 640 tokens, no
#: split by the rows' lengths; the GPU defaults are 512 and 1024 since): the sweep keeps them too
RUN_DEFAULTS = "--max-num-batched-tokens 640 --decode-split-tokens 0"
#: (file, which records, why): runs whose engine is today's in the settings they name
RUNS = (
    ("saturation_h200_colocated_20261205.json", "ramp+at_80", "b0d3461, the default settings: the ramp and the 80 % run"),
    ("rate80_h200_20261204.json", "all", "3c24e88, one server per setting at 20.4 req/s, two calls"),
    ("rate80_h200_20261204c.json", "second call",
     "its second call (its first ran an engine whose target held while the backlog fit 4 target steps, 16 since)"),
)
#: compared; TTFT is not (the model's is the engine's queue and prompt steps, a run's adds the router's HTTP hops)
METRICS = ("tpot_p50_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "request_throughput_rps")
#: issue 31's limit on TPOT p50 at 80 % of saturation, in decode steps at that batch
TPOT_STEPS_LIMIT = 1.5
#: the saturation ramp's last offered rate and its request count: the throughput a setting saturates at
SATURATED = (60.75, 1519)


def scaled(cost: MixedStepCost, k: float) -> MixedStepCost:
    """The table with every prompt-token cost times ``k`` (decode-only steps as measured)."""
    return dataclasses.replace(cost, extra_ms=tuple(tuple(x * k for x in row) for row in cost.extra_ms),
                               prefill_ms=tuple(x * k for x in cost.prefill_ms), source=f"{cost.source} x{k:.3g} on prompt tokens")


def paired(cost: MixedStepCost, ns: float) -> MixedStepCost:
    """The table with ``ns`` more per query-key pair of a later chunk against its prompt's earlier tokens."""
    return dataclasses.replace(cost, pair_ns=cost.pair_ns + ns, source=f"{cost.source} + {ns:.3g} ns per later-chunk pair")


#: the two readings of what a served step adds, each one number solved per run: ``k`` on every
#: prompt-token cost, or ``pair_ns`` on the later chunks' attention alone (the table as measured)
READINGS: dict[str, tuple[Callable[[MixedStepCost, float], MixedStepCost], float, float]] = {
    "k": (scaled, 0.25, 8.0), "pair_ns": (paired, 0.0, 400.0)}


def cases() -> list[dict[str, Any]]:
    """Every committed run to set beside the model: its records, settings and where they came from."""
    out = []
    for name, which, why in RUNS:
        data = json.loads((RESULTS / name).read_text())
        if which == "ramp+at_80":
            seed = data["options"]["seed"]
            recs = [(r, "") for r in data["ramp"]] + [(data["at_80"], "")]
        else:
            seed = 0  # gpu_suite.sh rate80 runs hawk bench serving with its default seed
            recs = [(r, r["serve_args"]) for r in data["records"] if which == "all" or r["call"].startswith(which)]
        for rec, args in recs:
            out.append({"file": name, "why": why, "label": rec["config"] if "serve_args" in rec else "default", "serve_args": args, "rate": rec["rate"],
                        "num_requests": rec["num_requests"], "seed": seed, "measured": {m: rec.get(m) for m in METRICS}})
    return out


def simulate(cost: MixedStepCost, policy: MixedPolicy, rate: float, n: int, seed: int) -> dict[str, Any]:
    """One simulated run: the bench's summary plus the step mix and the time-weighted decode batch."""
    wl = get_workload("chatbot")
    log = StepLog()
    rec = summarize(simulate_colocated(generate_requests(wl, n, rate, seed), cost, policy, log), wl.slo_ttft_ms, wl.slo_tpot_ms)
    busy = sum(log.seconds)
    chunked = [p for p in log.prompt_tokens if p]
    batch = sum(r * s for r, s in zip(log.rows, log.seconds)) / busy if busy else 0.0
    rec.update(steps=len(log.rows), chunked_share=len(chunked) / max(len(log.rows), 1),
               prompt_tokens_per_chunked_step=statistics.fmean(chunked) if chunked else 0.0, batch=batch,
               tpot_p50_over_step=rec["tpot_p50_ms"] / (cost.decode_s(round(batch)) * 1e3) if rec["tpot_p50_ms"] else None)
    return rec


def solve(cost: MixedStepCost, reading: str, policy: MixedPolicy, rate: float, n: int, seed: int, key: str, target: float) -> float | None:
    """The value of ``reading`` whose simulated ``key`` is ``target`` (bisection; ``key`` grows with it),
    None where its range cannot reach it."""
    make, lo, hi = READINGS[reading]

    def at(x: float) -> float:
        return simulate(make(cost, x), policy, rate, n, seed)[key]

    if not at(lo) <= target <= at(hi):
        return None
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < target else (lo, mid)
    return (lo + hi) / 2


def with_rows(tables: dict[str, MixedStepCost], split_tokens: int = 0) -> dict[str, MixedStepCost]:
    """Each path's table with the rows' contexts costed (``RowStreams`` from ``ENGINE``), read once."""
    return {p: t.with_rows(ENGINE, split_tokens) for p, t in tables.items()}


def check(tables: dict[str, MixedStepCost], rows_tables: dict[str, MixedStepCost]) -> list[dict[str, Any]]:
    rows = []
    for c in cases():
        policy, path = MixedPolicy.from_serve_args(f"{RUN_DEFAULTS} {c['serve_args']}")
        sim = simulate(tables[path], policy, c["rate"], c["num_requests"], c["seed"])
        by_rows = simulate(rows_tables[path], policy, c["rate"], c["num_requests"], c["seed"])
        fit = {r: solve(tables[path], r, policy, c["rate"], c["num_requests"], c["seed"], "tpot_p50_ms", c["measured"]["tpot_p50_ms"])
               for r in READINGS}
        # what each reading, at its fitted value, says of what it was not fitted to: the inter-token gaps
        gaps = {r: {m: simulate(READINGS[r][0](tables[path], x), policy, c["rate"], c["num_requests"], c["seed"])[m]
                    for m in ("itl_p50_ms", "itl_p99_ms")} for r, x in fit.items() if x is not None}
        rows.append({**c, "path": path, "policy": dataclasses.asdict(policy), "simulated": {m: sim[m] for m in METRICS},
                     "simulated_rows": {m: by_rows[m] for m in METRICS},
                     "simulated_steps": {x: sim[x] for x in ("steps", "chunked_share", "prompt_tokens_per_chunked_step", "batch")},
                     "tpot_fit": fit, "fitted_gaps": gaps})
    return rows


SWEEP = (
    "", "--step-token-target 192", "--mixed-graphs", "--mixed-graphs --step-token-target 192",
    "--mixed-graphs --step-token-target 192 --step-target-backlog 64", "--mixed-graphs --max-num-batched-tokens 256",
    "--mixed-graphs --max-num-batched-tokens 384", "--mixed-graphs --step-token-target 256",
    "--mixed-graphs --step-token-target 256 --step-target-backlog 64", "--mixed-graphs --step-token-target 320 --step-target-backlog 64",
)


def sweep(tables: dict[str, MixedStepCost], served: dict[str, dict[str, float]], rate: float, n: int,
          rows_tables: dict[str, MixedStepCost], split_tables: dict[str, MixedStepCost]) -> list[dict[str, Any]]:
    """Each setting at ``rate``: with the table as measured, then under each reading with its path's
    served value, with the rows' contexts costed (the kernel as probed, and one whose splits follow the
    rows' lengths), and the value of each reading at which its TPOT p50 is ``TPOT_STEPS_LIMIT`` decode
    steps (what a served prompt token, or a later chunk's pair, may cost)."""
    out = []
    for args in SWEEP:
        policy, path = MixedPolicy.from_serve_args(f"{RUN_DEFAULTS} {args}")
        row: dict[str, Any] = {"serve_args": args, "path": path}
        for label, cost in (("table", tables[path]), *((f"served {r}", READINGS[r][0](tables[path], served[path][r])) for r in READINGS),
                            ("rows", rows_tables[path]), ("rows split", split_tables[path])):
            sim = simulate(cost, policy, rate, n, 0)
            top = simulate(cost, policy, *SATURATED, 0)
            row[label] = {"tpot_p50_ms": sim["tpot_p50_ms"], "tpot_p50_over_step": sim["tpot_p50_over_step"],
                          "itl_p99_over_tpot_p50": sim["itl_p99_ms"] / sim["tpot_p50_ms"], "engine_ttft_p50_ms": sim["ttft_p50_ms"],
                          "batch": sim["batch"], "saturated_rps": top["request_throughput_rps"]}
        row["at_limit"] = {r: solve(tables[path], r, policy, rate, n, 0, "tpot_p50_over_step", TPOT_STEPS_LIMIT) for r in READINGS}
        out.append(row)
    return out


#: the runs the fits summarize: short of saturation, where TPOT is the policy's and not the queue's
SERVED_RATES = 30.0


def spread(xs: list[float | None]) -> dict[str, float | None]:
    got = [x for x in xs if x is not None]
    return {"median": statistics.median(got) if got else None, "min": min(got, default=None), "max": max(got, default=None), "runs": len(got)}


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--sweep", action="store_true", help="also the policies a next run could try, at 20.4 req/s")
    ap.add_argument("--sweep-rate", type=float, default=20.4)
    ap.add_argument("--sweep-requests", type=int, default=420)
    ap.add_argument("--offsets", type=Path, default=None,
                    help="a mixed_step_probe.py --chunk-offsets file (gpu_suite.sh steptrace's mixed_step_offsets_h200.jsonl): "
                         "its measured cost per later-chunk pair goes into both tables, and pair_ns is then what a served step adds to it")
    a = ap.parse_args()
    tables = {s: MixedStepCost.from_probe(PROBE, s) for s in ("pieces", "mixed_graphs")}
    if a.offsets:
        measured = MixedStepCost.from_probe(a.offsets, "offsets")
        tables = {s: dataclasses.replace(t, pair_ns=measured.pair_ns, source=f"{t.source}; {measured.pair_ns:.3g} ns a later-chunk pair "
                                         f"from {a.offsets.name}") for s, t in tables.items()}
    rows_tables = with_rows(tables)
    streams = rows_tables["pieces"].streams
    assert streams is not None
    rows = check(tables, rows_tables)
    print(f"rows' streams from {ENGINE.name}: {streams.program_gb_s:.1f} GB/s a program, {streams.device_gb_s:.0f} GB/s the device, "
          f"probe context {streams.probe_context}")
    print("file | setting | rate | n | " + " | ".join(f"{m} meas/sim/rows" for m in METRICS)
          + " | k (ITL p50/p99 with it) | pair_ns (ITL p50/p99 with it)")
    for r in rows:
        ms, sm, sr, fit, gaps = r["measured"], r["simulated"], r["simulated_rows"], r["tpot_fit"], r["fitted_gaps"]
        fitted = " | ".join(f"{_f(fit[rd])} ({_f(gaps.get(rd, {}).get('itl_p50_ms'))}/{_f(gaps.get(rd, {}).get('itl_p99_ms'))})" for rd in READINGS)
        print(f"{r['file']} | {r['label']} | {r['rate']:.2f} | {r['num_requests']} | "
              + " | ".join(f"{_f(ms[m])}/{_f(sm[m])}/{_f(sr[m])}" for m in METRICS) + f" | {fitted}")
    fits = {p: {rd: spread([x["tpot_fit"][rd] for x in rows if x["path"] == p and x["rate"] <= SERVED_RATES]) for rd in READINGS} for p in tables}
    print(f"per path, runs up to {SERVED_RATES} req/s (median, min, max):", json.dumps(fits))
    served = {p: {rd: f[rd]["median"] for rd in READINGS} for p, f in fits.items()}
    out: dict[str, Any] = {
        "what": "hawk/sim/colocated.py over the mixed-step probe's step times, beside committed H200 runs of the same settings "
                "(8B bf16, chatbot, one server); tpot_fit: per run, the k (factor on every prompt-token cost) or the pair_ns "
                "(cost per query-key pair of a later chunk against its prompt's earlier tokens) that gives its measured TPOT p50",
        "command": "python benchmarks/colocated_sim_check.py --json benchmarks/results/colocated_sim_check.json --sweep",
        "simulated": True, "step_costs": {p: t.source for p, t in tables.items()}, "tpot_fits": fits,
        "row_streams": {**dataclasses.asdict(streams), "from": ENGINE.name, "split_tokens_tried": SPLIT_TOKENS}, "rows": rows,
    }
    if a.sweep:
        out["sweep"] = {"rate": a.sweep_rate, "num_requests": a.sweep_requests, "tpot_steps_limit": TPOT_STEPS_LIMIT,
                        "rows": sweep(tables, served, a.sweep_rate, a.sweep_requests, rows_tables, with_rows(tables, SPLIT_TOKENS))}
        print(f"\nsweep at {a.sweep_rate} req/s, {a.sweep_requests} requests: TPOT p50 in decode steps / ITL p99 over TPOT p50 / "
              f"engine TTFT p50 ms / req/s at {SATURATED[0]} offered, with the table's costs | served k | served pair_ns | the rows' "
              f"contexts | the same, decode programs of at most {SPLIT_TOKENS} tokens; the k and pair_ns at {TPOT_STEPS_LIMIT} steps")
        for s in out["sweep"]["rows"]:
            cols = " | ".join(f"{_f(v['tpot_p50_over_step'])} {_f(v['itl_p99_over_tpot_p50'])} {v['engine_ttft_p50_ms']:.0f} "
                              f"{_f(v['saturated_rps'])}" for v in (s["table"], s["served k"], s["served pair_ns"], s["rows"], s["rows split"]))
            print(f"{s['serve_args'] or 'default'} | {cols} | {_f(s['at_limit']['k'])} {_f(s['at_limit']['pair_ns'])}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
