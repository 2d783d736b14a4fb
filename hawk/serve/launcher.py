"""One command for the whole system, or one part of it per host.

``serve(cfg)`` with ``cfg.role == "all"`` starts each engine instance (prefill, decode, or one
colocated engine) as a child process running ``python -m hawk.serve.launcher`` with
$HAWK_CHILD_SPEC naming a JSON file (a :class:`ChildSpec`: the role and the whole
``ServeConfig``, serialised, never an option list rebuilt by hand), waits until each answers
/health, then runs the router in the foreground. Ctrl-C or SIGTERM stops the router, then the
children (each closes its instance, which releases its registered buffers), then returns.

Children bind their own port (0 = any free one) and report it through a small "ready file", so
nothing races for ports. Each child watches its parent and shuts down if the parent disappears,
so a killed launcher leaves no orphans holding memory.

Each child also watches its own engine threads and exits if one dies (a process whose engine is
dead only looks alive). A supervisor thread in the launcher restarts any child that exits, on the
same port, with backoff and a bounded number of attempts; meanwhile the router answers 503.

The launcher uses the cluster secret given (``--cluster-secret-file`` or $HAWK_CLUSTER_SECRET), else
makes one, and hands it to its children in $HAWK_CLUSTER_SECRET (never on a command line, where ``ps``
shows it); the router sends it on internal calls and the KV control channel tags its frames with it.
An operator who wants to read an instance's /internal/accounting gives the secret, so it knows it.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

from hawk.config_cli import config_command
from hawk.config import ENGINE_ROLES, ConfigError, ServeConfig, defaults
from hawk.engine.gc_policy import freeze_startup_heap
from hawk.serve import cpu_binding
from hawk.serve.cpu_binding import CorePlan
from hawk.serve.common import (
    CLUSTER_SECRET_ENV,
    LOOPBACK,
    ThreadedServer,
    bind_socket,
    cluster_secret_from_env,
    engine_alive,
    is_loopback,
    raise_open_file_limit,
    serve_foreground,
    set_torch_threads,
    stop_processes,
    url_of,
    watch_parent,
)

log = logging.getLogger("hawk.serve")

CHILD_SPEC_ENV = "HAWK_CHILD_SPEC"  # a child's spec file (the environment: argv is public and short)
CHILD_ARG = "hawk-engine="  # the last word of a child's command line names it (see child_argv)
EXIT_ENGINE_DEAD = 75  # a child whose engine thread died exits with this, for the supervisor
EXIT_RANK_DEAD = 76  # a child one of whose tensor-parallel ranks died (after draining)
RANK_DRAIN_S = 15.0  # how long a child with a dead rank waits for its in-flight requests to let go
RANK_LINGER_S = 2.0  # then how long it stays up, unhealthy, with its (empty) accounting readable
RESTART_BACKOFF_S = (0.5, 10.0)  # first wait, longest wait (doubling in between)
STABLE_S = 60.0  # a child up this long has its restart count forgotten


class UsageError(ConfigError):
    """A bad option found by a check that needs more than the config (files, the network)."""


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


def model_split_dims(spec: str) -> tuple[int, int]:
    """``(KV heads, MLP width)`` of ``spec``, read from its metadata only (no weights loaded):
    what a tensor-parallel degree must divide."""
    from hawk.engine.config import ModelConfig, preset
    from hawk.engine.loader import EMBEDDED, RANDOM_PRESETS, embedded_path

    if spec in RANDOM_PRESETS:
        mc = preset(spec)
        return mc.num_kv_heads, mc.intermediate_size
    path = embedded_path(spec) if spec in EMBEDDED else Path(spec).expanduser()
    if path.is_dir():
        mc = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        return mc.num_kv_heads, mc.intermediate_size
    import gguf

    fields = gguf.GGUFReader(path).fields

    def value(key: str) -> int | None:
        f = fields.get(key)
        return None if f is None else int(f.contents())

    heads = value("llama.attention.head_count")
    return int(value("llama.attention.head_count_kv") or heads or 1), int(value("llama.feed_forward_length") or 1)


def check_tensor_parallel(cfg: ServeConfig) -> None:
    """Refuse a TP degree the model cannot be split by, before any process starts (a rank that
    found out while loading would take the whole start-up down with a traceback)."""
    wanted = {"prefill": cfg.prefill_tp, "decode": cfg.decode_tp}
    if cfg.role in ("prefill", "decode"):
        wanted = {cfg.role: wanted[cfg.role]}
    wanted = {k: v for k, v in wanted.items() if v > 1}
    if not wanted:
        return
    if cfg.transfer == "colocated" or cfg.role == "colocated":
        raise UsageError("--prefill-tp/--decode-tp need a disaggregated --transfer: the colocated engine runs on one device (TP 1)")
    try:
        heads, mlp = model_split_dims(cfg.model)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--model {cfg.model!r}: cannot read its shape to check the tensor-parallel degree ({e})") from None
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and mlp % d == 0]
    for role, tp in wanted.items():
        if tp not in fits:
            raise UsageError(
                f"--{role}-tp {tp}: {cfg.model} has {heads} KV heads (MLP width {mlp}); the degree must divide both: one of {', '.join(map(str, fits))}"
            )


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


def engine_threads(engines: list[Any]) -> list[threading.Thread]:
    """The engines' loop threads (the ones that compute; a stepped prefill has none)."""
    return [t for t in (getattr(e, "loop_thread", None) for e in engines) if isinstance(t, threading.Thread)]


def role_device(role: str, cfg: ServeConfig) -> str:
    """Where an engine of ``role`` computes (colocated: on the prefill device)."""
    return cfg.decode_compute_device if role == "decode" else cfg.prefill_device


def plan_cluster_cores(roles: list[str], cfg: ServeConfig) -> CorePlan | None:
    """``--cpu-bind`` for the engine processes of ``roles`` (launch order) on this process's cores."""
    tp = cfg.prefill_tp > 1 or cfg.decode_tp > 1
    on_cpu = cpu_binding.engines_on_cpu(role_device(r, cfg) for r in roles)
    return cpu_binding.plan_cores(cfg.cpu_bind, len(roles), cpu_binding.allowed_cores(), on_cpu, tp)


def instance_cores(role: str, cfg: ServeConfig) -> CorePlan | None:
    """``--cpu-bind`` for one engine process run on its own (``--role colocated`` and the like)."""
    return plan_cluster_cores([role], cfg)


def _watch_engines(role: str, engines: list[Any], instance: Any = None, stopping: threading.Event | None = None, interval_s: float = 0.5) -> None:
    """Exit the process once an engine thread has died: nothing it holds will ever finish, and
    an exit is what the supervisor sees and restarts (open connections break, so in-flight
    requests fail at once instead of waiting out their timeouts).

    A dead tensor-parallel rank of ``instance`` ends the process too, but not at once: its
    in-flight requests are first failed and every reservation on the surviving ranks released
    (see :func:`_retire_after_rank_death`), so nothing is lost that a restart would hide.
    Once ``stopping`` is set the instance is being closed on purpose (a TP instance takes a
    while, joining its ranks) and nothing it does is a crash."""
    stopping = stopping or threading.Event()

    def watch() -> None:
        while all(engine_alive(e) for e in engines):
            if instance is not None and getattr(instance, "dead_ranks", None):
                _retire_after_rank_death(role, instance)
            if stopping.wait(interval_s):
                return
        if stopping.is_set():  # died while being closed on purpose
            return
        log.critical("%s engine thread died: exiting (%d) so the launcher restarts this instance", role, EXIT_ENGINE_DEAD)
        logging.shutdown()
        os._exit(EXIT_ENGINE_DEAD)

    threading.Thread(target=watch, name="hawk-engine-watch", daemon=True).start()


def _retire_after_rank_death(role: str, instance: Any) -> None:
    """A rank cannot rejoin its process group, so the instance must be restarted with all its
    ranks. /health is already 503 and new work is refused; wait (at most RANK_DRAIN_S) until the
    in-flight requests have failed and every surviving rank's ledger is empty, stay up
    RANK_LINGER_S more so the router and operators can read that accounting, then close the
    surviving ranks and exit (EXIT_RANK_DEAD) for the supervisor to restart the instance."""
    log.critical("%s instance: tensor-parallel rank(s) %s died: draining, then exiting (%d) to be restarted", role, instance.dead_ranks, EXIT_RANK_DEAD)
    deadline = time.monotonic() + RANK_DRAIN_S
    while time.monotonic() < deadline:
        try:
            if instance.drained():
                break
        except Exception:  # noqa: BLE001 - a ledger that cannot be read is not a reason to stay
            log.exception("reading the accounting of the dying instance failed")
            break
        time.sleep(0.2)
    else:
        log.error("%s instance still held KV %.0f s after its rank died; exiting anyway", role, RANK_DRAIN_S)
    time.sleep(RANK_LINGER_S)
    followers = getattr(instance, "followers", None)
    if followers is not None:
        with contextlib.suppress(Exception):
            followers.close(join_s=2.0)
    logging.shutdown()
    os._exit(EXIT_RANK_DEAD)


def run_instance(
    role: str,
    cfg: ServeConfig,
    host: str = LOOPBACK,
    port: int = 0,
    ready_file: str | None = None,
    parent_pid: int | None = None,
    cluster_secret: str | None = None,
    cores: CorePlan | None = None,
) -> None:
    """Serve one engine instance in the foreground until SIGINT/SIGTERM (or the parent's death).

    ``cluster_secret`` (default: $HAWK_CLUSTER_SECRET) guards /internal/* and the KV control
    channel, which reads it from the environment: it is put there for that. ``cores``: this
    process's binding as the launcher planned it (one engine group); None plans it here from
    ``--cpu-bind`` (a role run on its own)."""
    raise_open_file_limit()
    plan = cores if cores is not None else instance_cores(role, cfg)
    threads = cfg.threads if cfg.threads is not None or plan is None else default_threads(plan, 1)
    cfg = dataclasses.replace(cfg, threads=threads, prompt_threads=cfg.prompt_threads if role == "colocated" else None)
    # the most a step runs on: oneDNN fixes a GEMM primitive's threads when the weights are packed
    set_torch_threads(max(threads or 0, cfg.prompt_threads or 0) or None)
    sock = bind_socket(host, port)  # before loading: a busy port fails in a second, not after the model
    if cluster_secret:
        os.environ[CLUSTER_SECRET_ENV] = cluster_secret  # for the control channel's ControlServer/Client
    borrows = plan is not None and (cfg.prompt_threads or 0) > len(plan.engines[0])
    if plan is not None:  # the engine's threads, made while it builds, inherit the compute cores
        # (and the serving ones where a prompt step borrows them: OpenMP keeps to the cores it starts on)
        cpu_binding.bind_before_build([*plan.engines[0], *plan.serving] if borrows else plan.engines[0])
    instance = build_instance(role, cfg)
    if plan is not None:  # then everything else (HTTP, helpers, what they start later) serves elsewhere
        cpu_binding.bind_after_build(engine_threads(instance_engines(role, instance)), plan.serving, plan.engines[0])
        borrow = f", {cfg.prompt_threads} for a step with prompt tokens" if (cfg.prompt_threads or 0) > (threads or 0) else ""
        print(f"hawk {role}: {plan.describe()}; torch threads {threads}{borrow}", file=sys.stderr, flush=True)
    cap = getattr(instance, "capacity", None)
    if cap is not None:  # what the memory rule chose (hawk/engine/capacity.py), whatever the log level
        print(f"hawk {cap.describe(role)}", file=sys.stderr, flush=True)
    try:
        app = instance_app(role, instance, close_on_shutdown=False, cluster_secret=cluster_secret)
    except BaseException:
        instance.close()
        raise
    url = url_of(sock)
    stopping = threading.Event()
    _watch_engines(role, instance_engines(role, instance), instance, stopping)
    if parent_pid is not None:
        watch_parent(parent_pid)
    if cfg.gc_freeze:
        log.info("%s instance: %d startup objects frozen out of garbage collection", role, freeze_startup_heap())
    if ready_file:
        tmp = f"{ready_file}.tmp"
        Path(tmp).write_text(json.dumps({"url": url, "pid": os.getpid(), "role": role}))
        os.replace(tmp, ready_file)
    else:
        print(f"HAWK {role} instance on {url} ({cfg.model}, {cfg.transfer})", flush=True)
    try:
        serve_foreground(app, sock, cfg.log_level)
    finally:  # closed here, not in the app's shutdown, so the watcher knows a stopped engine is no crash
        stopping.set()
        log.info("%s instance shutting down: closing engine and releasing buffers", role)
        instance.close()


# ============================================================================ children (the cluster)


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    ready_file: Path
    log_path: Path | None
    url: str = ""
    spec: ChildSpec | None = None  # how to start it again
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    up_since: float = 0.0


@dataclass
class Cluster:
    """Engine child processes, started and healthy; ``close`` stops them."""

    children: list[Child] = field(default_factory=list)
    workdir: Path | None = None  # holds the children's ready files
    startup_timeout_s: float = 300.0
    cores: CorePlan | None = None  # the --cpu-bind plan the children were started with (None: unbound)
    _stop: threading.Event = field(default_factory=threading.Event)
    _supervisor: threading.Thread | None = None

    @property
    def prefill_urls(self) -> list[str]:
        return [c.url for c in self.children if c.role in ("prefill", "colocated")]

    @property
    def decode_urls(self) -> list[str]:
        return [c.url for c in self.children if c.role in ("decode", "colocated")]

    def supervise(self, max_restarts: int) -> Cluster:
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
        assert c.spec is not None
        c.proc = _popen(dataclasses.replace(c.spec, port=port), c.env, c.log_path)
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
        stop_processes([(f"{c.role} child", c.proc) for c in self.children], signal.SIGTERM, timeout_s)
        for c in self.children:
            c.ready_file.unlink(missing_ok=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class ChildSpec:
    """What an engine child needs: its role, where to listen, where to report, and the config."""

    role: str
    config: ServeConfig
    host: str
    port: int
    ready_file: str
    parent_pid: int
    name: str = ""  # e.g. "decode-0": shown in the child's command line, so ``ps`` tells the engines apart
    compute_cores: list[int] | None = None  # the launcher's --cpu-bind plan for this child (None: unbound)
    serving_cores: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "config": self.config.to_dict()})

    def cores(self) -> CorePlan | None:
        """This child's binding, as the launcher planned it."""
        if self.compute_cores is None:
            return None
        return CorePlan((tuple(self.compute_cores),), tuple(self.serving_cores), self.config.cpu_bind)

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        d = json.loads(text)
        return cls(**{**d, "config": ServeConfig.from_dict(d["config"])})


def _spawn(role: str, cfg: ServeConfig, host: str, workdir: Path, index: int, cluster_secret: str | None,
           cores: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Child:
    name = f"{role}-{index}"
    spec = ChildSpec(role, cfg, host, 0, str(workdir / f"{name}.ready.json"), os.getpid(), name,
                     compute_cores=None if cores is None else list(cores[0]), serving_cores=[] if cores is None else list(cores[1]))
    env = dict(os.environ)
    env[CHILD_SPEC_ENV] = str(workdir / f"{name}.spec.json")
    if cfg.threads is not None:  # OpenMP reads this at import, before torch.set_num_threads runs
        env["OMP_NUM_THREADS"] = str(max(cfg.threads, cfg.prompt_threads or 0))
    if cores is not None and (cfg.prompt_threads or 0) > len(cores[0]):
        env.update(omp_places([*cores[0], *cores[1]]))  # a borrowing step's threads one per core, the engine's first
    if cluster_secret:
        env[CLUSTER_SECRET_ENV] = cluster_secret  # in the environment: a command line is public
    log_path = Path(cfg.log_dir) / f"{name}.log" if cfg.log_dir is not None else None
    return Child(role, _popen(spec, env, log_path), Path(spec.ready_file), log_path, spec=spec, env=env, up_since=time.monotonic())


def child_argv(spec: ChildSpec) -> list[str]:
    """An engine child's command line: its last word names it (``hawk-engine=decode-0``), so ``ps``
    and ``pgrep -f hawk-engine=decode`` tell prefill from decode. The child reads its spec from
    $HAWK_CHILD_SPEC and ignores the word."""
    return [sys.executable, "-m", "hawk.serve.launcher", f"{CHILD_ARG}{spec.name or spec.role}"]


def _popen(spec: ChildSpec, env: dict[str, str], log_path: Path | None) -> subprocess.Popen:
    Path(env[CHILD_SPEC_ENV]).write_text(spec.to_json())
    out = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            child_argv(spec),
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


def default_threads(plan: CorePlan | None, engines: int) -> int:
    """Torch threads per engine process when ``--threads`` is not given: its cores where bound
    (the least group's, so no engine oversubscribes), else an even share of the cores."""
    if plan is not None:
        return min(len(g) for g in plan.engines)
    return max(1, (os.cpu_count() or 1) // engines)


def default_prompt_threads(cfg: ServeConfig, plan: CorePlan | None) -> int | None:
    """``--prompt-threads`` when not given: where ``--cpu-bind auto`` bound one engine process and left
    cores to serving, that process's cores and theirs (a prompt step borrows them); else unchanged."""
    if cfg.prompt_threads is not None or plan is None or cfg.cpu_bind != "auto" or len(plan.engines) != 1 or not plan.serving:
        return cfg.prompt_threads
    return len(plan.engines[0]) + len(plan.serving)


def omp_places(cores: list[int]) -> dict[str, str]:
    """OpenMP's environment for one thread per core of ``cores``, in order (vLLM's CPU build sets the
    same for its workers): read when the library loads, so only a process started with it is pinned."""
    return {"OMP_PLACES": ",".join(f"{{{c}}}" for c in cores), "OMP_PROC_BIND": "close"}


def start_cluster(cfg: ServeConfig, cluster_secret: str | None = None, host: str = LOOPBACK) -> Cluster:
    """Start the engine processes for ``cfg`` (one colocated engine when ``cfg.transfer`` is
    "colocated") and wait until all are healthy. ``--cpu-bind`` is planned here for all of them
    (:func:`plan_cluster_cores`); ``cfg.threads`` defaults by :func:`default_threads`."""
    roles = ["colocated"] if cfg.transfer == "colocated" else ["prefill"] * cfg.num_prefill + ["decode"] * cfg.num_decode
    if cfg.transport == "local" and len(roles) > 1:
        raise ConfigError("transport 'local' works inside one process only; prefill and decode run as separate processes here (use nixl or mooncake)")
    plan = plan_cluster_cores(roles, cfg)
    if cfg.threads is None:
        cfg = dataclasses.replace(cfg, threads=default_threads(plan, len(roles)))
    cfg = dataclasses.replace(cfg, prompt_threads=default_prompt_threads(cfg, plan))
    borrow = f" ({cfg.prompt_threads} for a step with prompt tokens)" if (cfg.prompt_threads or 0) > cfg.threads else ""
    print(f"HAWK CPU cores: {plan.describe() if plan else f'unbound (--cpu-bind {cfg.cpu_bind})'}; torch threads per engine {cfg.threads}{borrow}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="hawk-serve-"))
    if cfg.log_dir is not None:
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir=workdir, startup_timeout_s=cfg.startup_timeout_s)
    counts: dict[str, int] = {}
    try:
        for i, role in enumerate(roles):
            counts[role] = counts.get(role, 0) + 1
            cores = None if plan is None else (plan.engines[i], plan.serving)
            cluster.children.append(_spawn(role, cfg, host, workdir, counts[role] - 1, cluster_secret, cores))
        cluster.cores = plan
        deadline = time.monotonic() + cfg.startup_timeout_s
        for c in cluster.children:
            _wait_ready(c, deadline)
    except BaseException:
        cluster.close()
        raise
    return cluster



# ============================================================================ serve


@contextlib.contextmanager
def _stop_signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT behave like Ctrl-C, so cleanup in ``finally`` blocks runs (uvicorn re-raises the
    signal it shut down on; the default SIGTERM action would kill us before the children stop). SIGINT is
    set explicitly: a script's background job inherits it ignored, and Python then keeps it ignored; with
    router workers no uvicorn runs here to take it over, so ``kill -INT`` would do nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, interrupt)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def _advertised_host(host: str) -> str:
    """The address peers should use to reach a server bound on ``host``."""
    if host in ("0.0.0.0", "::", ""):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return LOOPBACK
    return host


def instance_config(**overrides: Any) -> ServeConfig:
    """A validated config: the defaults of ``hawk/config.py`` with ``overrides`` (tests, scripts)."""
    return defaults(**overrides).validate()


def check_serve(cfg: ServeConfig) -> str | None:
    """The checks that need more than the config (files, names, the network); returns the
    cluster secret to use, if any."""
    cfg.validate()
    check_bind(cfg.host, "--host", cfg.allow_remote)
    if cfg.kv_host is not None:
        check_bind(cfg.kv_host, "--kv-host", cfg.allow_remote)
    if cfg.role != "router":
        check_model_spec(cfg.model)
        check_tensor_parallel(cfg)
    secret = read_cluster_secret(cfg.cluster_secret_file)
    if cfg.role == "all":
        return secret or secrets.token_urlsafe(32)
    if not secret:
        log.warning("no cluster secret (--cluster-secret-file or $%s): internal endpoints and the KV control channel are unauthenticated", CLUSTER_SECRET_ENV)
    return secret


def router_config(cfg: ServeConfig, prefill_urls: list[str], decode_urls: list[str], secret: str | None) -> Any:
    """The router's settings for ``cfg`` in front of these instances."""
    from hawk.serve.router import RouterConfig

    names = cfg.served_model_name
    return RouterConfig(
        list(prefill_urls), list(decode_urls), model=names[0] if names else None, aliases=list(names[1:]),
        default_temperature=cfg.default_temperature, startup_timeout_s=cfg.startup_timeout_s, api_key=cfg.api_key,
        cluster_secret=secret, max_body_bytes=None if cfg.max_body_mb is None else int(cfg.max_body_mb * 2**20),
        warmup=cfg.warmup, prefill_api=cfg.prefill_api, decode_stream=cfg.decode_stream,
    )


def serve_router(cfg: ServeConfig, router_cfg: Any, sock: socket.socket) -> None:
    """The router on ``sock`` in the foreground: in this process, or as ``--api-server-count``
    worker processes sharing it (``router_workers.py``)."""
    from hawk.serve.router_workers import router_processes

    n, why = router_processes(cfg)
    print(f"HAWK router processes: {n} ({why})", flush=True)
    if n == 1:
        from hawk.serve.router import create_router_app

        serve_foreground(create_router_app(router_cfg), sock, cfg.log_level)
        return
    from hawk.serve.router_workers import RouterWorkers

    RouterWorkers(router_cfg, sock, n, cfg.log_level, cfg.max_restarts).run()


def describe_transfer(cfg: ServeConfig) -> str:
    """How KV moves in this system, as the start-up line says it (the KV flow when it is not the
    default pull: layer-wise changes the order of a request's steps, see serve/generation.py)."""
    flow = ", layer-wise KV push" if cfg.kv_flow == "layerwise" and cfg.transfer != "colocated" else ""
    return f"{cfg.transfer} over {cfg.transport}{flow}"


def serve(cfg: ServeConfig) -> None:
    """Run HAWK (or one part of it) in the foreground until Ctrl-C / SIGTERM.

    ``cfg.role``:
      "all"        router on host:port + engine children on free loopback ports (prefill and decode,
                   or one colocated engine when transfer="colocated").
      "router"     only the router, in front of ``prefill_urls`` and ``decode_urls``.
      "prefill" / "decode" / "colocated"
                   one engine instance on host:port, for a router elsewhere.
    Every option is described once, in ``hawk/config.py``.
    """
    secret = check_serve(cfg)
    with _stop_signals_as_interrupt():
        try:
            if cfg.role == "router":
                if not cfg.decode_urls or (not cfg.prefill_urls and cfg.prefill_api != "vllm"):
                    raise ConfigError("role 'router' needs --prefill-url and --decode-url (--prefill-api vllm without "
                                      "--prefill-url: a decode front behind a P/D router such as vllm-router)")
                sock = bind_socket(cfg.host, cfg.port)
                print(f"HAWK router on {url_of(sock)} -> prefill {cfg.prefill_urls}, decode {cfg.decode_urls}", flush=True)
                serve_router(cfg, router_config(cfg, cfg.prefill_urls, cfg.decode_urls, secret), sock)
                return
            cfg = dataclasses.replace(cfg, kv_host=cfg.kv_host or _advertised_host(cfg.host))
            if cfg.role in ENGINE_ROLES:
                run_instance(cfg.role, cfg, cfg.host, cfg.port, cluster_secret=secret)
                return
            if is_loopback(cfg.host):
                os.environ.setdefault("UCX_NET_DEVICES", "lo")  # keep UCX (NIXL) off other interfaces
            sock = bind_socket(cfg.host, cfg.port)  # fail fast on a busy port, before loading any model
            n = 1 if cfg.transfer == "colocated" else cfg.num_prefill + cfg.num_decode
            print(f"HAWK: starting {n} engine process(es) for {cfg.model} ({cfg.transfer}); the router opens {url_of(sock)} when they are up", flush=True)
            with start_cluster(cfg, secret) as cluster:
                if cluster.cores is not None and cluster.cores.serving:  # this process routes: it and its router workers serve
                    cpu_binding.set_thread_cores(cpu_binding.process_threads(), cluster.cores.serving)
                cluster.supervise(cfg.max_restarts)
                print(f"HAWK serving {cfg.model} ({describe_transfer(cfg)}) at {url_of(sock)}/v1", flush=True)
                serve_router(cfg, router_config(cfg, cluster.prefill_urls, cluster.decode_urls, secret), sock)
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


def start_system(cfg: ServeConfig, port: int = 0, **overrides: Any) -> RunningSystem:
    """``serve`` with role "all" without taking over the foreground: for the demo and tests.
    ``overrides`` replace config fields (e.g. ``threads=1``, ``log_dir=...``)."""
    from hawk.serve.router import create_router_app

    cfg = dataclasses.replace(cfg, **overrides).validate()
    if cfg.transport != "local":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    secret = read_cluster_secret(cfg.cluster_secret_file) or secrets.token_urlsafe(32)
    cluster = start_cluster(cfg, secret)
    try:
        cluster.supervise(cfg.max_restarts)
        router = ThreadedServer(create_router_app(router_config(cfg, cluster.prefill_urls, cluster.decode_urls, secret)), LOOPBACK, port).start()
    except BaseException:
        cluster.close()
        raise
    return RunningSystem(cluster, router)


# ============================================================================ python -m


def _child_main(spec_path: str) -> None:
    """An engine child: read the spec the launcher wrote, serve the instance it names."""
    spec = ChildSpec.from_json(Path(spec_path).read_text())
    cfg = spec.config
    if spec.compute_cores is None:  # the launcher planned no binding: the child does not plan its own
        cfg = dataclasses.replace(cfg, cpu_bind="nobind")
    else:  # before torch loads: OpenMP drops the places (OMP_PLACES) this thread may not run on
        os.sched_setaffinity(0, [*spec.compute_cores, *spec.serving_cores])
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.WARNING))
    with _stop_signals_as_interrupt():
        try:
            run_instance(spec.role, cfg, spec.host, spec.port, spec.ready_file, spec.parent_pid, cores=spec.cores())
        except KeyboardInterrupt:
            pass


def _serve_from_cli(cfg: ServeConfig) -> None:
    """Serve an OpenAI-compatible endpoint: router -> GPU prefill -> HAWK KV transfer -> NPU decode."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.WARNING))
    serve(cfg)


def serve_command() -> Callable[..., None]:
    """``hawk serve``: every option generated from ``ServeConfig``."""
    return config_command(_serve_from_cli, "serve")


def main() -> None:
    """``python -m hawk.serve.launcher``: an engine child when $HAWK_CHILD_SPEC names its spec,
    otherwise ``hawk serve`` itself (the same generated command line)."""
    spec_path = os.environ.pop(CHILD_SPEC_ENV, None)
    if spec_path:
        _child_main(spec_path)
        return
    typer.run(serve_command())


if __name__ == "__main__":
    main()
