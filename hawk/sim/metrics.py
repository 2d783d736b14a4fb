"""Serving metrics, computed one way for the live benchmark and for the simulator.

The paper (§5.3) reports TTFT, TPOT, SLO attainment and output throughput; §5.4 divides the
throughput *at 90 % SLO attainment* by power and price. Keeping these definitions in one pure
module (no simpy, no HTTP) means a simulated record and a measured one are directly comparable.

Definitions (per request, times in seconds from the start of the run), as ``vllm bench serve``:

* TTFT = first streamed token (the first chunk with non-empty text) − request sent
* ITL  = the gaps between consecutive text chunks (pooled over requests for the percentiles)
* E2E (E2EL) = end of the stream (the last chunk with text or the finish reason) − request sent
* TPOT = (E2E − TTFT) / (n − 1), n = output tokens; undefined (None) for n = 1, which then meets
  any TPOT SLO
* a request *meets the SLO* when it finished without error, TTFT ≤ SLO_TTFT and TPOT ≤ SLO_TPOT;
  SLO attainment = requests meeting it / requests sent (failures are misses)
* output throughput = output tokens of finished requests / run duration (first send → last token);
  goodput = the same, counting only SLO-meeting requests (DistServe's request goodput is also given)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """What one request did: enough to derive every per-request metric."""

    index: int
    input_len: int
    output_len: int  # requested
    sent_s: float
    first_s: float | None = None
    last_s: float | None = None
    output_tokens: int = 0  # received
    ok: bool = False
    error: str | None = None
    extra: dict[str, Any] | None = None  # e.g. the server's own ``hawk`` timings
    itl_s: list[float] | None = None  # gaps between text chunks; None where not streamed (simulator)
    #: ``(arrival s, tokens generated so far)`` of each chunk that reported usage (vLLM's
    #: continuous_usage_stats: a chunk per token, text or not); None where the server sent none.
    token_marks: list[tuple[float, int]] | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E − TTFT) / (n − 1): the decode time per token after the first."""
        if self.first_s is None or self.last_s is None or self.output_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.last_s is None else self.last_s - self.sent_s

    def meets(self, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
        return self.ok and self.meets_ttft(slo_ttft_ms) and self.meets_tpot(slo_tpot_ms)

    def meets_ttft(self, slo_ttft_ms: float) -> bool:
        t = self.ttft_s
        return t is not None and t * 1e3 <= slo_ttft_ms

    def meets_tpot(self, slo_tpot_ms: float) -> bool:
        t = self.tpot_s
        return self.ok and (t is None or t * 1e3 <= slo_tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile; None for no data (never a misleading 0)."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def latency_stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``{name}_mean_ms``, ``_median_ms``, ``_p50_ms``, ``_p90_ms``, ``_p99_ms`` of values in
    seconds (``_p50`` and ``_median`` are the same number: both names have readers)."""
    out: dict[str, float | None] = {f"{name}_mean_ms": _ms(float(np.mean(values_s))) if len(values_s) else None}
    out[f"{name}_median_ms"] = _ms(percentile(values_s, 50))
    for q in (50, 90, 99):
        out[f"{name}_p{q}_ms"] = _ms(percentile(values_s, q))
    return out


def summarize(results: Iterable[RequestResult], slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    """Aggregate one run (one request rate) into the record the tables and plots read."""
    rs = list(results)
    done = [r for r in rs if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    e2e = [r.e2e_s for r in done if r.e2e_s is not None]
    itl = [g for r in done for g in (r.itl_s or ())]
    start = min((r.sent_s for r in rs), default=0.0)
    end = max((r.last_s for r in done if r.last_s is not None), default=start)
    duration = end - start
    meet = [r for r in rs if r.meets(slo_ttft_ms, slo_tpot_ms)]
    tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.input_len for r in done)
    good_tokens = sum(r.output_tokens for r in meet)

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    n = len(rs)
    out: dict[str, Any] = {
        "num_requests": n,
        "completed": len(done),
        "failed": n - len(done),
        "duration_s": duration,
        "output_tokens": tokens,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_attainment": len(meet) / n if n else None,
        "ttft_attainment": sum(r.meets_ttft(slo_ttft_ms) for r in done) / n if n else None,
        "tpot_attainment": sum(r.meets_tpot(slo_tpot_ms) for r in done) / n if n else None,
        "output_throughput_tok_s": per_s(tokens),
        "total_token_throughput_tok_s": per_s(tokens + input_tokens),
        "goodput_tok_s": per_s(good_tokens),
        "goodput_rps": per_s(len(meet)),
        "request_throughput_rps": per_s(len(done)),
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out.update(latency_stats(name, xs))
    # a request's first gap spans its hand-off to the decode (a join, a hop): apart from the rest, so a
    # run says which of the two sets the pooled ITL's tail
    first = [r.itl_s[0] for r in done if r.itl_s]
    rest = [g for r in done for g in (r.itl_s or ())[1:]]
    out.update({"itl_first_p50_ms": _ms(percentile(first, 50)), "itl_first_p99_ms": _ms(percentile(first, 99)),
                "itl_rest_p99_ms": _ms(percentile(rest, 99))})
    return out


# ============================================================================ across rates


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def at_attainment(records: Sequence[dict[str, Any]], target: float = 0.9, key: str = "output_throughput_tok_s") -> dict[str, Any]:
    """The operating point where SLO attainment falls to ``target`` (the paper's "at 90 % SLO
    attainment", Fig. 13 and Tables 8–9), from one configuration's records over request rates.

    Between the last rate at or above the target and the next one below it, rate and ``key`` are
    linearly interpolated in attainment. ``status`` says how the point was found:
    ``interpolated``, ``exact``, ``lower-bound`` (every rate met the target: the true point lies
    beyond the sweep, so the values understate it) or ``none`` (no rate met it — the paper
    excludes such a configuration, as it does GN-Host)."""
    pts = sorted((r for r in records if _finite(r.get("rate")) and r.get("slo_attainment") is not None), key=lambda r: r["rate"])
    if not pts:
        return {"status": "none", "rate": None, key: None, "target": target}
    passing = [i for i, r in enumerate(pts) if r["slo_attainment"] >= target]
    if not passing:
        return {"status": "none", "rate": None, key: None, "target": target}
    i = passing[-1]
    hi = pts[i]
    if hi["slo_attainment"] == target or i + 1 == len(pts):
        status = "exact" if hi["slo_attainment"] == target else "lower-bound"
        return {"status": status, "rate": hi["rate"], key: hi.get(key), "target": target}
    lo = pts[i + 1]  # first rate after the last passing one: attainment < target there
    a0, a1 = hi["slo_attainment"], lo["slo_attainment"]
    w = (a0 - target) / (a0 - a1)
    v0, v1 = hi.get(key), lo.get(key)
    value = None if v0 is None or v1 is None else v0 + w * (v1 - v0)
    return {"status": "interpolated", "rate": hi["rate"] + w * (lo["rate"] - hi["rate"]), key: value, "target": target}
