"""What a served step costs, fitted over the steps a server really ran (``HAWK_STEP_TRACE`` lines,
``hawk/engine/step_trace.py``): step ms against decode rows, their cached tokens, the longest row's
(thousands: past 16 rows one program streams each row's context, so the longest can set the step),
prompt tokens and chunks, and the query-key pairs the chunks' attention reads (thousands: a chunk of q
tokens after s cached ones, q·(s + q/2)), by least squares, then the prompt tokens' share of the step time. The step time is
the device's (``device_ms``, CUDA events) or, with ``--time launch_ms``, the launch's host time: a CPU
engine's step runs inside its launch.

    HAWK_STEP_TRACE=/tmp/steps.jsonl python -m hawk serve ...    # a load, then stop the server
    python benchmarks/step_trace_fit.py /tmp/steps.jsonl [--json OUT] [--skip 200] [--time launch_ms]

Why a fit: a step probe times chunks it builds (``benchmarks/mixed_step_probe.py``); a served step
carries chunks deep into their prompts and several prompts at once, and the fit's prompt-token
coefficient is what those cost where the load put them. Steps whose device time includes a wait for
their own launch (``device_ms`` well above ``launch_ms`` of a graph replay) are in the fit as they ran.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

TERMS = ("rows", "context", "longest_k", "prompt_tokens", "chunks", "chunk_pairs_k")
PROMPT_TERMS = ("prompt_tokens", "chunks", "chunk_pairs_k")  # what the prompts bring to a step


def chunk_pairs_k(step: dict[str, Any]) -> float:
    """Query-key pairs of the step's chunks' causal attention, in thousands."""
    return sum(q * (s + q / 2) for s, q in step.get("spans", [])) / 1e3


TIMES = ("device_ms", "launch_ms")


def load(path: Path, skip: int = 0, time: str = "device_ms") -> list[dict[str, Any]]:
    """The trace's lines that have ``time``, past the first ``skip`` (warm-up, the ramp's start); each
    gets ``step_ms``, the time the fit explains. A ``.gz`` trace (as committed) is read as is."""
    if time not in TIMES:
        raise ValueError(f"time must be one of {TIMES}, got {time!r}")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    lines = [json.loads(x) for x in text.splitlines() if x.strip()]
    return [{**x, "chunk_pairs_k": chunk_pairs_k(x), "longest_k": x.get("longest", 0) / 1e3, "step_ms": x[time]}
            for x in lines[skip:] if x.get(time) is not None]


def fit(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """step_ms ≈ c0 + Σ c_t · term_t over the steps; each coefficient in ms per unit."""
    a = np.array([[1.0, *(float(s[t]) for t in TERMS)] for s in steps])
    y = np.array([float(s["step_ms"]) for s in steps])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    resid = y - a @ coef
    per = {t: float(c) for t, c in zip(TERMS, coef[1:])}
    mixed = [s for s in steps if s["prompt_tokens"] and s["rows"]]
    total = float(y.sum())
    n_prompt = sum(s["prompt_tokens"] for s in steps)
    prompt_ms = sum(per[t] * sum(s[t] for s in steps) for t in PROMPT_TERMS)
    return {
        "steps": len(steps),
        "mixed_steps": len(mixed),
        "step_s": round(total / 1e3, 3),
        "coef_ms": {"const": round(float(coef[0]), 4), **{t: round(c, 6) for t, c in per.items()}},
        "prompt_token_us": round(1e3 * per["prompt_tokens"], 2),  # per token, its chunk and attention apart
        # what the prompts cost all in (tokens, chunks, their attention) per prompt token
        "prompt_token_us_all_in": round(1e3 * prompt_ms / n_prompt, 2) if n_prompt else None,
        "prompt_share_of_step_time": round(prompt_ms / total, 3) if total else None,
        "residual_ms_p50_abs": round(float(np.median(np.abs(resid))), 3),
        "mean_rows": round(float(np.mean([s["rows"] for s in steps])), 1),
        "mean_prompt_tokens_in_mixed": round(float(np.mean([s["prompt_tokens"] for s in mixed])), 1) if mixed else 0.0,
        "by_path": {p: sum(1 for s in steps if s.get("path") == p) for p in sorted({str(s.get("path")) for s in steps})},
        # a running row gets a token a step: these are the inter-token gaps the steps set
        "step_ms_pct": {kind: _pct([float(s["step_ms"]) for s in group]) for kind, group in
                        (("decode_only", [s for s in steps if not s["prompt_tokens"]]), ("mixed", mixed), ("all", steps))},
    }


def _pct(xs: list[float]) -> dict[str, float] | None:
    return {f"p{q}": round(float(np.percentile(xs, q)), 3) for q in (50, 90, 99)} if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N lines (warm-up)")
    ap.add_argument("--json", type=Path, help="write the fit here too")
    ap.add_argument("--time", choices=TIMES, default="device_ms", help="the step time to explain (launch_ms: a CPU engine's steps)")
    a = ap.parse_args()
    steps = load(a.trace, a.skip, a.time)
    if len(steps) < len(TERMS) + 2:
        raise SystemExit(f"{a.trace}: {len(steps)} steps with a {a.time}, too few to fit")
    out = {"trace": str(a.trace), "time": a.time, **fit(steps)}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
