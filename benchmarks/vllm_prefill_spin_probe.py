"""CPU a stock vLLM prefill server burns while it holds a finished request's KV for a decode that has not
pulled yet, against the same server idle: vLLM's NixlConnector and HawkConnector, one server at a time.

vLLM's engine keeps stepping while a connector holds a finished request's blocks (its scheduler counts
them as work: ``Scheduler.has_finished_requests``), and its processes spin on their shared-memory queues
for a second after each read (``SpinCondition``), so a prefill holding KV keeps cores busy doing nothing;
on a small CPU box the decode beside it then waits for a core (the vLLM P/D comparison of docs/vllm.md).
``vllm-nixl-threads0`` gives NixlConnector's NIXL agent NIXL's default thread count, as HAWK's NIXL
transport runs it, instead of vLLM's 4. Then one bare NIXL agent per process, idle: as NIXL's Python
wrapper makes it (its progress thread sweeps without a pause) and as HAWK's NIXL transport makes it
(``HAWK_NIXL_PROGRESS_DELAY_US``, 200 us on hosts under 8 cores). Needs vLLM's CPU build
(``bash scripts/install.sh --with-vllm``); about 4 minutes on 2 cores.

    python benchmarks/vllm_prefill_spin_probe.py --json benchmarks/results/vllm_prefill_spin_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hawk.bench.procs import cpu_seconds
from hawk.integrations.vllm.servers import VllmServer, free_port, hawk_transfer_config, nixl_transfer_config

#: name -> (vLLM's --kv-transfer-config, whether it is NixlConnector); a consumer is measured idle only
CONFIGS = {
    "vllm-nixl": lambda: (nixl_transfer_config("kv_producer"), True),
    "vllm-nixl-threads0": lambda: ({**nixl_transfer_config("kv_producer"), "kv_connector_extra_config": {"num_threads": 0}}, True),
    "vllm-nixl-consumer": lambda: (nixl_transfer_config("kv_consumer"), True),
    "hawk": lambda: (hawk_transfer_config("kv_producer", transfer="gg-direct", ttl_s=600.0), False),
    "hawk-consumer": lambda: (hawk_transfer_config("kv_consumer", transfer="gg-direct"), False),
}


def group_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of every process in ``pid``'s process group (vLLM's API server, engine, worker)."""
    pg, total = os.getpgid(pid), 0.0
    for p in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            if os.getpgid(p) == pg:
                total += cpu_seconds(p)
        except (OSError, ValueError, IndexError):
            continue  # a process that ended between the listing and the read
    return total


def cores_busy(pid: int, seconds: float) -> float:
    a, t0 = group_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (group_cpu_s(pid) - a) / (time.monotonic() - t0)


#: One idle NIXL agent in a fresh process, and its process's CPU over a window (``{window}`` seconds).
AGENT_SNIPPETS = {
    "nixl-agent": "from nixl._api import nixl_agent, nixl_agent_config\n"
                  "a = nixl_agent('probe', nixl_agent_config(enable_prog_thread=True))",
    "hawk-nixl-transport": "from hawk.transport.nixl_transport import NixlTransport\na = NixlTransport()",
}
AGENT_WINDOW = """
import resource, time
time.sleep(1.0)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
time.sleep({window})
r1 = resource.getrusage(resource.RUSAGE_SELF)
print((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (time.monotonic() - t0))
"""


def measure_agent(name: str, window_s: float) -> dict[str, Any]:
    # UCX's ib modules crash at exit on a host without RDMA devices (hawk/transport/nixl_transport.py): the
    # answer is printed before that
    env = {"UCX_MODULES": "^ib*", **os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    out = subprocess.run([sys.executable, "-c", AGENT_SNIPPETS[name] + AGENT_WINDOW.format(window=window_s)], env=env,
                         capture_output=True, text=True, timeout=120)
    if not out.stdout.strip():
        raise RuntimeError(f"{name}: no answer (exit {out.returncode}): {out.stderr[-2000:]}")
    return {"config": name, "kv_held": False, "cores_busy_idle": round(float(out.stdout.strip().splitlines()[-1]), 3),
            "cores_busy_holding": None, "window_s": window_s, "prompt_tokens": None}


def measure(config: str, model: str, logs: Path, window_s: float, prompt_tokens: int) -> dict[str, Any]:
    kv, nixl = CONFIGS[config]()
    server = VllmServer(model, free_port(), kv_transfer=kv, threads=1,
                        extra_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if nixl else {})
    server.start(logs / f"{config}.log")
    try:
        server.wait_ready()
        body = {"model": server.served_name, "prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": 1, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()  # warm-up, nothing held
        assert server.proc is not None
        idle = cores_busy(server.proc.pid, window_s)
        if kv["kv_role"] == "kv_consumer":
            return {"config": config, "kv_held": False, "cores_busy_idle": round(idle, 3), "cores_busy_holding": None,
                    "window_s": window_s, "prompt_tokens": prompt_tokens}
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
        r.raise_for_status()
        held = (r.json().get("kv_transfer_params") or {}).get("do_remote_prefill") is True
        holding = cores_busy(server.proc.pid, window_s)
        return {"config": config, "kv_held": held, "cores_busy_idle": round(idle, 3), "cores_busy_holding": round(holding, 3),
                "window_s": window_s, "prompt_tokens": prompt_tokens}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    from hawk.engine.loader import load_model, save_hf_dir

    logs = Path(tempfile.mkdtemp(prefix="hawk-spin-probe-"))
    model = str(logs / "model")
    save_hf_dir(load_model("smollm2-135m", dtype=torch.bfloat16), model)
    t0 = time.time()
    records = []
    for config in filter(None, a.configs.split(",")):
        rec = measure(config.strip(), model, logs, a.window_s, a.prompt_tokens)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    for name in AGENT_SNIPPETS:
        rec = measure_agent(name, a.window_s)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    out = {"records": records, "settings": {**vars(a), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                                            "cpus": os.cpu_count(), "load_avg_end": os.getloadavg(), "logs": str(logs),
                                            "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])}}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
