"""One command for the whole system, or one part of it per host.

``serve(role="all")`` starts each engine instance (prefill, decode, or one colocated engine) as a
child process running ``python -m hawk.serve.launcher --child ...``, waits until each answers
/health, then runs the router in the foreground. Ctrl-C or SIGTERM stops the router, then the
children (each closes its instance, which releases its registered buffers), then returns.

Children bind their own port (0 = any free one) and report it through a small "ready file", so
nothing races for ports. Each child watches its parent and shuts down if the parent disappears,
so a killed launcher leaves no orphans holding memory.

Each child also watches its own engine threads and exits if one dies (a process whose engine is
dead only looks alive). A supervisor thread in the launcher restarts any child that exits, on the
same port, with backoff and a bounded number of attempts; meanwhile the router answers 503.

The launcher makes a per-cluster secret and hands it to its children in $HAWK_CLUSTER_SECRET
(never on a command line, where ``ps`` shows it); the router sends it on internal calls and the
KV control channel tags its frames with it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hawk.serve.common import (
    CLUSTER_SECRET_ENV,
    LOOPBACK,
    ThreadedServer,
    bind_socket,
    cluster_secret_from_env,
    engine_alive,
    is_loopback,
    serve_foreground,
    set_torch_threads,
    url_of,
)

log = logging.getLogger("hawk.serve")

ROLES = ("all", "router", "prefill", "decode", "colocated")
ENGINE_ROLES = ("prefill", "decode", "colocated")
EXIT_ENGINE_DEAD = 75  # a child whose engine thread died exits with this, for the supervisor
MAX_RESTARTS = 5  # attempts per child before the supervisor gives up on it
RESTART_BACKOFF_S = (0.5, 10.0)  # first wait, longest wait (doubling in between)
STABLE_S = 60.0  # a child up this long has its restart count forgotten


class UsageError(ValueError):
    """A bad option, found before anything starts; the CLI prints it on one line and exits 2."""


# ============================================================================ checking options


def check_model_spec(spec: str) -> None:
    """Raises UsageError unless ``spec`` names a model the loader can find (nothing is loaded)."""
    from hawk.engine.loader import EMBEDDED, RANDOM_PRESETS, embedded_path

    if spec in EMBEDDED:
        try:
            embedded_path(spec)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return
    path = Path(spec).expanduser()
    if spec in RANDOM_PRESETS or (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()):
        return
    if spec and path.exists():
        raise UsageError(f"--model {spec!r}: not a .gguf file nor a directory with config.json")
    raise UsageError(f"unknown --model {spec!r}: expected one of {', '.join([*EMBEDDED, *RANDOM_PRESETS])}, a .gguf file, or a Hugging Face checkpoint directory")


def check_port(port: int, what: str = "--port") -> None:
    if not 0 <= port <= 65535:
        raise UsageError(f"{what} must be in 0..65535 (0 = any free port), got {port}")


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")


def check_bind(host: str, what: str, allow_remote: bool) -> None:
    """Binding beyond loopback exposes a server to the network: only on purpose, and logged."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise UsageError(f"{what} {host} is not a loopback address: it would listen on the network; pass --allow-remote to do that on purpose")
    log.warning("%s %s: listening beyond loopback (--allow-remote); use --api-key and a cluster secret", what, host)


def read_cluster_secret(path: str | None) -> str | None:
    """The secret of a cluster run as separate roles: from ``path``, else $HAWK_CLUSTER_SECRET."""
    if path is None:
        return cluster_secret_from_env()
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise UsageError(f"--cluster-secret-file {path}: {e.strerror or e}") from None
    if not secret:
        raise UsageError(f"--cluster-secret-file {path} is empty")
    return secret


# ============================================================================ one instance (a child)


def build_instance(role: str, cfg: Any) -> Any:
    """Load the model and assemble the instance for ``role`` (this is where the seconds go)."""
    from hawk.engine.instances import ColocatedInstance, DecodeInstance, PrefillInstance

    if role == "prefill":
        return PrefillInstance(cfg)
    if role == "decode":
        return DecodeInstance(cfg)
    if role == "colocated":
        return ColocatedInstance(cfg)
    raise ValueError(f"not an engine role: {role!r} (expected one of {ENGINE_ROLES})")


def instance_app(role: str, instance: Any, close_on_shutdown: bool = True, cluster_secret: str | None = None) -> Any:
    """The FastAPI app for an instance of ``role``."""
    if role == "prefill":
        from hawk.serve.prefill_server import create_prefill_app

        return create_prefill_app(instance, close_on_shutdown, cluster_secret)
    if role == "decode":
        from hawk.serve.decode_server import create_decode_app

        return create_decode_app(instance, close_on_shutdown, cluster_secret)
    from hawk.serve.colocated_server import create_colocated_app

    return create_colocated_app(instance, close_on_shutdown, cluster_secret)


def instance_engines(role: str, instance: Any) -> list[Any]:
    """The engines whose threads keep an instance of ``role`` alive."""
    return [instance.prefill, instance.decode] if role == "colocated" else [instance.engine]


def _watch_engines(role: str, engines: list[Any], interval_s: float = 0.5) -> None:
    """Exit the process once an engine thread has died: nothing it holds will ever finish, and
    an exit is what the supervisor sees and restarts (open connections break, so in-flight
    requests fail at once instead of waiting out their timeouts)."""

    def watch() -> None:
        while all(engine_alive(e) for e in engines):
            time.sleep(interval_s)
        log.critical("%s engine thread died: exiting (%d) so the launcher restarts this instance", role, EXIT_ENGINE_DEAD)
        logging.shutdown()
        os._exit(EXIT_ENGINE_DEAD)

    threading.Thread(target=watch, name="hawk-engine-watch", daemon=True).start()


def run_instance(
    role: str,
    cfg: Any,
    host: str = LOOPBACK,
    port: int = 0,
    threads: int | None = None,
    ready_file: str | None = None,
    parent_pid: int | None = None,
    log_level: str = "warning",
    cluster_secret: str | None = None,
) -> None:
    """Serve one engine instance in the foreground until SIGINT/SIGTERM (or the parent's death).

    ``cluster_secret`` (default: $HAWK_CLUSTER_SECRET) guards /internal/* and the KV control
    channel, which reads it from the environment: it is put there for that."""
    set_torch_threads(threads)
    sock = bind_socket(host, port)  # before loading: a busy port fails in a second, not after the model
    if cluster_secret:
        os.environ[CLUSTER_SECRET_ENV] = cluster_secret  # for the control channel's ControlServer/Client
    instance = build_instance(role, cfg)
    try:
        app = instance_app(role, instance, cluster_secret=cluster_secret)
    except BaseException:
        instance.close()
        raise
    url = url_of(sock)
    _watch_engines(role, instance_engines(role, instance))
    if parent_pid is not None:
        _watch_parent(parent_pid)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(json.dumps({"url": url, "pid": os.getpid(), "role": role}))
        os.replace(tmp, ready_file)
    else:
        print(f"HAWK {role} instance on {url} ({cfg.model}, {cfg.transfer})", flush=True)
    serve_foreground(app, sock, log_level)


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                log.warning("launcher %d is gone: shutting down", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="hawk-parent-watch", daemon=True).start()


# ============================================================================ children (the cluster)


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    ready_file: Path
    log_path: Path | None
    url: str = ""
    spec: dict[str, Any] = field(default_factory=dict)  # how to start it again
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    up_since: float = 0.0


@dataclass
class Cluster:
    """Engine child processes, started and healthy; ``close`` stops them."""

    children: list[Child] = field(default_factory=list)
    workdir: Path | None = None  # holds the children's ready files
    startup_timeout_s: float = 300.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None

    @property
    def prefill_urls(self) -> list[str]:
        return [c.url for c in self.children if c.role in ("prefill", "colocated")]

    @property
    def decode_urls(self) -> list[str]:
        return [c.url for c in self.children if c.role in ("decode", "colocated")]

    def supervise(self, max_restarts: int = MAX_RESTARTS) -> Cluster:
        """Restart children that exit, from a background thread, until ``close``."""
        self._supervisor = threading.Thread(target=self._supervise, args=(max_restarts,), name="hawk-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self, max_restarts: int) -> None:
        given_up: set[int] = set()
        while not self._stop.wait(0.2):
            for i, c in enumerate(self.children):
                code = c.proc.poll()  # also reaps it: no zombie is left behind
                if code is None:
                    if c.restarts and time.monotonic() - c.up_since > STABLE_S:
                        c.restarts = 0
                    continue
                if i in given_up:
                    continue
                if c.restarts >= max_restarts:
                    log.error("%s instance %s exited (%s) and was restarted %d times: giving up on it", c.role, c.url, code, c.restarts)
                    given_up.add(i)
                    continue
                wait = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2**c.restarts)
                c.restarts += 1
                log.error("%s instance %s exited with code %s: restarting it in %.1f s (attempt %d/%d)", c.role, c.url, code, wait, c.restarts, max_restarts)
                if self._stop.wait(wait):
                    return
                self._restart(c)

    def _restart(self, c: Child) -> None:
        """Start ``c`` again on its old port (so the router's URL for it stays right)."""
        c.ready_file.unlink(missing_ok=True)
        port = int(c.url.rsplit(":", 1)[1]) if c.url else 0
        c.proc = _popen({**c.spec, "port": port}, c.env, c.log_path)
        c.url = ""
        try:
            _wait_ready(c, time.monotonic() + self.startup_timeout_s)
        except RuntimeError as e:  # it exited again (or hung): the loop sees it and tries again
            log.error("restarting %s instance failed: %s", c.role, e)
            if c.proc.poll() is None:
                c.proc.kill()
            return
        c.up_since = time.monotonic()
        log.warning("%s instance is back on %s", c.role, c.url)

    def close(self, timeout_s: float = 20.0) -> None:
        """SIGTERM each child (graceful: it closes its instance), then SIGKILL any that hang."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout_s)
        for c in self.children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s child %d did not stop; killing it", c.role, c.proc.pid)
                c.proc.kill()
                c.proc.wait(5)
            c.ready_file.unlink(missing_ok=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _spawn(
    role: str, cfg: Any, host: str, threads: int | None, workdir: Path, index: int, log_dir: Path | None, log_level: str,
    cluster_secret: str | None = None,
) -> Child:
    ready = workdir / f"{role}-{index}.json"
    spec = {
        "role": role, "config": dataclasses.asdict(cfg), "host": host, "port": 0, "threads": threads,
        "ready_file": str(ready), "parent_pid": os.getpid(), "log_level": log_level,
    }
    env = dict(os.environ)
    if threads is not None:  # OpenMP reads this at import, before torch.set_num_threads runs
        env["OMP_NUM_THREADS"] = str(threads)
    if cluster_secret:
        env[CLUSTER_SECRET_ENV] = cluster_secret  # in the environment: a command line is public
    log_path = log_dir / f"{role}-{index}.log" if log_dir is not None else None
    return Child(role, _popen(spec, env, log_path), ready, log_path, spec=spec, env=env, up_since=time.monotonic())


def _popen(spec: dict[str, Any], env: dict[str, str], log_path: Path | None) -> subprocess.Popen:
    out = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "hawk.serve.launcher", "--child", json.dumps(spec)],
            env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()


def _log_tail(path: Path | None, n: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()[-n:]
    return "\n" + "\n".join(f"    {ln}" for ln in lines)


def _wait_ready(c: Child, deadline: float) -> None:
    while True:
        code = c.proc.poll()
        if code is not None:
            raise RuntimeError(f"{c.role} instance exited with code {code} while starting{_log_tail(c.log_path)}")
        if not c.url and c.ready_file.exists():
            c.url = json.loads(c.ready_file.read_text())["url"]
        if c.url:
            try:
                if httpx.get(f"{c.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{c.role} instance did not become healthy in time{_log_tail(c.log_path)}")
        time.sleep(0.1)


def start_cluster(
    cfg: Any,
    num_prefill: int = 1,
    num_decode: int = 1,
    threads: int | None = None,
    host: str = LOOPBACK,
    log_dir: str | Path | None = None,
    startup_timeout_s: float = 300.0,
    log_level: str = "warning",
    cluster_secret: str | None = None,
) -> Cluster:
    """Start the engine processes for ``cfg`` (one colocated engine when ``cfg.transfer`` is
    "colocated") and wait until all are healthy. ``threads`` defaults to an even share of the
    cores per process."""
    roles = ["colocated"] if cfg.transfer == "colocated" else ["prefill"] * num_prefill + ["decode"] * num_decode
    if cfg.transport == "local" and len(roles) > 1:
        raise ValueError("transport 'local' works inside one process only; prefill and decode run as separate processes here (use nixl or mooncake)")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"need at least one prefill and one decode instance, got {num_prefill} and {num_decode}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // len(roles))
    workdir = Path(tempfile.mkdtemp(prefix="hawk-serve-"))
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir=workdir, startup_timeout_s=startup_timeout_s)
    counts: dict[str, int] = {}
    try:
        for role in roles:
            counts[role] = counts.get(role, 0) + 1
            cluster.children.append(_spawn(role, cfg, host, threads, workdir, counts[role] - 1, logs, log_level, cluster_secret))
        deadline = time.monotonic() + startup_timeout_s
        for c in cluster.children:
            _wait_ready(c, deadline)
    except BaseException:
        cluster.close()
        raise
    return cluster


# ============================================================================ serve


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so cleanup in ``finally`` blocks runs (uvicorn re-raises the
    signal it shut down on; the default SIGTERM action would kill us before the children stop)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _advertised_host(host: str) -> str:
    """The address peers should use to reach a server bound on ``host``."""
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return LOOPBACK
    return host


def instance_config(
    model: str = "smollm2-135m",
    transfer: str = "gn-hawk",
    transport: str = "nixl",
    prefill_device: str = "cpu",
    decode_device: str = "npu-emu:cpu",
    arch: str = "blackhole-p150a",
    kv_dtype: str = "bf16",
    dtype: str = "fp32",
    kv_tokens: int = 8192,
    staging_mb: int = 64,
    rx_mb: int = 64,
    landing_mode: str = "auto",
    post: str = "pull",
    kv_host: str = LOOPBACK,
    seed: int = 0,
    npu_shard_pages: int = 1,
) -> Any:
    """An ``InstanceConfig`` from the launcher's options (validated early, before any process starts)."""
    from hawk.engine.instances import InstanceConfig

    return InstanceConfig(
        model=model, dtype=dtype, transfer=transfer, transport=transport, prefill_device=prefill_device,
        decode_device=decode_device, arch=arch, kv_dtype=kv_dtype, kv_tokens=kv_tokens, staging_mb=staging_mb,
        rx_mb=rx_mb, landing_mode=landing_mode, post=post, host=kv_host, seed=seed, npu_shard_pages=npu_shard_pages,
    ).validate()


def serve(
    host: str = LOOPBACK,
    port: int = 8000,
    role: str = "all",
    model: str = "smollm2-135m",
    transfer: str = "gn-hawk",
    transport: str = "nixl",
    prefill_device: str = "cpu",
    decode_device: str = "npu-emu:cpu",
    arch: str = "blackhole-p150a",
    kv_dtype: str = "bf16",
    npu_shard_pages: int = 1,
    prefill_urls: list[str] | None = None,
    decode_urls: list[str] | None = None,
    num_prefill: int = 1,
    num_decode: int = 1,
    threads: int | None = None,
    dtype: str = "fp32",
    kv_tokens: int = 8192,
    staging_mb: int = 64,
    rx_mb: int = 64,
    landing_mode: str = "auto",
    post: str = "pull",
    kv_host: str | None = None,
    seed: int = 0,
    default_temperature: float = 1.0,
    log_dir: str | None = None,
    log_level: str = "warning",
    startup_timeout_s: float = 300.0,
    api_key: str | None = None,
    cluster_secret_file: str | None = None,
    allow_remote: bool = False,
    max_body_mb: float | None = None,
    max_restarts: int = MAX_RESTARTS,
) -> None:
    """Run HAWK (or one part of it) in the foreground until Ctrl-C / SIGTERM.

    role:
      "all"        router on host:port + engine children on free loopback ports (prefill and decode,
                   or one colocated engine when transfer="colocated").
      "router"     only the router, in front of ``prefill_urls`` and ``decode_urls``.
      "prefill" / "decode" / "colocated"
                   one engine instance on host:port, for a router elsewhere.
    model: "smollm2-135m" (embedded default), a preset (tiny, llama-3.1-8b, ...), a .gguf file or an
      HF checkpoint directory.  transfer: gn-hawk | gn-host | gn-direct-single | gg-direct | gg-host |
      colocated.  transport: nixl | mooncake | local (same process only).  prefill_device: cpu |
      cuda:N.  decode_device: npu-emu:cpu | npu-emu:cuda:N (gn-*) or cpu | cuda:N (gg-*).
      arch: the emulated NPU (blackhole-p150a, ...).  kv_dtype: the NPU KV dtype, bf16 | bfp8_b.
      npu_shard_pages: the NPU cache's page map: 1 = tt-metal interleaved, more = block-cyclic shards.
    threads: torch threads per engine process (default: the cores shared evenly among them).
    kv_host: the address the prefill's KV control socket binds and advertises (default: host, or
      this machine's address when host is a wildcard).
    default_temperature: used when a request omits temperature (OpenAI's default is 1.0).
    log_dir: where children write their logs (default: they share this terminal).
    api_key: clients of the router must send ``Authorization: Bearer <api_key>`` (default:
      $HAWK_API_KEY; none = open).  cluster_secret_file: the secret shared by separately run roles
      (default: $HAWK_CLUSTER_SECRET; role "all" makes its own).  allow_remote: permit binding a
      non-loopback address.  max_body_mb: the router's request-size limit.
    max_restarts: how often a crashed engine child is restarted before the launcher gives up.
    """
    if role not in ROLES:
        raise UsageError(f"unknown role {role!r}; expected one of {ROLES}")
    check_port(port)
    check_threads(threads)
    check_bind(host, "--host", allow_remote)
    if kv_host is not None:
        check_bind(kv_host, "--kv-host", allow_remote)
    if max_body_mb is not None and max_body_mb <= 0:
        raise UsageError(f"--max-body-mb must be positive, got {max_body_mb}")
    if role != "router":
        check_model_spec(model)
    secret = read_cluster_secret(cluster_secret_file)
    if role == "all":
        secret = secret or secrets.token_urlsafe(32)
    elif not secret:
        log.warning("no cluster secret (--cluster-secret-file or $%s): internal endpoints and the KV control channel are unauthenticated", CLUSTER_SECRET_ENV)
    max_body = None if max_body_mb is None else int(max_body_mb * 2**20)
    from hawk.serve.router import RouterConfig, create_router_app

    def router_config(p_urls: list[str], d_urls: list[str]) -> RouterConfig:
        return RouterConfig(
            list(p_urls), list(d_urls), default_temperature=default_temperature, startup_timeout_s=startup_timeout_s,
            api_key=api_key, cluster_secret=secret, max_body_bytes=max_body,
        )

    with _sigterm_as_interrupt():
        try:
            if role == "router":
                if not prefill_urls or not decode_urls:
                    raise ValueError("role 'router' needs prefill_urls and decode_urls")
                sock = bind_socket(host, port)
                app = create_router_app(router_config(prefill_urls, decode_urls))
                print(f"HAWK router on {url_of(sock)} -> prefill {prefill_urls}, decode {decode_urls}", flush=True)
                serve_foreground(app, sock, log_level)
                return
            cfg = instance_config(
                model, transfer, transport, prefill_device, decode_device, arch, kv_dtype, dtype, kv_tokens,
                staging_mb, rx_mb, landing_mode, post, kv_host or _advertised_host(host), seed, npu_shard_pages,
            )
            if role in ENGINE_ROLES:
                run_instance(role, cfg, host, port, threads, log_level=log_level, cluster_secret=secret)
                return
            if host in (LOOPBACK, "localhost"):
                os.environ.setdefault("UCX_NET_DEVICES", "lo")  # keep UCX (NIXL) off other interfaces
            sock = bind_socket(host, port)  # fail fast on a busy port, before loading any model
            n = 1 if transfer == "colocated" else num_prefill + num_decode
            print(f"HAWK: starting {n} engine process(es) for {model} ({transfer}); the router opens {url_of(sock)} when they are up", flush=True)
            with start_cluster(cfg, num_prefill, num_decode, threads, LOOPBACK, log_dir, startup_timeout_s, log_level, secret) as cluster:
                cluster.supervise(max_restarts)
                app = create_router_app(router_config(cluster.prefill_urls, cluster.decode_urls))
                print(f"HAWK serving {model} ({transfer} over {transport}) at {url_of(sock)}/v1", flush=True)
                serve_foreground(app, sock, log_level)
        except KeyboardInterrupt:
            pass  # Ctrl-C / SIGTERM: children were stopped by the ``with`` block


@dataclass
class RunningSystem:
    """A whole HAWK system held by this process: engine children and a router in a thread."""

    cluster: Cluster
    router: ThreadedServer

    @property
    def url(self) -> str:
        return self.router.url

    def close(self) -> None:
        try:
            self.router.stop()
        finally:
            self.cluster.close()

    def __enter__(self) -> RunningSystem:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def start_system(
    cfg: Any,
    num_prefill: int = 1,
    num_decode: int = 1,
    threads: int | None = None,
    port: int = 0,
    log_dir: str | Path | None = None,
    default_temperature: float = 1.0,
    startup_timeout_s: float = 300.0,
    api_key: str | None = None,
    max_restarts: int = MAX_RESTARTS,
    max_body_bytes: int | None = None,
) -> RunningSystem:
    """``serve(role="all")`` without taking over the foreground: for the demo and tests."""
    from hawk.serve.router import RouterConfig, create_router_app

    if cfg.transport != "local":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    secret = secrets.token_urlsafe(32)
    cluster = start_cluster(cfg, num_prefill, num_decode, threads, LOOPBACK, log_dir, startup_timeout_s, cluster_secret=secret)
    try:
        cluster.supervise(max_restarts)
        app = create_router_app(RouterConfig(
            cluster.prefill_urls, cluster.decode_urls, default_temperature=default_temperature, api_key=api_key,
            cluster_secret=secret, max_body_bytes=max_body_bytes,
        ))
        router = ThreadedServer(app, LOOPBACK, port).start()
    except BaseException:
        cluster.close()
        raise
    return RunningSystem(cluster, router)


# ============================================================================ python -m


def _child_main(spec_json: str) -> None:
    from hawk.engine.instances import InstanceConfig

    spec = json.loads(spec_json)
    cfg = InstanceConfig(**spec["config"])
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "warning").upper(), logging.WARNING))
    with _sigterm_as_interrupt():
        try:
            run_instance(spec["role"], cfg, spec["host"], spec["port"], spec["threads"], spec["ready_file"], spec["parent_pid"], spec["log_level"])
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m hawk.serve.launcher [--role ...]``: the same options as :func:`serve`."""
    p = argparse.ArgumentParser(prog="python -m hawk.serve.launcher", description="Run HAWK's servers.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--role", default="all", choices=ROLES)
    p.add_argument("--host", default=LOOPBACK)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--transfer", default="gn-hawk")
    p.add_argument("--transport", default="nixl")
    p.add_argument("--prefill-device", default="cpu")
    p.add_argument("--decode-device", default="npu-emu:cpu")
    p.add_argument("--arch", default="blackhole-p150a")
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--prefill-url", action="append", dest="prefill_urls")
    p.add_argument("--decode-url", action="append", dest="decode_urls")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--threads", type=int)
    p.add_argument("--kv-tokens", type=int, default=8192)
    p.add_argument("--log-dir")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--api-key")
    p.add_argument("--cluster-secret-file")
    p.add_argument("--allow-remote", action="store_true")
    p.add_argument("--max-body-mb", type=float)
    a = p.parse_args(argv)
    if a.child:
        _child_main(a.child)
        return
    logging.basicConfig(level=getattr(logging, a.log_level.upper(), logging.WARNING))
    try:
        serve(
            host=a.host, port=a.port, role=a.role, model=a.model, transfer=a.transfer, transport=a.transport,
            prefill_device=a.prefill_device, decode_device=a.decode_device, arch=a.arch, kv_dtype=a.kv_dtype,
            prefill_urls=a.prefill_urls, decode_urls=a.decode_urls, num_prefill=a.num_prefill, num_decode=a.num_decode,
            threads=a.threads, kv_tokens=a.kv_tokens, log_dir=a.log_dir, log_level=a.log_level,
            api_key=a.api_key, cluster_secret_file=a.cluster_secret_file, allow_remote=a.allow_remote, max_body_mb=a.max_body_mb,
        )
    except UsageError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
