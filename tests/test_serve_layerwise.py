"""The layer-wise KV flow (``--kv-flow layerwise``) through the serving stack: router -> decode first
(it reserves the blocks and hands them to the prefill as the push destination) -> prefill (it pushes
each layer) -> the first token to the decode -> tokens streamed as in pull mode.

Greedy tokens equal pull mode's, in one process and across processes. Bad input gets a 4xx and loses
nothing. Every reservation on both instances (prefill staging, waiting KV, push destinations, paged
blocks; decode receive reservations, destinations handed out, KV blocks, queued requests) is released,
as /internal/accounting shows, after: success, a client gone while its request waits for decode memory
(before any prefill), a client gone during its prefill (queued, or mid-forward), a prefill that fails
or refuses, a decode that fails mid-push or mid-generation, and a prefill server that is down with the
request in flight. A restarted prefill is used at its new KV address. The model is the random-weight
``tiny`` preset, so everything starts in seconds; a failed push's blocks wait out NIXL's 5 s drain.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.engine.instances import DecodeInstance, InstanceConfig, PrefillInstance  # noqa: E402
from hawk.engine.loader import load_model  # noqa: E402
from hawk.errors import BadRequest  # noqa: E402
from hawk.serve.common import CLUSTER_SECRET_ENV, ThreadedServer  # noqa: E402
from hawk.serve.contract import CONTRACT_VERSION  # noqa: E402
from hawk.serve.decode_server import create_decode_app  # noqa: E402
from hawk.serve.prefill_server import create_prefill_app  # noqa: E402
from hawk.serve.router import RouterConfig, create_router_app  # noqa: E402
from hawk.transport.registry import available  # noqa: E402
from tests.polling import wait_until  # noqa: E402

KV_TOKENS = 1024  # the decode: 16 NPU blocks of 64 tokens
TTL_S = 20.0  # the connector's TTL: what a request's release must not wait for (but one test's)
#: A failed push's blocks and staging wait out the transport's drain time (NIXL: 5 s) before reuse.
DRAIN_S = 5.0
RELEASE_S = DRAIN_S + 5.0
CHAT = {"messages": [{"role": "user", "content": "Why is decode memory-bound?"}], "max_tokens": 16, "ignore_eos": True, "temperature": 0}
GOOD = {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "temperature": 0}


class Pair:
    """A prefill and a decode instance of one KV flow behind a router, in this process."""

    def __init__(self, cfg: InstanceConfig, loaded: Any):
        self.prefill_inst = PrefillInstance(cfg, loaded=loaded)
        self.decode_inst = DecodeInstance(cfg, loaded=loaded)
        self.servers: list[ThreadedServer] = []
        self.prefill = self.start(create_prefill_app(self.prefill_inst))
        self.decode = self.start(create_decode_app(self.decode_inst))
        self.router = self.start(create_router_app(RouterConfig([self.prefill.url], [self.decode.url], default_temperature=0.0)))
        self.request_router = self.start(create_router_app(RouterConfig([self.prefill.url], [self.decode.url], default_temperature=0.0, decode_stream="request")))
        self.http = httpx.Client(base_url=self.router.url, timeout=60.0, trust_env=False)

    def start(self, app: Any) -> ThreadedServer:
        s = ThreadedServer(app).start()
        self.servers.append(s)
        return s

    def close(self) -> None:
        self.http.close()
        for s in reversed(self.servers):  # routers first; the instance apps close their instances
            s.stop()


@pytest.fixture(scope="module")
def systems() -> Iterator[tuple[Pair, Pair]]:
    """(layer-wise, pull): the same model and config but for the KV flow."""
    transport = "nixl" if available("nixl") else "local"
    cfg = InstanceConfig(model="tiny", transport=transport, kv_tokens=KV_TOKENS, staging_mb=4, rx_mb=4, kv_ttl_s=TTL_S)
    loaded = load_model("tiny")
    lw = Pair(replace(cfg, kv_flow="layerwise"), loaded)
    pull = Pair(cfg, loaded)
    yield lw, pull
    lw.close()
    pull.close()


@pytest.fixture
def lw(systems: tuple[Pair, Pair]) -> Iterator[Pair]:
    """The layer-wise system, checked empty before and after the test."""
    s = systems[0]
    wait_released(s, RELEASE_S)
    yield s
    wait_released(s, RELEASE_S)


# ============================================================================ helpers


def accounting(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/internal/accounting", timeout=10, trust_env=False).json()


def held(s: Pair) -> dict[str, int]:
    """Everything either instance holds for requests (all zero when idle)."""
    p = accounting(s.prefill.url)
    return {
        "prefill_staging": p["staging_reservations"],
        "prefill_kv_waiting": len(p["kv_waiting"]),
        "prefill_kv_in_flight": len(p["kv_in_flight"]),
        "prefill_push_destinations": len(p["kv_pushes"]),
        "prefill_draining": p["draining"],
        "prefill_gpu_blocks": p["gpu_blocks_used"],
        **decode_held(s),
    }


def decode_held(s: Pair) -> dict[str, int]:
    d = accounting(s.decode.url)
    return {
        "decode_rx_reservations": d["rx_reservations"],
        "decode_destinations_out": len(d["kv_expecting"]),
        "decode_draining": d["draining"],
        "decode_kv_blocks": d["kv_blocks_used"],
        "decode_requests": d["engine_waiting"] + d["engine_transferring"] + d["engine_running"],
    }


def wait_released(s: Pair, timeout_s: float, only: Any = held) -> float:
    return wait_until(lambda: not any(only(s).values()), timeout_s, lambda: f"still held: {only(s)}")


def stream_text(client: httpx.Client, path: str, body: dict) -> tuple[str, dict]:
    """A streamed request's text and its ``hawk`` summary."""
    text, summary = [], {}
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev["choices"]:
                text.append(c.get("text") or c.get("delta", {}).get("content") or "")
            summary = ev.get("hawk") or summary
    return "".join(text), summary


class Gate:
    """Holds the prefill engine's forwards until opened, or fails the next one: lets a test act while
    a request is inside its prefill."""

    def __init__(self, runner: Any):
        self.runner, self.forward = runner, runner.forward
        self.open, self.entered = threading.Event(), threading.Event()
        self.fail: str | None = None
        runner.forward = self._forward

    def _forward(self, *a: Any, **kw: Any) -> Any:
        self.entered.set()
        if self.fail is not None:
            msg, self.fail = self.fail, None
            raise RuntimeError(msg)
        if not self.open.wait(30):
            raise RuntimeError("the test's gate was never opened")
        return self.forward(*a, **kw)

    def restore(self) -> None:
        self.open.set()
        self.runner.forward = self.forward


@pytest.fixture
def gate(lw: Pair) -> Iterator[Gate]:
    g = Gate(lw.prefill_inst.engine.runner)
    g.open.set()
    yield g
    g.restore()


def in_thread(url: str, path: str, body: dict, read_s: float) -> tuple[threading.Thread, dict]:
    """Send a request from a thread whose client gives up (disconnects) after ``read_s`` without an answer."""
    out: dict[str, Any] = {}

    def go() -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=read_s), trust_env=False) as c:
            try:
                r = c.post(path, json=body)
                out["status"], out["body"] = r.status_code, r.json()
            except httpx.ReadTimeout:
                out["gone"] = True

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


# ============================================================================ success


def test_layerwise_streams_the_same_greedy_tokens_as_pull(systems):
    lw, pull = systems
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", {**GOOD, "max_tokens": 20})]:
        got, summary = stream_text(lw.http, path, body)
        want, ref = stream_text(pull.http, path, body)
        assert got == want and got, (got, want)
        assert summary["kv_mode"] == "layerwise" and summary["kv_flow"] == "layerwise" and summary["kv_bytes"] > 0
        assert summary["kv_exposed_s"] is not None and summary["decode_handed_s"] is not None
        assert ref["kv_mode"] != "layerwise" and "kv_flow" not in ref
    plain = lw.http.post("/v1/completions", json={**GOOD, "max_tokens": 20}).json()
    assert plain["choices"][0]["text"] == want and plain["usage"]["completion_tokens"] == 20
    with httpx.Client(base_url=lw.request_router.url, timeout=60.0, trust_env=False) as own:  # a stream per request
        got, summary = stream_text(own, "/v1/completions", {**GOOD, "max_tokens": 20})
    assert got == want and summary["kv_flow"] == "layerwise" and summary["decode_handed_s"] is not None
    info = httpx.get(f"{lw.decode.url}/internal/info", trust_env=False).json()
    assert info["kv_flow"] == "layerwise"
    wait_released(lw, 5)
    wait_released(pull, 5)


def test_concurrent_layerwise_requests(lw):
    results: list[dict] = []

    def one(i: int) -> None:  # half of them on a decode stream of their own
        with httpx.Client(base_url=(lw.router, lw.request_router)[i % 2].url, timeout=60, trust_env=False) as c:
            results.append(c.post("/v1/completions", json={**GOOD, "prompt": f"{i} + {i} ="}).json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6 and all(r["usage"]["completion_tokens"] == 6 and r["hawk"]["kv_mode"] == "layerwise" for r in results), results


# ============================================================================ bad input


def _error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    for n in needles:
        assert n in err["message"], err["message"]
    return err


def test_bad_input_gets_a_4xx_and_loses_nothing(lw):
    _error(lw.http.post("/v1/completions", json={**GOOD, "max_tokens": 5000}), 400, "context length")
    _error(lw.http.post("/v1/completions", json={"prompt": [1, 2, 10**6]}), 400, "outside the vocabulary")
    kv = {"address": lw.prefill_inst.kv_address, "request_id": "x"}
    push = {"version": CONTRACT_VERSION, "request_id": "x", "prompt_len": 3, "params": {"max_tokens": 2}, "kv": kv, "kv_flow": "layerwise"}
    post = lambda url, path, body: httpx.post(f"{url}{path}", json=body, trust_env=False, timeout=30)  # noqa: E731
    _error(post(lw.decode.url, "/internal/decode", {**push, "first_token": 5}), 400, "first_token must be left out")
    _error(post(lw.decode.url, "/internal/decode", {**push, "params": {"max_tokens": 5000}}), 400, "exceeds")
    err = _error(post(lw.decode.url, "/internal/decode", {**push, "kv_flow": "pull", "first_token": 5}), 400, "kv_flow 'pull'")
    assert err["code"] == "contract_mismatch"
    err = _error(post(lw.prefill.url, "/internal/prefill", {"version": CONTRACT_VERSION, "request_id": "y", "prompt_ids": [1, 2]}), 400, "kv_flow")
    assert err["code"] == "contract_mismatch"
    _error(post(lw.decode.url, "/internal/first_token", {"version": CONTRACT_VERSION, "request_id": "x"}), 400, "token")
    _error(post(lw.decode.url, "/internal/first_token", {"version": CONTRACT_VERSION, "request_id": "x", "token": -1}), 400)
    r = post(lw.decode.url, "/internal/first_token", {"version": CONTRACT_VERSION, "request_id": "nobody", "token": 3})
    assert r.status_code == 200 and r.json()["accepted"] is False
    assert not any(held(lw).values())
    assert lw.http.post("/v1/completions", json=GOOD).json()["usage"]["completion_tokens"] == 6


# ============================================================================ clients that leave


def test_client_gone_while_waiting_for_decode_memory_frees_everything(lw, gate):
    """Before any prefill: B waits for decode blocks (A holds 15 of 16 while its prefill is held),
    B's client leaves; B leaves the decode queue, and the prefill never held anything for it."""
    gate.open.clear()
    before = accounting(lw.prefill.url)
    a, a_out = in_thread(lw.router.url, "/v1/completions", {"prompt": [1 + i % 250 for i in range(900)], "max_tokens": 4}, 60)
    assert gate.entered.wait(10), "A never reached its prefill"
    b, b_out = in_thread(lw.router.url, "/v1/completions", {"prompt": [1 + i % 250 for i in range(200)], "max_tokens": 4, "stream": True}, 3.0)
    wait_until(lambda: accounting(lw.decode.url)["engine_waiting"] == 1, 2.8, "B queued for decode memory")
    b.join(10)
    assert b_out == {"gone": True}
    wait_until(lambda: accounting(lw.decode.url)["engine_waiting"] == 0, 5, "B left the decode queue")
    assert accounting(lw.prefill.url)["kv_pushes"] == [next(iter(accounting(lw.decode.url)["kv_expecting"]))]  # only A's
    gate.open.set()
    a.join(30)
    assert a_out["status"] == 200 and a_out["body"]["usage"]["completion_tokens"] == 4
    after = accounting(lw.prefill.url)
    assert after["aborts_unknown"] == before["aborts_unknown"] + 1  # B's abort found nothing at the prefill


@pytest.mark.parametrize("router", ["router", "request_router"])
def test_client_gone_during_prefill_frees_everything(lw, gate, router):
    """A is mid-forward (held), B is queued behind it; both clients leave. The decode frees both at
    once, before the prefill's forward ends (A's push is failed, B's prompt cancelled and its
    destination released by the decode's abort); the prefill frees A's blocks as soon as its
    forward ends."""
    gate.open.clear()
    before = accounting(lw.prefill.url)
    url = getattr(lw, router).url
    a, a_out = in_thread(url, "/v1/completions", {**GOOD, "stream": True}, 4.0)
    assert gate.entered.wait(10), "A never reached its prefill"
    b, b_out = in_thread(url, "/v1/chat/completions", CHAT, 3.5)
    wait_until(lambda: len(accounting(lw.prefill.url)["kv_pushes"]) == 2, 3.3, "both destinations handed over")
    a.join(10)
    b.join(10)
    assert a_out == {"gone": True} and b_out == {"gone": True}
    wait_released(lw, RELEASE_S, only=decode_held)  # the forward is still held
    assert not gate.open.is_set()
    gate.open.set()
    wait_released(lw, RELEASE_S)
    after = accounting(lw.prefill.url)
    assert after["aborts_discarded"] == before["aborts_discarded"] + 1  # A: its push failed mid-forward
    assert after["aborts_cancelled"] == before["aborts_cancelled"] + 1  # B: its queued prompt
    assert not after["kv_pushes"]  # B's destination: the decode's abort cancelled it (D9) at once


# ============================================================================ failures


def test_prefill_failure_fails_the_request_and_frees_everything(lw, gate):
    gate.fail = "injected prefill failure"
    r = lw.http.post("/v1/completions", json=GOOD)
    # whichever reports first: the prefill's answer (502) or the decode's failed push naming it (500)
    _error(r, 502 if r.status_code == 502 else 500, "injected prefill failure")
    wait_released(lw, RELEASE_S)
    assert lw.http.post("/v1/completions", json=GOOD).json()["usage"]["completion_tokens"] == 6


def test_prefill_refusal_releases_the_destination(lw, monkeypatch):
    def refuse(*a: Any, **kw: Any) -> Any:
        raise BadRequest("injected refusal")

    before = accounting(lw.prefill.url)["push_destinations_released"]
    monkeypatch.setattr(lw.prefill_inst.engine, "submit", refuse)
    _error(lw.http.post("/v1/completions", json=GOOD), 400, "injected refusal")
    assert wait_released(lw, RELEASE_S) < TTL_S / 2  # after the transport's drain, not at the TTL
    assert accounting(lw.prefill.url)["push_destinations_released"] == before + 1
    monkeypatch.undo()
    assert lw.http.post("/v1/completions", json=GOOD).json()["usage"]["completion_tokens"] == 6


def test_prefill_refusal_is_the_cause_when_the_decode_hears_first(lw, monkeypatch):
    """The refusal discards the push destination; the decode's push fails and its stream may say so
    before the prefill's 400 reaches the router. The client is told the cause (the refusal)."""
    def discard_then_refuse(rid: str, *a: Any, **kw: Any) -> Any:
        lw.prefill_inst.discard(rid)  # the decode hears of it now ...
        time.sleep(0.3)  # ... and the prefill's answer comes later
        raise BadRequest("injected late refusal")

    monkeypatch.setattr(lw.prefill_inst.engine, "submit", discard_then_refuse)
    _error(lw.http.post("/v1/completions", json=GOOD), 400, "injected late refusal")
    wait_released(lw, RELEASE_S)
    monkeypatch.undo()
    assert lw.http.post("/v1/completions", json=GOOD).json()["usage"]["completion_tokens"] == 6


def test_decode_failure_mid_push_frees_everything(lw, monkeypatch):
    landing = lw.decode_inst.receiver.landing
    real = landing.finish_layers
    calls = []

    def fail_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected landing failure")
        real()

    monkeypatch.setattr(landing, "finish_layers", fail_once)
    _error(lw.http.post("/v1/completions", json=GOOD), 500, "injected landing failure")
    wait_released(lw, RELEASE_S)
    assert lw.http.post("/v1/completions", json=GOOD).json()["usage"]["completion_tokens"] == 6


def test_decode_failure_mid_generation_is_reported_in_band_and_frees_everything(lw, monkeypatch):
    runner = lw.decode_inst.engine.runner
    real = runner.step

    def fail_once(*a: Any, **kw: Any) -> Any:
        monkeypatch.setattr(runner, "step", real)
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(runner, "step", fail_once)
    with lw.http.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "injected decode failure" in events[-1]["error"]["message"]
    wait_released(lw, RELEASE_S)


def test_prefill_server_down_with_the_request_in_flight_frees_everything(lw, monkeypatch):
    """The prefill's HTTP server is gone (its KV connector still up) after the decode handed its
    blocks over: the client gets a 503 at once, and the destination nobody will prefill expires at
    the connector's TTL, which fails the decode's wait and frees its blocks."""
    monkeypatch.setattr(lw.prefill_inst.sender, "ttl_s", 1.5)
    front = ThreadedServer(create_prefill_app(lw.prefill_inst, close_on_shutdown=False)).start()
    cfg = RouterConfig([front.url], [lw.decode.url], default_temperature=0.0, health_interval_s=3600)  # no monitor to notice
    router = ThreadedServer(create_router_app(cfg)).start()
    try:
        front.stop()
        t0 = time.monotonic()
        err = _error(httpx.post(f"{router.url}/v1/completions", json=GOOD, timeout=30, trust_env=False), 503, "unreachable")
        assert err["code"] == "instance_unavailable" and time.monotonic() - t0 < 3
        wait_released(lw, 1.5 + RELEASE_S)
    finally:
        router.stop()


def test_a_restarted_prefill_is_used_at_its_new_kv_address(systems):
    """Layer-wise requests give the decode the prefill's KV address before the prefill runs, so the
    router must learn a restarted prefill's new one (read again when it comes back up)."""
    lw, _ = systems
    old = ThreadedServer(create_prefill_app(lw.prefill_inst, close_on_shutdown=False)).start()
    app = create_router_app(RouterConfig([old.url], [lw.decode.url], default_temperature=0.0, health_interval_s=0.2))
    router = ThreadedServer(app).start()
    http = httpx.Client(base_url=router.url, timeout=30, trust_env=False)
    new = None
    try:
        assert http.post("/v1/completions", json=GOOD).status_code == 200
        old.stop()
        wait_until(lambda: app.state.router.down, 5, "the router saw the prefill go down")
        restarted = PrefillInstance(lw.prefill_inst.cfg, loaded=lw.prefill_inst.loaded)  # a new KV control address
        assert restarted.kv_address != lw.prefill_inst.kv_address
        new = ThreadedServer(create_prefill_app(restarted), port=int(old.url.rsplit(":", 1)[1])).start()
        wait_until(lambda: not app.state.router.down, 5, "the router saw it back")
        r = http.post("/v1/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["hawk"]["kv_mode"] == "layerwise", r.text
        wait_until(lambda: not (a := accounting(new.url))["kv_pushes"] and not a["gpu_blocks_used"], 5, "the restarted prefill let go")
        wait_released(lw, RELEASE_S, only=decode_held)
    finally:
        http.close()
        router.stop()
        if new is not None:
            new.stop()  # closes the restarted instance


# ============================================================================ across processes


def test_layerwise_across_processes_equals_pull(systems, tmp_path):
    """``hawk serve --kv-flow layerwise`` as the launcher runs it (separate processes, NIXL): the same
    greedy tokens as pull mode, and both instances' ledgers empty afterwards."""
    if not available("nixl"):
        pytest.skip("NIXL is not installed (separate processes need it)")
    from hawk.serve.launcher import instance_config, start_system

    _, pull = systems
    want, _ = stream_text(pull.http, "/v1/chat/completions", CHAT)
    cfg = instance_config(model="tiny", kv_tokens=KV_TOKENS, staging_mb=4, rx_mb=4, kv_flow="layerwise")
    with start_system(cfg, threads=1, log_dir=tmp_path, startup_timeout_s=120) as s:
        with httpx.Client(base_url=s.url, timeout=60, trust_env=False) as c:
            got, summary = stream_text(c, "/v1/chat/completions", CHAT)
        assert got == want and summary["kv_mode"] == "layerwise"
        auth = {"Authorization": f"Bearer {s.cluster.children[0].env[CLUSTER_SECRET_ENV]}"}

        def empty() -> bool:
            p, d = (httpx.get(f"{u}/internal/accounting", headers=auth, trust_env=False).json() for u in (s.cluster.prefill_urls[0], s.cluster.decode_urls[0]))
            return not (p["kv_pushes"] or p["kv_waiting"] or p["gpu_blocks_used"] or p["staging_reservations"] or d["kv_expecting"] or d["kv_blocks_used"])

        wait_until(empty, 5, "ledgers empty across processes")
