"""Starting stock vLLM servers with HawkConnector, and reading what HAWK holds in them.

For the tests, the P/D benchmark and users who want the command lines spelled out; nothing here is needed
to run HawkConnector (vLLM loads it from ``--kv-transfer-config`` alone).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hawk.connector.control import ControlClient
from hawk.connector.messages import Error, Holdings, Inspect

MODULE = "hawk.integrations.vllm"

_handed_ports: set[int] = set()
_ports_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out before by this process. Why: picked one at a time, the OS may
    give a just-released port again, and two servers of one test cluster were given the same one (the
    second then answered for the first)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _ports_lock:
            if port not in _handed_ports:
                _handed_ports.add(port)
                return port


def hawk_transfer_config(role: str, load_failure_policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for HawkConnector; ``extra`` goes to ConnectorSettings (settings.py).

    ``load_failure_policy`` is vLLM's own (``kv_load_failure_policy``): what a decode does with a request
    whose pull failed (its prefill died, say): ``recompute`` its prompt, or ``fail`` it (vLLM's default)."""
    return {"kv_connector": "HawkConnector", "kv_connector_module_path": MODULE, "kv_role": role,
            "kv_load_failure_policy": load_failure_policy, "kv_connector_extra_config": extra}


def nixl_transfer_config(role: str = "kv_both") -> dict[str, Any]:
    """vLLM's own P/D connector over NIXL, on the host (the CPU build has no device buffers)."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process on 127.0.0.1."""

    model_dir: str
    port: int
    served_name: str = "hawk-model"
    kv_transfer: dict[str, Any] | None = None
    kv_cache_bytes: int = 256 << 20  # the CPU build needs the KV size given (it cannot probe free memory)
    max_model_len: int = 2048
    prefix_caching: bool = True
    threads: int | None = None  # OpenMP threads (None: vLLM's choice); several servers on few cores want 1
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
             "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(self.max_model_len),
             "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        if not self.prefix_caching:
            a.append("--no-enable-prefix-caching")
        if self.kv_transfer is not None:
            a += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return a + self.extra_args

    def env(self) -> dict[str, str]:
        env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **self.extra_env}
        if self.threads is not None:  # unpinned: vLLM's default binds every server to the same cores
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(self.threads))
        return env

    def start(self, log: Path) -> VllmServer:
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until /health answers 200; raises with the reason if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server on port {self.port} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM server on port {self.port} not ready within {timeout_s:.0f}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            stop_group(self.proc, kill)


def stop_group(proc: subprocess.Popen, kill: bool = False) -> None:
    """End a process started with ``start_new_session`` and everything it started (vLLM's engine and worker
    processes): SIGTERM (SIGKILL with ``kill``, or after 30 s), then reap it."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 9 if kill else 15)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def kv_cache_usage(url: str) -> float:
    """vLLM's own count of KV blocks in use (``vllm:kv_cache_usage_perc`` on /metrics), 0..1."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{url}/metrics has no vllm:kv_cache_usage_perc")


def inspect(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """What a HawkConnector worker holds (its ledger), asked over its KV control socket."""
    client = ControlClient(address)
    try:
        reply = client.call(Inspect(), timeout_s)
    finally:
        client.close()
    if isinstance(reply, Error):
        raise RuntimeError(f"{address}: {reply.message}")
    assert isinstance(reply, Holdings)
    return reply.ledger
