"""What every HAWK HTTP server shares: OpenAI-shaped errors, sockets, and running uvicorn.

Servers bind their own socket (port 0 picks a free one) and hand it to uvicorn, so a launcher
learns the real port without racing another process for it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hawk.errors import HawkError
from hawk.serve.errors import http_error
from hawk.serve.protocol import OpenAIError, RequestTooLarge, Unauthorized, error_body

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

#: Where children find the per-cluster secret (never on a command line, where ``ps`` shows it).
CLUSTER_SECRET_ENV = "HAWK_CLUSTER_SECRET"
#: The router's API key when --api-key is not given (as vLLM's VLLM_API_KEY).
API_KEY_ENV = "HAWK_API_KEY"


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def cluster_secret_from_env() -> str | None:
    return os.environ.get(CLUSTER_SECRET_ENV) or None


# ============================================================================ engine liveness


def engine_alive(engine: Any) -> bool:
    """Whether an engine's step loop still runs (its ``is_alive()``): a dead one answers nothing, ever.
    An engine without one has no loop of its own to die."""
    probe = getattr(engine, "is_alive", None)
    return bool(probe()) if callable(probe) else True


# ============================================================================ child processes


#: Open files an engine process asks for (vLLM and SGLang raise theirs likewise): each KV control
#: call waiting on a peer holds a socket, a layer-wise decode has one waiting per request, and every
#: transfer peer holds connections of its own.
OPEN_FILE_TARGET = 65536


def raise_open_file_limit(target: int = OPEN_FILE_TARGET) -> int:
    """Raise this process's soft limit on open files to ``target`` (at most the hard limit); returns
    the soft limit now. Never lowers it; a refusal is logged, not raised."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def watch_parent(parent_pid: int) -> None:
    """SIGTERM this process (its server stops gracefully) once its launcher ``parent_pid`` is gone:
    a launcher killed without stopping its children must not leave them serving."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                log.warning("launcher %d is gone: shutting down", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="hawk-parent-watch", daemon=True).start()


def stop_processes(procs: Sequence[tuple[str, subprocess.Popen[Any]]], sig: int, timeout_s: float) -> None:
    """Send ``sig`` to each live (name, process), wait for all of them until one shared deadline,
    then SIGKILL any that hang; every one is reaped."""
    for _, p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for name, p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s %d did not stop; killing it", name, p.pid)
            p.kill()
            p.wait(5)


# ============================================================================ ASGI guards


async def send_error(send: Send, err: OpenAIError, headers: dict[str, str] | None = None) -> None:
    """Answer with ``err`` as OpenAI's JSON, from a pure ASGI middleware."""
    body = json.dumps(err.body()).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header, or None."""
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class RequireBearer:
    """Refuses (401) requests to the protected paths that lack ``Authorization: Bearer <token>``.

    Pure ASGI so it runs before the body is read: an unauthenticated client cannot make the
    server parse anything. The comparison is constant-time.
    """

    def __init__(self, app: ASGIApp, token: str | None, protected: Callable[[str], bool], what: str):
        self.app, self.token, self.protected, self.what = app, token, protected, what

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.token or not self.protected(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        got = bearer_token(scope)
        if got is None or not hmac.compare_digest(got.encode(), self.token.encode()):
            why = "missing" if got is None else "wrong"
            err = Unauthorized(f"{why} {self.what}: send 'Authorization: Bearer <{self.what}>'")
            await send_error(send, err, {"www-authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class LimitBody:
    """Refuses (413) request bodies over ``limit()`` bytes before the app parses any of them.

    The body is read here, counted, and replayed to the app, so at most ``limit`` bytes are ever
    held; a declared Content-Length over the limit is refused without reading at all.
    """

    def __init__(self, app: ASGIApp, limit: Callable[[], int | None]):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if scope["type"] == "http" else None
        if not limit:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_error(send, RequestTooLarge(int(declared), limit), {"connection": "close"})
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left while sending
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await send_error(send, RequestTooLarge(None, limit), {"connection": "close"})
                return
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnect detection still works

        await self.app(scope, replay, send)


# ============================================================================ errors


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for FastAPI's validation errors, and the offending parameter.

    Union-typed fields (``prompt``) fail once per alternative; those are folded into one message
    per field so the client reads "prompt: ..." once, not four near-identical lines.
    """
    by_field: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            return f"Invalid JSON in request body: {detail}".rstrip(": "), None
        loc = list(e.get("loc", ()))
        top = _field(loc[:2]) if loc and loc[0] == "body" else _field(loc[:1])
        by_field.setdefault(top, []).append(e)
    parts, first = [], None
    for top, errs in by_field.items():
        first = first or top or None
        e = errs[0]
        kind, msg = e.get("type", ""), str(e.get("msg", "invalid value"))
        msg = msg.removeprefix("Value error, ")
        if kind == "value_error":  # our own validators write whole sentences
            parts.append(msg if not top or top in msg else f"'{top}': {msg}")
        elif not top:  # the body itself
            parts.append("the request body is missing: send a JSON object" if kind == "missing" else f"the request body must be a JSON object ({msg})")
        elif kind == "missing":
            parts.append(f"missing required field '{_field(e.get('loc', ()))}'")
        elif len(errs) > 1 and any(len(x.get("loc", ())) > 2 for x in errs):  # one per union branch
            parts.append(f"'{top}' has an invalid type or value (got {_short(e.get('input'))})")
        else:
            parts.append(f"'{_field(e.get('loc', ()))}': {msg} (got {_short(e.get('input'))})")
    return "; ".join(parts) or "invalid request", first


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's ``{"error": {...}}``; bad input is a 400, never a 422 or a 500."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        retry = {"Retry-After": "2"} if exc.status == 503 else None  # e.g. an instance restarting
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(HawkError)
    async def _named(request: Request, exc: HawkError) -> JSONResponse:  # a named fault: the table says how
        return await _openai(request, http_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", None, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(msg, kind), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:  # keep serving; say what broke
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


# ============================================================================ sockets and servers


def bind_socket(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket; port 0 lets the OS choose (read it back with ``getsockname``).

    The protocol is named (``IPPROTO_TCP``, not 0) and ``TCP_NODELAY`` set: asyncio only turns
    Nagle's algorithm off on sockets whose ``proto`` says TCP, and accepted connections inherit
    both from this socket. With Nagle on, each small streamed write after the first waits for
    the client's delayed ACK (~40 ms), so tokens reach the client in bursts.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    host = LOOPBACK if host in ("0.0.0.0", "") else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


#: Seconds a HAWK server keeps an idle keep-alive connection open. Longer than any client of it keeps
#: one (httpx's default is 5 s, the router's :data:`CLIENT_KEEPALIVE_S`): with equal limits a client
#: may send a request on a connection in the instant the server closes it, and that request fails with
#: ``ReadError`` (the likely cause of one such failure in a burst of 256 requests after a pause). The
#: server's side must outlast the client's, as nginx's 75 s outlasts its clients'.
SERVER_KEEPALIVE_S = 75
#: Seconds the router keeps an idle connection to an instance (below :data:`SERVER_KEEPALIVE_S`).
CLIENT_KEEPALIVE_S = 30.0


def make_server(app: FastAPI, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=SERVER_KEEPALIVE_S)
    return uvicorn.Server(config)


def serve_foreground(app: FastAPI, sock: socket.socket, log_level: str = "warning") -> None:
    """Run ``app`` on ``sock`` in this (main) thread until SIGINT/SIGTERM; uvicorn then runs the
    app's shutdown (which closes the engine instance and releases its buffers)."""
    make_server(app, log_level).run(sockets=[sock])


class ThreadedServer:
    """uvicorn in a background thread: for tests, the demo, and a router beside its children."""

    def __init__(self, app: FastAPI, host: str = LOOPBACK, port: int = 0, log_level: str = "warning"):
        self.sock = bind_socket(host, port)
        self.url = url_of(self.sock)
        self.server = make_server(app, log_level)
        self.thread = threading.Thread(target=self._run, name="hawk-http", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e

    def start(self, timeout_s: float = 60.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server at {self.url} did not start: {self._error or 'timeout'}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def set_torch_threads(threads: int | None) -> None:
    """Engines on one box share its cores: without a cap, each torch process spawns one thread per
    core and they thrash each other."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(max(1, int(threads)))
