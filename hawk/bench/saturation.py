"""``hawk bench serving --saturation``: where a server's throughput stops growing, against a bound
measured on the same server in the same run.

The ramp: rates ``r0, r0·f, r0·f², ...`` (open loop, ``hawk bench serving``'s Poisson arrivals),
until the request throughput grows by less than ``min_growth`` over the best so far (or
``max_steps`` rates). A rate's throughput is the steady state's (:func:`steady_throughput`:
the middle 80 % of the completions over their time span), not completed / duration, which a short run at a high
rate mostly fills with its drain; ``duration_s`` makes each rate long enough to have one.
Saturation throughput is the best rate's; the rate at 90 % SLO attainment is
interpolated between the last rate that met it and the first that did not. One more run at 80 % of
the saturation throughput gives the latencies a loaded server shows short of saturation.

The bound is what the server's own steps allow for this workload's token counts, with prefill and
decode taking turns on the device (no overlap credited):

    bound_rps = 1 / (mean_i T_prefill(P_i) + mean_i (O_i - 1) · T_step(B) / B)

``T_prefill`` is a line fitted to the prefill times of lone requests at three prompt lengths of
the workload (10th, 50th, 90th percentile; three each, medians): the server's own ``prefill_s``
where it reports one (HAWK), else the client's TTFT (vLLM: HTTP and tokenization included, so that
bound is a little low). ``T_step(B)`` is the decode step at batch ``B``: ``B`` requests sent at once,
with outputs long enough that all of them are decoding a while before the first ends, and lengths
that centre that window's contexts on the workload's mean context; the window's length over the
median number of tokens a request received in it (every request in the batch, no prefill in the
steps) is the step. ``B`` is ``bound_batch`` (the server's ``--max-num-seqs``). Both are measured
through the HTTP API on the server under test, so the bound and the ramp share the machine's state.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
import numpy as np

from hawk.bench.serving import _bench, _server_info, completion_body, prompt_ids, run_rate
from hawk.sim.metrics import RequestResult
from hawk.sim.workload import RequestSpec, Workload, generate_requests, get_workload


@dataclass(frozen=True)
class Bound:
    """The same-run bound and what it was computed from."""

    bound_rps: float
    prefill_ms_mean: float  # mean over the workload's prompts of the fitted prefill time
    prefill_fit_ms: tuple[float, float]  # a + b * tokens: (a ms, b ms per token)
    prefill_source: str  # "server prefill_s" or "client TTFT"
    decode_step_ms: float  # T_step(B)
    batch: int  # B
    decode_ms_per_request: float  # mean (O - 1) * T_step / B
    input_len_mean: float
    output_len_mean: float
    decode_probe_context: float  # the decode probe's mean context in its window (about the workload's mean)


@dataclass(frozen=True)
class SaturationOptions:
    start_rate: float = 1.0
    factor: float = 1.5
    min_growth: float = 0.05
    max_steps: int = 8
    num_requests: int = 200
    bound_batch: int = 256
    seed: int = 0
    prefill_reps: int = 3
    budget_guess: int = 640  # the server's --max-num-batched-tokens, for the decode probe's length (retried if wrong)
    duration_s: float = 0.0  # each rate sends at least rate x this many requests (a steady state needs many E2E times)


def _percentile_lengths(specs: Sequence[RequestSpec]) -> list[int]:
    lens = np.array([s.input_len for s in specs])
    return sorted({max(1, int(np.percentile(lens, q))) for q in (10, 50, 90)})


async def _lone(client: httpx.AsyncClient, url: str, model: str | None, n_in: int, n_out: int, index: int, seed: int) -> RequestResult:
    spec = RequestSpec(index, 0.0, n_in, n_out)
    body = completion_body(spec, prompt_ids(spec, seed, (1000, 10000)), model)
    res = await run_rate(client, url, [spec], [body])
    return res[0]


async def measure_prefill(client: httpx.AsyncClient, url: str, model: str | None, lengths: Sequence[int], reps: int, seed: int) -> tuple[list[tuple[int, float]], str]:
    """(prompt tokens, seconds) per length: the median of ``reps`` lone requests of 2 output tokens."""
    out, source = [], "server prefill_s"
    for n in lengths:
        times = []
        for r in range(reps):
            res = await _lone(client, url, model, n, 2, 10_000 + 100 * n + r, seed)
            if not res.ok:
                raise RuntimeError(f"prefill probe of {n} tokens failed: {res.error}")
            hawk = (res.extra or {}).get("hawk") or {}
            if hawk.get("prefill_s") is not None:
                times.append(float(hawk["prefill_s"]))
            else:
                source = "client TTFT"
                times.append(float(res.ttft_s or 0.0))
        out.append((n, float(np.median(times))))
    return out, source


def step_window(results: Sequence[RequestResult]) -> tuple[float, list[int]]:
    """The window in which every request of a batch was decoding (from the last first token to the
    first end: nobody joins or leaves, so no prefill rides in those steps), and how many tokens
    each request received in it. Counting tokens over the window, rather than taking the gaps
    between them, is robust to a client that reads a busy server's chunks in bursts. Where every
    chunk reports usage (vLLM's continuous_usage_stats: a chunk per token), tokens are counted
    from it; else text chunks are, and one may carry several tokens (text held back until its
    UTF-8 bytes are whole).

    A request whose stream carried text only once (a byte-level tokenizer holds back bytes that
    are not yet whole UTF-8 characters) still decoded through the window: it bounds the window but
    adds no count."""
    failed = [r for r in results if not r.ok or r.first_s is None]
    if failed:
        why = failed[0].error or "no first token"
        raise RuntimeError(f"{len(failed)} of the decode probe's requests failed; the first: {why}")
    if all(r.token_marks for r in results):
        return _token_window(results)
    start = max(r.first_s for r in results)  # type: ignore[type-var]
    end = min(r.last_s if r.last_s is not None else r.first_s for r in results)  # type: ignore[type-var]
    counts = []
    for r in results:
        if not r.itl_s:
            continue
        t = r.first_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])  # type: ignore[operator]
        counts.append(int(((t > start) & (t <= end)).sum()))
    return max(0.0, end - start), counts


def _token_window(results: Sequence[RequestResult]) -> tuple[float, list[int]]:
    """:func:`step_window` from the usage every chunk reported: the window runs from the last
    request's first token to the first request's last, and each request's count is the tokens it
    was told of inside it (a chunk per token, so text held back does not hide a step)."""
    marks = [np.asarray(r.token_marks, dtype=float) for r in results]
    start = max(float(m[0, 0]) for m in marks)
    end = min(float(m[-1, 0]) for m in marks)
    counts = []
    for m in marks:
        t, n = m[:, 0], m[:, 1]
        before, through = int((t <= start).sum()), int((t <= end).sum())
        counts.append(int((n[through - 1] if through else 0) - (n[before - 1] if before else 0)))
    return max(0.0, end - start), counts


#: Tokens every request must receive inside the window for the step time to count.
MIN_WINDOW_STEPS = 24


async def measure_decode_step(client: httpx.AsyncClient, url: str, model: str | None, batch: int, n_in: int | Sequence[int],
                              n_out: int, seed: int) -> float:
    """Seconds of one decode step at ``batch``: ``batch`` requests at once (each ``n_in`` prompt
    tokens, or request ``i`` ``n_in[i]``); the window's length over the median tokens a request got
    in it. A window too short (the batch's prefill outlasted the first request's decode) is retried
    with outputs twice as long, twice."""
    lengths = [n_in] * batch if isinstance(n_in, int) else list(n_in)
    if len(lengths) != batch:
        raise ValueError(f"{len(lengths)} prompt lengths for a batch of {batch}")
    for attempt in range(3):
        specs = [RequestSpec(20_000 + i, 0.0, lengths[i], n_out) for i in range(batch)]
        bodies = [completion_body(s, prompt_ids(s, seed + attempt, (1000, 10000)), model, continuous_usage=True) for s in specs]
        span, counts = step_window(await run_rate(client, url, specs, bodies))
        steps = float(np.median(counts)) if counts else 0.0
        if steps >= MIN_WINDOW_STEPS:
            return span / steps
        n_out *= 2
    raise RuntimeError(f"the decode probe at batch {batch} never had the whole batch decoding for {MIN_WINDOW_STEPS} steps")


def fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b n (b = 0, a = the mean, from one point)."""
    ns = np.array([p[0] for p in points], dtype=float)
    ts = np.array([p[1] for p in points], dtype=float)
    if len(points) < 2 or np.ptp(ns) == 0:
        return float(ts.mean()), 0.0
    b, a = np.polyfit(ns, ts, 1)
    return float(a), float(b)


def bound_from(specs: Sequence[RequestSpec], fit: tuple[float, float], step_s: float, batch: int, source: str, context: float = math.nan) -> Bound:
    """The formula in the module docstring, over the workload's own requests."""
    a, b = fit
    prefill = float(np.mean([max(0.0, a + b * s.input_len) for s in specs]))
    decode = float(np.mean([(s.output_len - 1) * step_s / batch for s in specs]))
    return Bound(1.0 / (prefill + decode), prefill * 1e3, (a * 1e3, b * 1e3), source, step_s * 1e3, batch, decode * 1e3,
                 float(np.mean([s.input_len for s in specs])), float(np.mean([s.output_len for s in specs])), context)


def _prefill_steps(prompt_tokens: int, batch: int, budget: int) -> int:
    """Steps a probe's batch spends prefilling ``prompt_tokens`` beside its decode rows (what a step's
    ``budget`` leaves after ``batch`` rows), with a margin of 8: the probes' windows open after them."""
    return -(-prompt_tokens // max(1, budget - batch)) + 8


def decode_probe(batch: int, specs: Sequence[RequestSpec], budget: int) -> tuple[int, int, float]:
    """(prompt tokens, output tokens, mean context in the window) of the decode probe at ``batch``:
    the window's contexts centred on the workload's mean context (prompt + half the output), and
    outputs long enough that the whole batch decodes a while before its first request ends (its
    prompts take about ``batch * prompt / (budget - batch)`` steps to prefill)."""
    target = float(np.mean([s.input_len + s.output_len / 2 for s in specs]))
    n_in = max(16, round(target / 3))
    pre = _prefill_steps(batch * n_in, batch, budget)
    n_out = max(pre + 2 * MIN_WINDOW_STEPS, round(2 * (target - n_in)) - pre)
    return n_in, n_out, n_in + (pre + n_out) / 2


def spread_probe(batch: int, specs: Sequence[RequestSpec], budget: int) -> tuple[list[int], int]:
    """(prompt tokens of each request, output tokens) of a decode probe at ``batch`` whose contexts
    spread as the workload's do: in the window's middle request ``i`` holds the workload's ``i``-th
    request's mid-decode context (prompt + half its output), where :func:`decode_probe` puts every row
    at their mean. Why: past 16 rows a GPU decode step lasts as long as its longest row's attention
    (``hawk/sim/colocated.py``'s ``RowStreams``), which a batch of equal rows never shows."""
    pool = list(specs) or [RequestSpec(0, 0.0, 16, 2)]
    mids = [s.input_len + s.output_len // 2 for s in itertools.islice(itertools.cycle(pool), batch)]
    lengths, n_out = mids, 0
    for _ in range(3):  # the window (just past the batch's prefill) moves with the prompts, and they with it
        pre = _prefill_steps(sum(lengths), batch, budget)
        n_out = pre + 4 * MIN_WINDOW_STEPS  # a window of about twice the steps the count needs
        lengths = [max(16, m - (pre + n_out) // 2) for m in mids]
    return lengths, n_out


async def measure_bound(base_url: str, wl: Workload, opts: SaturationOptions, model: str | None, timeout_s: float = 900.0,
                        batch: int | None = None) -> Bound:
    """Measure ``T_prefill`` and ``T_step(batch)`` on the server and return the bound."""
    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    specs = generate_requests(wl, opts.num_requests, 1.0, opts.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False) as client:
        model = model or (await _server_info(client, base_url)).get("id")
        points, source = await measure_prefill(client, url, model, _percentile_lengths(specs), opts.prefill_reps, opts.seed)
        b = batch or opts.bound_batch
        n_in, n_out, ctx = decode_probe(b, specs, opts.budget_guess)
        step = await measure_decode_step(client, url, model, b, n_in, n_out, opts.seed)
    return bound_from(specs, fit_line(points), step, b, source, ctx)


def slo90_rate(records: Sequence[dict[str, Any]], target: float = 0.9) -> float | None:
    """The offered rate where SLO attainment crosses ``target``, linear between the ramp's last rate
    that met it and the next; the highest rate if all met it; None if none did."""
    ok = None
    for r in sorted(records, key=lambda x: x["rate"]):
        att = r.get("slo_attainment") or 0.0
        if att >= target:
            ok = r
            continue
        if ok is None:
            return None
        a0, a1 = ok["slo_attainment"], att
        return float(ok["rate"] + (r["rate"] - ok["rate"]) * (a0 - target) / (a0 - a1))
    return None if ok is None else float(ok["rate"])


def _chunks(r: dict[str, Any]) -> list[tuple[float, float]]:
    """``(time, tokens)`` of each streamed chunk of a request: its usage marks where the server sent
    them (a count per chunk), else its text chunks (the first, then the inter-chunk gaps) with its
    tokens spread evenly over them."""
    marks = r.get("token_marks")
    if marks:
        counts = [n for _, n in marks]
        return [(t, n - p) for (t, n), p in zip(marks, [0, *counts])]
    first, n = r.get("first_s"), r.get("output_tokens") or 0
    if first is None or n <= 0:
        return []
    times = list(itertools.accumulate(r.get("itl_s") or [], initial=first))
    return [(t, n / len(times)) for t in times]


def steady_throughput(requests: Sequence[dict[str, Any]], trim: float = 0.1) -> float | None:
    """Requests per second the server sustained while the load lasted: the output tokens it streamed
    between the ``trim`` quantile of the arrivals (past the ramp-up) and the last arrival (before the
    drain), per second, over a finished request's mean output tokens.

    Why tokens: below saturation they follow the arrivals (this is the offered rate); above it a
    server streams at its capacity whether it queues requests (finishing them at its service rate) or
    admits them all and shares its steps (finishing few while they arrive and the rest in the drain).
    Counting completions instead reads the second kind wrong: the middle of its completions is a short
    burst at the end (for vLLM on a CPU it read 4.6 req/s against 1.38 completed per second of the run).
    ``completed / duration`` (vLLM's figure) also counts the ramp-up and the drain, which a short run at
    a high rate is mostly made of."""
    sent = sorted(r["sent_s"] for r in requests if r.get("sent_s") is not None)
    finished = [r["output_tokens"] for r in requests if r.get("ok") and r.get("output_tokens")]
    if len(sent) < 6 or len(finished) < 6:
        return None
    lo, hi = sent[int(len(sent) * trim)], sent[-1]
    if hi <= lo:
        return None
    tokens = sum(n for r in requests for t, n in _chunks(r) if lo <= t <= hi)
    return tokens / (hi - lo) / (sum(finished) / len(finished))


def with_aliases(rec: dict[str, Any], bound_rps: float | None) -> dict[str, Any]:
    """The fields the results files name (p50 = the median), beside ``hawk bench serving``'s own."""
    return {**rec, "ttft_p50_ms": rec.get("ttft_median_ms"), "tpot_p50_ms": rec.get("tpot_median_ms"),
            "itl_p50_ms": rec.get("itl_median_ms"), "bound_rps": bound_rps}


def ramp(bench_rate: Callable[[float], dict[str, Any]], opts: SaturationOptions, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run rates ``start, start·f, ...`` until throughput grows by less than ``min_growth``."""
    records: list[dict[str, Any]] = []
    best = 0.0
    rate = opts.start_rate
    for _ in range(opts.max_steps):
        rec = bench_rate(rate)
        records.append(rec)
        tput = _tput(rec)
        log(f"rate {rate:.3g} req/s: {tput:.3g} req/s done, SLO attainment {rec.get('slo_attainment') or 0:.0%}")
        if records[:-1] and tput < best * (1 + opts.min_growth):
            break
        best = max(best, tput)
        rate *= opts.factor
    return records


def _tput(rec: dict[str, Any]) -> float:
    """The throughput a rate is judged by: steady-state where measured, else completed / duration."""
    return rec.get("steady_throughput_rps") or rec.get("request_throughput_rps") or 0.0


def served_batch(base_url: str) -> int | None:
    """The server's ``--max-num-seqs`` where it says so (a HAWK router's ``/v1/models`` carries
    ``max_num_seqs``), else None."""
    async def info() -> dict[str, Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await _server_info(client, base_url.rstrip("/"))

    n = asyncio.run(info()).get("max_num_seqs")
    return n if isinstance(n, int) and n > 0 else None


def bound_batch_for(requested: int, served: int | None) -> int:
    """The bound's decode batch: as asked, but never past what the server runs in one step (a probe of
    more sequences never sees its whole batch decoding, and would fail after minutes)."""
    return requested if served is None or requested <= 0 else min(requested, served)


def run_saturation(base_url: str, workload: str | Workload, opts: SaturationOptions, *, model: str | None = None,
                   config: str | None = None, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                   timeout_s: float = 900.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Bound, ramp, and the 80 %-of-saturation run; one JSON-ready record of all of it."""
    wl = get_workload(workload)
    t0 = time.time()
    b = bound_batch_for(opts.bound_batch, served_batch(base_url))
    if b != opts.bound_batch:
        log(f"bound batch: the server runs at most {b} sequences a step, not {opts.bound_batch}")
        opts = replace(opts, bound_batch=b)
    bound = asyncio.run(measure_bound(base_url, wl, opts, model, timeout_s)) if opts.bound_batch > 0 else None
    if bound is not None:
        log(f"bound: {bound.bound_rps:.3g} req/s (prefill {bound.prefill_ms_mean:.1f} ms/request [{bound.prefill_source}], "
            f"decode step {bound.decode_step_ms:.2f} ms at batch {bound.batch})")
    bound_rps = bound.bound_rps if bound is not None else None

    def bench_rate(rate: float) -> dict[str, Any]:
        n = max(opts.num_requests, math.ceil(rate * opts.duration_s))
        recs = asyncio.run(_bench(
            base_url, [rate], wl, n, opts.seed,
            wl.slo_ttft_ms if slo_ttft_ms is None else slo_ttft_ms, wl.slo_tpot_ms if slo_tpot_ms is None else slo_tpot_ms,
            model, config, None, timeout_s, 1, (1000, 10000), True, 0.0, 0.0, True, None, None,
        ))
        rec = recs[0]
        rec["steady_throughput_rps"] = steady_throughput(rec.pop("requests"))
        return with_aliases(rec, bound_rps)

    records = ramp(bench_rate, opts, log)
    best = max(records, key=_tput)
    sat = _tput(best)
    at80 = bench_rate(0.8 * sat) if sat > 0 else None
    extra: dict[str, Any] = {}
    if at80 is not None and opts.bound_batch > 0:
        # Little's law: requests in the system at 80 % = rate x mean time in it; that batch's step
        batch80 = max(1, min(opts.bound_batch, round(_tput(at80) * (at80.get("e2e_mean_ms") or 0.0) / 1e3)))
        step80, spread80 = asyncio.run(_steps_at(base_url, wl, opts, model, timeout_s, batch80, log))
        extra = {"batch_at_80": batch80, "decode_step_ms_at_80": step80 * 1e3,
                 "tpot_p50_over_step_at_80": (at80.get("tpot_median_ms") or math.nan) / (step80 * 1e3),
                 "itl_p99_over_tpot_p50_at_80": (at80.get("itl_p99_ms") or math.nan) / (at80.get("tpot_median_ms") or math.nan),
                 # the same batch with the workload's spread of contexts (spread_probe): what its longest rows add
                 "decode_step_ms_at_80_spread": None if spread80 is None else spread80 * 1e3}
    return {
        "workload": wl.name, "config": config or best.get("config"), "base_url": base_url, "started_at": t0,
        "options": asdict(opts), "bound": asdict(bound) if bound is not None else None,
        "saturation_rps": sat, "saturation_rate": best["rate"], "saturation_over_bound": sat / bound_rps if bound_rps else None,
        "slo90_rate_rps": slo90_rate(records), "ramp": records, "at_80": at80, **extra,
    }


async def _steps_at(base_url: str, wl: Workload, opts: SaturationOptions, model: str | None, timeout_s: float, batch: int,
                    log: Callable[[str], None]) -> tuple[float, float | None]:
    """The decode step at ``batch``, its rows at the workload's mean context (:func:`decode_probe`), then
    at its spread of contexts (:func:`spread_probe`; an extra reading: None, and logged, if it fails)."""
    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    specs = generate_requests(wl, opts.num_requests, 1.0, opts.seed)
    n_in, n_out, _ = decode_probe(batch, specs, opts.budget_guess)
    lengths, spread_out = spread_probe(batch, specs, opts.budget_guess)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False) as client:
        model = model or (await _server_info(client, base_url)).get("id")
        step = await measure_decode_step(client, url, model, batch, n_in, n_out, opts.seed)
        try:
            spread: float | None = await measure_decode_step(client, url, model, batch, lengths, spread_out, opts.seed)
        except (RuntimeError, httpx.HTTPError) as e:
            log(f"the decode probe with the workload's contexts failed: {e}")
            spread = None
    return step, spread


ROW_FIELDS = ("config", "rate", "request_throughput_rps", "steady_throughput_rps", "bound_rps", "ttft_p50_ms", "tpot_p50_ms", "itl_p99_ms", "slo_attainment")


def rows_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rate of a saturation run (the ramp, then the 80 % run), in the results files' fields."""
    recs = [*run["ramp"], *([run["at_80"]] if run.get("at_80") else [])]
    return [{**{k: r.get(k) for k in ROW_FIELDS}, "config": run["config"], "at_80": r is run.get("at_80")} for r in recs]


def summarize(runs: Sequence[dict[str, Any]], device: str, command: str) -> dict[str, Any]:
    """The runs side by side with the acceptance ratios of issue 31: the first run is colocated, the
    first later one whose config is not ``colocated...`` (if any) a disaggregated one on the same GPU
    (other colocated variants are rows only)."""
    first = runs[0]
    checks: dict[str, Any] = {
        "colocated_saturation_over_bound": first["saturation_over_bound"],
        "tpot_p50_over_step_at_80": first.get("tpot_p50_over_step_at_80"),
        "itl_p99_over_tpot_p50_at_80": first.get("itl_p99_over_tpot_p50_at_80"),
    }
    disaggregated = next((r for r in runs[1:] if not str(r.get("config", "")).startswith("colocated")), None)
    if disaggregated is not None:
        checks["disaggregated_over_colocated"] = disaggregated["saturation_rps"] / first["saturation_rps"]
    limits = {"colocated_saturation_over_bound": (">=", 0.8), "disaggregated_over_colocated": (">=", 0.9),
              "tpot_p50_over_step_at_80": ("<=", 1.5), "itl_p99_over_tpot_p50_at_80": ("<=", 3.0)}
    holds = {k: (v is not None and (v >= limits[k][1] if limits[k][0] == ">=" else v <= limits[k][1])) for k, v in checks.items()}
    return {
        "command": command, "device": device,
        "summary": [{k: r.get(k) for k in ("config", "saturation_rps", "saturation_rate", "saturation_over_bound", "slo90_rate_rps",
                                           "batch_at_80", "decode_step_ms_at_80", "tpot_p50_over_step_at_80", "itl_p99_over_tpot_p50_at_80")}
                    | {"bound": r["bound"]} for r in runs],
        "acceptance": {k: {"value": v, "limit": " ".join(map(str, limits[k])), "holds": holds[k]} for k, v in checks.items()},
        "records": [row for r in runs for row in rows_of(r)],
        "runs": list(runs),
    }


def compare(ours: dict[str, Any], theirs: dict[str, Any], ours_half: dict[str, Any], theirs_half: dict[str, Any], device: str, command: str,
            others: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()) -> dict[str, Any]:
    """HAWK against another server (vLLM) on the same workload: saturation throughput, and the
    latencies of both at half the other server's saturation rate (``*_half``: ``hawk bench serving
    --json`` records at that rate). ``others``: more servers of the same run as (saturation run, half-rate
    record) pairs, e.g. HAWK disaggregated, laid beside them without an acceptance of their own."""
    def lat(rec: dict[str, Any]) -> dict[str, Any]:
        return {k: rec.get(k) for k in ("rate", "request_throughput_rps", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
                                        "itl_p99_ms", "slo_attainment")}

    ratio = ours["saturation_rps"] / theirs["saturation_rps"] if theirs["saturation_rps"] else None
    ttft = (ours_half.get("ttft_median_ms"), theirs_half.get("ttft_median_ms"))
    return {
        "command": command, "device": device,
        "saturation": {ours["config"]: ours["saturation_rps"], theirs["config"]: theirs["saturation_rps"]},
        "at_half_of_theirs": {ours["config"]: lat(ours_half), theirs["config"]: lat(theirs_half)},
        "acceptance": {
            "saturation_ours_over_theirs": {"value": ratio, "limit": ">= 1", "holds": ratio is not None and ratio >= 1},
            "ttft_p50_ours_over_theirs_at_half": {"value": ttft[0] / ttft[1] if None not in ttft else None, "limit": "<= 1",
                                                  "holds": None not in ttft and ttft[0] <= ttft[1]},
        },
        "others": [{"config": o["config"], "saturation_rps": o["saturation_rps"],
                    "over_theirs": o["saturation_rps"] / theirs["saturation_rps"] if theirs["saturation_rps"] else None,
                    "at_half_of_theirs": lat(h)} for o, h in others],
        "runs": [ours, theirs, *(o for o, _ in others)], "half_rate_runs": [ours_half, theirs_half, *(h for _, h in others)],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m hawk.bench.saturation summarize A.json [B.json] --out X.json``: saturation runs
    (``hawk bench serving --saturation --json``) side by side, with issue 31's ratios."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m hawk.bench.saturation", description=main.__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("runs", nargs="+", help="saturation JSON files, colocated first")
    s.add_argument("--device", default="", help="what ran them, in words")
    s.add_argument("--command", default="", help="the command that produced them")
    s.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="HAWK's saturation run against another server's, with both at half the other's saturation rate")
    c.add_argument("ours")
    c.add_argument("theirs")
    c.add_argument("ours_half", help="hawk bench serving --json at half their saturation rate (first record)")
    c.add_argument("theirs_half")
    c.add_argument("--also", nargs=2, action="append", default=[], metavar=("SAT", "HALF"),
                   help="another server of the same run: its saturation run and its record at the same half rate (repeatable)")
    c.add_argument("--device", default="")
    c.add_argument("--command", default="")
    c.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "compare":
        def first(path: str) -> dict[str, Any]:
            with open(path) as f:
                d = json.load(f)
            return d[0] if isinstance(d, list) else d.get("records", [d])[0] if "records" in d else d

        loaded = [first(path) for path in (a.ours, a.theirs, a.ours_half, a.theirs_half)]
        out = compare(*loaded, a.device, a.command, others=[(first(s), first(h)) for s, h in a.also])
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=float)
        for k, v in out["acceptance"].items():
            print(f"{k}: {v['value']} ({v['limit']}): {'holds' if v['holds'] else 'does not hold'}")
        return out
    runs = []
    for path in a.runs:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"skipping {path}: {e}")
    if not runs:
        p.error("no saturation run could be read")
    out = summarize(runs, a.device, a.command)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, default=float)
    for k, v in out["acceptance"].items():
        print(f"{k}: {v['value']} ({v['limit']}): {'holds' if v['holds'] else 'does not hold'}")
    return out


if __name__ == "__main__":
    main()
