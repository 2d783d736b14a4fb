"""The declared calibration protocol of ``--reproduce-paper``: which paper numbers set parameters.

Three numbers from the paper's serving results set the three parameters of the ``paper`` testbed
that no source gives (``testbeds.PaperCalibration``); they are solved in this order, each with the
ones before it fixed (``paper.calibrate``):

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
from dataclasses import dataclass
from typing import Any

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
