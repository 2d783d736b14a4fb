"""Streaming that streams: tokens reach the client one by one through decode server and router.

A random-weight model with a Llama-3-sized vocabulary (128k ids, tiny layers so it runs on a CPU)
stands in for the ``llama-3.1-8b`` preset the GPU suite serves. Its ids are almost all outside the
byte range, which is what made the preset's text empty until the last chunk. Everything runs in
this process on loopback sockets.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.engine.config import preset  # noqa: E402
from hawk.engine.instances import DecodeInstance, InstanceConfig, PrefillInstance  # noqa: E402
from hawk.engine.loader import LoadedModel  # noqa: E402
from hawk.engine.model import LlamaModel  # noqa: E402
from hawk.engine.tokenizer import Tokenizer  # noqa: E402
from hawk.serve.common import ThreadedServer, bind_socket  # noqa: E402
from hawk.serve.decode_server import create_decode_app  # noqa: E402
from hawk.serve.prefill_server import create_prefill_app  # noqa: E402
from hawk.serve.router import RouterConfig, create_router_app  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

MAX_TOKENS = 24


def _llama3_shaped() -> LoadedModel:
    """The 8B preset's vocabulary and special ids on the tiny preset's layers."""
    cfg = preset("tiny").replace(
        vocab_size=preset("llama-3.1-8b").vocab_size,
        bos_token_id=preset("llama-3.1-8b").bos_token_id,
        eos_token_ids=preset("llama-3.1-8b").eos_token_ids,
        hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
    )
    return LoadedModel(LlamaModel.from_config(cfg, seed=3), Tokenizer.byte_level(cfg), cfg, "llama3-shaped")


@pytest.fixture(scope="module")
def router_url():
    loaded = _llama3_shaped()
    transport = "nixl" if available("nixl") else "local"
    cfg = InstanceConfig(model="llama3-shaped", transport=transport, kv_tokens=1024, staging_mb=8, rx_mb=8, kv_ttl_s=60.0)
    prefill = PrefillInstance(cfg, loaded=loaded)
    decode = DecodeInstance(cfg, loaded=loaded)
    servers = [ThreadedServer(create_prefill_app(prefill)).start(), ThreadedServer(create_decode_app(decode)).start()]
    servers.append(ThreadedServer(create_router_app(RouterConfig([servers[0].url], [servers[1].url]))).start())
    yield servers[-1].url
    for s in reversed(servers):
        s.stop()


def _stream(client: httpx.Client, body: dict) -> list[tuple[float, str, str | None]]:
    """(arrival time, text, finish_reason) of every completion chunk; times from the request."""
    out = []
    t0 = time.monotonic()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"]
                if c:
                    out.append((time.monotonic() - t0, c[0]["text"], c[0]["finish_reason"]))
    return out


BODY = {"prompt": "Hello there", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11, "ignore_eos": True}


def test_random_preset_streams_each_token_as_it_is_made(router_url):
    with httpx.Client(base_url=router_url, timeout=60.0, trust_env=False) as c:
        _stream(c, BODY)  # warm-up: first-request costs are not what this test is about
        chunks = _stream(c, BODY)
    content = [(t, s) for t, s, _ in chunks if s]
    assert len(content) >= MAX_TOKENS // 2, chunks  # one chunk per token (a few may be specials)
    times = [t for t, _ in content]
    # the first text arrives well before the end, and the arrivals are spread out, not bunched
    assert times[0] < 0.5 * chunks[-1][0], chunks
    assert len({round(t, 3) for t in times}) >= len(times) // 2, times
    assert chunks[-1][2] == "length"


def test_streamed_deltas_equal_the_non_streamed_text(router_url):
    with httpx.Client(base_url=router_url, timeout=60.0, trust_env=False) as c:
        streamed = "".join(s for _, s, _ in _stream(c, BODY))
        whole = c.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    assert streamed == whole and len(whole) >= MAX_TOKENS  # every id decodes to visible text


@pytest.mark.parametrize("body", [
    {"prompt": "a\ud800b"},
    {"prompt": "hi", "stop": ["\udc00"]},
    {"model": "\ud800", "prompt": "hi"},
])
def test_lone_surrogates_are_a_400(router_url, body):
    raw = json.dumps({**body, "max_tokens": 2}, ensure_ascii=True)  # JSON's "\ud800" escape
    with httpx.Client(base_url=router_url, timeout=60.0, trust_env=False) as c:
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "lone surrogate" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_a_400(router_url, seed):
    with httpx.Client(base_url=router_url, timeout=60.0, trust_env=False) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "seed": seed})
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
        for ok in (2**64 - 1, -(2**63)):
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "seed": ok}).status_code == 200


# ---- the sockets under every server: no Nagle delay on small streamed writes -------------------


def test_server_sockets_disable_nagle():
    sock = bind_socket()
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY only when proto says TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def test_small_streamed_writes_are_not_held_for_acks():
    """Chunks 20 ms apart must arrive 20 ms apart on a reused connection. With Nagle on, a write
    waits for the ACK of the previous one, which the client delays ~40 ms: chunks come in pairs."""
    app = FastAPI()

    @app.get("/s")
    async def s() -> StreamingResponse:
        async def gen():
            for i in range(8):
                await asyncio.sleep(0.02)
                yield f"{i}\n".encode()
        return StreamingResponse(gen())

    def arrivals(c: httpx.Client) -> list[float]:
        with c.stream("GET", "/s") as r:
            return [time.monotonic() for _line in r.iter_lines()]

    with ThreadedServer(app) as srv, httpx.Client(base_url=srv.url, timeout=10.0, trust_env=False) as c:
        arrivals(c)  # the first request on a connection is never delayed; later ones were
        best = 0
        for _ in range(3):  # a busy CPU may bunch two chunks once; Nagle bunches them every time
            times = arrivals(c)
            gaps = [b - a for a, b in zip(times, times[1:])]
            best = max(best, sum(g > 0.005 for g in gaps))
            if best == len(gaps):
                break
        assert best == 7
