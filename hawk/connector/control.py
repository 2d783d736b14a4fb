"""The control channel of Algorithm 1 over ZeroMQ: a ROUTER server and DEALER clients.

A round trip costs as few thread hand-offs as ZeroMQ allows (each is a futex wake and a GIL
acquisition, 100-300 us on a VM): the calling thread sends its request and reads its reply
itself, and the server thread that receives a request runs its handler and sends the reply.

Client: a pool of DEALER sockets, all connected to the server. A call takes a free socket (or
opens one) and owns it until its reply is read, so no socket is ever used by two threads at once
and concurrent callers each wait on their own socket; :meth:`ControlClient.start` hands the
socket to the returned :class:`PendingCall`, which reads the reply on ``result`` (from any
thread). A reply to a call that timed out reaches the socket's next user, who drops it by its
correlation id.

Server: ``workers`` threads take turns as the listener (leader/followers): the leader waits on
the ROUTER socket's notification fd (an OS-level poll, which is not a socket operation), takes
one request under the socket lock, hands the listener role on, and serves the request itself.
Replies, Deferred ones included, are sent under the same lock by whichever thread has them;
ZeroMQ allows a socket to move between threads when a full memory barrier (the lock) separates
them. As the fd only signals new events, a thread that has just sent checks the socket for
pending input and, finding some, wakes the listener through a pipe.

Frames are ``[correlation id, tag, payload]``; requests and replies are matched by the 8-byte
correlation id. With a cluster secret (the ``secret`` argument, or $HAWK_CLUSTER_SECRET, which
the launcher gives its children), the tag is an HMAC of the frame (messages.sign); the server
checks it before decoding and answers a bad one with an Error, and the client drops replies
whose tag is wrong.

Liveness: ZeroMQ reconnects to a dead peer silently and keeps the request queued, so a call alone
would learn of the death only at its timeout. A call still waiting after ``LIVENESS_EVERY_S`` checks,
once per that period per client, that the peer's address still takes a plain connection; a refusal
(its process is gone) ends the call with :class:`PeerUnreachable` then.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Collection

import msgpack
import zmq

from hawk.connector.messages import AuthError, Error, Message, ProtocolError, decode, encode, sign, verify

log = logging.getLogger(__name__)

_NO_REPLY = struct.pack("<Q", 0)
SECRET_ENV = "HAWK_CLUSTER_SECRET"
_FLUSH_MS = 100  # how long a closed client's socket may still flush fire-and-forget messages (in the background)


#: Flags and options as plain ints: pyzmq's enums cost microseconds per operation (``Enum.__or__`` for
#: every frame of ``send_multipart``, an enum per ``getsockopt``), and one pull sends and receives three
#: multipart messages each way (D1, D2, D9).
_NB, _MORE_NB = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)


def _send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)`` for bytes frames, with int flags. As there: a full
    queue raises ``zmq.Again`` on the first frame and nothing is sent (ZeroMQ sends a message whole)."""
    send = sock.send
    for f in frames[:-1]:
        send(f, _MORE_NB)
    send(frames[-1], _NB)


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """``sock.recv_multipart(zmq.NOBLOCK)``, with int flags: ``zmq.Again`` when no message is waiting."""
    parts = [sock.recv(_NB)]
    while sock.get(_RCVMORE):
        parts.append(sock.recv(_NB))
    return parts


def _secret(secret: str | bytes | None) -> bytes | None:
    """The key for frame tags: the one given, else the cluster's from the environment, else none."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None


class PeerUnreachable(TimeoutError):
    """No reply from the control peer in time: it may be dead, or the address is wrong (or the
    client was closed while the call waited)."""


#: A call still unanswered after this long checks, once per this period, that its peer's address still
#: takes connections: a peer whose process is gone fails the call then, not at its timeout.
LIVENESS_EVERY_S = 1.0


def refuses_connections(address: str, timeout_s: float = 0.5) -> bool:
    """Whether nothing listens at a ``tcp://`` or ``ipc://`` address any more (the connection is refused:
    the process that bound it is gone). A slow or unreachable host is not a refusal: False.

    Why a plain connect: ZeroMQ reconnects to a dead peer silently and queues the request, so a caller
    would learn of the death only at its timeout (a pull's 30 s); the kernel answers a connect to a
    closed port or socket file at once. ZeroMQ drops the probe's connection when no handshake follows."""
    scheme, _, rest = address.partition("://")
    try:
        if scheme == "tcp":
            host, _, port = rest.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        if scheme == "ipc":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout_s)
                sock.connect(rest)
                return False
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except (OSError, ValueError):
        return False
    return False


class _Liveness:
    """One client's view of whether its peer's address still takes connections, checked at most once
    per :data:`LIVENESS_EVERY_S` however many calls wait (each check is a connect)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._checked_at = -math.inf
        self._refused = False

    def gone(self) -> bool:
        with self._lock:  # one caller checks; the others read the last answer meanwhile
            now = time.monotonic()
            due = now - self._checked_at >= LIVENESS_EVERY_S
            if due:
                self._checked_at = now
        if due:
            self._refused = refuses_connections(self.address)
        return self._refused


def _pipe() -> tuple[int, int]:
    """A non-blocking pipe: a wake-up signal another thread can poll along with a socket's fd."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _signal(w: int) -> None:
    try:
        os.write(w, b"x")
    except (BlockingIOError, OSError):  # full: it is signalled already; closed: nobody listens
        pass


def _peek_type(payload: bytes) -> str | None:
    """The ``type`` of an encoded message (messages.encode puts it second), without decoding the rest."""
    try:
        u = msgpack.Unpacker(raw=False)
        u.feed(payload)
        for _ in range(min(u.read_map_header(), 2)):
            key, value = u.unpack(), u.unpack()
            if key == "type":
                return value if isinstance(value, str) else None
    except Exception:  # noqa: BLE001 - not ours to judge here: _serve rejects it
        return None
    return None


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


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
    """Serves ``handler(message, peer_identity) -> reply`` on a ROUTER socket (127.0.0.1 by default).

    ``workers`` threads serve, up to that many handlers at once (a handler may block: the others
    keep serving). ``peer_identity`` names the client's socket that sent the message (a client
    may call through several).

    ``inline``: message types (``Message.TYPE``) whose handlers are quick and never block. The
    thread that receives one serves it without first handing the listener role on, which saves a
    thread wake-up per round trip; while it does, no other request is taken. Empty by default."""

    def __init__(
        self,
        handler: Callable[[Message, bytes], Message | Deferred | None],
        host: str = "127.0.0.1",
        port: int = 0,
        workers: int = 4,
        secret: str | bytes | None = None,
        inline: Collection[str] = (),
    ):
        self._handler = handler
        self._key = _secret(secret)
        self._inline = frozenset(inline)
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
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)  # readable when the socket has new events (edge-like: see _send)
        self._sock_lock = threading.Lock()  # every operation on the socket holds it; _closed too
        self._closed = False
        self._lead = threading.Lock()  # held by the listener
        self._stop = threading.Event()
        self._wake_r, self._wake_w = _pipe()
        self._threads = [threading.Thread(target=self._run, name=f"hawk-ctl-server-{i}", daemon=True) for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    # -- the serving threads -------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with self._lead:  # followers wait here; the leader listens
                while True:
                    if self._stop.is_set():
                        return
                    try:
                        frames = self._listen(poller)
                    except Exception:  # noqa: BLE001 - the serving threads must not die
                        log.exception("control server failed to receive")
                        time.sleep(0.01)
                        continue
                    if frames is None or len(frames) != 4 or not self._inline or _peek_type(frames[3]) not in self._inline:
                        break
                    try:  # quick: served by the listener, which keeps its role (nobody is woken)
                        self._serve(*frames)
                    except Exception:  # noqa: BLE001 - one bad frame must not kill the thread
                        log.exception("control frame handler failed")
            if frames is None:
                return
            if len(frames) != 4:
                continue
            try:
                self._serve(*frames)
            except Exception:  # noqa: BLE001 - one bad frame must not kill the thread
                log.exception("control frame handler failed")

    def _listen(self, poller: select.poll) -> list[bytes] | None:
        """The next request's frames (None once closed)."""
        while not self._stop.is_set():
            with self._sock_lock:
                if self._closed:
                    return None
                # Asking for the events processes the socket's commands, so the fd is quiet after a "no"; asked
                # rather than a receive that fails: pyzmq builds an exception for that (microseconds), and a new
                # listener comes here while the thread it took over from runs a handler
                if self._sock.get(_EVENTS) & _POLLIN:
                    try:
                        return _recv_frames(self._sock)
                    except zmq.Again:
                        pass
            for fd, _ in poller.poll(1000):  # the socket's fd (new events) or the wake-up pipe
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:  # BlockingIOError: drained already
                        pass
        return None

    def _serve(self, ident: bytes, corr: bytes, tag: bytes, payload: bytes) -> None:
        try:
            verify(self._key, corr, tag, payload)  # before decoding: a stranger changes nothing
            msg = decode(payload)
            reply = self._handler(msg, ident)
        except AuthError as e:  # answered untagged: the peer's key (if any) is not ours
            log.warning("control message refused: %s", e)
            if corr != _NO_REPLY:
                self._send([ident, corr, b"", encode(Error("", f"rejected: {e}"))])
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
        self._send([ident, corr, sign(self._key, corr, out), out])

    def _send(self, frames: list[bytes]) -> None:
        """Send from any thread. Sending processes the socket's pending commands, which may include
        a request's arrival that the listener's poll will then not see: if input is pending after
        the send, the listener is woken."""
        with self._sock_lock:
            if self._closed:  # the caller's timeout decides
                log.debug("control reply after close dropped")
                return
            try:
                _send_frames(self._sock, frames)
            except zmq.ZMQError as e:  # a full queue to a peer that reads nothing: its timeout decides
                log.debug("control reply dropped: %s", e)
            if self._sock.get(_EVENTS) & _POLLIN:
                _signal(self._wake_w)

    def close(self) -> None:
        """Stop serving: requests not yet taken are dropped, and so are the replies of handlers
        still running (and of Deferreds resolved later). Returns without waiting for them."""
        with self._sock_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            _signal(self._wake_w)  # the listener leaves its poll
        leading = self._lead.acquire(timeout=5)  # held: no thread polls the socket's fd, nor will
        try:
            with self._sock_lock:
                self._closed = True
                self._sock.close(linger=0)
            if leading:  # else a listener may still poll them: left to the process
                _close_fds(self._wake_r, self._wake_w)
        finally:
            if leading:
                self._lead.release()


class ControlClient:
    """Calls a :class:`ControlServer`; safe to use from many threads at once (each call waits on a
    socket of its own, so concurrent callers do not wait for each other)."""

    def __init__(self, address: str, secret: str | bytes | None = None):
        self.address = address
        self._key = _secret(secret)
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards _free, _closed, _opened
        self._free: list[zmq.Socket] = []  # connected sockets no call owns
        self._opened = 0
        self._closed = False
        self._wake_r, self._wake_w = _pipe()  # readable once closed: wakes every waiting call
        self._liveness = _Liveness(address)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)  # after the last waiter is gone
        self._free.append(self._open())  # connect now, as the handshake is being prepared

    def _open(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        with self._lock:
            self._opened += 1
        return sock

    def _take(self) -> zmq.Socket:
        with self._lock:
            if self._closed:
                raise PeerUnreachable(f"control client for {self.address} is closed")
            if self._free:
                return self._free.pop()
        return self._open()

    def _give(self, sock: zmq.Socket) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(sock)
                return
        sock.close(linger=_FLUSH_MS)

    def call(self, msg: Message, timeout_s: float) -> Message:
        """Send ``msg`` and wait for its reply; :class:`PeerUnreachable` after ``timeout_s``."""
        return self.start(msg).result(timeout_s)

    def start(self, msg: Message) -> PendingCall:
        """Send ``msg`` now and return at once; the reply is ``.result(timeout_s)`` (so the caller can
        do work while the request is in flight, e.g. plan its side of a transfer during D1)."""
        corr = struct.pack("<Q", next(self._ids))
        payload = encode(msg)
        frames = [corr, sign(self._key, corr, payload), payload]
        sock = self._take()
        try:
            _send_frames(sock, frames)
        except zmq.ZMQError as e:  # Again: the queue to the peer is full, it has not been reading
            self._give(sock)
            raise PeerUnreachable(f"{msg.TYPE} to {self.address} not sent: {e}") from None
        return PendingCall(self, msg, corr, sock)

    def _wait(self, sock: zmq.Socket, msg: Message, corr: bytes, timeout_s: float) -> tuple[bytes, bytes]:
        """Read ``sock`` until the reply to ``corr`` comes (others are stale: dropped). While it waits,
        a peer whose address refuses connections ends the wait (:class:`_Liveness`)."""
        start = time.monotonic()
        deadline, check = start + timeout_s, start + LIVENESS_EVERY_S
        items = [(sock, zmq.POLLIN), (self._wake_r, zmq.POLLIN)]
        while True:
            if self._closed:
                raise PeerUnreachable(f"control client for {self.address} closed while waiting for the reply to {msg.TYPE}")
            now = time.monotonic()
            if now >= deadline:
                raise PeerUnreachable(f"no reply to {msg.TYPE} from {self.address} within {timeout_s:.3g} s")
            if now >= check:
                if self._liveness.gone():
                    raise PeerUnreachable(f"no reply to {msg.TYPE} from {self.address}: it refuses connections "
                                          f"(nothing listens there any more) after {now - start:.1f} s")
                check = now + LIVENESS_EVERY_S
            if not zmq.zmq_poll(items, max(1, math.ceil((min(deadline, check) - now) * 1000))):
                continue
            while True:
                try:
                    frames = _recv_frames(sock)
                except zmq.Again:
                    break
                if len(frames) != 3 or frames[0] != corr:  # a late reply to a call that timed out
                    continue
                _, tag, payload = frames
                if tag:  # an untagged reply is accepted only as an Error (see PendingCall.result)
                    try:
                        verify(self._key, corr, tag, payload)
                    except AuthError:
                        log.warning("dropped a control reply from %s with a bad tag", self.address)
                        continue
                return tag, payload

    def _decode(self, tag: bytes, payload: bytes) -> Message:
        reply = decode(payload)
        if self._key and not tag and not isinstance(reply, Error):
            raise AuthError(f"untagged {reply.TYPE} reply from {self.address}: the peer does not share this cluster's secret")
        return reply

    def send(self, msg: Message) -> None:
        """Fire and forget (the server sends no reply): D9's single notification per transfer."""
        payload = encode(msg)
        frames = [_NO_REPLY, sign(self._key, _NO_REPLY, payload), payload]
        try:
            sock = self._take()
        except PeerUnreachable:  # closed: nobody would send it
            return
        try:
            _send_frames(sock, frames)
        except zmq.ZMQError as e:
            log.debug("control message %s to %s dropped: %s", msg.TYPE, self.address, e)
        finally:
            self._give(sock)

    def close(self) -> None:
        """Close the sockets; calls still waiting end with :class:`PeerUnreachable` at once, and later
        calls too (sends are dropped). Messages already sent are flushed for a short while."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free, self._free = self._free, []
        for sock in free:
            sock.close(linger=_FLUSH_MS)
        _signal(self._wake_w)


class PendingCall:
    """A request sent by :meth:`ControlClient.start` whose reply has not been collected yet; it owns
    the socket the reply comes on until then."""

    def __init__(self, client: ControlClient, msg: Message, corr: bytes, sock: zmq.Socket):
        self._client, self._msg, self._corr = client, msg, corr
        self._sock: zmq.Socket | None = sock
        self._reply: tuple[bytes, bytes] | None = None
        self._failed = ""  # why the call ended without a reply
        self._lock = threading.Lock()

    def result(self, timeout_s: float) -> Message:
        """The reply; :class:`PeerUnreachable` after ``timeout_s`` (counted from this call). Once it
        has timed out, the call is over (the socket goes back to the client) and so is every later
        ``result``."""
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):  # another thread is reading it
            raise PeerUnreachable(f"no reply to {self._msg.TYPE} from {self._client.address} within {timeout_s:.3g} s")
        try:
            if self._reply is None:
                if self._sock is None:
                    raise PeerUnreachable(self._failed)
                try:
                    self._reply = self._client._wait(self._sock, self._msg, self._corr, timeout_s)
                except PeerUnreachable as e:
                    self._failed = str(e)
                    raise
                finally:
                    sock, self._sock = self._sock, None
                    self._client._give(sock)
        finally:
            self._lock.release()
        return self._client._decode(*self._reply)

    def __del__(self) -> None:  # never collected: the socket goes back (a late reply on it is dropped)
        sock, self._sock = getattr(self, "_sock", None), None
        if sock is not None:
            try:
                self._client._give(sock)
            except Exception:  # noqa: BLE001 - at interpreter exit
                pass
