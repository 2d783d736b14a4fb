"""``hawk demo``: the whole system on this machine, a few requests, what each one cost, shut down.

It starts a prefill instance (the "GPU" role, here on the CPU) and a decode instance (an emulated
Tenstorrent Blackhole p150a NPU whose KV cache lives in tiled, per-DRAM-channel layout), moves each
request's KV between them with HAWK over NIXL on loopback, and talks to the router exactly as any
OpenAI client would. Greedy sampling, so the answers are repeatable.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from hawk.config import ServeConfig, defaults
from hawk.config_cli import config_command
from hawk.devices.timing import timing_label
from hawk.layouts.device import parse_device
from hawk.serve.launcher import check_model_spec, start_system

DEMO_REQUESTS: list[dict[str, Any]] = [
    {
        "title": "streamed completion",
        "path": "/v1/completions",
        "body": {"prompt": "The three primary colors are", "max_tokens": 32, "stream": True},
    },
    {
        "title": "chat completion",
        "path": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32},
    },
    {
        "title": "streamed chat",
        "path": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Write a haiku about the ocean."}], "max_tokens": 40, "stream": True},
    },
]


def _sse(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _text_of(chunk: dict[str, Any]) -> str:
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


def run_request(client: httpx.Client, req: dict[str, Any], console: Console) -> dict[str, Any]:
    """Send one demo request, printing its text as it arrives; returns the ``hawk`` timings."""
    body = {"temperature": 0, **req["body"]}
    console.print(f"\n[bold cyan]▶ {req['title']}[/]  [dim]POST {req['path']}[/]")
    shown = body.get("prompt") or body["messages"][-1]["content"]
    console.print(f"[dim]prompt:[/] {shown}")
    console.print("[dim]answer:[/] ", end="")
    if body.get("stream"):
        hawk: dict[str, Any] = {}
        with client.stream("POST", req["path"], json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{req['path']} answered {r.status_code}: {r.text}")
            for chunk in _sse(r):
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                console.print(_text_of(chunk), end="", markup=False, highlight=False, soft_wrap=True)
                hawk = chunk.get("hawk") or hawk
        console.print()
        return hawk
    r = client.post(req["path"], json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{req['path']} answered {r.status_code}: {r.text}")
    out = r.json()
    c = out["choices"][0]
    console.print(c.get("text") or c["message"]["content"], markup=False, highlight=False, soft_wrap=True)
    return out["hawk"]


def timing_line(h: dict[str, Any]) -> str:
    ms = lambda s: "n/a" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
    kv = "no transfer (colocated)" if h.get("kv_mode") == "colocated" else (
        f"{(h.get('kv_bytes') or 0) / 1e6:.2f} MB in {ms(h.get('kv_transfer_s'))} "
        f"({h.get('kv_requests')} transfer requests, {h.get('kv_mode')})"
    )
    return (
        f"TTFT {ms(h.get('ttft_s'))} · TPOT {ms(h.get('tpot_s'))} · "
        f"{h.get('prompt_tokens')} prompt + {h.get('completion_tokens')} generated tokens · KV {kv}"
    )


#: Where the demo differs from ``hawk serve``: a smaller cache starts faster, and greedy answers repeat.
DEMO_DEFAULTS: dict[str, Any] = {"kv_tokens": 4096, "default_temperature": 0.0}


def demo(cfg: ServeConfig | None = None) -> list[dict[str, Any]]:
    """Start the whole system on the embedded default, send a few requests, print answers and timings, stop.

    Returns each request's ``hawk`` timings (TTFT, TPOT, KV-transfer time and bytes). Without a
    config, the defaults of ``hawk/config.py`` with ``DEMO_DEFAULTS``: CPU prefill, emulated
    Blackhole p150a decode, bf16 KV, NIXL over loopback.
    """
    cfg = (cfg or defaults(**DEMO_DEFAULTS)).validate()
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    t0 = time.monotonic()
    check_model_spec(cfg.model)  # a bad name fails here, in one line, not inside a child process
    decode = parse_device(cfg.decode_device)
    npu = decode.label(cfg.arch) if decode.is_npu else cfg.decode_device
    timing = timing_label(cfg.npu_timing if decode.is_npu else None, cfg.link_gbps)
    if timing:  # paced runs say so: their times are modelled, not measured on that hardware
        npu = f"{npu} [{timing}]"
    console.print(
        f"[bold]HAWK demo[/]: {cfg.model} · prefill on {cfg.prefill_device} (GPU role) · decode on {npu} · "
        f"{cfg.kv_dtype} KV · {cfg.transfer} over {cfg.transport}"
    )
    logs = tempfile.mkdtemp(prefix="hawk-demo-logs-")
    console.print(f"[dim]starting prefill and decode processes (logs in {logs}, removed on success) ...[/]")
    results = []
    with start_system(cfg, log_dir=logs) as system:
        console.print(
            f"[dim]up in {time.monotonic() - t0:.1f} s: router {system.url}, prefill {system.cluster.prefill_urls[0]}, "
            f"decode {system.cluster.decode_urls[0]}[/]"
        )
        with httpx.Client(base_url=system.url, timeout=120.0, trust_env=False) as client:
            for req in DEMO_REQUESTS:
                h = run_request(client, req, console)
                console.print(f"[green]  {timing_line(h)}[/]")
                results.append(h)
        console.print("\n[dim]shutting down (children stop, buffers released) ...[/]")
    shutil.rmtree(logs, ignore_errors=True)
    console.print(summary_table(results, npu))
    console.print(f"[bold]done in {time.monotonic() - t0:.1f} s[/]  (the NPU is emulated on this machine: its timings are not Tenstorrent hardware numbers)")
    return results


def demo_command() -> Callable[..., None]:
    """``hawk demo``: the engine options of ``ServeConfig``, with the demo's own defaults."""
    return config_command(demo, "demo", overrides=DEMO_DEFAULTS, doc="Start the whole system on the embedded default, send a few requests, print answers and timings, stop.")


def summary_table(results: list[dict[str, Any]], npu: str) -> Table:
    t = Table(title=f"per-request timings (decode on {npu})", title_justify="left")
    for col in ("request", "TTFT ms", "TPOT ms", "tokens in/out", "KV MB", "KV ms", "KV reqs"):
        t.add_column(col, justify="left" if col == "request" else "right")
    for req, h in zip(DEMO_REQUESTS, results):
        f = lambda v, k=1e3: "-" if v is None else f"{v * k:.1f}"  # noqa: E731
        t.add_row(
            req["title"], f(h.get("ttft_s")), f(h.get("tpot_s")), f"{h.get('prompt_tokens')}/{h.get('completion_tokens')}",
            f(h.get("kv_bytes"), 1e-6), f(h.get("kv_transfer_s")), str(h.get("kv_requests", "-")),
        )
    return t


if __name__ == "__main__":
    demo()
