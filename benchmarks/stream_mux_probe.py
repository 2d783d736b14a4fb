"""One HTTP stream per request against one shared stream per router process: CPU per token on each side.

The router reads a decode instance's tokens either on a stream per request (``--decode-stream request``,
one NDJSON line per token on each) or on one shared stream that carries every request's lines, a decode
step's lines in one write (``--decode-stream shared``; hawk/serve/decode_lines.py). This probe prices the
two with the engine stubbed, on this machine: the real ``DecodeService`` and a stub engine thread
(``stream_probe.StubEngine``) serve; the reader is the router's own code (``RequestLines`` or
``SharedStreams``), R requests of N tokens each, every line parsed as ``TokenLine``.

Reported per layout: tokens per second, the reading process's CPU per token (the router's side) and the
serving process's (the decode instance's: its event loop shares the interpreter with the engine thread).

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

from hawk.serve.contract import DecodeRequest, KVRef
from hawk.serve.decode_lines import DecodeLines, RequestLines, SharedStreams
from hawk.serve.decode_server import DecodeService, decode_routes
from stream_probe import StubEngine, parse_args  # benchmarks/ is sys.path[0] when run as a script

LAYOUTS = ("request", "shared")


def _app(streams: int, tokens: int) -> FastAPI:
    app = FastAPI()
    app.include_router(decode_routes(DecodeService(StubEngine(streams, tokens), handle_for=lambda req: None)))
    return app


def _serve(port: int, streams: int, tokens: int, q: Any) -> None:
    server = uvicorn.Server(uvicorn.Config(_app(streams, tokens), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    q.put("up")
    q.get()
    c0 = time.process_time()
    q.get()
    q.put(time.process_time() - c0)


async def _read(layout: str, port: int, streams: int, tokens: int) -> int:
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None), trust_env=False) as c:
        shared = SharedStreams(c) if layout == "shared" else None

        async def one(i: int) -> int:
            rid = f"r{i}"
            lines: DecodeLines = shared.lines(url, rid) if shared is not None else RequestLines(c, url, rid)
            await lines.open(DecodeRequest.of(request_id=rid, prompt_len=8, first_token=1, params={"max_tokens": tokens},
                                              kv=KVRef(address="stub", request_id=rid)))
            n = 0
            while (ev := await lines.read()) is not None:
                n += 1
                if ev.finish_reason is not None:
                    break
            await lines.close(stop=False)
            return n

        n = sum(await asyncio.gather(*(one(i) for i in range(streams))))
        if shared is not None:
            await shared.close()
        return n


def probe(layout: str, streams: int, tokens: int, port: int) -> dict[str, Any]:
    q: Any = mp.Queue()
    p = mp.Process(target=_serve, args=(port, streams, tokens, q))
    p.start()
    q.get()
    time.sleep(1.0)
    q.put("go")
    c0, t0 = time.process_time(), time.perf_counter()
    n = asyncio.run(_read(layout, port, streams, tokens))
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
        for j, layout in enumerate(LAYOUTS):
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
