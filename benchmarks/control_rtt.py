"""Round trip of the control channel (hawk.connector.control): one ControlClient.call of a Done that
the server answers with an Ack, as the decode's D1/D9 messages do, with a trivial handler.

Prints the median and p90 in microseconds, for one caller thread and for ``--threads`` caller
threads calling at once (each thread's own round trips), with the server in this process and, with ``--process``, in a child process (as the engines run:
decode and prefill are separate processes, so they do not share a GIL).

    PYTHONPATH=. python3 benchmarks/control_rtt.py
    PYTHONPATH=. python3 benchmarks/control_rtt.py --calls 2000 --threads 8 --process

``--inline`` has the server serve Done without handing its listener role on (see ControlServer's
``inline``). ``--impl PATH`` loads another copy of control.py instead of hawk.connector.control, to
compare with an earlier version (``git show REV:hawk/connector/control.py > /tmp/old.py``; the
version with an I/O thread per side has no ``inline``).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import statistics
import sys
import threading
import time
from types import ModuleType

from hawk.connector.messages import Ack, Done


def _load(impl: str | None) -> ModuleType:
    if not impl:
        import hawk.connector.control as control

        return control
    spec = importlib.util.spec_from_file_location("hawk_control_impl", impl)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _ack(msg, ident):  # noqa: ANN001 - the handler signature of ControlServer
    return Ack(getattr(msg, "request_id", ""))


def _server(control: ModuleType, inline: bool):  # noqa: ANN202
    return control.ControlServer(_ack, inline=("done",)) if inline else control.ControlServer(_ack)


def _serve(impl: str | None, inline: bool, conn) -> None:  # noqa: ANN001 - a multiprocessing Connection
    control = _load(impl)
    server = _server(control, inline)
    conn.send(server.address)
    conn.recv()  # until the parent is done
    server.close()


def _stats(ts: list[float]) -> str:
    ts = sorted(ts)
    med = statistics.median(ts) * 1e6
    p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))] * 1e6
    return f"median {med:7.1f} us   p90 {p90:7.1f} us   (n={len(ts)})"


def _measure(control: ModuleType, address: str, calls: int, threads: int, warmup: int) -> list[float]:
    client = control.ControlClient(address)
    out: list[list[float]] = [[] for _ in range(threads)]
    go = threading.Barrier(threads)

    def caller(i: int) -> None:
        msg = Done(f"r{i}", True, "")
        for _ in range(warmup):
            client.call(msg, 5.0)
        go.wait()
        ts = out[i]
        for _ in range(calls):
            t = time.perf_counter()
            reply = client.call(msg, 5.0)
            ts.append(time.perf_counter() - t)
            assert reply == Ack(f"r{i}"), reply

    try:
        ths = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    finally:
        client.close()
    return [x for ts in out for x in ts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=500, help="timed calls per caller thread")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=8, help="caller threads of the concurrent run")
    p.add_argument("--process", action="store_true", help="also run with the server in a child process")
    p.add_argument("--impl", help="path of another control.py to measure instead")
    p.add_argument("--inline", action="store_true", help="declare Done inline on the server (ControlServer(inline=...))")
    a = p.parse_args()
    control = _load(a.impl)
    print(f"control: {control.__file__}")
    server = _server(control, a.inline)
    try:
        print(f"in-process,  1 caller : {_stats(_measure(control, server.address, a.calls, 1, a.warmup))}")
        print(f"in-process, {a.threads:2d} callers: {_stats(_measure(control, server.address, a.calls, a.threads, a.warmup))}")
    finally:
        server.close()
    if a.process:
        ctx = mp.get_context("spawn")
        mine, theirs = ctx.Pipe()
        child = ctx.Process(target=_serve, args=(a.impl, a.inline, theirs), daemon=True)
        child.start()
        try:
            address = mine.recv()
            print(f"2 processes, 1 caller : {_stats(_measure(control, address, a.calls, 1, a.warmup))}")
            print(f"2 processes,{a.threads:2d} callers: {_stats(_measure(control, address, a.calls, a.threads, a.warmup))}")
        finally:
            mine.send("stop")
            child.join(10)


if __name__ == "__main__":
    main()
