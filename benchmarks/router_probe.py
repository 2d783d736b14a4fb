"""CPU time per streamed token in each process of a served HAWK system: the router, the engines.

A whole system (default: colocated, the tiny model on this machine's CPU, so the engine is cheap
and the front door is what is measured) serves R concurrent streaming completions of N tokens
each; the CPU seconds every process of the system spent while they ran (``/proc/<pid>/stat``),
over the tokens delivered, say what one token costs where. On one H200 the router's one event
loop ran at ~97 % of a core at 30 req/s (8B shape, ``benchmarks/serving_host_profile.sh``), so this
is the number that bounds a server's tokens per second before any GPU does.

    python benchmarks/router_probe.py --streams 64,256 --tokens 200 --json out.json [-- hawk serve args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from hawk.bench.procs import children, cmdline, cpu_seconds
from hawk.integrations.vllm.servers import free_port

DEFAULT_SERVE = ["--model", "tiny", "--transfer", "colocated", "--max-num-seqs", "256", "--kv-tokens", "131072"]
def family(pid: int) -> dict[int, str]:
    """``pid`` and its children, each with its role: the launcher and its router workers
    (``--api-server-count``) count as the router, engine processes as the engine."""
    out = {pid: "router"}
    for child in children(pid):
        try:
            cmd = cmdline(child)
        except OSError:
            continue
        out[child] = "router" if "router_workers" in cmd else "engine" if "launcher" in cmd else cmd[:40]
    return out


async def _streams(url: str, streams: int, tokens: int) -> tuple[float, int]:
    body = {"prompt": [10 + i % 480 for i in range(16)], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None), trust_env=False) as c:
        async def one() -> int:
            n = 0
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and "\"usage\": {" in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            return n

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one() for _ in range(streams)))
        return time.perf_counter() - t0, sum(got)


def probe(url: str, pids: dict[int, str], streams: int, tokens: int) -> dict[str, Any]:
    before = {p: cpu_seconds(p) for p in pids}
    wall, n = asyncio.run(_streams(url, streams, tokens))
    spent: dict[str, float] = {}
    for p, role in pids.items():
        spent[role] = spent.get(role, 0.0) + cpu_seconds(p) - before[p]
    return {"streams": streams, "tokens": tokens, "delivered": n, "wall_s": wall, "tokens_per_s": n / wall,
            "cpu_us_per_token": {role: 1e6 * s / max(1, n) for role, s in spent.items()},
            "cpu_cores_busy": {role: s / wall for role, s in spent.items()}}


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_SERVE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="64,256", help="concurrent streams (comma-separated)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hawk", "serve", *serve_args, "--port", str(port)], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"hawk serve {' '.join(serve_args)} did not come up")
            time.sleep(0.5)
        asyncio.run(_streams(url, 4, 8))  # warm-up
        pids = family(server.pid)
        recs = []
        for r in (int(x) for x in args.streams.split(",")):
            rec = probe(url, pids, r, args.tokens)
            recs.append(rec)
            per = ", ".join(f"{k} {v:.1f}" for k, v in rec["cpu_us_per_token"].items())
            print(f"{r} streams x {args.tokens}: {rec['tokens_per_s']:,.0f} tokens/s; CPU us/token: {per}", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    if args.json:
        out = {"command": "python benchmarks/router_probe.py " + " ".join(argv), "serve_args": serve_args,
               "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg(), "records": recs}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
