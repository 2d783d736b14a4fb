"""The real thing: ``python -m hawk.serve.launcher`` (= ``serve(role="all")``) as its own process,
with prefill and decode children talking NIXL over loopback, driven by the official ``openai``
client; then SIGTERM, and every process must be gone with exit code 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from hawk.bench.procs import children, running

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("gguf")
    from hawk.engine.loader import embedded_path
    from hawk.transport.registry import available

    try:
        embedded_path()
    except ValueError as e:  # the wheel carrying SmolLM2 is not installed
        pytest.skip(str(e))
    if not available("nixl"):
        pytest.skip("NIXL is not installed")
    logs = tmp_path_factory.mktemp("serve-logs")
    port = _free_port()
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    cmd = [sys.executable, "-m", "hawk.serve.launcher", "--port", str(port), "--kv-tokens", "2048", "--log-dir", str(logs)]
    out = open(logs / "launcher.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}: {(logs / 'launcher.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 180:
            proc.kill()
            pytest.fail("serve did not come up in 180 s")
        time.sleep(0.2)
    startup_s = time.monotonic() - t0
    yield {"url": url, "proc": proc, "logs": logs, "startup_s": startup_s}
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    out.close()


@pytest.fixture(scope="module")
def client(served):
    c = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def test_models(client):
    assert MODEL in [m.id for m in client.models.list()]


def test_completion_streamed_and_not(client):
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}
    plain = client.completions.create(**kw)
    text = plain.choices[0].text
    assert text.strip() and plain.usage.completion_tokens == 10 and plain.choices[0].finish_reason == "length"
    hawk = plain.model_extra["hawk"]
    assert hawk["kv_bytes"] > 0 and hawk["transfer"] == "gn-hawk" and hawk["ttft_s"] > 0
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    answer = resp.choices[0].message.content
    assert "Paris" in answer and resp.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert chunks[-1].model_extra["hawk"]["kv_transfer_s"] > 0


def test_errors_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[100] * 9000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    # and it keeps serving
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_sigterm_stops_everything(served):
    proc = served["proc"]
    kids = children(proc.pid)
    assert len(kids) == 2, kids  # one prefill, one decode
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(running(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(k) for k in kids), "engine children outlived the launcher"
