"""The declared calibration protocol of ``--reproduce-paper``: which paper numbers set parameters.

Three numbers from the paper's serving results set the three parameters of the ``paper`` testbed
that no source gives (``testbeds.PaperCalibration``); they are solved in this order, each with the
ones before it fixed:

1. Fig. 12, Summarization, GG-Direct reaches 90 % SLO attainment at 0.65 req/s → the prefill
   instance's effective MFU. Summarization's 15 s TTFT SLO lets the prefill run close to
   saturation, so this rate is the one most directly a prefill throughput.
2. Fig. 12, Chatbot, GG-Host falls below 90 % at 0.40 req/s → the rate at which the workers issue
   host-staging copies (``host.py``). Fig. 9 gives the host paths only relative to GG-Direct.
3. Table 9, Chatbot, GN-HAWK's power efficiency is 1.03x GGH-Direct's → the H100 decode power
   ("the H100 GPUs consume less power during decoding in our evaluation", §5.4.3).

A row that quotes one of these numbers is ``role: input`` (the same number in Fig. 10 too); the
Fig. 9 and Table 1 rows the testbed encodes are inputs; every other row is a prediction and is
scored (``score``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hawk.sim.testbeds import PAPER_CALIBRATION, MeasuredHere, PaperCalibration, paper_testbed

#: within this much a prediction counts as reproduced: relative for rates and ratios, percentage
#: points for rows that are themselves percentages
REL_TOLERANCE = 0.15
PP_TOLERANCE = 3.0


@dataclass(frozen=True)
class Input:
    """One paper number that sets one parameter."""

    figure: str
    quantity: str  # the row's quantity, as ``paper.py`` names it
    paper: float
    parameter: str  # a field of PaperCalibration


INPUTS = (
    Input("Fig. 12", "Summarization: gg-direct rate at 90 % SLO attainment", 0.65, "prefill_mfu"),
    Input("Fig. 12", "Chatbot: gg-host rate at 90 % SLO attainment", 0.40, "host_copy_gb_s"),
    Input("Table 9", "Chatbot: power efficiency GN-HAWK / GGH-Direct", 1.03, "h100_power_w"),
)
#: rows that quote an input's number (the same measurement shown in another figure)
SAME_NUMBER = {
    "Fig. 10|Chatbot: GG-Host P90 TTFT reaches the SLO at": "host_copy_gb_s",
}


def input_parameter(figure: str, quantity: str) -> str | None:
    """The parameter a row sets, if it is one of the protocol's inputs."""
    for i in INPUTS:
        if (i.figure, i.quantity) == (figure, quantity):
            return i.parameter
    return SAME_NUMBER.get(f"{figure}|{quantity}")


def within(unit: str, paper: float | None, ours: float | None) -> bool:
    """Whether a prediction reproduces the paper's number. ``paper`` None means "never reaches
    90 %": reproduced only if ours never does either (None)."""
    if paper is None:
        return ours is None
    if ours is None or math.isinf(ours) or math.isnan(ours):
        return False
    if unit == "%":
        return abs(ours - paper) <= PP_TOLERANCE
    return abs(ours / paper - 1) <= REL_TOLERANCE if paper else ours == 0


def score(rows: list[Any]) -> dict[str, Any]:
    """How many prediction rows are within tolerance (inputs are not scored)."""
    preds = [r for r in rows if r.role == "prediction"]
    ok = [r for r in preds if r.within]
    return {
        "predictions": len(preds), "within": len(ok), "fraction": len(ok) / len(preds) if preds else None,
        "inputs": sum(r.role == "input" for r in rows), "tolerance": f"{REL_TOLERANCE:.0%} relative, {PP_TOLERANCE:g} pp for %",
    }


def _bisect(f: Callable[[float], float], target: float, lo: float, hi: float, steps: int, log: bool = False) -> float:
    """x in [lo, hi] where the increasing ``f`` crosses ``target`` (geometric midpoints if ``log``)."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def calibrate(num_requests: int = 1000, seed: int = 0, measured: MeasuredHere | None = None, steps: int = 10,
              log: Callable[[str], None] = print) -> PaperCalibration:
    """Solve the three parameters from their inputs, in order (see the module docstring)."""
    from hawk.sim.paper import Runner, _slo

    c = PAPER_CALIBRATION

    def rate90(cal: PaperCalibration, config: str, workload: str) -> float:
        run = Runner(paper_testbed(c=cal, m=measured), num_requests, seed)
        r = run.rate_where(config, workload, _slo)
        return 0.0 if r is None else r

    mfu = _bisect(lambda x: rate90(replace(c, prefill_mfu=x), "gg-direct", "summarization"), INPUTS[0].paper, 0.05, 0.6, steps)
    c = replace(c, prefill_mfu=mfu)
    log(f"prefill_mfu = {mfu:.4f} (GG-Direct Summarization 90 % at {INPUTS[0].paper} req/s)")
    host = _bisect(lambda x: rate90(replace(c, host_copy_gb_s=x), "gg-host", "chatbot"), INPUTS[1].paper, 0.05, 50.0, steps, log=True)
    c = replace(c, host_copy_gb_s=host)
    log(f"host_copy_gb_s = {host:.4f} (GG-Host Chatbot 90 % at {INPUTS[1].paper} req/s)")
    tb = paper_testbed(c=c, m=measured)
    run = Runner(tb, num_requests, seed)
    thr = {}
    for cfg in ("gn-hawk", "ggh-direct"):
        r = run.rate_where(cfg, "chatbot", _slo)
        thr[cfg] = run.run(cfg, "chatbot", r)["output_throughput_tok_s"] if r and math.isfinite(r) else None
    if thr["gn-hawk"] and thr["ggh-direct"]:
        # power ratio = (thr_hawk / thr_ggh) x (4 A100 + 4 H100) / (4 A100 + 4 p150a): solve for the H100's watts
        dev = tb.devices
        pa, pn = dev["a100-tp4"].power_w, dev["p150a-tp4"].power_w
        w = INPUTS[2].paper * (pa + pn) * thr["ggh-direct"] / thr["gn-hawk"] - pa
        c = replace(c, h100_power_w=w)
        log(f"h100_power_w = {w:.1f} (Table 9 Chatbot power efficiency {INPUTS[2].paper}x)")
    return c
