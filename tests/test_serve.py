"""The HTTP serving layer end to end, in one process: prefill, decode and colocated instances behind
routers (uvicorn in threads, real loopback sockets, NIXL between the instances).

SmolLM2 is loaded once for the module and shared by all instances. The tests cover the OpenAI API
(streamed and not), bad input (4xx with a clear message, then still serving), clients that leave
mid-stream or mid-prefill (everything they held is released on both instances), and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from dataclasses import replace

import httpx
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.bench.saturation import bound_batch_for, served_batch  # noqa: E402
from hawk.connector.algorithm1 import BREAKDOWN  # noqa: E402
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance  # noqa: E402
from hawk.serve.colocated_server import create_colocated_app  # noqa: E402
from hawk.serve.common import ThreadedServer  # noqa: E402
from hawk.serve.contract import CONTRACT_VERSION  # noqa: E402
from hawk.serve.decode_server import create_decode_app  # noqa: E402
from hawk.serve.prefill_server import create_prefill_app  # noqa: E402
from hawk.serve.router import RouterConfig, create_router_app  # noqa: E402
from hawk.transport.registry import available  # noqa: E402
from tests.polling import wait_until  # noqa: E402

KV_TOKENS = 2048
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class System:
    def __init__(self) -> None:
        transport = "nixl" if available("nixl") else "local"
        cfg = InstanceConfig(model="smollm2-135m", transport=transport, kv_tokens=KV_TOKENS, kv_ttl_s=60.0)
        self.prefill_inst = PrefillInstance(cfg)
        self.decode_inst = DecodeInstance(cfg, loaded=self.prefill_inst.loaded)
        self.coloc_inst = ColocatedInstance(replace(cfg, transfer="colocated"), loaded=self.prefill_inst.loaded)
        self.servers: list[ThreadedServer] = []
        self.prefill = self._start(create_prefill_app(self.prefill_inst))
        self.decode = self._start(create_decode_app(self.decode_inst))
        self.coloc = self._start(create_colocated_app(self.coloc_inst))
        self.router = self._start(create_router_app(RouterConfig([self.prefill.url], [self.decode.url], default_temperature=0.0)))
        self.coloc_router = self._start(create_router_app(RouterConfig([self.coloc.url], [self.coloc.url], default_temperature=0.0)))
        self.request_router = self._start(create_router_app(RouterConfig([self.prefill.url], [self.decode.url], default_temperature=0.0, decode_stream="request")))
        self.http = httpx.Client(base_url=self.router.url, timeout=60.0, trust_env=False)

    def _start(self, app) -> ThreadedServer:
        s = ThreadedServer(app).start()
        self.servers.append(s)
        return s

    def close(self) -> None:
        self.http.close()
        for s in reversed(self.servers):  # routers first; instance apps close their instances
            s.stop()


@pytest.fixture(scope="module")
def system():
    pytest.importorskip("gguf")
    from hawk.engine.loader import embedded_path

    try:
        embedded_path()
    except ValueError as e:  # the wheel carrying SmolLM2 is not installed
        pytest.skip(str(e))
    s = System()
    yield s
    s.close()


def sse_events(lines) -> list[dict]:
    """Parse an SSE stream: the JSON payloads, checking it ends with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    assert done, "stream did not end with data: [DONE]"
    return events


def accounting(url: str) -> dict:
    return httpx.get(f"{url}/internal/accounting", timeout=10, trust_env=False).json()


def held(system: System) -> dict:
    """Everything either instance still holds for requests (should all be zero when idle)."""
    p, d = accounting(system.prefill.url), accounting(system.decode.url)
    return {
        "prefill_staging": p["staging_reservations"],
        "prefill_kv_waiting": len(p["kv_waiting"]),
        "prefill_kv_in_flight": len(p["kv_in_flight"]),
        "prefill_gpu_blocks": p["gpu_blocks_used"],
        "decode_rx_reservations": d["rx_reservations"],
        "decode_kv_blocks": d["kv_blocks_used"],
        "decode_requests": d["engine_waiting"] + d["engine_transferring"] + d["engine_running"],
    }


def wait_released(system: System, timeout_s: float) -> float:
    """Poll until both instances hold nothing; returns how long it took (releases are async)."""
    return wait_until(lambda: not any(held(system).values()), timeout_s, lambda: f"still held: {held(system)}")


def complete(system: System, **body) -> dict:
    r = system.http.post("/v1/completions", json={"max_tokens": 16, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(client: httpx.Client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ============================================================================ the API


def test_health_models_and_info(system):
    r = system.http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = system.http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smollm2-135m"
    assert models["data"][0]["max_model_len"] == 8192
    batch = system.decode_inst.engine.max_batch  # what a saturation bench's bound may ask of one step
    assert models["data"][0]["max_num_seqs"] == batch and served_batch(system.router.url) == batch
    assert bound_batch_for(256, served_batch(system.router.url)) == batch
    assert system.http.get("/v1/models/smollm2-135m").status_code == 200
    info = httpx.get(f"{system.decode.url}/internal/info", trust_env=False).json()
    assert info["emulated_npu"] and "emulated" in info["device_label"]


def test_chat_completion_answers_and_reports_timings(system):
    out = chat(system.http)
    assert out["object"] == "chat.completion"
    msg = out["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]
    assert out["choices"][0]["finish_reason"] == "stop"
    h = out["hawk"]
    assert h["kv_bytes"] > 0 and h["kv_transfer_s"] > 0 and h["kv_mode"]
    steps = h["kv_breakdown_ms"]  # where the pull's time went, Algorithm 1's steps, as the decode timed them
    assert set(steps) <= set(BREAKDOWN) and steps["total_s"] == pytest.approx(h["kv_transfer_s"] * 1e3)
    assert {"connect_s", "send_s", "control_s", "release_s"} <= set(steps)  # a one-rank decode's own steps, not only the total
    inside = sum(v for k, v in steps.items() if k not in ("total_s", "release_s", "notify_s"))  # those two come after it
    assert inside <= steps["total_s"] * (1 + 1e-9)
    assert 0 < h["ttft_s"] < h["e2e_s"] and h["tpot_s"] > 0
    # the server's TTFT, piece by piece: the router's own work, the prefill call (its engine's queue,
    # forward and hand-off, plus the hop), the decode call (admission + KV + first emission, plus the hop)
    assert h["decode_first_token_s"] >= h["kv_transfer_s"] and h["prefill_handoff_s"] >= 0
    assert h["prefill_hop_s"] >= 0 and h["decode_hop_s"] >= 0 and h["router_before_prefill_s"] >= 0
    pieces = h["router_before_prefill_s"] + h["prefill_call_s"] + h["decode_call_s"]
    assert pieces <= h["ttft_s"] < pieces + 0.2  # only the router's own steps between the calls are not in a piece
    assert "emulated" in h["decode_device"] and h["transfer"] == "gn-hawk"
    u = out["usage"]
    assert u["completion_tokens"] == h["completion_tokens"] and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    wait_released(system, 5)


def test_streamed_completion_matches_unstreamed(system):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    plain = complete(system, **body)
    with system.http.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == plain["choices"][0]["text"] and text.strip()
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length" and finish[0]["hawk"]["kv_bytes"] > 0
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_continuous_usage_counts_every_token_behind_each_chunk(system):
    """vLLM's continuous_usage_stats: each chunk's usage counts the tokens generated up to it, so a
    client counts tokens even where one chunk carries several; the last one equals the final usage."""
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with system.http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == list(range(1, 13))  # a chunk per token, text or not
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    with system.http.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        assert not any(e.get("usage") for e in sse_events(r.iter_lines()) if e["choices"])


def test_streamed_chat(system):
    with system.http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert "Paris" in text
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "stop" and last["hawk"]["ttft_s"] > 0


def test_disaggregated_equals_colocated_over_http(system):
    """Greedy text from gn-hawk (KV over NIXL into the emulated NPU) equals the colocated oracle."""
    coloc = httpx.Client(base_url=system.coloc_router.url, timeout=60, trust_env=False)
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        a = complete(system, **body)
        b = coloc.post("/v1/completions", json=body).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"], prompt
        assert b["hawk"]["kv_mode"] == "colocated"
    out = chat(coloc)
    assert "Paris" in out["choices"][0]["message"]["content"]
    coloc.close()
    assert accounting(system.coloc.url)["kv_blocks_used"] == 0


def test_stop_strings_cut_the_text_and_free_the_request(system):
    out = chat(system.http, stop=[" Paris"], temperature=0)
    text = out["choices"][0]["message"]["content"]
    assert "Paris" not in text and text.startswith("The capital")
    assert out["choices"][0]["finish_reason"] == "stop"
    with system.http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "stop": "France", "stream": True}) as r:
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert "France" not in text and events[-1]["choices"][0]["finish_reason"] == "stop"
    wait_released(system, 5)


def test_concurrent_requests(system):
    results: list[dict] = []

    def one(i: int) -> None:
        with httpx.Client(base_url=system.router.url, timeout=60, trust_env=False) as c:
            results.append(c.post("/v1/completions", json={"prompt": f"{i} + {i} =", "max_tokens": 8, "ignore_eos": True}).json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and all(r["usage"]["completion_tokens"] == 8 for r in results)
    # round-robin over one instance of each still; every request got its own KV transfer
    assert all(r["hawk"]["kv_bytes"] > 0 for r in results)
    wait_released(system, 5)


# ============================================================================ bad input


def _error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    for n in needles:
        assert n in err["message"], err["message"]
    return err


def test_invalid_json(system):
    r = system.http.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ', headers={"content-type": "application/json"})
    _error(r, 400, "Invalid JSON")
    r = system.http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    _error(r, 400, "JSON object")


def test_missing_fields(system):
    _error(system.http.post("/v1/completions", json={"max_tokens": 5}), 400, "missing required field 'prompt'")
    _error(system.http.post("/v1/chat/completions", json={"model": "smollm2-135m"}), 400, "missing required field 'messages'")
    _error(system.http.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}), 400, "role")


@pytest.mark.parametrize("max_tokens, needle", [(0, "max_tokens"), (-3, "max_tokens"), (10**9, "larger than the model's context length"), (3000, "KV cache")])
def test_bad_max_tokens(system, max_tokens, needle):
    _error(system.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens}), 400, needle)


def test_prompt_longer_than_the_context(system):
    err = _error(system.http.post("/v1/completions", json={"prompt": [100] * 9000, "max_tokens": 4}), 400, "maximum context length")
    assert err["code"] == "context_length_exceeded"
    # longer than this deployment's prefill cache, though within the model's 8192
    err = _error(system.http.post("/v1/completions", json={"prompt": [100] * (KV_TOKENS + 10), "max_tokens": 4}), 400, "your prompt has")
    # and prompt + max_tokens over the context, with the numbers spelled out
    _error(system.http.post("/v1/completions", json={"prompt": [100] * 2000, "max_tokens": 7000}), 400, "2000 in the prompt")


def test_other_bad_requests(system):
    err = _error(system.http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404, "gpt-17")
    assert err["code"] == "model_not_found"
    _error(system.http.get("/v1/models/gpt-17"), 404)
    _error(system.http.post("/v1/completions", json={"prompt": "hi", "n": 3}), 400, "n=3")
    _error(system.http.post("/v1/completions", json={"prompt": "hi", "temperature": 5}), 400, "temperature")
    _error(system.http.post("/v1/completions", json={"prompt": [1, 2, 10**7]}), 400, "outside the vocabulary")
    _error(system.http.post("/v1/completions", json={"prompt": ""}), 400, "prompt is empty")
    _error(system.http.get("/v1/completions"), 405)
    _error(system.http.post("/v1/nothing", json={}), 404, "no route")
    # the instances' own endpoints validate too
    _error(httpx.post(f"{system.prefill.url}/internal/prefill", json={"version": CONTRACT_VERSION, "request_id": "x", "prompt_ids": []}, trust_env=False), 400)
    _error(httpx.post(f"{system.prefill.url}/internal/prefill", json={"version": 99, "request_id": "x", "prompt_ids": [1]}, trust_env=False), 400, "contract version 99")
    _error(httpx.post(f"{system.decode.url}/internal/decode", json={"version": CONTRACT_VERSION, "request_id": "x", "prompt_len": 3, "first_token": 1, "kv": {"address": "tcp://127.0.0.1:1", "request_id": "x"}, "params": {"max_tokens": 100000}}, trust_env=False), 400, "exceeds")


def test_still_serving_after_bad_input(system):
    assert "Paris" in chat(system.http)["choices"][0]["message"]["content"]
    wait_released(system, 5)


# ============================================================================ clients that leave


def test_disconnect_mid_stream_frees_everything(system):
    body = {"prompt": "Count to a thousand: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    before = accounting(system.decode.url)["aborted_on_disconnect"]
    with httpx.Client(base_url=system.router.url, timeout=60, trust_env=False) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines: list[str] = []
            stream = r.iter_lines()
            for line in stream:
                lines += [line] if line.startswith("data: ") else []
                if len(lines) >= 3:
                    break
            # generating; it would run for ~400 tokens (the next line says why if the request ended early)
            if held(system)["decode_requests"] != 1:
                acct = {k: v for k, v in accounting(system.decode.url).items() if k.startswith(("engine_", "abort"))}
                pytest.fail(f"the decode no longer runs the request: {acct}; the stream went on with {next(stream, None)!r}")
        # leaving the block closed the response mid-stream, which drops the connection
    wait_released(system, 30)  # the count below says the decode aborted it rather than let it finish
    assert accounting(system.decode.url)["aborted_on_disconnect"] == before + 1
    assert "Paris" in chat(system.http)["choices"][0]["message"]["content"]


def test_disconnect_during_prefill_discards_the_kv(system):
    """A client gone while its (long) prompt is prefilled: the prefill's KV is dropped when the
    batch ends, not 60 s later when its TTL expires, and nothing reaches the decode side."""
    prompt = [1000 + (i % 5000) for i in range(2000)]  # a few seconds of prefill on 2 cores
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "stream": True}).encode()
    before = accounting(system.prefill.url)
    host, port = system.router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:  # closed once its prompt is in the batch
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: hawk\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: accounting(system.prefill.url)["engine_prefilling"] == 1, 120, "the prompt never reached the batch")
    # the prefill's own pace sets when its batch ends (minutes on a starved 2-core box, seconds here);
    # the KV must be gone soon after that, far inside its 60-s TTL
    prefill_s = wait_until(lambda: not any(accounting(system.prefill.url)[k] for k in ("engine_waiting", "engine_prefilling")), 240,
                           "the prefill engine still busy")
    assert wait_released(system, 10) < 10, f"prefill idle after {prefill_s:.1f} s"
    after = accounting(system.prefill.url)
    # the router's abort arrived mid-batch and the KV was dropped as soon as the batch ended (or, if it
    # came in the moment between the batch's planning and its forward, the prompt was cancelled)
    pending = after["aborts_pending"] - before["aborts_pending"]
    assert pending == after["aborts_discarded_after_prefill"] - before["aborts_discarded_after_prefill"]
    assert pending + after["aborts_cancelled"] - before["aborts_cancelled"] == 1, (before, after)


def test_an_abort_that_overtakes_its_prefill_refuses_it(system):
    """The router's prefill call and its abort travel on different connections, so on a busy
    prefill the abort can come first: it is remembered, and the prefill arriving after it is
    refused (499) instead of leaving KV nobody pulls until its TTL."""
    url, rid = system.prefill.url, "overtaken-by-its-abort"
    before = accounting(url)
    r = httpx.post(f"{url}/internal/abort", json={"version": CONTRACT_VERSION, "request_id": rid}, trust_env=False)
    assert r.json()["result"] == "unknown"
    prefill = {"version": CONTRACT_VERSION, "request_id": rid, "prompt_ids": [1, 2, 3]}
    _error(httpx.post(f"{url}/internal/prefill", json=prefill, trust_env=False), 499, "aborted before its prefill")
    after = accounting(url)
    assert after["aborts_before_prefill"] == before["aborts_before_prefill"] + 1
    assert after["engine_waiting"] == 0 and after["engine_prefilling"] == 0 and not any(held(system).values())
    # remembered once: the id may be used again
    r = httpx.post(f"{url}/internal/prefill", json=prefill, trust_env=False)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/internal/abort", json={"version": CONTRACT_VERSION, "request_id": rid}, trust_env=False).json()["result"] == "discarded"


def test_non_streaming_client_timeout_frees_everything(system):
    body = {"prompt": "Write a long story:", "max_tokens": 400, "ignore_eos": True}
    before = accounting(system.decode.url)["aborted_on_disconnect"]
    with httpx.Client(base_url=system.router.url, timeout=httpx.Timeout(60, read=1.5), trust_env=False) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_released(system, 30)  # aborted (the count below), not run to its 400 tokens
    assert accounting(system.decode.url)["aborted_on_disconnect"] == before + 1
    assert complete(system, prompt="Hello", max_tokens=4)["usage"]["completion_tokens"] == 4


def test_a_stop_string_is_a_normal_finish_not_a_client_abort(system):
    """A completion that ends on a stop string while the decode still generates is stopped by the
    router: finish_reason "stop", everything released, and not counted as a client's disconnect
    (``aborted_on_disconnect``, ``hawk_decode_aborted_on_disconnect_total``)."""
    prompt = "Count to a thousand: 1, 2, 3,"
    free = complete(system, prompt=prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = free[len(free) // 2:][:3]
    assert stop.strip(), free
    before = accounting(system.decode.url)["aborted_on_disconnect"]
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stop": [stop], "stream": stream}
        if stream:
            with system.http.stream("POST", "/v1/completions", json=body) as r:
                events = sse_events(r.iter_lines())
            text, reason = "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]
        else:
            choice = complete(system, **body)["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert reason == "stop" and text == free[: free.index(stop)], (text, free, stop)
        wait_released(system, 10)
    assert accounting(system.decode.url)["aborted_on_disconnect"] == before
    inst = httpx.get(f"{system.decode.url}/metrics", trust_env=False).text
    assert f"hawk_decode_aborted_on_disconnect_total {float(before)}" in inst


# ============================================================================ the two decode streams


def test_a_shared_decode_stream_carries_each_request_its_own_tokens(system):
    """The default router reads every request's tokens from one stream per decode (``decode_stream="shared"``):
    the same greedy text as a router reading a stream per request, streamed or not, and concurrent
    requests' lines never cross."""
    prompts = [f"{i} + {i} =" for i in range(6)] + ["The capital of France is"]
    with httpx.Client(base_url=system.request_router.url, timeout=60, trust_env=False) as c:
        want = {p: c.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "ignore_eos": True}).json()["choices"][0]["text"] for p in prompts}
    got: dict[str, str] = {}

    def one(p: str) -> None:
        with httpx.Client(base_url=system.router.url, timeout=60, trust_env=False) as c:
            got[p] = c.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "ignore_eos": True}).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want
    with system.http.stream("POST", "/v1/completions", json={"prompt": prompts[-1], "max_tokens": 10, "ignore_eos": True, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == want[prompts[-1]]
    assert events[-1]["hawk"]["kv_bytes"] > 0
    wait_released(system, 5)


def test_a_request_stream_whose_client_leaves_or_stops_is_released(system):
    """A stream per request (``decode_stream="request"``): the client gone closes it (counted as a
    disconnect), a stop string ends it without counting; both free everything."""
    before = accounting(system.decode.url)["aborted_on_disconnect"]
    body = {"prompt": "Write a long story:", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=system.request_router.url, timeout=httpx.Timeout(60, read=1.5), trust_env=False) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    wait_released(system, 10)
    assert accounting(system.decode.url)["aborted_on_disconnect"] == before + 1
    prompt = "Count to a thousand: 1, 2, 3,"
    free = complete(system, prompt=prompt, max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = free[len(free) // 2:][:3]
    with httpx.Client(base_url=system.request_router.url, timeout=60, trust_env=False) as c:
        choice = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "stop": [stop]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == free[: free.index(stop)]
    wait_released(system, 10)
    assert accounting(system.decode.url)["aborted_on_disconnect"] == before + 1


def _prefilled(system: System, rid: str, prompt_ids: list[int]) -> dict:
    """Prefill one prompt on the prefill instance directly: what a DecodeRequest needs (pull)."""
    r = httpx.post(f"{system.prefill.url}/internal/prefill", json={"version": CONTRACT_VERSION, "request_id": rid, "prompt_ids": prompt_ids}, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    pre = r.json()
    return {"version": CONTRACT_VERSION, "request_id": rid, "prompt_len": pre["num_prompt_tokens"], "first_token": pre["first_token"],
            "params": {"max_tokens": 900, "ignore_eos": True}, "kv": pre["kv"]}


def test_closing_a_shared_stream_releases_its_requests(system):
    """The decode side of a shared stream: each line names its request; a DecodeRequest naming a stream
    that is not open is refused (400) and a second stream of the same name too; closing the stream (its
    router gone) ends the requests still running on it and frees everything (how many were still running
    is the box's pace: tests/test_decode_stream.py counts the aborts with the engine held)."""
    url = system.decode.url
    before = accounting(url)["aborted_on_disconnect"]
    req = _prefilled(system, "shared-close-1", list(range(100, 140)))
    _error(httpx.post(f"{url}/internal/decode", json={**req, "subscriber": "nobody"}, trust_env=False), 400, "no decode event stream named 'nobody'")
    with httpx.Client(timeout=httpx.Timeout(60, read=10), trust_env=False) as c:
        with c.stream("GET", f"{url}/internal/decode_events", params={"subscriber": "test-sub"}) as events:
            assert events.status_code == 200
            _error(c.get(f"{url}/internal/decode_events", params={"subscriber": "test-sub"}), 400, "already open")
            for i in (1, 2):
                body = req if i == 1 else _prefilled(system, "shared-close-2", list(range(200, 230)))
                r = c.post(f"{url}/internal/decode", json={**body, "subscriber": "test-sub"})
                assert r.status_code == 200 and r.json()["request_id"] == body["request_id"], r.text
            seen: dict[str, int] = {}
            for line in events.iter_lines():
                if line:
                    ev = json.loads(line)
                    assert ev["version"] == CONTRACT_VERSION and "finish_reason" not in ev, ev
                    seen[ev["request_id"]] = seen.get(ev["request_id"], 0) + 1
                if len(seen) == 2 and min(seen.values()) >= 3:
                    break
        # leaving the block closed the stream, the requests generating (unless they ran ahead of this reader)
    wait_released(system, 10)
    assert before <= accounting(url)["aborted_on_disconnect"] <= before + 2


def test_a_string_where_a_number_belongs_is_a_400(system):
    """OpenAI's types are strict, and so are HAWK's: "0.5" is not a temperature."""
    r = system.http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": "0.5"})
    assert r.status_code == 400, r.text
    assert "temperature" in r.json()["error"]["message"]
    assert chat(system.http, temperature=0.5, max_tokens=2)["usage"]["completion_tokens"] == 2


# ============================================================================ metrics


def test_metrics(system):
    system.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    complete(system, prompt="Hi", max_tokens=2)
    text = system.http.get("/metrics").text
    for needle in [
        'hawk_http_requests_total{endpoint="/v1/completions",status="200"}',
        'hawk_http_requests_total{endpoint="/v1/completions",status="400"}',
        "hawk_time_to_first_token_seconds_bucket",
        "hawk_time_per_output_token_seconds_count",
        "hawk_kv_transfer_bytes_sum",
        "hawk_kv_transfer_seconds_count",
        'hawk_request_finish_total{reason="length"}',
        f'hawk_instance_up{{instance="{system.prefill.url}",role="prefill"}} 1.0',
        f'hawk_decode_kv_blocks_total{{instance="{system.decode.url}"}}',
        f'hawk_prefill_staging_bytes{{instance="{system.prefill.url}"}} 0.0',
        'hawk_decode_npu_channel_bytes{channel="0"',
    ]:
        assert needle in text, needle
    inst = httpx.get(f"{system.decode.url}/metrics", trust_env=False).text
    assert "hawk_decode_rx_reservations 0.0" in inst and "hawk_decode_npu_channel_bytes" in inst
    assert "hawk_decode_aborted_on_disconnect_total " in inst
    # the decode's steps by kind (a CPU decode does not overlap them)
    assert "hawk_decode_engine_steps_overlapped 0.0" in inst
    assert float(re.search(r"^hawk_decode_engine_steps_synchronous (\S+)$", inst, re.M).group(1)) >= 1
    # and where its step loop's time went (hawk/engine/loop_clock.py)
    busy = float(re.search(r"^hawk_decode_engine_loop_busy_s (\S+)$", inst, re.M).group(1))
    assert busy > 0 and float(re.search(r"^hawk_decode_engine_loop_blocked_s (\S+)$", inst, re.M).group(1)) <= busy


# ============================================================================ warm-up


def _decode_steps(system: System) -> float:
    inst = httpx.get(f"{system.decode.url}/metrics", trust_env=False).text
    return float(re.search(r"^hawk_decode_engine_steps_synchronous (\S+)$", inst, re.M).group(1))


def test_warmup_runs_one_request_through_the_pair_before_ready(system):
    before = _decode_steps(system)
    with ThreadedServer(create_router_app(RouterConfig([system.prefill.url], [system.decode.url], warmup=True))) as r:
        assert _decode_steps(system) > before  # its KV reached the decode, which generated
        wait_released(system, 10.0)  # and gave back everything it held
        text = httpx.get(f"{r.url}/metrics", trust_env=False).text
        assert "hawk_request_finish_total{" not in text  # not a client's request: not in the router's figures
        assert "hawk_time_to_first_token_seconds_count 0.0" in text
        out = httpx.post(f"{r.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}, trust_env=False, timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2


def test_a_failed_warmup_stops_the_start(system, monkeypatch):
    from hawk.serve import router as router_mod

    async def fail(self) -> None:
        raise RuntimeError("prefill refused")

    monkeypatch.setattr(router_mod.Generation, "start", fail)
    r = router_mod.Router(RouterConfig([system.prefill.url], [system.decode.url], warmup=True), None)
    with pytest.raises(RuntimeError, match=r"warm-up request 1 \(.* -> .*\) failed after [0-9.]+ s: prefill refused"):
        asyncio.run(r.startup())
    assert r.client is not None and r.client.is_closed  # the failed start closed what it opened
