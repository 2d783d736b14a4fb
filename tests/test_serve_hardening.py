"""The serving layer under hostile or broken conditions, in one process on loopback sockets:
authentication (router API key, cluster secret on internal routes and on the KV control channel),
request-size limits, truthful health when an engine thread dies, and a sweep of bad input that
must each get a clear 4xx while the server keeps serving.

The model is the random-weight ``tiny`` preset (byte-level tokenizer), so everything starts in
seconds on a CPU.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import httpx
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.connector.control import ControlClient, ControlServer  # noqa: E402
from hawk.connector.messages import Ack, Done, Error  # noqa: E402
from hawk.engine.instances import DecodeInstance, InstanceConfig, PrefillInstance  # noqa: E402
from hawk.engine.loader import load_model  # noqa: E402
from hawk.serve.common import ThreadedServer  # noqa: E402
from hawk.serve.contract import CONTRACT_VERSION  # noqa: E402
from hawk.serve.decode_server import create_decode_app  # noqa: E402
from hawk.serve.prefill_server import create_prefill_app  # noqa: E402
from hawk.serve.router import RouterConfig, create_router_app  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

API_KEY = "sk-test-key"
SECRET = "cluster-secret-for-tests"
BODY_LIMIT = 256 * 1024
KV_TOKENS = 1024
GOOD = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}


class TinySystem:
    """A prefill and a decode instance of the tiny preset behind a router, all authenticated."""

    def __init__(self, api_key: str | None = API_KEY, secret: str | None = SECRET, health_interval_s: float = 1.0):
        transport = "nixl" if available("nixl") else "local"
        cfg = InstanceConfig(model="tiny", transport=transport, kv_tokens=KV_TOKENS, staging_mb=4, rx_mb=4, kv_ttl_s=60.0)
        loaded = load_model("tiny")
        self.prefill_inst = PrefillInstance(cfg, loaded=loaded)
        self.decode_inst = DecodeInstance(cfg, loaded=loaded)
        self.prefill = ThreadedServer(create_prefill_app(self.prefill_inst, cluster_secret=secret)).start()
        self.decode = ThreadedServer(create_decode_app(self.decode_inst, cluster_secret=secret)).start()
        rcfg = RouterConfig(
            [self.prefill.url], [self.decode.url], api_key=api_key, cluster_secret=secret,
            max_body_bytes=BODY_LIMIT, health_interval_s=health_interval_s,
        )
        self.router_app = create_router_app(rcfg)
        self.router = ThreadedServer(self.router_app).start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.router.url, timeout=60.0, trust_env=False, headers=headers)

    def close(self) -> None:
        self.http.close()
        for s in (self.router, self.decode, self.prefill):
            s.stop()


@pytest.fixture(scope="module")
def tiny():
    s = TinySystem()
    yield s
    s.close()


def _error(r: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"] and err["type"]
    for n in needles:
        assert n.lower() in err["message"].lower(), err["message"]
    return err


def _internal(url: str, path: str, body: dict | None = None, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if body is None:
        return httpx.get(f"{url}{path}", headers=headers, trust_env=False, timeout=30)
    return httpx.post(f"{url}{path}", json=body, headers=headers, trust_env=False, timeout=30)


# ============================================================================ authentication


def test_router_wants_the_api_key(tiny):
    bare = httpx.Client(base_url=tiny.router.url, trust_env=False, timeout=30)
    try:
        _error(bare.post("/v1/completions", json=GOOD), 401, "missing API key")
        _error(bare.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer nope"}), 401, "wrong API key")
        _error(bare.post("/v1/completions", json=GOOD, headers={"Authorization": f"Basic {API_KEY}"}), 401)
        _error(bare.get("/v1/models"), 401)
        assert bare.get("/health").status_code == 200  # probes need no key
    finally:
        bare.close()
    r = tiny.http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_api_key_from_the_environment(monkeypatch):
    """HAWK_API_KEY works like --api-key (as VLLM_API_KEY does for vLLM)."""
    from fastapi.testclient import TestClient

    monkeypatch.setenv("HAWK_API_KEY", "from-env")
    app = create_router_app(RouterConfig(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]))
    c = TestClient(app)  # outside ``with``: no lifespan, so no instances are needed to be refused
    assert c.get("/v1/models").status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_internal_endpoints_want_the_cluster_secret_and_change_nothing(tiny):
    before = _internal(tiny.prefill.url, "/internal/accounting", token=SECRET).json()
    prefill = {"version": CONTRACT_VERSION, "request_id": "intruder", "prompt_ids": [1, 2, 3], "params": {"max_tokens": 2}}
    decode = {"version": CONTRACT_VERSION, "request_id": "intruder", "prompt_len": 3, "first_token": 1, "params": {}, "kv": {"address": tiny.prefill_inst.kv_address, "request_id": "intruder"}}
    for token in (None, "wrong-secret"):
        _error(_internal(tiny.prefill.url, "/internal/prefill", prefill, token), 401, "cluster secret")
        _error(_internal(tiny.prefill.url, "/internal/abort", {"request_id": "x"}, token), 401)
        _error(_internal(tiny.decode.url, "/internal/decode", decode, token), 401)
        _error(_internal(tiny.decode.url, "/internal/decode_abort", {"request_id": "x"}, token), 401)
        _error(_internal(tiny.prefill.url, "/internal/accounting", token=token), 401)
        _error(_internal(tiny.decode.url, "/internal/info", token=token), 401)
    after = _internal(tiny.prefill.url, "/internal/accounting", token=SECRET).json()
    assert after == before  # nothing was prefilled, staged or aborted
    assert _internal(tiny.decode.url, "/health").status_code == 200
    r = _internal(tiny.prefill.url, "/internal/prefill", {**prefill, "request_id": "insider"}, SECRET)
    assert r.status_code == 200, r.text
    assert _internal(tiny.prefill.url, "/internal/abort", {"version": CONTRACT_VERSION, "request_id": "insider"}, SECRET).json()["result"] == "discarded"


def test_control_channel_refuses_unauthenticated_messages():
    seen: list[Any] = []

    def handler(msg: Any, peer: bytes) -> Any:
        seen.append(msg)
        return Ack(msg.request_id)

    server = ControlServer(handler, secret=b"right")
    clients = [ControlClient(server.address, secret=None), ControlClient(server.address, secret=b"wrong")]
    try:
        for c in clients:
            reply = c.call(Done("r1", True), timeout_s=10)
            assert isinstance(reply, Error) and "rejected" in reply.message and "secret" in reply.message, reply
        assert seen == []  # the handler never ran: nothing changed
        good = ControlClient(server.address, secret=b"right")
        clients.append(good)
        assert good.call(Done("r2", True), timeout_s=10) == Ack("r2")
        assert [m.request_id for m in seen] == ["r2"]
    finally:
        for c in clients:
            c.close()
        server.close()


def test_control_channel_takes_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("HAWK_CLUSTER_SECRET", "env-secret")
    server = ControlServer(lambda m, p: Ack(m.request_id))
    good, bad = ControlClient(server.address), ControlClient(server.address, secret=b"other")
    try:
        assert good.call(Done("a", True), timeout_s=10) == Ack("a")
        assert isinstance(bad.call(Done("b", True), timeout_s=10), Error)
    finally:
        good.close()
        bad.close()
        server.close()


# ============================================================================ request size


def test_body_over_the_limit_is_a_413(tiny):
    big = "x" * (BODY_LIMIT + 10)
    _error(tiny.http.post("/v1/completions", json={"prompt": big}), 413, "too large", str(BODY_LIMIT))

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(BODY_LIMIT // 4096 + 4):
            yield b" " * 4096

    _error(tiny.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413, "too large")
    assert tiny.http.post("/v1/completions", json=GOOD).status_code == 200


def test_overlong_text_is_refused_without_tokenizing(tiny, monkeypatch):
    from hawk.serve.router import MAX_CHARS_PER_TOKEN

    router = tiny.router_app.state.router
    calls = []
    real = router.tokenizer.encode
    monkeypatch.setattr(router.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    n = router.pool.max_prompt_tokens * MAX_CHARS_PER_TOKEN + 1
    err = _error(tiny.http.post("/v1/completions", json={"prompt": "a" * n}), 400, f"{n} characters")
    assert err["code"] == "context_length_exceeded"
    _error(tiny.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * n}]}), 400, "characters")
    assert calls == []


def test_health_stays_fast_while_a_prompt_is_tokenized(tiny, monkeypatch):
    router = tiny.router_app.state.router
    real = router.tokenizer.encode

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(3.0)  # a long prompt's tokenizing: must not hold the event loop
        return real(*a, **k)

    monkeypatch.setattr(router.tokenizer, "encode", slow)
    t = threading.Thread(target=lambda: tiny.http.post("/v1/completions", json=GOOD))
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    assert tiny.http.get("/health").status_code == 200
    assert time.monotonic() - t0 < 1.5
    t.join()


# ============================================================================ bad input sweep

LONG_IDS = [65] * (KV_TOKENS + 5)

# (name, method, path, json body or raw bytes, status, a word the message must hold)
BAD_INPUT = [
    ("invalid JSON", "POST", "/v1/completions", b'{"prompt": "x",', 400, "invalid json"),
    ("non-object body", "POST", "/v1/completions", b"[1, 2]", 400, "json object"),
    ("empty body", "POST", "/v1/completions", b"", 400, "body"),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("prompt of wrong type", "POST", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("token id outside vocab", "POST", "/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "vocabulary"),
    ("negative token id", "POST", "/v1/completions", {"prompt": [1, -5]}, 400, "vocabulary"),
    ("max_tokens zero", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "context length"),
    ("max_tokens a string", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt over the context", "POST", "/v1/completions", {"prompt": LONG_IDS, "max_tokens": 2}, 400, "context length"),
    ("temperature too high", "POST", "/v1/completions", {"prompt": "hi", "temperature": 9}, 400, "temperature"),
    ("top_p zero", "POST", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("n > 1", "POST", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n=2"),
    ("seed beyond 64 bits", "POST", "/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("lone surrogate", "POST", "/v1/completions", b'{"prompt": "\\ud800"}', 400, "surrogate"),
    ("too many stops", "POST", "/v1/completions", {"prompt": "hi", "stop": ["s"] * 20}, 400, "stop"),
    ("unsupported logprobs", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "gpt-17"),
    ("unknown route", "POST", "/v1/nothing", {}, 404, "no route"),
    ("wrong method", "GET", "/v1/completions", None, 405, "not allowed"),
    ("body too large", "POST", "/v1/completions", {"prompt": "y" * (BODY_LIMIT + 1)}, 413, "too large"),
    ("no API key", "POST", "/v1/completions", GOOD, 401, "api key"),
]


@pytest.mark.parametrize("name, method, path, body, status, needle", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_bad_input_is_a_clear_4xx_and_serving_goes_on(tiny, name, method, path, body, status, needle):
    headers = {} if name == "no API key" else {"Authorization": f"Bearer {API_KEY}"}
    kw: dict[str, Any] = {"headers": headers}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"] = {**headers, "content-type": "application/json"}
    elif body is not None:
        kw["json"] = body
    with httpx.Client(base_url=tiny.router.url, trust_env=False, timeout=30) as c:
        _error(c.request(method, path, **kw), status, needle)
        t0 = time.monotonic()
        assert c.get("/health").status_code == 200
        assert time.monotonic() - t0 < 2.0


def test_bad_input_sweep_is_wide_enough():
    assert len({b[0] for b in BAD_INPUT}) >= 15


def test_still_serving_after_the_sweep(tiny):
    r = tiny.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ============================================================================ health


def test_engine_alive_helper():
    """Read from the engines' own ``is_alive`` (a decode engine's step loop), never assumed."""
    from hawk.serve.common import engine_alive

    class WithMethod:
        def __init__(self, alive: bool):
            self.alive = alive

        def is_alive(self) -> bool:
            return self.alive

    assert engine_alive(WithMethod(True)) and not engine_alive(WithMethod(False))
    assert engine_alive(object())  # no loop of its own: nothing to die


def test_dead_engine_makes_health_fail_and_the_router_answer_503_at_once():
    """Its own system: the decode engine is stopped for good here."""
    from hawk.serve.common import engine_alive

    s = TinySystem(health_interval_s=0.2)
    try:
        assert s.http.get("/health").status_code == 200
        s.decode_inst.engine.close()  # the engine thread ends, the process and its HTTP server do not
        assert not engine_alive(s.decode_inst.engine)
        r = httpx.get(f"{s.decode.url}/health", trust_env=False, timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "engine_dead"
        t0 = time.monotonic()
        while s.http.get("/health").status_code == 200:
            assert time.monotonic() - t0 < 5.0, "router /health still 200 with a dead decode engine"
            time.sleep(0.1)
        time.sleep(0.5)  # the monitor has seen it too
        t0 = time.monotonic()
        r = s.http.post("/v1/completions", json=GOOD, timeout=30)
        assert time.monotonic() - t0 < 5.0
        err = _error(r, 503, "decode")
        assert err["code"] == "instance_unavailable" and r.headers.get("retry-after")
    finally:
        s.close()


def test_a_failing_prefill_forward_is_the_engines_fault_named_and_the_next_request_runs(tiny, monkeypatch, caplog):
    """A forward that raises fails its batch's requests as ``engine_failure`` (the prefill's 500
    with that code, the router's 502 naming it), not as a crash of the server; the engine and the
    servers keep serving."""
    runner = tiny.prefill_inst.engine.runner
    real = runner.forward
    calls = {"n": 0}

    def once(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(*a, **kw)

    monkeypatch.setattr(runner, "forward", once)
    err = _error(tiny.http.post("/v1/completions", json=GOOD), 502, "injected forward failure")
    assert err["code"] == "engine_failure" and err["type"] == "server_error"
    assert "unhandled error" not in caplog.text  # answered as a named fault, not by the crash handler
    r = tiny.http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert tiny.http.get("/health").status_code == 200
