"""The reachability bounds of ``feasibility.py`` evaluated on the paper testbed, for the rows
``--reproduce-paper`` misses (the ``bounds`` section of its JSON; docs/reproduce.md).

Each bound says what a row would need and what that would do elsewhere, computed on the same
testbed, requests and seed as the rows themselves; none sets or changes a parameter.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hawk.sim.calibration import MiB
from hawk.sim.cluster import SimConfig, simulate
from hawk.sim.feasibility import (
    extra_s_per_token,
    implied_throughput_ratio,
    lone_request,
    prompt_quantile,
)
from hawk.sim.host import HostStaging
from hawk.sim.paper import (
    PAPER,
    PAPER_RATE_90,
    Runner,
    _bisect,
    _slo,
    config_for,
    crossing,
)
from hawk.sim.workload import WORKLOADS


def table9_bound(points: dict[str, Any]) -> dict[str, Any]:
    """GGH-Direct over GG-Direct throughput as the paper's Fig. 13 and Table 9 gaps imply it, beside
    the simulation's; a ratio below 1 needs a faster decode to lower the throughput."""
    out = {}
    for wl in ("chatbot", "summarization"):
        thr = points[wl]["throughput90"]
        ours = thr["ggh-direct"] / thr["gg-direct"] if thr.get("ggh-direct") and thr.get("gg-direct") else None
        out[wl] = {"paper_implied_ggh_over_gg": implied_throughput_ratio(PAPER["thr_gap"][wl], PAPER["h100_thr_gap"][wl]),
                   "ours_ggh_over_gg": ours}
    return out


def gn_host_lone_bound(run: Runner, q: float = 0.9) -> dict[str, Any]:
    """GN-Host's ``q``-quantile prompt served alone, per workload: if it meets the SLO, at least a
    fraction ``q`` of requests meet it at a low enough rate, and "never" needs a lowest evaluated rate."""
    out = {}
    for wl in ("chatbot", "summarization"):
        w = WORKLOADS[wl]
        lone = lone_request(run.configs["gn-host"], prompt_quantile(w, q, run.num_requests, run.seed))
        out[wl] = {"quantile": q, "prompt_tokens": lone.prompt_tokens, "ttft_s": lone.ttft_s, "tpot_s": lone.tpot_s,
                   "meets_slo_alone": lone.meets(w.slo_ttft_ms / 1e3, w.slo_tpot_ms / 1e3)}
    return out


def fig9_fixup_gb_s(run: Runner, size_mb: float = 1280.0) -> float:
    """The NPU-side layout fix-up rate the paper's own Fig. 9 allows: GN-Host's latency minus
    GG-Host's at the largest published size is the most the fix-up can take there."""
    c, nbytes = run.tb.curves, size_mb * MiB
    return nbytes / (c["gn-host"].latency(nbytes) - c["gg-host"].latency(nbytes)) / 1e9


def gn_host_fig9_bound(run: Runner) -> dict[str, Any]:
    """GN-Host's 90 % rates with its decode-side fix-up at the Fig. 9 rate instead of the CPU tilize
    measured here (the staging copies as calibrated): how much "never" rests on the measurement."""
    rate, gg = fig9_fixup_gb_s(run), run.tb.host["gg-host"]
    cfg = replace(config_for(run.tb, "gn-host"), host=HostStaging(gg.prefill_s_per_byte, gg.decode_s_per_byte + 1 / (rate * 1e9)))
    rates = {w: crossing(lambda r, w=w: _slo(_sim(run, cfg, w, r))) for w in ("chatbot", "summarization")}
    return {"fixup_gb_s": rate, "gn_host_rate90": rates}


def gg_host_bound(run: Runner, points: dict[str, Any]) -> dict[str, Any]:
    """The per-token worker time that would bring Summarization's GG-Host from GG-Direct's rate to the
    paper's 0.38 req/s (its prefill is the bottleneck there), placed on either worker instead of the
    calibrated staging, and what each placement does to both workloads' GG-Host rates."""
    tb, wl = run.tb, WORKLOADS["summarization"]
    prefill = tb.prefill_models["a100-tp4"]
    busy = prefill.batch_time([int(wl.input.mean)])
    direct = points["summarization"]["rate90"]["gg-direct"]
    target = PAPER_RATE_90[("summarization", "gg-host")]
    per_token = extra_s_per_token(direct, target, busy, wl.input.mean)
    per_byte = per_token / tb.bytes_per_token
    out: dict[str, Any] = {"summarization_gg_direct_rate": direct, "target_rate": target, "prefill_busy_s_per_mean_request": busy,
                           "extra_s_per_prompt_token": per_token, "placements": {}}
    for where, host in (("prefill worker", HostStaging(per_byte, 0.0)), ("decode worker", HostStaging(0.0, per_byte))):
        cfg = replace(config_for(tb, "gg-host"), host=host)
        rates = {w: crossing(lambda r, w=w, c=cfg: _slo(_sim(run, c, w, r))) for w in ("chatbot", "summarization")}
        out["placements"][where] = {"gg_host_rate90": rates}
    return out


def gg_host_pinned_bound(run: Runner, steps: int = 8) -> dict[str, Any]:
    """The other way round: a per-token cost on one worker only, solved (as the calibration solves
    ``host_copy_gb_s``) so that Chatbot's GG-Host stays at the paper's 0.40 req/s, and the
    Summarization GG-Host rate it then gives. Where the cost sits does not change the answer if no
    placement moves Summarization near 0.38."""
    tb, target = run.tb, PAPER_RATE_90[("chatbot", "gg-host")]
    out: dict[str, Any] = {"chatbot_gg_host_rate": target, "placements": {}}
    for where in ("prefill worker", "decode worker"):
        def cfg(s_per_token: float, where: str = where) -> SimConfig:
            b = s_per_token / tb.bytes_per_token
            return replace(config_for(tb, "gg-host"), host=HostStaging(b, 0.0) if where == "prefill worker" else HostStaging(0.0, b))

        def neg_rate(s_per_token: float) -> float:  # increasing in the cost, as _bisect wants
            r = crossing(lambda x: _slo(_sim(run, cfg(s_per_token), "chatbot", x)))
            return -(r or 0.0)

        per_token = _bisect(neg_rate, -target, 1e-6, 5e-3, steps, log=True)
        solved = cfg(per_token)
        summ = crossing(lambda x, c=solved: _slo(_sim(run, c, "summarization", x)))
        out["placements"][where] = {"s_per_prompt_token": per_token, "summarization_gg_host_rate90": summ}
    return out


def npu_tpot_bound(run: Runner, rate: float = 0.60, steps: int = 8) -> dict[str, Any]:
    """Fig. 11: GN-HAWK's P90 TPOT reaches 200 ms on Summarization at 0.60 req/s. The factor by which
    every p150a step would have to be slower for that (solved, as the calibration solves), and what
    the same factor does to Chatbot, whose TPOT the paper says stays below the SLO."""
    tb = run.tb
    base = config_for(tb, "gn-hawk")

    def cfg(k: float) -> SimConfig:
        return replace(base, decode=base.decode.slowed(k))

    def p90(k: float, workload: str, r: float) -> float:
        return _sim(run, cfg(k), workload, r)["tpot_p90_ms"] or 0.0

    slo = WORKLOADS["summarization"].slo_tpot_ms
    k = _bisect(lambda x: p90(x, "summarization", rate), slo, 1.0, 8.0, steps, log=True)
    chat = _sim(run, cfg(k), "chatbot", PAPER_RATE_90[("chatbot", "gn-hawk")])
    return {"summarization_rate": rate, "step_factor": k, "chatbot_rate": PAPER_RATE_90[("chatbot", "gn-hawk")],
            "chatbot_tpot_p90_ms": chat["tpot_p90_ms"], "chatbot_slo_attainment": chat["slo_attainment"],
            "chatbot_gn_hawk_rate90": crossing(lambda x: _slo(_sim(run, cfg(k), "chatbot", x)))}


def _sim(run: Runner, cfg: SimConfig, workload: str, rate: float) -> dict[str, Any]:
    """One run of ``cfg`` on the runner's requests and seed (not cached: ``cfg`` is not a preset)."""
    return simulate(cfg, rate, workload, run.num_requests, run.seed)


def bounds(run: Runner, points: dict[str, Any]) -> dict[str, Any]:
    """All of them, for the JSON."""
    return {"table9": table9_bound(points), "gn_host_lone": gn_host_lone_bound(run), "gn_host_fig9_fixup": gn_host_fig9_bound(run),
            "gg_host_per_token": gg_host_bound(run, points), "gg_host_chatbot_pinned": gg_host_pinned_bound(run),
            "npu_tpot": npu_tpot_bound(run)}
