"""The control channel of Algorithm 1 over ZeroMQ: a ROUTER server and a DEALER client.

Each side owns its socket in one I/O thread (ZeroMQ sockets are not thread-safe). Other threads
hand frames to that thread over an inproc PUSH/PULL pair, so a reply leaves as soon as it is
ready, with no polling delay. Requests and replies are matched by an 8-byte correlation id.
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from hawk.connector.messages import Error, Message, ProtocolError, decode, encode

log = logging.getLogger(__name__)

_NO_REPLY = struct.pack("<Q", 0)


class PeerUnreachable(TimeoutError):
    """No reply from the control peer in time: it may be dead, or the address is wrong."""


class _Loop:
    """An I/O thread owning ``sock``; ``post(frames)`` from any thread sends through it."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, on_frames: Callable[[list[bytes]], None], name: str):
        self._ctx = ctx
        self._sock = sock
        self._on_frames = on_frames
        self._inbox_addr = f"inproc://hawk-ctl-{uuid.uuid4().hex}"
        self._inbox = ctx.socket(zmq.PULL)
        self._inbox.bind(self._inbox_addr)
        self._local = threading.local()
        self._pushers: list[zmq.Socket] = []
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, frames: list[bytes]) -> None:
        p = getattr(self._local, "push", None)
        if p is None:
            p = self._ctx.socket(zmq.PUSH)
            p.setsockopt(zmq.LINGER, 0)
            p.connect(self._inbox_addr)
            self._local.push = p
            with self._push_lock:
                self._pushers.append(p)
        p.send_multipart(frames)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(50))
            except zmq.ZMQError:
                break
            if self._inbox in events:
                while True:
                    try:
                        self._sock.send_multipart(self._inbox.recv_multipart(zmq.NOBLOCK), zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_frames(frames)
                    except Exception:  # noqa: BLE001 - one bad frame must not kill the loop
                        log.exception("control frame handler failed")
        self._sock.close(linger=0)
        self._inbox.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._push_lock:
            for p in self._pushers:
                p.close(linger=0)
            self._pushers.clear()


class ControlServer:
    """Serves ``handler(message, peer_identity) -> reply`` on a ROUTER socket (127.0.0.1 by default)."""

    def __init__(self, handler: Callable[[Message, bytes], Message | None], host: str = "127.0.0.1", port: int = 0, workers: int = 4):
        self._handler = handler
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hawk-ctl-worker")
        self._loop = _Loop(self._ctx, sock, self._dispatch, "hawk-ctl-server")

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        ident, corr, payload = frames
        self._pool.submit(self._serve, ident, corr, payload)

    def _serve(self, ident: bytes, corr: bytes, payload: bytes) -> None:
        try:
            msg = decode(payload)
            reply = self._handler(msg, ident)
        except ProtocolError as e:
            reply = Error("", f"rejected: {e}")
        except Exception as e:  # noqa: BLE001 - the peer gets the error, the server keeps serving
            log.exception("control handler failed")
            reply = Error(getattr(locals().get("msg"), "request_id", ""), f"{type(e).__name__}: {e}")
        if reply is not None and corr != _NO_REPLY:
            self._loop.post([ident, corr, encode(reply)])

    def close(self) -> None:
        self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class ControlClient:
    """Calls a :class:`ControlServer`; safe to use from many threads at once."""

    def __init__(self, address: str):
        self.address = address
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._pending: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._loop = _Loop(self._ctx, sock, self._on_reply, "hawk-ctl-client")

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        with self._lock:
            fut = self._pending.pop(frames[0], None)
        if fut is not None and not fut.done():
            fut.set_result(frames[1])

    def call(self, msg: Message, timeout_s: float) -> Message:
        """Send ``msg`` and wait for its reply; :class:`PeerUnreachable` after ``timeout_s``."""
        corr = struct.pack("<Q", next(self._ids))
        fut: Future = Future()
        with self._lock:
            self._pending[corr] = fut
        self._loop.post([corr, encode(msg)])
        try:
            payload = fut.result(timeout=timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"no reply to {msg.TYPE} from {self.address} within {timeout_s:.3g} s") from None
        finally:
            with self._lock:
                self._pending.pop(corr, None)
        return decode(payload)

    def send(self, msg: Message) -> None:
        """Fire and forget (the server sends no reply)."""
        self._loop.post([_NO_REPLY, encode(msg)])

    def close(self) -> None:
        self._loop.close()
        with self._lock:
            for f in self._pending.values():
                f.cancel()
            self._pending.clear()
