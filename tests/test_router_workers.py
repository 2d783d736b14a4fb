"""``hawk serve --api-server-count N``: N router processes on one port (hawk/serve/router_workers.py).

A real launcher with the tiny model colocated on the CPU: requests on fresh connections are served,
the workers' metrics are one sum whichever worker answers, a killed worker is started again while the
others keep serving, and SIGTERM to the launcher ends every process and frees the port."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from hawk.bench.procs import children, cmdline, running
from hawk.config import ConfigError, defaults
from hawk.integrations.vllm.servers import free_port, stop_group
from hawk.serve.metrics import MULTIPROC_ENV

WORKERS = 2


def _workers_of(pid: int) -> list[int]:
    """The launcher's router worker processes (its children running hawk.serve.router_workers)."""
    out = []
    for child in children(pid):
        try:
            if "hawk.serve.router_workers" in cmdline(child):
                out.append(child)
        except OSError:
            continue
    return out


def _complete(url: str) -> dict:
    with httpx.Client(trust_env=False, timeout=60) as c:  # a new connection each time: any worker may take it
        r = c.post(f"{url}/v1/completions", json={"prompt": [10, 11, 12], "max_tokens": 3, "ignore_eos": True, "temperature": 0})
        r.raise_for_status()
        return r.json()


def _finished(url: str) -> float:
    with httpx.Client(trust_env=False, timeout=30) as c:
        text = c.get(f"{url}/metrics").text
    m = re.search(r'^hawk_request_finish_total\{reason="length"\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("workers") / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hawk", "serve", "--model", "tiny", "--transfer", "colocated", "--port", str(port),
                                 "--api-server-count", str(WORKERS), "--no-warmup"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200 and len(_workers_of(proc.pid)) == WORKERS:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_group(proc, kill=True)
            pytest.fail(f"hawk serve --api-server-count {WORKERS} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield proc, url, port
    stop_group(proc, kill=True)


def _finished_by(worker: int) -> float:
    """What one worker alone counted: its own file of the shared multiprocess directory, read apart."""
    env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0") if b"=" in kv)
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(Path(env[MULTIPROC_ENV.encode()].decode()) / f"counter_{worker}.db", d)
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=d)
        return reg.get_sample_value("hawk_request_finish_total", {"reason": "length"}) or 0.0


def test_requests_are_served_and_the_workers_metrics_are_one_sum(system):
    proc, url, _ = system
    workers = _workers_of(proc.pid)
    assert len(workers) == WORKERS
    with ThreadPoolExecutor(16) as pool:  # at once, on fresh connections: both workers take some
        done = list(pool.map(lambda _: _complete(url), range(32)))
    assert all(d["usage"]["completion_tokens"] == 3 for d in done)
    each = [_finished_by(w) for w in workers]
    assert all(n > 0 for n in each) and sum(each) == 32, each
    assert [_finished(url) for _ in range(6)] == [32.0] * 6  # each /metrics answer, from either worker, sums both


def test_a_killed_worker_is_started_again_and_the_port_keeps_serving(system):
    proc, url, _ = system
    first, *_ = _workers_of(proc.pid)
    os.kill(first, signal.SIGKILL)
    for _ in range(4):  # the other worker serves meanwhile (the dead one's accepted connections are lost, not new ones)
        assert _complete(url)["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 60
    while not (len(now := _workers_of(proc.pid)) == WORKERS and first not in now):
        assert time.monotonic() < deadline, f"worker {first} was not replaced: {now}"
        time.sleep(0.5)
    assert _complete(url)["usage"]["completion_tokens"] == 3


def test_sigterm_ends_every_process_and_frees_the_port(system):
    proc, _, port = system
    workers = _workers_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while live := [pid for pid in workers if running(pid)]:
        assert time.monotonic() < deadline, f"router workers {live} outlived their launcher"
        time.sleep(0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds it any more


def test_api_server_count_below_one_is_refused():
    with pytest.raises(ConfigError, match="api-server-count"):
        defaults(api_server_count=0).validate()


def test_router_processes_default_to_four_on_a_many_core_gpu_host_and_one_elsewhere(monkeypatch):
    from hawk.serve.router_workers import GPU_ROUTER_PROCESSES, router_processes

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    gpu = defaults(prefill_device="cuda:0", decode_device="npu-emu:cuda:0")
    assert router_processes(gpu)[0] == GPU_ROUTER_PROCESSES
    assert router_processes(defaults(prefill_device="cuda:0", transfer="colocated"))[0] == GPU_ROUTER_PROCESSES
    assert router_processes(defaults(api_server_count=2, prefill_device="cuda:0"))[0] == 2  # given wins
    assert router_processes(defaults())[0] == 1  # the CPU default
    assert router_processes(dataclasses.replace(gpu, role="router"))[0] == 1  # a router alone knows no engine
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert router_processes(gpu)[0] == 1


def test_sigint_ends_a_launcher_that_inherited_it_ignored():
    """A script's ``hawk serve ... &`` starts with SIGINT ignored (a non-interactive shell's background
    job); with router workers no uvicorn runs in the launcher to take SIGINT over, so the launcher must
    set it itself or ``kill -INT`` does nothing (it hung a GPU run's clean stop for minutes)."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "hawk", "serve", "--model", "tiny", "--transfer", "colocated", "--port", str(port),
                                 "--api-server-count", str(WORKERS), "--no-warmup"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            deadline = time.monotonic() + 240
            while len(workers := _workers_of(proc.pid)) < WORKERS or not _healthy(port):
                assert proc.poll() is None and time.monotonic() < deadline, "hawk serve did not come up"
                time.sleep(0.5)
            proc.send_signal(signal.SIGINT)  # to the launcher alone, as `kill -INT $pid` does
            proc.wait(timeout=60)
            deadline = time.monotonic() + 30
            while live := [pid for pid in workers if running(pid)]:
                assert time.monotonic() < deadline, f"router workers {live} outlived their launcher"
                time.sleep(0.2)
        finally:
            stop_group(proc, kill=True)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
