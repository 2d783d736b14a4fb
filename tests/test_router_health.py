"""The router's health monitor: when an instance counts as down.

A refused connection or an unhealthy answer is down at once; a probe that only times out (a busy
host) is a miss, and only ``health_misses`` misses in a row make the instance down, so one slow
answer never fails the requests in flight. Instances are faked with an httpx mock transport.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from hawk.serve.contract import InstanceInfo  # noqa: E402
from hawk.serve.router import Instance, InstancePool, Router, RouterConfig  # noqa: E402

P, D = "http://127.0.0.1:1001", "http://127.0.0.1:1002"


def _info(role: str) -> InstanceInfo:
    return InstanceInfo.of(role=role, model="m", transfer="hawk", transport="local", device="cpu", max_model_len=64, vocab_size=10)


def _router(answers: dict[str, list[str]], misses: int = 3) -> Router:
    """A router whose instances answer /health as scripted: "ok", "timeout", "refused", "dead"
    per probe (the last answer repeats)."""
    cfg = RouterConfig([P], [D], health_interval_s=0.0, health_misses=misses)
    router = Router(cfg, tokenizer=None)
    router.pool = InstancePool([Instance(P, "prefill", _info("prefill"))], [Instance(D, "decode", _info("decode"))])
    calls = {url: 0 for url in answers}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/internal/info":
            return httpx.Response(200, content=_info("prefill" if url == P else "decode").model_dump_json())
        script = answers[url]
        kind = script[min(calls[url], len(script) - 1)]
        calls[url] += 1
        if kind == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        if kind == "refused":
            raise httpx.ConnectError("refused", request=request)
        if kind == "dead":
            return httpx.Response(503, json={"status": "engine_dead"})
        return httpx.Response(200, json={"status": "ok"})

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router


async def _rounds(router: Router, n: int) -> list[dict[str, str]]:
    """Run the monitor for ``n`` probe rounds; what was down after each."""
    seen: list[dict[str, str]] = []
    original = asyncio.sleep

    async def after_round(_: float) -> None:
        seen.append(dict(router.down))
        if len(seen) == n:
            raise asyncio.CancelledError
        await original(0)

    asyncio.sleep = after_round  # type: ignore[assignment]
    try:
        with pytest.raises(asyncio.CancelledError):
            await router._watch_instances()
    finally:
        asyncio.sleep = original  # type: ignore[assignment]
        await router.client.aclose()  # type: ignore[union-attr]
    return seen


def test_slow_probes_are_misses_until_enough_in_a_row():
    router = _router({P: ["ok"], D: ["timeout", "timeout", "ok", "timeout", "timeout", "timeout", "ok"]})
    seen = asyncio.run(_rounds(router, 7))
    assert [D in s for s in seen] == [False, False, False, False, False, True, False]
    assert seen[5][D] == "decode instance not answering"
    assert all(P not in s for s in seen)


def test_refused_and_unhealthy_are_down_at_once():
    router = _router({P: ["refused", "ok"], D: ["dead", "dead", "ok"]})
    seen = asyncio.run(_rounds(router, 3))
    assert seen[0] == {P: "prefill instance unreachable", D: "decode instance not healthy"}
    assert seen[1] == {D: "decode instance not healthy"}  # the prefill is back (its info re-read)
    assert seen[2] == {}


def test_one_miss_is_enough_when_configured():
    router = _router({P: ["ok"], D: ["timeout"]}, misses=1)
    assert asyncio.run(_rounds(router, 1)) == [{D: "decode instance not answering"}]


def test_a_miss_wakes_no_request_in_flight():
    """The in-flight request's waiter (wait_down) stays asleep through misses below the threshold."""
    router = _router({P: ["ok"], D: ["timeout", "timeout", "ok"]})

    async def main() -> bool:
        waiter = asyncio.ensure_future(router.wait_down(P, D))
        await _rounds(router, 3)
        woke = waiter.done()
        waiter.cancel()
        return woke

    assert asyncio.run(main()) is False


def _app_with(router_state: Router, handler_calls: list[str]) -> tuple[object, httpx.AsyncClient]:
    """The router app with ``router_state``'s pool and down map, its instance client counting calls."""
    from hawk.serve.router import create_router_app

    app = create_router_app(RouterConfig([P], [D]))
    router: Router = app.state.router
    router.pool, router.down = router_state.pool, router_state.down

    def handler(request: httpx.Request) -> httpx.Response:
        handler_calls.append(str(request.url))
        return httpx.Response(200, json={"status": "ok"})  # the instance itself already says it is fine

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def test_router_health_is_not_ok_while_requests_would_be_refused():
    """A restarted decode answers its own /health before the router routes to it again (the monitor
    has not re-read its /internal/info yet): the router's /health must say 503 then, as a request
    would get, and it must answer from the monitor's view without probing (no wait on a restarting
    instance)."""
    from hawk.serve.router import InstanceDown

    state = _router({P: ["ok"], D: ["ok"]})
    state.down = {D: "decode instance unreachable"}
    calls: list[str] = []
    app, client = _app_with(state, calls)

    async def go() -> tuple[int, dict]:
        async with client:
            r = await client.get("/health")
        return r.status_code, r.json()

    status, body = asyncio.run(go())
    with pytest.raises(InstanceDown):
        state.pool.next_decode(state.down)  # what a request gets now
    assert status == 503, body
    assert body["instances"][f"decode {D}"] == "down" and body["down"][f"decode {D}"] == "decode instance unreachable"
    assert calls == [], "the router's /health probed an instance instead of answering from the monitor's view"

    state.down.clear()  # the monitor re-read it: requests are routed again, and /health says so
    calls.clear()
    app, client = _app_with(state, calls)
    status, body = asyncio.run(go())
    assert state.pool.next_decode(state.down).url == D
    assert status == 200 and body["status"] == "ok", body
