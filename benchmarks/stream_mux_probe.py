"""One HTTP stream per request against one stream carrying every request's tokens: CPU per token on each side.

The decode instance streams each request's tokens to the router on a stream of its own
(``/internal/decode``, NDJSON, one line per token); vLLM's front end instead gets one message per engine
step with every request's outputs. This probe prices the two with the engine stubbed, on this machine:

- per request: the real ``DecodeService`` and a stub engine thread (``stream_probe.StubEngine``), R
  streams read the way the router reads them (httpx ``aiter_lines``, each line parsed as ``TokenLine``);
- multiplexed: a stub engine thread posts one line per step, ``{"events": [[request id, token], ...]}``,
  through the same ``LoopMailbox`` onto one stream; the reader parses each line and hands every token to
  its request's queue, where R consumer tasks take them.

Reported per layout: tokens per second, the reading process's CPU per token (the router's side) and the
serving process's (the decode instance's: its event loop shares the interpreter with the engine thread).
The multiplexed side is a ceiling for a design HAWK does not have yet (no aborts, no errors, no per-request
state): run it beside the real thing once it exists.

    python benchmarks/stream_mux_probe.py --streams 64,256 --tokens 400 --json out.json
"""

from __future__ import annotations

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
from fastapi.responses import StreamingResponse

from hawk.serve.contract import DecodeRequest, TokenLine, receive
from hawk.serve.decode_server import DecodeService, LoopMailbox, decode_routes
from stream_probe import StubEngine, parse_args  # benchmarks/ is sys.path[0] when run as a script


def _app(streams: int, tokens: int) -> FastAPI:
    app = FastAPI()
    app.include_router(decode_routes(DecodeService(StubEngine(streams, tokens), handle_for=lambda req: None)))

    @app.get("/mux")
    async def mux() -> StreamingResponse:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        box = LoopMailbox(asyncio.get_running_loop())

        def engine() -> None:  # one line per step, every request's token in it
            for step in range(1, tokens + 1):
                box.post(queue, json.dumps({"events": [[f"r{i}", step] for i in range(streams)]}).encode() + b"\n")
                time.sleep(0)  # a real step waits for its device here, without the interpreter lock
            box.post(queue, None)

        threading.Thread(target=engine, daemon=True).start()

        async def lines():
            while True:
                out = [await queue.get()]
                while out[-1] is not None and not queue.empty():  # behind: what waits goes in one write
                    out.append(queue.get_nowait())
                done = out[-1] is None
                if body := b"".join(x for x in out if x is not None):
                    yield body
                if done:
                    return

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


def _serve(port: int, streams: int, tokens: int, q: Any) -> None:
    server = uvicorn.Server(uvicorn.Config(_app(streams, tokens), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    q.put("up")
    q.get()
    c0 = time.process_time()
    q.get()
    q.put(time.process_time() - c0)


async def _per_request(port: int, streams: int, tokens: int) -> int:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None), trust_env=False) as c:
        async def one(i: int) -> int:
            body = DecodeRequest.of(request_id=f"r{i}", prompt_len=8, first_token=1, params={"max_tokens": tokens},
                                    kv={"address": "stub", "request_id": f"r{i}"}).model_dump()
            n = 0
            async with c.stream("POST", f"http://127.0.0.1:{port}/internal/decode", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        receive(TokenLine, line, "probe")
                        n += 1
            return n

        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


async def _multiplexed(port: int, streams: int, tokens: int) -> int:
    queues: dict[str, asyncio.Queue[int | None]] = {f"r{i}": asyncio.Queue() for i in range(streams)}

    async def consumer(q: asyncio.Queue[int | None]) -> int:
        n = 0
        while await q.get() is not None:
            n += 1
        return n

    tasks = [asyncio.ensure_future(consumer(q)) for q in queues.values()]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as c, c.stream("GET", f"http://127.0.0.1:{port}/mux") as r:
        async for line in r.aiter_lines():
            if line:
                for rid, tok in json.loads(line)["events"]:
                    queues[rid].put_nowait(tok)
    for q in queues.values():
        q.put_nowait(None)
    return sum(await asyncio.gather(*tasks))


def probe(layout: str, streams: int, tokens: int, port: int) -> dict[str, Any]:
    q: Any = mp.Queue()
    p = mp.Process(target=_serve, args=(port, streams, tokens, q))
    p.start()
    q.get()
    time.sleep(1.0)
    q.put("go")
    c0, t0 = time.process_time(), time.perf_counter()
    read = _per_request if layout == "per-request" else _multiplexed
    n = asyncio.run(read(port, streams, tokens))
    wall, client = time.perf_counter() - t0, time.process_time() - c0
    q.put("done")
    server = q.get()
    p.kill()
    p.join(5)
    return {"layout": layout, "streams": streams, "tokens": tokens, "lines_read": n, "tokens_per_s": n / wall,
            "reader_cpu_us_per_token": 1e6 * client / max(1, n), "server_cpu_us_per_token": 1e6 * server / max(1, n)}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "64,256", 8871)
    recs = []
    for i, r in enumerate(int(x) for x in args.streams.split(",")):
        for j, layout in enumerate(("per-request", "multiplexed")):
            rec = probe(layout, r, args.tokens, args.port + 2 * i + j)
            recs.append(rec)
            print(f"{layout}: {r} streams x {args.tokens}: {rec['tokens_per_s']:,.0f} tokens/s, reader CPU "
                  f"{rec['reader_cpu_us_per_token']:.1f} us/token, server CPU {rec['server_cpu_us_per_token']:.1f} us/token")
    if args.json:
        out = {"command": f"python benchmarks/stream_mux_probe.py --streams {args.streams} --tokens {args.tokens}",
               "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "load_average": os.getloadavg(), "records": recs}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
