"""The control channel of Algorithm 1 over ZeroMQ: a ROUTER server and a DEALER client.

Each side owns its socket in one I/O thread (ZeroMQ sockets are not thread-safe). Other threads
hand frames to that thread over an inproc PUSH/PULL pair, so a reply leaves as soon as it is
ready, with no polling delay. Requests and replies are matched by an 8-byte correlation id.

Frames are ``[correlation id, tag, payload]``. With a cluster secret (the ``secret`` argument, or
$HAWK_CLUSTER_SECRET, which the launcher gives its children), the tag is an HMAC of the frame
(messages.sign); the server checks it before decoding and answers a bad one with an Error, and
the client drops replies whose tag is wrong.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import zmq

from hawk.connector.messages import AuthError, Error, Message, ProtocolError, decode, encode, sign, verify

log = logging.getLogger(__name__)

_NO_REPLY = struct.pack("<Q", 0)
SECRET_ENV = "HAWK_CLUSTER_SECRET"


def _secret(secret: str | bytes | None) -> bytes | None:
    """The key for frame tags: the one given, else the cluster's from the environment, else none."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


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
        if self._stop.is_set():  # closed: nobody would send it (and a new inproc pusher could block)
            return
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


class Deferred:
    """A reply a handler gives later (the layer-wise flow answers AwaitPush once the KV is pushed).

    The handler returns a Deferred instead of a message; the server binds it to the caller, and
    :meth:`resolve` sends the reply from any thread, once (a second resolve is ignored; one that
    comes before the binding is sent at binding)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send: Callable[[Message], None] | None = None
        self._reply: Message | None = None
        self._sent = False

    def _bind(self, send: Callable[[Message], None]) -> None:
        with self._lock:
            self._send = send
            reply = self._reply if not self._sent else None
            self._sent = self._sent or reply is not None
        if reply is not None:
            send(reply)

    def resolve(self, reply: Message) -> bool:
        """Send ``reply`` (or keep it until bound); False if a reply was already given."""
        with self._lock:
            if self._sent or self._reply is not None:
                return False
            self._reply = reply
            send = self._send
            self._sent = send is not None
        if send is not None:
            send(reply)
        return True


class ControlServer:
    """Serves ``handler(message, peer_identity) -> reply`` on a ROUTER socket (127.0.0.1 by default)."""

    def __init__(
        self,
        handler: Callable[[Message, bytes], Message | Deferred | None],
        host: str = "127.0.0.1",
        port: int = 0,
        workers: int = 4,
        secret: str | bytes | None = None,
    ):
        self._handler = handler
        self._key = _secret(secret)
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
        if len(frames) != 4:
            return
        ident, corr, tag, payload = frames
        self._pool.submit(self._serve, ident, corr, tag, payload)

    def _serve(self, ident: bytes, corr: bytes, tag: bytes, payload: bytes) -> None:
        try:
            verify(self._key, corr, tag, payload)  # before decoding: a stranger changes nothing
            msg = decode(payload)
            reply = self._handler(msg, ident)
        except AuthError as e:  # answered untagged: the peer's key (if any) is not ours
            log.warning("control message refused: %s", e)
            if corr != _NO_REPLY:
                self._loop.post([ident, corr, b"", encode(Error("", f"rejected: {e}"))])
            return
        except ProtocolError as e:
            reply = Error("", f"rejected: {e}")
        except Exception as e:  # noqa: BLE001 - the peer gets the error, the server keeps serving
            log.exception("control handler failed")
            reply = Error(getattr(locals().get("msg"), "request_id", ""), f"{type(e).__name__}: {e}")
        if isinstance(reply, Deferred):
            if corr != _NO_REPLY:
                reply._bind(lambda m: self._answer(ident, corr, m))
            return
        if reply is not None and corr != _NO_REPLY:
            self._answer(ident, corr, reply)

    def _answer(self, ident: bytes, corr: bytes, reply: Message) -> None:
        out = encode(reply)
        try:
            self._loop.post([ident, corr, sign(self._key, corr, out), out])
        except zmq.ZMQError:  # the server closed meanwhile: the caller's timeout decides
            log.debug("control reply after close dropped")

    def close(self) -> None:
        self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class ControlClient:
    """Calls a :class:`ControlServer`; safe to use from many threads at once."""

    def __init__(self, address: str, secret: str | bytes | None = None):
        self.address = address
        self._key = _secret(secret)
        self._ctx = zmq.Context.instance()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._pending: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._loop = _Loop(self._ctx, sock, self._on_reply, "hawk-ctl-client")

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        corr, tag, payload = frames
        if tag:  # an untagged reply is accepted only as an Error (see call)
            try:
                verify(self._key, corr, tag, payload)
            except AuthError:
                log.warning("dropped a control reply from %s with a bad tag", self.address)
                return
        with self._lock:
            fut = self._pending.pop(corr, None)
        if fut is not None and not fut.done():
            fut.set_result((tag, payload))

    def call(self, msg: Message, timeout_s: float) -> Message:
        """Send ``msg`` and wait for its reply; :class:`PeerUnreachable` after ``timeout_s``."""
        return self.start(msg).result(timeout_s)

    def start(self, msg: Message) -> PendingCall:
        """Send ``msg`` now and return at once; the reply is ``.result(timeout_s)`` (so the caller can
        do work while the request is in flight, e.g. plan its side of a transfer during D1)."""
        corr = struct.pack("<Q", next(self._ids))
        fut: Future = Future()
        with self._lock:
            self._pending[corr] = fut
        payload = encode(msg)
        self._loop.post([corr, sign(self._key, corr, payload), payload])
        return PendingCall(self, msg, corr, fut)

    def _finish(self, msg: Message, corr: bytes, fut: Future, timeout_s: float) -> Message:
        try:
            tag, payload = fut.result(timeout=timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"no reply to {msg.TYPE} from {self.address} within {timeout_s:.3g} s") from None
        finally:
            with self._lock:
                self._pending.pop(corr, None)
        reply = decode(payload)
        if self._key and not tag and not isinstance(reply, Error):
            raise AuthError(f"untagged {reply.TYPE} reply from {self.address}: the peer does not share this cluster's secret")
        return reply

    def send(self, msg: Message) -> None:
        """Fire and forget (the server sends no reply): D9's single notification per transfer."""
        payload = encode(msg)
        self._loop.post([_NO_REPLY, sign(self._key, _NO_REPLY, payload), payload])

    def close(self) -> None:
        self._loop.close()
        with self._lock:
            for f in self._pending.values():
                f.cancel()
            self._pending.clear()


class PendingCall:
    """A request sent by :meth:`ControlClient.start` whose reply has not been collected yet."""

    def __init__(self, client: ControlClient, msg: Message, corr: bytes, fut: Future):
        self._client, self._msg, self._corr, self._fut = client, msg, corr, fut

    def result(self, timeout_s: float) -> Message:
        """The reply; :class:`PeerUnreachable` after ``timeout_s`` (counted from this call)."""
        return self._client._finish(self._msg, self._corr, self._fut, timeout_s)
