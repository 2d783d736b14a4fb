"""User traces as workloads: ShareGPT conversations, the Azure LLM inference trace, Mooncake's trace.

A synthetic workload (``workload.py``) draws lengths from a distribution; a trace replays real ones.
Both reach the simulator and the serving benchmark as the same :class:`RequestSpec` lists, so a
trace is "just another workload" everywhere a workload name is accepted.

Formats (one loader each, all returning a :class:`Trace`):

* **ShareGPT** JSON — a list of ``{"conversations": [{"from": "human"|"gpt", "value": text}, ...]}``,
  read as vLLM's benchmark reads it: input = the first human turn, output = the reply that follows
  it. The file has text, not token counts and no timestamps: lengths are counted with a tokenizer
  when one is given (``count_tokens``), else estimated at :data:`CHARS_PER_TOKEN` characters per
  token; arrivals are Poisson at the sweep's rate.
* **Azure** LLM inference trace CSV — columns ``TIMESTAMP, ContextTokens, GeneratedTokens``;
  arrivals come from the timestamps (ISO date-times or seconds).
* **Mooncake** JSONL — one ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` per
  line; arrivals from the timestamps; ``hash_ids`` (prefix-cache block hashes) are kept and
  summarised, but the simulator does not model prefix caching.

Rates: a timed trace keeps its burst shape. With no rate asked for it replays at its own mean
rate; asked for a rate, its times are stretched or compressed so that the mean rate is that rate.
``rate_scale`` then multiplies whichever rate applies (2 = twice as fast). An untimed trace
(ShareGPT) gets seeded Poisson arrivals at rate × scale, like a synthetic workload.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from hawk.sim.workload import WORKLOADS, RequestSpec, unit_gaps

#: English text under a BPE tokenizer averages about four characters per token (OpenAI's rule of
#: thumb; SmolLM2's and Llama-3's tokenizers land near it on ShareGPT prose). An estimate: pass a
#: tokenizer when lengths must be exact.
CHARS_PER_TOKEN = 4.0
FORMATS = ("sharegpt", "azure", "mooncake")
EXTENSIONS = {".json": "sharegpt", ".csv": "azure", ".jsonl": "mooncake"}
HUMAN = ("human", "user")
ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "bing")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


class TraceError(ValueError):
    """A trace file that cannot be read as the format it was taken for (the message says where)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it came (s from the trace's first request; None if untimed)."""

    input_len: int
    output_len: int
    arrival_s: float | None = None
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TraceLimits:
    """Which records to keep. Over-long records are *skipped* (counted), never clipped, so the
    lengths that remain are the trace's own; the serving benchmark still clips to the served
    context (and records it)."""

    max_requests: int | None = None
    min_input_len: int = 1
    min_output_len: int = 1
    max_input_len: int | None = None
    max_output_len: int | None = None

    def keeps(self, r: TraceRequest) -> bool:
        return (
            r.input_len >= self.min_input_len and r.output_len >= self.min_output_len
            and (self.max_input_len is None or r.input_len <= self.max_input_len)
            and (self.max_output_len is None or r.output_len <= self.max_output_len)
        )


@dataclass(frozen=True)
class Trace:
    """A loaded trace: its requests in arrival order and how many records were left out."""

    name: str
    format: str
    path: str
    requests: tuple[TraceRequest, ...]
    skipped: int = 0
    length_source: str = "trace"

    @property
    def timed(self) -> bool:
        return bool(self.requests) and self.requests[0].arrival_s is not None

    def native_rate(self, n: int | None = None) -> float:
        """Mean arrival rate (req/s) of the first ``n`` requests: (n − 1) / their time span."""
        rs = self.requests[: n or None]
        if not self.timed or len(rs) < 2:
            return math.inf
        span = rs[-1].arrival_s - rs[0].arrival_s  # type: ignore[operator]
        return (len(rs) - 1) / span if span > 0 else math.inf

    def summary(self) -> dict[str, Any]:
        """What a record says about the trace it replayed (lengths, rate, prefix reuse)."""
        ins = [r.input_len for r in self.requests]
        outs = [r.output_len for r in self.requests]
        out: dict[str, Any] = {
            "trace": self.path, "trace_format": self.format, "trace_requests": len(self.requests),
            "trace_skipped": self.skipped, "trace_length_source": self.length_source,
            "trace_input_mean": float(np.mean(ins)) if ins else None,
            "trace_output_mean": float(np.mean(outs)) if outs else None,
            "trace_native_rate": self.native_rate() if self.timed else None,
        }
        blocks = [h for r in self.requests for h in r.hash_ids]
        if blocks:  # share of prefix blocks seen before: what a prefix cache could reuse
            out["trace_block_reuse"] = 1 - len(set(blocks)) / len(blocks)
        return out


# ============================================================================ loaders


def estimate_tokens(text: str) -> int:
    """Token count from characters (:data:`CHARS_PER_TOKEN`), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def guess_format(path: str | Path) -> str:
    """The format from the file's extension (.json ShareGPT, .csv Azure, .jsonl Mooncake)."""
    ext = Path(path).suffix.lower()
    if ext not in EXTENSIONS:
        raise TraceError(f"{path}: cannot tell the trace format from {ext or 'no extension'!r}; "
                         f"give --trace-format ({' | '.join(FORMATS)})")
    return EXTENSIONS[ext]


def _turns(conv: Any) -> tuple[str, str] | None:
    """(first human turn, the assistant reply after it), or None when the conversation has no such pair."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(turns, list):
        return None
    for i, t in enumerate(turns[:-1]):
        if isinstance(t, dict) and t.get("from") in HUMAN:
            nxt = turns[i + 1]
            if isinstance(nxt, dict) and nxt.get("from") in ASSISTANT:
                return str(t.get("value") or ""), str(nxt.get("value") or "")
            return None
    return None


def load_sharegpt(path: Path, count_tokens: Callable[[str], int] | None = None) -> tuple[list[TraceRequest], int, str]:
    """ShareGPT conversations → untimed requests; conversations without a human→gpt pair are skipped."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not valid JSON (line {e.lineno}: {e.msg}); a ShareGPT trace is a JSON list of conversations") from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: a ShareGPT trace is a JSON list of {{'conversations': [...]}}, got a {type(data).__name__}")
    count = count_tokens or estimate_tokens
    out, skipped = [], 0
    for conv in data:
        pair = _turns(conv)
        if pair is None:
            skipped += 1
            continue
        out.append(TraceRequest(count(pair[0]), count(pair[1])))
    src = "tokenizer" if count_tokens else f"estimate: {CHARS_PER_TOKEN:g} chars/token"
    return out, skipped, src


def _seconds(value: str, where: str) -> float:
    """A timestamp in seconds: a number, or an ISO date-time (Azure writes 7 fractional digits)."""
    v = value.strip()
    try:
        return float(v)
    except ValueError:
        pass
    head, dot, frac = v.partition(".")
    try:
        t = datetime.fromisoformat(head)
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP {value!r} is neither seconds nor an ISO date-time") from None
    digits = "".join(c for c in frac if c.isdigit())
    return t.timestamp() + (float("0." + digits) if dot and digits else 0.0)


def _number(value: Any, what: str, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} {value!r} is not a number") from None
    if not math.isfinite(x):
        raise TraceError(f"{where}: {what} {value!r} is not finite")
    return x


def _int(value: Any, what: str, where: str) -> int:
    x = _number(value, what, where)
    if x != int(x):
        raise TraceError(f"{where}: {what} {value!r} is not a whole number of tokens")
    return int(x)


def load_azure(path: Path) -> list[TraceRequest]:
    """Azure LLM inference trace CSV → timed requests (times relative to the first)."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in AZURE_COLUMNS if c not in cols]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}; an Azure trace has "
                             f"{', '.join(AZURE_COLUMNS)} (found: {', '.join(cols) or 'no header'})")
        rows = []
        for i, row in enumerate(reader, start=2):
            row = {(k or "").strip(): v for k, v in row.items()}
            where = f"{path}:{i}"
            rows.append((_seconds(row["TIMESTAMP"] or "", where), _int(row["ContextTokens"], "ContextTokens", where),
                         _int(row["GeneratedTokens"], "GeneratedTokens", where)))
    return _timed(rows)


def load_mooncake(path: Path) -> list[TraceRequest]:
    """Mooncake JSONL → timed requests (``timestamp`` in ms), keeping ``hash_ids``."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not a JSON object ({e.msg}); a Mooncake trace has one per line") from None
            if not isinstance(rec, dict) or any(k not in rec for k in MOONCAKE_FIELDS):
                raise TraceError(f"{where}: a Mooncake record needs {', '.join(MOONCAKE_FIELDS)}")
            hashes = tuple(_int(h, "hash id", where) for h in rec.get("hash_ids") or ())
            rows.append((_number(rec["timestamp"], "timestamp", where) / 1e3, _int(rec["input_length"], "input_length", where),
                         _int(rec["output_length"], "output_length", where), hashes))
    return _timed(rows)


def _timed(rows: Sequence[tuple]) -> list[TraceRequest]:
    """Sort by time (stable) and make times relative to the first request."""
    rows = sorted(rows, key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    return [TraceRequest(r[1], r[2], r[0] - t0, r[3] if len(r) > 3 else ()) for r in rows]


def load_trace(
    path: str | Path,
    fmt: str | None = None,
    limits: TraceLimits = TraceLimits(),
    count_tokens: Callable[[str], int] | None = None,
) -> Trace:
    """Read a trace file (format from ``fmt`` or the extension), apply ``limits``, and check that
    something is left. Errors name the file, the line and what was expected."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace file not found: {p}")
    fmt = fmt or guess_format(p)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    skipped, src = 0, "trace"
    if fmt == "sharegpt":
        reqs, skipped, src = load_sharegpt(p, count_tokens)
    elif fmt == "azure":
        reqs = load_azure(p)
    else:
        reqs = load_mooncake(p)
    kept = [r for r in reqs if limits.keeps(r)]
    skipped += len(reqs) - len(kept)
    if limits.max_requests is not None:
        kept = kept[: limits.max_requests]
    if not kept:
        raise TraceError(f"{p}: no usable requests ({skipped} skipped by format or limits)")
    if kept[0].arrival_s is not None:  # limits may drop the first record: restart the clock
        t0 = kept[0].arrival_s
        kept = [replace(r, arrival_s=r.arrival_s - t0) for r in kept]  # type: ignore[operator]
    return Trace(p.stem, fmt, str(p), tuple(kept), skipped, src)


# ============================================================================ as a workload


@dataclass(frozen=True)
class TraceWorkload:
    """A trace where a :class:`~hawk.sim.workload.Workload` is expected (``generate_requests``
    calls :meth:`requests`). SLOs default to the chatbot's (the paper's 2000/200 ms)."""

    trace: Trace
    slo_ttft_ms: float = WORKLOADS["chatbot"].slo_ttft_ms
    slo_tpot_ms: float = WORKLOADS["chatbot"].slo_tpot_ms
    rate_scale: float = 1.0
    input_scale: float = 1.0
    output_scale: float = 1.0
    note: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        return f"trace:{self.trace.name}"

    def scaled(self, input_scale: float = 1.0, output_scale: float = 1.0) -> TraceWorkload:
        """Lengths scaled (e.g. to a small model's context), as ``Workload.scaled``."""
        return replace(self, input_scale=self.input_scale * input_scale, output_scale=self.output_scale * output_scale)

    def rates(self, requested: Sequence[float] | None, n: int) -> list[float]:
        """The rates a sweep runs: the requested ones, or the trace's own mean rate, × ``rate_scale``."""
        if self.rate_scale <= 0:
            raise ValueError(f"trace rate scale must be positive, got {self.rate_scale}")
        if not requested:
            if not self.trace.timed:
                raise ValueError(f"{self.trace.path}: a {self.trace.format} trace has no timestamps; give request rates")
            return [self.trace.native_rate(n) * self.rate_scale]
        return [r * self.rate_scale for r in requested]

    def requests(self, n: int, rate: float, seed: int = 0) -> list[RequestSpec]:
        """The first ``n`` requests (all if the trace is shorter), arriving at mean ``rate`` req/s."""
        if not rate > 0:
            raise ValueError(f"request rate must be positive, got {rate}")
        rs = self.trace.requests[:n]
        if self.trace.timed:
            native = self.trace.native_rate(len(rs))
            k = 0.0 if math.isinf(rate) else (native / rate if math.isfinite(native) else 1.0)
            times = [r.arrival_s * k for r in rs]  # type: ignore[operator]
        else:
            times = (np.zeros(len(rs)) if math.isinf(rate) else np.cumsum(unit_gaps(len(rs), seed)) / rate).tolist()
        return [
            RequestSpec(i, float(t), max(1, round(r.input_len * self.input_scale)), max(1, round(r.output_len * self.output_scale)))
            for i, (t, r) in enumerate(zip(times, rs))
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "slo_ttft_ms": self.slo_ttft_ms, "slo_tpot_ms": self.slo_tpot_ms, "rate_scale": self.rate_scale,
                "input_scale": self.input_scale, "output_scale": self.output_scale, **self.trace.summary()}


def trace_workload(
    path: str | Path,
    fmt: str | None = None,
    *,
    rate_scale: float = 1.0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    limits: TraceLimits = TraceLimits(),
    count_tokens: Callable[[str], int] | None = None,
) -> TraceWorkload:
    """Load a trace and wrap it as a workload (what ``--trace`` does)."""
    if not rate_scale > 0:
        raise TraceError(f"--trace-rate-scale must be positive, got {rate_scale}")
    tw = TraceWorkload(load_trace(path, fmt, limits, count_tokens), rate_scale=rate_scale)
    if slo_ttft_ms is not None:
        tw = replace(tw, slo_ttft_ms=slo_ttft_ms)
    if slo_tpot_ms is not None:
        tw = replace(tw, slo_tpot_ms=slo_tpot_ms)
    return tw
