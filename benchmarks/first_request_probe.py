"""What the first request after `hawk serve` starts pays, with and without the router's warm-up.

Why: the first request through a prefill/decode pair pays one-time costs (the transfer's first plan,
registrations, lazy imports, on a GPU kernel compiles). The router's warm-up (``--warmup``, on by
default) sends one 2-token request through each pair before it reports ready. This starts the
system ``--launches`` times each way, sends ``--requests`` one-token completions one after another
and records each one's server-side timings (the ``hawk`` object: TTFT, prefill, KV transfer).

    python benchmarks/first_request_probe.py --launches 3 --json first_request_cpu.json
    python benchmarks/first_request_probe.py --launches 1 --fresh-triton-cache -- --model llama-3.1-8b --dtype bf16 \
        --prefill-device cuda:0 --decode-device npu-emu:cuda:0 --transport auto
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_launch(warmup: bool, requests: int, serve_args: list[str], timeout_s: float, fresh_cache: bool = False) -> dict[str, Any]:
    """Start `hawk serve`, wait for /health, send the requests, stop it; the timings of each request.
    ``fresh_cache``: an empty Triton cache for this start, as on a new machine (else the first start's
    compiles serve the later ones)."""
    port = free_port()
    cmd = [sys.executable, "-m", "hawk", "serve", "--port", str(port), "--warmup" if warmup else "--no-warmup", *serve_args]
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    if fresh_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="hawk-triton-")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as http:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"hawk serve exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"hawk serve not healthy after {timeout_s} s")
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            up_s = time.monotonic() - t0
            out = []
            for i in range(requests):
                body = {"prompt": f"Request {i}: the capital of France is", "max_tokens": 1, "temperature": 0}
                h = http.post("/v1/completions", json=body).raise_for_status().json()["hawk"]
                out.append({k: round(h[k] * 1e3, 2) for k in ("ttft_s", "prefill_s", "kv_transfer_s") if h.get(k) is not None})
        return {"warmup": warmup, "up_s": round(up_s, 2), "requests_ms": out}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--launches", type=int, default=3, help="starts of the system each way (with and without warm-up)")
    p.add_argument("--requests", type=int, default=4, help="requests per start, one after another")
    p.add_argument("--timeout-s", type=float, default=300.0, help="how long a start may take")
    p.add_argument("--fresh-triton-cache", action="store_true", help="each start with an empty Triton cache (a GPU's first start)")
    p.add_argument("--json", default=None)
    p.add_argument("serve_args", nargs="*", help="more `hawk serve` options (after --)")
    a = p.parse_args(argv)
    launches: list[dict[str, Any]] = []
    result: dict[str, Any] = {"command": " ".join(sys.argv), "serve_args": a.serve_args, "launches": launches}

    def save() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)

    for _ in range(a.launches):
        for w in (True, False):
            launches.append(one_launch(w, a.requests, a.serve_args, a.timeout_s, a.fresh_triton_cache))
            print(json.dumps(launches[-1]), flush=True)
            save()  # kept current: a run cut short keeps its launches
    summary = {}
    for w in (True, False):
        runs = [r for r in launches if r["warmup"] is w]
        first = [r["requests_ms"][0] for r in runs]
        later = [x for r in runs for x in r["requests_ms"][1:]]
        summary["warmup" if w else "no_warmup"] = {
            k: {"first_median": statistics.median(f[k] for f in first), "later_median": statistics.median(x[k] for x in later)}
            for k in first[0]
        } | {"up_s_median": statistics.median(r["up_s"] for r in runs)}
    for name, s in summary.items():
        line = "  ".join(f"{k} first {v['first_median']:.0f} / later {v['later_median']:.0f} ms" for k, v in s.items() if isinstance(v, dict))
        print(f"{name:10} up {s['up_s_median']:.1f} s  {line}")
    result["summary"] = summary
    save()
    return result


if __name__ == "__main__":
    main()
