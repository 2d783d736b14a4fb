"""Supervision with real processes: an engine child SIGKILLed under a running system is noticed
(router /health non-200 within 5 s, requests refused with a clear 503 rather than hanging) and
restarted by the launcher, which serves again within 60 s without anyone stepping in.

The engines run the random-weight ``tiny`` preset, with NIXL over loopback between them.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.serve.launcher import instance_config, start_system  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

GOOD = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
SECRET = "an-operator-chose-this-secret"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    if not available("nixl"):
        pytest.skip("NIXL is not installed (separate processes need it)")
    secret = tmp_path_factory.mktemp("secret") / "cluster-secret"
    secret.write_text(SECRET + "\n")
    cfg = instance_config(model="tiny", kv_tokens=512, staging_mb=4, rx_mb=4, cluster_secret_file=str(secret))
    s = start_system(cfg, threads=1, log_dir=tmp_path_factory.mktemp("supervision-logs"), startup_timeout_s=120)
    yield s
    s.close()


def _completion(url: str, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=GOOD, timeout=timeout, trust_env=False)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_killed_engine_is_reported_and_restarted(system, role):
    url = system.url
    assert _completion(url).status_code == 200
    child = next(c for c in system.cluster.children if c.role == role)
    old_pid = child.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    t_kill = time.monotonic()

    while httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:  # noticed
        assert time.monotonic() - t_kill < 5.0, "router /health still 200 five seconds after the kill"
        time.sleep(0.1)

    t0 = time.monotonic()
    r = _completion(url)  # while it is down: refused at once, with a reason
    if r.status_code != 200:  # (a fast restart may already be serving)
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 5.0
        assert role in r.json()["error"]["message"]

    while True:  # back without anyone's help
        r = _completion(url)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert time.monotonic() - t_kill < 60.0, f"not serving 60 s after the kill: {r.text}"
        time.sleep(0.5)
    assert child.proc.pid != old_pid and child.proc.poll() is None
    assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4


def _instances(url: str) -> dict[str, str]:
    """Role -> URL of each engine instance, as the router's /health names them ("ROLE URL")."""
    body = httpx.get(f"{url}/health", timeout=5, trust_env=False).json()
    return {key.split(" ", 1)[0]: key.split(" ", 1)[1] for key in body["instances"]}


def test_an_operator_reads_the_accounting_of_a_system_it_started(system):
    """The documented way (docs/serving.md): start with --cluster-secret-file, find the instances
    in the router's /health, send the secret. Role "all" uses the operator's secret (it used to
    make its own, which nobody outside could know)."""
    for role, inst in _instances(system.url).items():
        r = httpx.get(f"{inst}/internal/accounting", headers={"Authorization": f"Bearer {SECRET}"}, timeout=10, trust_env=False)
        assert r.status_code == 200, (role, r.text)
        assert r.json()["role"] == role
        assert httpx.get(f"{inst}/internal/accounting", timeout=10, trust_env=False).status_code == 401


def test_ps_tells_the_engine_processes_apart(system):
    """Each engine child's command line names its role (``hawk-engine=decode-0``): ``ps`` and
    ``pgrep -f`` tell prefill from decode without reading environments."""
    for child in system.cluster.children:
        argv = open(f"/proc/{child.proc.pid}/cmdline", "rb").read().split(b"\0")
        assert f"hawk-engine={child.role}-0".encode() in argv, argv

