"""The serving benchmark against a fake OpenAI-style SSE server with known timings.

The fake server speaks exactly what HAWK's router sends: its chunks are built with the router's
own ``ChunkMaker`` and ``sse`` and its request bodies are validated with the router's
``CompletionRequest``, so a change of wire format on either side fails here.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hawk.bench.serving import completion_body, prompt_ids, run_serving_bench
from hawk.serve.common import ThreadedServer
from hawk.serve.protocol import CompletionRequest, Usage
from hawk.serve.router import ChunkMaker, sse
from hawk.sim.report import plot_sweep, print_table
from hawk.sim.workload import LengthDist, RequestSpec, Workload

MODEL = "fake-model"


class FakeRouter:
    """Streams ``max_tokens`` tokens: the first after ``ttfts[k]`` (k = arrival order), then one per ``tpot``."""

    def __init__(self, ttfts: list[float], tpot: float, max_model_len: int = 4096):
        self.ttfts, self.tpot, self.max_model_len = ttfts, tpot, max_model_len
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            req = CompletionRequest(**body)  # the router's own validation
            with self.lock:
                k = len(self.bodies)
                self.bodies.append(body)
            ttft = self.ttfts[k % len(self.ttfts)]
            n = req.max_tokens
            if n is None or n > 1000:
                return JSONResponse({"error": {"message": "bad max_tokens"}}, status_code=400)
            chunks = ChunkMaker(False, f"cmpl-{k}", MODEL)

            async def stream():
                await asyncio.sleep(ttft)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.tpot)
                    if i < n - 1:
                        yield sse(chunks.delta(f"t{i} "))
                hawk = {"ttft_s": ttft, "tpot_s": self.tpot, "completion_tokens": n, "kv_transfer_s": 0.004, "kv_bytes": 1 << 20,
                        "transfer": "gn-hawk", "decode_device": "emulated blackhole-p150a NPU (memory on cpu)"}
                yield sse(chunks.delta(f"t{n - 1}", "length", hawk))
                if req.include_usage:
                    yield sse(chunks.usage(Usage.of(len(req.prompt), n), hawk))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        return app


def _workload(inp: int = 8, out: int = 5) -> Workload:
    return Workload("fixed", LengthDist(inp), LengthDist(out), slo_ttft_ms=1000, slo_tpot_ms=1000)


@pytest.fixture
def fake():
    def start(ttfts: list[float], tpot: float, **kw: Any) -> tuple[FakeRouter, str]:
        fr = FakeRouter(ttfts, tpot, **kw)
        srv = ThreadedServer(fr.app()).start()
        servers.append(srv)
        return fr, srv.url

    servers: list[ThreadedServer] = []
    yield start
    for s in servers:
        s.stop()


def test_ttft_tpot_and_slo_against_known_timings(fake):
    fr, url = fake([0.20], 0.05)
    (rec,) = run_serving_bench(url, [math.inf], _workload(8, 5), num_requests=4, seed=0, slo_ttft_ms=1000, slo_tpot_ms=1000, warmup_requests=0, per_request=True)
    assert rec["completed"] == 4 and rec["failed"] == 0
    assert rec["output_tokens"] == 20
    assert 190 <= rec["ttft_p50_ms"] <= 320  # 200 ms server delay + loopback HTTP
    assert 45 <= rec["tpot_p50_ms"] <= 75  # (last - first) / (n - 1) with n from usage
    assert rec["e2e_p50_ms"] == pytest.approx(rec["ttft_p50_ms"] + 4 * rec["tpot_p50_ms"], rel=0.1)
    assert rec["slo_attainment"] == 1.0
    assert rec["model"] == MODEL and rec["config"] == "gn-hawk" and "emulated" in rec["decode_device"]
    assert rec["server_ttft_p50_ms"] == pytest.approx(200.0) and rec["kv_transfer_p50_ms"] == pytest.approx(4.0)
    for r in rec["requests"]:
        assert r["extra"]["chunks"] == 5 and r["output_tokens"] == 5
    # what the router received: exact prompt length, fixed output length, ignore_eos, streaming with usage
    for b in fr.bodies:
        assert len(b["prompt"]) == 8 and b["max_tokens"] == 5 and b["ignore_eos"] is True
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["model"] == MODEL


def test_slo_attainment_counts_each_slo(fake):
    _, url = fake([0.05, 0.05, 0.40, 0.40], 0.03)
    wl = _workload(4, 4)
    (r,) = run_serving_bench(url, [math.inf], wl, 4, 0, slo_ttft_ms=250, slo_tpot_ms=1000, warmup_requests=0)
    assert r["slo_attainment"] == pytest.approx(0.5) and r["ttft_attainment"] == pytest.approx(0.5)
    (r,) = run_serving_bench(url, [math.inf], wl, 4, 0, slo_ttft_ms=10_000, slo_tpot_ms=5, warmup_requests=0)
    assert r["slo_attainment"] == 0.0 and r["tpot_attainment"] == 0.0 and r["completed"] == 4


def test_poisson_sweep_records_and_throughput(fake, tmp_path):
    _, url = fake([0.02], 0.01)
    t = time.monotonic()
    recs = run_serving_bench(url, [5.0, 20.0], _workload(6, 3), num_requests=10, seed=1, warmup_requests=1)
    assert [r["rate"] for r in recs] == [5.0, 20.0]
    for r in recs:
        assert r["completed"] == 10 and r["output_tokens"] == 30
        assert r["output_throughput_tok_s"] == pytest.approx(30 / r["duration_s"])
        assert r["goodput_tok_s"] == r["output_throughput_tok_s"]
    assert recs[0]["duration_s"] > recs[1]["duration_s"]  # same requests, 4x the rate
    assert time.monotonic() - t < 10
    print_table(recs)
    assert plot_sweep(recs, tmp_path / "fig.png").stat().st_size > 0


def _mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def test_http_and_in_band_errors_count_as_misses():
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        calls["n"] += 1
        if calls["n"] % 2:
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})
        body = sse({"error": {"message": "decode failed", "type": "server_error"}}) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    (r,) = run_serving_bench("http://fake", [math.inf], _workload(4, 4), 4, 0, warmup_requests=0, transport=_mock(handler))
    assert r["completed"] == 0 and r["failed"] == 4 and r["slo_attainment"] == 0.0
    assert any("HTTP 400" in e for e in r["errors"]) and any("decode failed" in e for e in r["errors"])
    assert r["ttft_p50_ms"] is None and r["output_throughput_tok_s"] is None


def test_requests_are_fitted_to_the_served_context():
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 32}]})
        import json as _json

        body = _json.loads(request.content)
        seen.append(body)
        ch = ChunkMaker(False, "x", "m")
        text = "".join(sse(ch.delta("a", "length" if i == body["max_tokens"] - 1 else None)) for i in range(body["max_tokens"]))
        return httpx.Response(200, text=text + "data: [DONE]\n\n")

    (r,) = run_serving_bench("http://fake", [math.inf], _workload(40, 8), 2, 0, warmup_requests=0, transport=_mock(handler))
    assert r["clipped_requests"] == 2 and r["completed"] == 2
    assert all(len(b["prompt"]) + b["max_tokens"] <= 32 for b in seen)
    assert r["output_tokens"] == 16  # no usage chunk: falls back to counting token chunks


def test_prompts_are_deterministic_and_in_range():
    s = RequestSpec(3, 0.0, 50, 5)
    a, b = prompt_ids(s, 0, (100, 200)), prompt_ids(s, 0, (100, 200))
    assert a == b and len(a) == 50 and all(100 <= t < 200 for t in a)
    assert prompt_ids(s, 1, (100, 200)) != a
    body = completion_body(s, a, None)
    assert "model" not in body and body["max_tokens"] == 5 and body["ignore_eos"] is True
