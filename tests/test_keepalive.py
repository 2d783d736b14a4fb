"""A HAWK server keeps an idle connection open longer than its clients do, so a client never sends a
request on a connection the server is closing (the request would fail with ReadError)."""

from __future__ import annotations

import socket
import time

from fastapi import FastAPI

from hawk.serve.common import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S, ThreadedServer

HTTPX_DEFAULT_KEEPALIVE_S = 5.0


def _get(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock.recv(4096)


def test_an_idle_connection_outlives_the_clients_keepalive() -> None:
    assert SERVER_KEEPALIVE_S > max(CLIENT_KEEPALIVE_S, HTTPX_DEFAULT_KEEPALIVE_S)
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    srv = ThreadedServer(app).start()
    try:
        host, port = srv.sock.getsockname()[:2]
        with socket.create_connection((host, port), timeout=10) as s:
            assert _get(s).startswith(b"HTTP/1.1 200")
            time.sleep(HTTPX_DEFAULT_KEEPALIVE_S + 1.0)  # idle past what a client keeps: still open here
            assert _get(s).startswith(b"HTTP/1.1 200")
    finally:
        srv.stop()
