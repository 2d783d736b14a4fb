"""Tensor-parallel instances behind ``hawk serve`` (gloo on the CPU, NIXL over loopback, the
random-weight ``tiny`` preset with 2 KV heads): a TP2 prefill serves the TP1 server's greedy
text; a follower rank SIGKILLed under a running system fails its in-flight request with a clear
error, turns /health non-200, leaves nothing reserved on the surviving ranks, and the launcher
restarts the instance (with its ranks) so that it serves again; a degree the model cannot be
split by is refused in one line before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.serve.common import CLUSTER_SECRET_ENV  # noqa: E402
from hawk.serve.launcher import Child, RunningSystem, instance_config, start_system  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = ["The memory channels of an NPU", "Hello there"]


def _start(tmp_path_factory: pytest.TempPathFactory, prefill_tp: int, decode_tp: int) -> RunningSystem:
    if not available("nixl"):
        pytest.skip("NIXL is not installed (separate processes need it)")
    cfg = instance_config(model="tiny", kv_tokens=1024, staging_mb=4, rx_mb=4, prefill_tp=prefill_tp, decode_tp=decode_tp)
    logs = tmp_path_factory.mktemp(f"tp{prefill_tp}{decode_tp}-logs")
    return start_system(cfg, threads=1, log_dir=logs, startup_timeout_s=120)


@pytest.fixture(scope="module")
def tp2_prefill(tmp_path_factory) -> Iterator[RunningSystem]:
    s = _start(tmp_path_factory, 2, 1)
    yield s
    s.close()


def _greedy(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)


def _texts(url: str) -> list[str]:
    out = []
    for p in PROMPTS:
        r = _greedy(url, p)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        out.append(r.json()["choices"][0]["text"])
    return out


def _child(system: RunningSystem, role: str) -> Child:
    return next(c for c in system.cluster.children if c.role == role)


def _accounting(c: Child) -> dict:
    headers = {"Authorization": f"Bearer {c.env[CLUSTER_SECRET_ENV]}"}
    r = httpx.get(f"{c.url}/internal/accounting", headers=headers, timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


def _follower_pid(c: Child) -> int:
    return int(_accounting(c)["ranks"]["1"]["pid"])


def _wait_unhealthy(url: str, since: float, what: str) -> None:
    while httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
        assert time.monotonic() - since < 5.0, f"{what} /health still 200 five seconds after the kill"
        time.sleep(0.05)


def _wait_released(c: Child, empty, since: float) -> dict:
    """The dying instance's accounting once it holds nothing (it stays up a moment for this)."""
    while True:
        a = _accounting(c)
        if empty(a):
            return a
        assert time.monotonic() - since < 15.0, f"still held 15 s after the kill: {a}"
        time.sleep(0.1)


def _wait_serving(system: RunningSystem, child: Child, old_pid: int, since: float) -> None:
    while True:
        r = _greedy(system.url, PROMPTS[1], 4)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert time.monotonic() - since < 60.0, f"not serving 60 s after the kill: {r.text}"
        time.sleep(0.5)
    assert child.proc.pid != old_pid and child.proc.poll() is None


def test_a_degree_that_does_not_divide_the_kv_heads_is_refused_before_anything_starts():
    r = subprocess.run([sys.executable, "-m", "hawk", "serve", "--prefill-tp", "2", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prefill-tp 2" in lines[0] and "3 KV heads" in lines[0], r.stderr
    assert "HAWK: starting" not in r.stdout


def test_tp2_prefill_serves_the_tp1_servers_greedy_text(tmp_path_factory, tp2_prefill):
    with _start(tmp_path_factory, 1, 1) as tp1:
        want = _texts(tp1.url)
    assert _texts(tp2_prefill.url) == want
    a = _accounting(_child(tp2_prefill, "prefill"))
    assert a["healthy"] and set(a["ranks"]) == {"1"}


def _prefill_empty(a: dict) -> bool:
    return a["staging_reservations"] == 0 and not a["kv_waiting"] and not a["kv_in_flight"] and a["draining"] == 0 and a["gpu_blocks_used"] == 0


def test_engine_processes_freeze_their_startup_heap(tp2_prefill):
    """--gc-freeze (the default): once up, each engine process has frozen what startup built, so the
    collector no longer walks it during requests; its /metrics says how much."""
    for c in tp2_prefill.cluster.children:
        text = httpx.get(f"{c.url}/metrics", timeout=30, trust_env=False).text
        frozen = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("hawk_gc_frozen_objects "))
        assert frozen > 10_000, (c.role, frozen)
        assert 'python_gc_collections_total{generation="2"}' in text


def test_a_killed_prefill_follower_is_reported_released_and_restarted(tp2_prefill):
    system = tp2_prefill
    child = _child(system, "prefill")
    want = _greedy(system.url, PROMPTS[1], 4).json()["choices"][0]["text"]
    old_pid = child.proc.pid
    os.kill(_follower_pid(child), signal.SIGKILL)
    t_kill = time.monotonic()

    _wait_unhealthy(child.url, t_kill, "prefill instance")
    health = httpx.get(f"{child.url}/health", timeout=5, trust_env=False).json()
    assert health["status"] == "engine_dead" and "tp rank 1" in health["dead"][0]
    a = _wait_released(child, _prefill_empty, t_kill)
    assert a["healthy"] is False and a["ranks"]["1"]["dead"]
    _wait_unhealthy(system.url, t_kill, "router")

    t0 = time.monotonic()
    r = _greedy(system.url, PROMPTS[1], 4)  # refused at once with a reason (or served, after a fast restart)
    if r.status_code != 200:
        assert r.status_code == 503 and time.monotonic() - t0 < 5.0, r.text
        assert "prefill" in r.json()["error"]["message"]

    _wait_serving(system, child, old_pid, t_kill)
    assert _greedy(system.url, PROMPTS[1], 4).json()["choices"][0]["text"] == want  # the restarted ranks: same model
    assert _accounting(child)["healthy"]


def test_a_decode_follower_killed_mid_stream_fails_the_request_cleanly_and_is_restarted(tmp_path_factory):
    with _start(tmp_path_factory, 1, 2) as system:
        child = _child(system, "decode")
        old_pid, rank_pid = child.proc.pid, _follower_pid(child)
        body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        events, t_kill = [], 0.0
        with httpx.stream("POST", f"{system.url}/v1/completions", json=body, timeout=60, trust_env=False) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 3:
                    os.kill(rank_pid, signal.SIGKILL)
                    t_kill = time.monotonic()
        assert t_kill, "the stream ended before the kill"
        assert time.monotonic() - t_kill < 10.0, "the stream outlived its dead rank by more than 10 s"
        assert "error" in events[-1], events[-1]  # an in-band error, not a truncated stream
        assert len(events) < 900

        _wait_unhealthy(child.url, t_kill, "decode instance")
        a = _wait_released(child, lambda a: a["rx_reservations"] == 0 and a["draining"] == 0 and a["kv_blocks_used"] == 0, t_kill)
        assert a["ranks"]["1"]["dead"]
        _wait_unhealthy(system.url, t_kill, "router")
        pa = _accounting(_child(system, "prefill"))
        assert _prefill_empty(pa), pa
        _wait_serving(system, child, old_pid, t_kill)
