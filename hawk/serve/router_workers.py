"""Several router processes behind one port (vLLM's ``--api-server-count``).

Why: the router relays every token of every stream (a read from the decode instance, a write to
the client) on one event loop, and that loop is the first thing to saturate on a GPU host: on one
H200 at 30 req/s (8B shape, colocated) the router process used 89 % of a core while the engine's
decode thread mostly waited on the GPU (``benchmarks/serving_host_profile.sh``, docs/throughput.md).
N workers spread that over N cores.

Each worker is a whole router: its own instance pool, health probes and HTTP clients, serving the
listening socket the launcher bound (inherited by file descriptor; the kernel hands each new
connection to one of them). Their counters and histograms are one set: the workers share a
prometheus_client multiprocess directory, and whichever answers ``/metrics`` sums all of them.

Lifecycle, once:
  1 the launcher binds the port (and starts its engine children), then ``RouterWorkers.run``:
  2 spawn N workers, each with the router's config in its environment (it holds the API key and the
    cluster secret: never on a command line), the socket's descriptor, and the metrics directory;
    only the first sends the warm-up requests
  3 wait in the foreground; a worker that exits is started again (``max_restarts`` in all), so the
    port keeps being served while the launcher lives
  4 on SIGINT / SIGTERM (KeyboardInterrupt here): every worker gets SIGINT (uvicorn's graceful
    stop), then SIGKILL after a grace period; the metrics directory is removed. A worker whose
    launcher dies without that stops itself (it watches its parent), as engine children do.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from hawk.serve.common import serve_foreground, stop_processes, watch_parent
from hawk.serve.metrics import MULTIPROC_ENV

#: Router processes by default where an engine computes on a GPU and the host has
#: :data:`MANY_CORES` cores or more. On one H200 with 16 cores (8B shape, colocated, 256 streams of 300
#: tokens; benchmarks/router_probe.py) one router relayed 2,095 tokens/s at 471 us of its CPU per
#: token, four relayed 12,308 at 156 (benchmarks/results/router_probe_h200_x1.json, _x4.json).
GPU_ROUTER_PROCESSES = 4
MANY_CORES = 16

log = logging.getLogger(__name__)

#: the worker's spec (JSON: the socket's descriptor, the router config, the log level)
WORKER_SPEC_ENV = "HAWK_ROUTER_WORKER"
STOP_GRACE_S = 15.0
RESTART_BACKOFF_S = 1.0


class RouterWorkers:
    """N router processes on one bound socket; ``run`` blocks until interrupted."""

    def __init__(self, router_cfg: Any, sock: socket.socket, count: int, log_level: str = "warning", max_restarts: int = 5):
        if count < 1:
            raise ValueError(f"router workers: need at least 1, got {count}")
        self.cfg, self.sock, self.count, self.log_level = router_cfg, sock, count, log_level
        self.restarts_left = max_restarts
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.metrics_dir = tempfile.mkdtemp(prefix="hawk-router-metrics-")

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        cfg = dataclasses.replace(self.cfg, warmup=self.cfg.warmup and index == 0)
        spec = {"fd": self.sock.fileno(), "config": dataclasses.asdict(cfg), "log_level": self.log_level}
        env = {**os.environ, WORKER_SPEC_ENV: json.dumps(spec), MULTIPROC_ENV: self.metrics_dir}
        return subprocess.Popen([sys.executable, "-m", "hawk.serve.router_workers"], env=env, pass_fds=(self.sock.fileno(),))

    def start(self) -> RouterWorkers:
        for i in range(self.count):
            self.procs[i] = self._spawn(i)
        return self

    def watch_once(self) -> None:
        """Start again a worker that exited (while restarts are left)."""
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is None:
                continue
            if self.restarts_left <= 0:
                raise RuntimeError(f"router worker {i} exited with {p.returncode} and no restarts are left")
            log.error("router worker %d (pid %d) exited with %s; starting it again", i, p.pid, p.returncode)
            self.restarts_left -= 1
            time.sleep(RESTART_BACKOFF_S)
            self.procs[i] = self._spawn(i)

    def run(self) -> None:
        """Serve until KeyboardInterrupt (SIGINT, or SIGTERM turned into it by the launcher)."""
        self.start()
        try:
            while True:
                self.watch_once()
                time.sleep(0.5)
        finally:
            self.stop()

    def stop(self) -> None:
        stop_processes([(f"router worker {i}", p) for i, p in enumerate(self.procs) if p is not None], signal.SIGINT, STOP_GRACE_S)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

def router_processes(cfg: Any) -> tuple[int, str]:
    """How many router processes serve the port, and why: ``--api-server-count`` if given, else
    :data:`GPU_ROUTER_PROCESSES` on a many-core GPU host (where one event loop caps the token rate
    below the engine's), else 1 (a CPU engine is far slower than one router)."""
    if cfg.api_server_count is not None:
        return cfg.api_server_count, "--api-server-count"
    on_gpu = any(str(d).startswith("cuda") for d in (cfg.prefill_device, cfg.decode_device, cfg.decode_compute_device))
    cores = os.cpu_count() or 1
    if cfg.role == "all" and on_gpu and cores >= MANY_CORES:
        return GPU_ROUTER_PROCESSES, f"an engine on a GPU and {cores} cores"
    return 1, "the default off a many-core GPU host"



def main() -> None:
    """A worker: the router app on the inherited socket, in the foreground."""
    from hawk.serve.router import RouterConfig, create_router_app

    spec = json.loads(os.environ.pop(WORKER_SPEC_ENV))
    logging.basicConfig(level=getattr(logging, spec["log_level"].upper(), logging.WARNING))
    sock = socket.socket(fileno=spec["fd"])
    watch_parent(os.getppid())  # SIGTERM: uvicorn's graceful stop, as on SIGINT
    # uvicorn handles SIGINT while it serves, then raises it again; a Ctrl-C reaches the launcher's whole
    # process group and the launcher then signals each worker too, and asyncio's own handler would turn
    # that second signal into a KeyboardInterrupt inside the loop, mid-shutdown. This handler keeps asyncio's out.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    serve_foreground(create_router_app(RouterConfig(**spec["config"])), sock, spec["log_level"])


if __name__ == "__main__":
    main()

