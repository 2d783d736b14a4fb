"""Tokens per second through the decode instance's token stream, the engine stubbed out.

A stub engine thread emits one token per running request per step, as fast as it can, through the
real ``DecodeService`` (``/internal/decode``, NDJSON); a client in another process reads R streams
of N tokens each. Reported: tokens per second, the server process's CPU time per token, the step
period, and the engine thread's time to emit one step's tokens (it shares the interpreter with the
server's event loop, so a costly stream slows the engine's steps).

    python benchmarks/stream_probe.py --streams 64,128,256 --tokens 400 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from hawk.engine.decode_engine import TokenEvent
from hawk.serve.contract import DecodeRequest
from hawk.serve.decode_server import DecodeService, decode_routes


class StubEngine:
    """What ``DecodeService`` needs of a decode engine; steps start once all R requests are in."""

    max_len = 1 << 20

    def __init__(self, streams: int, tokens: int) -> None:
        self.streams, self.tokens = streams, tokens
        self.subs: dict[str, list[Any]] = {}
        self.lock = threading.Lock()
        self.emit_s: list[float] = []
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, rid: str, prompt_len: int, first: int, params: Any, handle: Any, on_event: Any) -> None:
        with self.lock:
            self.subs[rid] = [on_event, 0]

    def abort(self, rid: str) -> bool:
        return False

    def _loop(self) -> None:
        started = False
        while True:
            with self.lock:
                live = list(self.subs.items())
            if not started and len(live) < self.streams:
                time.sleep(0.001)
                continue
            started = True
            if not live:
                time.sleep(0.001)
                continue
            t0 = time.perf_counter()
            for rid, st in live:
                st[1] += 1
                last = st[1] >= self.tokens
                st[0](TokenEvent(rid, token=st[1], finish_reason="length" if last else None))
                if last:
                    with self.lock:
                        self.subs.pop(rid, None)
            self.emit_s.append(time.perf_counter() - t0)
            time.sleep(0)  # a real step waits for its device here, without the interpreter lock


def _serve(port: int, streams: int, tokens: int, q: Any) -> None:
    eng = StubEngine(streams, tokens)
    app = FastAPI()
    app.include_router(decode_routes(DecodeService(eng, handle_for=lambda req: None)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    q.put("up")
    c0 = time.process_time()
    q.get()
    q.put((time.process_time() - c0, len(eng.emit_s), sum(eng.emit_s) / max(1, len(eng.emit_s))))


async def _read(port: int, streams: int, tokens: int) -> tuple[float, int]:
    def body(i: int) -> dict[str, Any]:
        return DecodeRequest.of(request_id=f"r{i}", prompt_len=8, first_token=1, params={"max_tokens": tokens},
                                kv={"address": "stub", "request_id": f"r{i}"}).model_dump()

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None), trust_env=False) as c:
        async def one(i: int) -> int:
            n = 0
            async with c.stream("POST", f"http://127.0.0.1:{port}/internal/decode", json=body(i)) as r:
                async for line in r.aiter_lines():
                    n += bool(line)
            return n

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(streams)))
        return time.perf_counter() - t0, sum(got)


def probe(streams: int, tokens: int, port: int) -> dict[str, Any]:
    q: Any = mp.Queue()
    p = mp.Process(target=_serve, args=(port, streams, tokens, q))
    p.start()
    q.get()
    time.sleep(1.0)
    wall, lines = asyncio.run(_read(port, streams, tokens))
    q.put("done")
    cpu, steps, emit = q.get()
    p.kill()
    p.join(5)
    return {"streams": streams, "tokens": tokens, "lines": lines, "wall_s": wall, "tokens_per_s": lines / wall,
            "server_cpu_us_per_token": 1e6 * cpu / max(1, lines), "steps": steps, "step_ms": 1e3 * wall / max(1, steps),
            "engine_emit_ms_per_step": 1e3 * emit}


def parse_args(description: str, streams: str, port: int) -> argparse.Namespace:
    """The options of this probe and of ``stream_mux_probe.py``: streams, tokens per stream, first port, output."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--streams", default=streams, help="concurrent streams (comma-separated)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per stream")
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--json", help="write the records here")
    return ap.parse_args()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "64,128,256", 8791)
    recs = []
    for i, r in enumerate(int(x) for x in args.streams.split(",")):
        rec = probe(r, args.tokens, args.port + i)
        recs.append(rec)
        print(f"{r} streams x {args.tokens}: {rec['tokens_per_s']:,.0f} tokens/s, server CPU {rec['server_cpu_us_per_token']:.1f} us/token, "
              f"{rec['step_ms']:.2f} ms/step, engine emit {rec['engine_emit_ms_per_step']:.2f} ms/step")
    if args.json:
        out = {"command": "python benchmarks/stream_probe.py --streams " + args.streams + f" --tokens {args.tokens}",
               "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg(), "records": recs}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
