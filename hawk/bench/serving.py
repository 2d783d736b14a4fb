"""``hawk bench serving``: online-serving load against HAWK's OpenAI-compatible router (paper §5.3).

Requests arrive as a seeded Poisson process at each rate of a sweep; each is a streaming
``/v1/completions`` call whose prompt is a list of token ids (so its length is exact) and whose
output length is fixed with ``max_tokens`` + ``ignore_eos`` (a vLLM extension HAWK's router
accepts). The client measures, per request:

* TTFT — request sent → first chunk with non-empty text (the first streamed token);
* ITL  — the gaps between consecutive text chunks;
* E2EL — request sent → end of the stream (last chunk with text or the finish reason);
* TPOT — (E2EL − TTFT) / (n − 1), with n the server's ``usage.completion_tokens``;

as ``vllm bench serve`` does, and aggregates them (``hawk.sim.metrics``) into mean / median /
P90 / P99 of each, SLO attainment, request and output-token throughput and goodput per rate.
The router's own ``hawk`` timings (server-side TTFT/TPOT, KV transfer time and bytes, which
decode device) are kept beside the client's numbers.

Why token-id prompts: a text prompt's token count depends on the tokenizer; ids make the input
length the workload's, on any model. The ids are drawn from ``token_id_range`` (inside any
real vocabulary); their text is nonsense, which does not matter with ``ignore_eos``.

    python -m hawk.bench.serving_cli --url http://127.0.0.1:8000 --workload chatbot-tiny \
        --rates 0.5,1,2 --num-requests 20 --json out.json --plot out.png
    python -m hawk.bench.serving_cli --trace conversations.json --rates 1 --trace-tokenizer smollm2-135m

A trace (``--trace``, see ``hawk.sim.traces``) replaces the synthetic workload: its lengths, and for
Azure / Mooncake traces its arrival times (rescaled to each ``--rates`` value, or at its own rate
when ``--rates`` is not given, times ``--trace-rate-scale``). Prompts are still token ids of the
trace's lengths.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np

from hawk.sim.metrics import RequestResult, summarize
from hawk.sim.report import report
from hawk.sim.traces import TraceWorkload
from hawk.sim.workload import RequestSource, RequestSpec, Workload, generate_requests, get_workload


def prompt_ids(spec: RequestSpec, seed: int, token_id_range: tuple[int, int], rate: float = 0.0) -> list[int]:
    """The request's prompt: ``input_len`` token ids, fixed by (seed, rate, request index). The rate
    is in it so that a sweep or a ramp never sends a prompt twice: a server with a prefix cache (vLLM's
    is on by default) would otherwise prefill each repeated prompt for free at every later rate."""
    rng = np.random.default_rng([seed, 7, round(rate * 1000) if math.isfinite(rate) else 1 << 40, spec.index])
    lo, hi = token_id_range
    return rng.integers(lo, hi, spec.input_len).tolist()


def completion_body(
    spec: RequestSpec,
    ids: list[int],
    model: str | None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    continuous_usage: bool = False,
) -> dict[str, Any]:
    """The OpenAI request for one spec; ``ignore_eos`` pins the output length to ``max_tokens``;
    ``continuous_usage``: usage on every chunk (vLLM's extension, HAWK's too), to count tokens."""
    body: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True, **({"continuous_usage_stats": True} if continuous_usage else {})},
        "temperature": temperature,
        "ignore_eos": ignore_eos,
    }
    if model:
        body["model"] = model
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a chunk carries (completion ``text`` or chat ``delta.content``)."""
    out = []
    for c in chunk.get("choices") or []:
        out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def _chunk_finishes(chunk: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") for c in chunk.get("choices") or [])


class ChunkTimer:
    """Arrival times of one stream's chunks, turned into TTFT / ITL / E2EL inputs.

    Only chunks with text count as tokens arriving: chat's opening role-only chunk, a usage-only
    chunk and an empty finishing chunk carry none (a stream whose text all comes at the end then
    shows TTFT = E2EL, as it should). The finishing chunk still marks the end of the stream."""

    def __init__(self) -> None:
        self.text_times: list[float] = []
        self.marks: list[tuple[float, int]] = []  # (time, usage.completion_tokens) of chunks with choices and usage
        self.end: float | None = None

    def feed(self, chunk: dict[str, Any], now: float) -> None:
        usage = chunk.get("usage")
        if chunk.get("choices") and usage and usage.get("completion_tokens") is not None:
            self.marks.append((now, int(usage["completion_tokens"])))
        if chunk_text(chunk):
            self.text_times.append(now)
            self.end = now
        elif _chunk_finishes(chunk) and self.text_times:
            self.end = now

    @property
    def first(self) -> float | None:
        return self.text_times[0] if self.text_times else None

    @property
    def itl(self) -> list[float]:
        t = self.text_times
        return [b - a for a, b in zip(t, t[1:])]


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    spec: RequestSpec,
    clock: Callable[[], float],
) -> RequestResult:
    """Send one streaming request and time its chunks (``clock`` = seconds since the run began)."""
    res = RequestResult(spec.index, spec.input_len, spec.output_len, sent_s=clock())
    timer = ChunkTimer()
    usage_tokens: int | None = None
    hawk: dict[str, Any] = {}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = clock()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))
                    continue
                timer.feed(chunk, now)
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"].get("completion_tokens", 0))
                if chunk.get("hawk"):
                    hawk = chunk["hawk"]
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    chunks = len(timer.text_times)
    res.first_s, res.last_s, res.itl_s = timer.first, timer.end, timer.itl
    res.token_marks = timer.marks or None
    n = usage_tokens if usage_tokens is not None else hawk.get("completion_tokens")
    res.output_tokens = int(n) if n is not None else chunks
    res.ok = res.error is None and res.first_s is not None
    if res.error is None and res.first_s is None:
        res.error = "no text was streamed"
    if res.ok and res.output_tokens == 0:
        res.ok, res.error = False, "no tokens"
    res.extra = {"chunks": chunks, "hawk": hawk} if hawk else {"chunks": chunks}
    return res


async def run_rate(
    client: httpx.AsyncClient,
    url: str,
    specs: Sequence[RequestSpec],
    bodies: Sequence[dict[str, Any]],
    max_concurrency: int | None = None,
    time_source: Callable[[], float] | None = None,
) -> list[RequestResult]:
    """Fire each request at its arrival time (open loop: arrivals never wait for completions,
    unless ``max_concurrency`` caps requests in flight). ``time_source`` (seconds) defaults to the
    event loop's clock; tests give a scripted one so timings do not depend on the machine's load."""
    now = time_source or asyncio.get_running_loop().time
    t0 = now()

    def clock() -> float:
        return now() - t0

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(spec: RequestSpec, body: dict[str, Any]) -> RequestResult:
        if sem is None:
            return await stream_one(client, url, body, spec, clock)
        async with sem:
            return await stream_one(client, url, body, spec, clock)

    tasks = []
    for spec, body in zip(specs, bodies):
        delay = spec.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec, body)))
    return list(await asyncio.gather(*tasks))


async def _server_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """Model name and context length from ``/v1/models`` (best effort)."""
    try:
        r = await client.get(f"{base_url}/v1/models", timeout=10.0)
        data = r.json().get("data") or []
        return data[0] if data else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _fit(spec: RequestSpec, max_model_len: int | None) -> tuple[RequestSpec, bool]:
    """Shrink the prompt so prompt + output fits the served context (recorded, never silent)."""
    if not max_model_len or spec.input_len + spec.output_len <= max_model_len:
        return spec, False
    out = min(spec.output_len, max_model_len // 2)
    return RequestSpec(spec.index, spec.arrival_s, max(1, max_model_len - out), out), True


def _server_side(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Medians of the router's own ``hawk`` timings, and which devices served."""
    hs = [r.extra["hawk"] for r in results if r.ok and r.extra and r.extra.get("hawk")]

    def med(key: str) -> float | None:
        xs = [h[key] for h in hs if h.get(key) is not None]
        return float(np.median(xs)) * 1e3 if xs else None

    return {
        "server_ttft_p50_ms": med("ttft_s"),
        "server_tpot_p50_ms": med("tpot_s"),
        "kv_transfer_p50_ms": med("kv_transfer_s"),
        "prefill_p50_ms": med("prefill_s"),
        # where the rest of the server's TTFT went (hawk/serve/generation.py, Generation._hops)
        "prefill_queue_p50_ms": med("prefill_queue_s"),
        "prefill_handoff_p50_ms": med("prefill_handoff_s"),
        "router_before_prefill_p50_ms": med("router_before_prefill_s"),
        "prefill_hop_p50_ms": med("prefill_hop_s"),
        "decode_first_token_p50_ms": med("decode_first_token_s"),
        "decode_hop_p50_ms": med("decode_hop_s"),
        "kv_bytes_p50": (float(np.median([h["kv_bytes"] for h in hs if h.get("kv_bytes") is not None])) if any(h.get("kv_bytes") is not None for h in hs) else None),
        "transfer": next((h.get("transfer") for h in hs if h.get("transfer")), None),
        "decode_device": next((h.get("decode_device") for h in hs if h.get("decode_device")), None),
        # timing emulation (--npu-timing / --link-gbps): the decode instance's label says "[... emulated ...]"
        "timing_emulation": next((d.partition(" [")[2].rstrip("]") for h in hs if " [" in (d := h.get("decode_device") or "")), None),
        "kv_mode": next((h.get("kv_mode") for h in hs if h.get("kv_mode")), None),
    }


async def _bench(
    base_url: str,
    rates: Sequence[float],
    wl: Workload | RequestSource,
    num_requests: int,
    seed: int,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    model: str | None,
    config: str | None,
    max_concurrency: int | None,
    timeout_s: float,
    warmup_requests: int,
    token_id_range: tuple[int, int],
    ignore_eos: bool,
    temperature: float,
    cooldown_s: float,
    per_request: bool,
    transport: httpx.AsyncBaseTransport | None,
    progress: Callable[[dict[str, Any]], None] | None,
    time_source: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, transport=transport, trust_env=False) as client:
        info = await _server_info(client, base_url)
        model = model or info.get("id")
        max_len = info.get("max_model_len")
        records = []
        for w in range(warmup_requests):  # first requests pay one-off costs (allocation, caches)
            spec, _ = _fit(generate_requests(wl, 1, 1.0, seed + 1000 + w)[0], max_len)
            await stream_one(client, url, completion_body(spec, prompt_ids(spec, seed + 1000 + w, token_id_range), model, ignore_eos, temperature), spec, time.monotonic)
        for rate in rates:
            specs, clipped = [], 0
            for s in generate_requests(wl, num_requests, rate, seed):
                s2, c = _fit(s, max_len)
                specs.append(s2)
                clipped += c
            bodies = [completion_body(s, prompt_ids(s, seed, token_id_range, rate), model, ignore_eos, temperature) for s in specs]
            t_wall = time.time()
            results = await run_rate(client, url, specs, bodies, max_concurrency, time_source)
            rec: dict[str, Any] = {
                "simulated": False,
                "config": config,
                "workload": wl.name,
                "rate": rate,
                "seed": seed,
                "model": model,
                "base_url": base_url,
                "started_at": t_wall,
                "clipped_requests": clipped,
                "input_len_mean": float(np.mean([s.input_len for s in specs])),
                "output_len_mean": float(np.mean([s.output_len for s in specs])),
                **summarize(results, slo_ttft_ms, slo_tpot_ms),
                **_server_side(results),
            }
            rec["config"] = rec["config"] or rec.get("transfer") or "hawk"
            errors = sorted({r.error for r in results if r.error})
            rec["errors"] = errors[:5]
            if per_request:
                rec["requests"] = [r.to_dict() for r in results]
            records.append(rec)
            if progress is not None:
                progress(rec)
            if cooldown_s > 0:
                await asyncio.sleep(cooldown_s)
        return records


def run_serving_bench(
    base_url: str,
    rates: Sequence[float],
    workload: str | Workload | RequestSource = "chatbot-tiny",
    num_requests: int = 20,
    seed: int = 0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    *,
    model: str | None = None,
    config: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    warmup_requests: int = 1,
    token_id_range: tuple[int, int] = (1000, 10000),
    ignore_eos: bool = True,
    temperature: float = 0.0,
    cooldown_s: float = 0.0,
    per_request: bool = False,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    time_source: Callable[[], float] | None = None,
) -> list[dict[str, Any]]:
    """Run the sweep; one record per rate (see ``hawk.sim.metrics`` for the fields).

    SLOs default to the workload's (the paper's 2000/200 ms chatbot, 15000/200 ms summarization).
    ``config`` labels the records (default: the ``transfer`` the router reports, e.g. gn-hawk).
    ``transport`` lets tests run against an in-process server, ``time_source`` against a scripted clock."""
    wl = get_workload(workload)
    if not rates:
        raise ValueError("give at least one request rate")
    if any(not (r > 0) for r in rates):
        raise ValueError(f"request rates must be positive (inf = all at once), got {list(rates)}")
    return asyncio.run(_bench(
        base_url, list(rates), wl, num_requests, seed,
        wl.slo_ttft_ms if slo_ttft_ms is None else slo_ttft_ms, wl.slo_tpot_ms if slo_tpot_ms is None else slo_tpot_ms,
        model, config, max_concurrency, timeout_s, warmup_requests, token_id_range, ignore_eos, temperature,
        cooldown_s, per_request, transport, progress, time_source,
    ))


def run_serving_report(
    base_url: str,
    rates: Sequence[float],
    workload: str | Workload | RequestSource = "chatbot-tiny",
    *args: Any,
    input_scale: float = 1.0,
    output_scale: float = 1.0,
    json_path: str | None = None,
    plot_path: str | None = None,
    **bench: Any,
) -> list[dict[str, Any]]:
    """What ``hawk bench serving`` does: :func:`run_serving_bench` (its options pass through), then
    print the table and write JSON and the figure."""
    wl = get_workload(workload)
    if input_scale != 1.0 or output_scale != 1.0:
        wl = wl.scaled(input_scale, output_scale)
    bench.setdefault("progress", lambda r: print(f"rate {r['rate']:g}: {r['completed']}/{r['num_requests']} done, SLO attainment {r['slo_attainment']:.0%}", flush=True))
    records = run_serving_bench(base_url, rates, wl, *args, **bench)
    trace = getattr(wl, "trace", None)
    if trace is not None:  # say which trace, and how it was replayed
        extra = {**trace.summary(), "trace_rate_scale": getattr(wl, "rate_scale", 1.0)}
        records = [{**r, **extra} for r in records]
    report(records, json_path, plot_path)
    for rec in records:
        print(format_result(rec), flush=True)
    return records


def format_result(rec: dict[str, Any]) -> str:
    """One rate's result laid out like ``vllm bench serve`` prints it (client-side numbers)."""

    def num(x: Any) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def row(label: str, value: Any) -> str:
        return f"{label:<40}{value}"

    title = f" Serving Benchmark Result (rate {rec.get('rate')} req/s) "
    lines = [
        f"{title:=^60}",
        row("Successful requests:", rec.get("completed")),
        row("Failed requests:", rec.get("failed")),
        row("Benchmark duration (s):", num(rec.get("duration_s"))),
        row("Total generated tokens:", rec.get("output_tokens")),
        row("Request throughput (req/s):", num(rec.get("request_throughput_rps"))),
        row("Output token throughput (tok/s):", num(rec.get("output_throughput_tok_s"))),
        row("Total token throughput (tok/s):", num(rec.get("total_token_throughput_tok_s"))),
    ]
    sections = (
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2e", "E2EL", "End-to-end Latency"),
    )
    for key, short, heading in sections:
        lines.append(f"{' ' + heading + ' ':-^60}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(row(f"{label} {short} (ms):", num(rec.get(f"{key}_{stat}_ms"))))
    lines.append("=" * 60)
    return "\n".join(lines)


def trace_rates(asked: list[float] | None, wl: Any, num_requests: int) -> list[float]:
    """The sweep's rates: as asked (default 0.5, 1, 2), or a trace's (``TraceWorkload.rates``)."""
    if isinstance(wl, TraceWorkload):  # untimed traces (ShareGPT) sweep the default rates
        return wl.rates(asked or (None if wl.trace.timed else [0.5, 1.0, 2.0]), num_requests)
    return asked or [0.5, 1.0, 2.0]


def trace_token_counter(model: str) -> Callable[[str], int]:
    """Token counts from the served model's tokenizer (GGUF or a HF checkpoint directory)."""
    from pathlib import Path

    from hawk.engine.tokenizer import Tokenizer

    p = Path(model)
    if p.is_dir():
        tok = Tokenizer.from_hf_dir(p)
    elif p.suffix == ".gguf":
        tok = Tokenizer.from_gguf(p)
    else:
        from hawk.engine.loader import EMBEDDED, embedded_path

        if model not in EMBEDDED:
            raise ValueError(f"--trace-tokenizer {model!r}: give a .gguf file, a HF checkpoint dir or one of {', '.join(EMBEDDED)}")
        tok = Tokenizer.from_gguf(embedded_path(model))
    return lambda text: max(1, len(tok.encode(text)))


def _floats(s: str) -> list[float]:
    return [math.inf if x.strip() in ("inf", "max") else float(x) for x in s.split(",") if x.strip()]
