"""The control channel (hawk.connector.control) on its own: correlation under many concurrent callers,
timeouts, Deferred replies, close on either side, fire-and-forget sends, and the HMAC tags."""

from __future__ import annotations

import gc
import random
import threading
import time
from typing import Any

import pytest
import zmq

from hawk.connector.control import LIVENESS_EVERY_S, ControlClient, ControlServer, Deferred, PeerUnreachable, refuses_connections
from hawk.connector.messages import Ack, AuthError, Done, Error, KeepAlive, decode, encode, sign


def _echo(msg: Any, peer: bytes) -> Any:
    return Ack(msg.request_id)


@pytest.fixture
def echo():
    server = ControlServer(_echo)
    client = ControlClient(server.address)
    yield server, client
    client.close()
    server.close()


def _run_threads(n: int, fn) -> list[BaseException]:
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a caller thread hung"
    return errors


def test_call_and_start(echo):
    server, client = echo
    assert client.call(Done("a", True), 5) == Ack("a")
    pending = client.start(Done("b", True))
    time.sleep(0.01)  # work while the request is in flight (algorithm1 plans here)
    assert pending.result(5) == Ack("b")
    assert pending.result(5) == Ack("b")  # collected once, kept


def test_pending_calls_overlap_and_resolve_in_any_order_and_thread(echo):
    server, client = echo
    calls = [client.start(Done(f"r{i}", True)) for i in range(20)]
    for i in reversed(range(10, 20)):
        assert calls[i].result(5) == Ack(f"r{i}")
    got: dict[int, Any] = {}
    errors = _run_threads(10, lambda i: got.__setitem__(i, calls[i].result(5)))  # a result read by another thread
    assert not errors
    assert got == {i: Ack(f"r{i}") for i in range(10)}


def test_many_concurrent_callers_each_get_their_own_reply():
    """Replies come back out of order (the handler sleeps at random) to many threads at once; each
    call gets the reply to its own message. Also exercises the server's wake-up of its listener
    when a reply's send absorbs the notice of a request that arrived meanwhile."""
    rng = random.Random(3)

    def handler(msg: Any, peer: bytes) -> Any:
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.002)
        return Ack(msg.request_id)

    server = ControlServer(handler, workers=4)
    client = ControlClient(server.address)
    try:

        def caller(i: int) -> None:
            for j in range(150):
                rid = f"t{i}-{j}"
                if j % 3 == 0:
                    p = client.start(Done(rid, True))
                    assert p.result(10) == Ack(rid)
                else:
                    assert client.call(Done(rid, True), 10) == Ack(rid)

        assert _run_threads(16, caller) == []
        assert client._opened <= 16  # one socket per concurrent call at most, reused after
    finally:
        client.close()
        server.close()


def test_many_clients_many_threads_one_server():
    server = ControlServer(_echo, workers=2)
    clients = [ControlClient(server.address) for _ in range(4)]
    try:
        errors = _run_threads(12, lambda i: [clients[i % 4].call(Done(f"{i}.{j}", True), 10) == Ack(f"{i}.{j}") or pytest.fail("wrong reply") for j in range(100)])
        assert errors == []
    finally:
        for c in clients:
            c.close()
        server.close()


def test_slow_handler_does_not_hold_up_the_others():
    gate = threading.Event()

    def handler(msg: Any, peer: bytes) -> Any:
        if msg.request_id == "slow":
            gate.wait(10)
        return Ack(msg.request_id)

    server = ControlServer(handler, workers=2)
    client = ControlClient(server.address)
    try:
        slow = client.start(Done("slow", True))
        t0 = time.monotonic()
        for i in range(20):
            assert client.call(Done(f"fast{i}", True), 5) == Ack(f"fast{i}")
        assert time.monotonic() - t0 < 5
        gate.set()
        assert slow.result(5) == Ack("slow")
    finally:
        gate.set()
        client.close()
        server.close()


def test_timeout_is_peer_unreachable_and_the_late_reply_is_dropped():
    late_handled = threading.Semaphore(0)

    def handler(msg: Any, peer: bytes) -> Any:
        if msg.request_id.startswith("late"):
            time.sleep(1.0)
            late_handled.release()
        return Ack(msg.request_id)

    server = ControlServer(handler)
    client = ControlClient(server.address)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match="within"):
            client.call(Done("late1", True), 0.1)
        assert 0.09 <= time.monotonic() - t0 < 0.8  # at the timeout, not at the reply (1 s)
        pending = client.start(Done("late2", True))
        with pytest.raises(PeerUnreachable):
            pending.result(0.05)
        with pytest.raises(PeerUnreachable):  # the call is over: no second wait
            pending.result(5)
        for _ in range(2):
            assert late_handled.acquire(timeout=10)
        time.sleep(0.3)  # both late replies are now queued on the client's (reused) socket
        assert client._opened == 1
        for i in range(5):
            assert client.call(Done(f"next{i}", True), 5) == Ack(f"next{i}")
    finally:
        client.close()
        server.close()


def test_a_peer_whose_address_refuses_connections_fails_the_call_before_its_timeout():
    """The server goes away (its port closes, as when its process dies) while a call waits on a 30 s
    timeout: the call ends within a few liveness checks, saying why, not at the timeout."""
    started = threading.Event()

    def stalls(msg: Any, peer: bytes) -> Any:
        started.set()
        time.sleep(0.5)
        return Deferred()  # never answered

    server = ControlServer(stalls)
    client = ControlClient(server.address)
    try:
        pending = client.start(Done("r", True))
        assert started.wait(5)
        server.close()
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable, match="refuses connections"):
            pending.result(30)
        assert time.monotonic() - t0 < 3 * LIVENESS_EVERY_S + 2
    finally:
        client.close()


def test_a_slow_peer_that_still_listens_is_waited_for():
    """Liveness checks while a slow handler works do not end the call: the reply comes, after several checks."""
    def slow(msg: Any, peer: bytes) -> Any:
        time.sleep(2.5 * LIVENESS_EVERY_S)
        return Ack(msg.request_id)

    server = ControlServer(slow)
    client = ControlClient(server.address)
    try:
        assert client.call(Done("slow", True), 30) == Ack("slow")
    finally:
        client.close()
        server.close()


def test_refuses_connections_tells_a_closed_port_and_socket_file_from_a_live_one(tmp_path):
    server = ControlServer(_echo)
    try:
        assert not refuses_connections(server.address)
    finally:
        server.close()
    deadline = time.monotonic() + 5  # ZeroMQ's I/O thread closes the listening socket shortly after close()
    while not refuses_connections(server.address) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert refuses_connections(server.address)
    assert refuses_connections(f"ipc://{tmp_path}/nobody.sock")
    with zmq.Context.instance().socket(zmq.ROUTER) as live:
        live.bind(f"ipc://{tmp_path}/live.sock")
        assert not refuses_connections(f"ipc://{tmp_path}/live.sock")
    assert not refuses_connections("inproc://anything")  # nothing to probe: never called gone


def test_no_server_is_peer_unreachable():
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # a free port nobody serves
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(PeerUnreachable):
            client.call(Done("x", True), 0.2)
        client.send(Done("y", True))  # fire and forget: no error either
    finally:
        client.close()


def test_deferred_reply_from_another_thread(echo):
    waiting: list[Deferred] = []

    def handler(msg: Any, peer: bytes) -> Any:
        if msg.request_id == "early":  # resolved before the server binds it
            d = Deferred()
            assert d.resolve(Ack("early"))
            assert not d.resolve(Ack("twice"))
            return d
        d = Deferred()
        waiting.append(d)
        return d

    server = ControlServer(handler, workers=1)  # the reply must not need a free worker
    client = ControlClient(server.address)
    try:
        assert client.call(Done("early", True), 5) == Ack("early")
        pending = client.start(Done("later", True))
        deadline = time.monotonic() + 5
        while not waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        assert client.call(Done("early", True), 5) == Ack("early")  # the single worker is free meanwhile
        threading.Timer(0.05, lambda: waiting[0].resolve(Ack("later"))).start()
        assert pending.result(5) == Ack("later")
        assert not waiting[0].resolve(Error("later", "too late"))
    finally:
        client.close()
        server.close()


def test_reply_after_server_close_is_dropped():
    held: list[Deferred] = []
    entered, release = threading.Event(), threading.Event()

    def handler(msg: Any, peer: bytes) -> Any:
        if msg.request_id == "deferred":
            held.append(Deferred())
            return held[-1]
        entered.set()
        release.wait(5)
        return Ack(msg.request_id)

    server = ControlServer(handler)
    client = ControlClient(server.address)
    try:
        deferred = client.start(Done("deferred", True))
        running = client.start(Done("running", True))
        assert entered.wait(5)
        deadline = time.monotonic() + 5
        while not held and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 2  # does not wait for the running handler
        release.set()  # its reply now meets a closed socket
        assert held[0].resolve(Ack("deferred"))  # so does this one: no error
        with pytest.raises(PeerUnreachable):
            running.result(0.3)
        with pytest.raises(PeerUnreachable):
            deferred.result(0.1)
        server.close()  # twice is fine
        time.sleep(0.1)
        assert not [t for t in threading.enumerate() if t.name.startswith("hawk-ctl-server") and t.is_alive() and t in server._threads]
    finally:
        release.set()
        client.close()


def test_reply_after_client_close_and_close_wakes_waiting_callers():
    release = threading.Event()

    def handler(msg: Any, peer: bytes) -> Any:
        if msg.request_id.startswith("wait"):
            release.wait(5)
        return Ack(msg.request_id)

    server = ControlServer(handler, workers=4)
    client = ControlClient(server.address)
    other = ControlClient(server.address)
    try:
        outcome: dict[int, Any] = {}

        def waiter(i: int) -> None:
            try:
                outcome[i] = client.call(Done(f"wait{i}", True), 30)
            except PeerUnreachable as e:
                outcome[i] = e

        threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        client.close()
        for t in threads:
            t.join(5)
        assert time.monotonic() - t0 < 2, "close must end the waiting calls at once"
        assert all(isinstance(outcome[i], PeerUnreachable) and "closed" in str(outcome[i]) for i in range(3)), outcome
        release.set()  # the replies now go to closed sockets; the server keeps serving
        with pytest.raises(PeerUnreachable, match="closed"):
            client.call(Done("after", True), 5)
        with pytest.raises(PeerUnreachable, match="closed"):
            client.start(Done("after", True))
        client.send(Done("after", True))  # dropped, as before
        client.close()  # twice is fine
        for i in range(5):
            assert other.call(Done(f"o{i}", True), 5) == Ack(f"o{i}")
    finally:
        release.set()
        other.close()
        server.close()


def test_abandoned_pending_call_gives_its_socket_back(echo):
    server, client = echo
    for i in range(50):
        client.start(Done(f"dropped{i}", True))  # never collected: its socket comes back when it goes
    gc.collect()
    assert client._opened <= 2
    assert client.call(Done("kept", True), 5) == Ack("kept")


def test_fire_and_forget_from_many_threads():
    seen: list[str] = []
    lock = threading.Lock()

    def handler(msg: Any, peer: bytes) -> Any:
        with lock:
            seen.append(msg.request_ids[0] if isinstance(msg, KeepAlive) else msg.request_id)
        return Ack(getattr(msg, "request_id", ""))  # no reply goes to a send, whatever the handler returns

    server = ControlServer(handler)
    client = ControlClient(server.address)
    try:
        _run_threads(8, lambda i: [client.send(Done(f"{i}.{j}", True) if j % 2 else KeepAlive("r", [f"{i}.{j}"])) for j in range(50)])
        deadline = time.monotonic() + 10
        while len(seen) < 400 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == sorted(f"{i}.{j}" for i in range(8) for j in range(50))
        assert client.call(Done("z", True), 5) == Ack("z")  # the socket holds no stray reply
    finally:
        client.close()
        server.close()


def test_handler_errors_are_answered():
    def handler(msg: Any, peer: bytes) -> Any:
        raise RuntimeError("boom")

    server = ControlServer(handler)
    client = ControlClient(server.address)
    try:
        reply = client.call(Done("x", True), 5)
        assert isinstance(reply, Error) and "boom" in reply.message and reply.request_id == "x"
        with zmq.Context.instance().socket(zmq.DEALER) as raw:  # a malformed payload
            raw.connect(server.address)
            raw.send_multipart([b"\x01" * 8, b"", b"not msgpack \xc1"])
            assert raw.poll(5000)
            corr, tag, payload = raw.recv_multipart()
            assert corr == b"\x01" * 8
        assert "rejected" in client._decode(tag, payload).message
    finally:
        client.close()
        server.close()


def test_hmac_enforced_under_concurrency():
    seen: list[str] = []

    def handler(msg: Any, peer: bytes) -> Any:
        seen.append(msg.request_id)
        return Ack(msg.request_id)

    server = ControlServer(handler, secret=b"right")
    good = ControlClient(server.address, secret=b"right")
    bad = ControlClient(server.address, secret=b"wrong")
    none = ControlClient(server.address, secret=b"")  # explicitly no key (and none from the environment)
    none._key = None
    try:

        def caller(i: int) -> None:
            for j in range(30):
                c = (good, bad, none)[(i + j) % 3]
                rid = f"{i}.{j}.{(i + j) % 3}"
                reply = c.call(Done(rid, True), 10)
                if c is good:
                    assert reply == Ack(rid)
                else:
                    assert isinstance(reply, Error) and "rejected" in reply.message, reply

        assert _run_threads(6, caller) == []
        assert seen and all(r.endswith(".0") for r in seen)  # only the keyed client's messages ran
        bad.send(Done("sneaky", True))
        good.send(Done("fine", True))
        deadline = time.monotonic() + 5
        while "fine" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert "fine" in seen and "sneaky" not in seen
    finally:
        for c in (good, bad, none):
            c.close()
        server.close()


def test_client_checks_the_reply_tags():
    """A peer that answers with a wrong tag is ignored (the call times out); one that answers an
    untagged non-Error to a keyed client raises AuthError; an untagged Error is accepted."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = ControlClient(f"tcp://127.0.0.1:{port}", secret=b"key")
    stop = threading.Event()

    def fake() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            ident, corr, tag, payload = router.recv_multipart()
            how = decode(payload).request_id  # says how to misbehave
            if how == "wrong-tag":
                out = encode(Ack("forged"))
                router.send_multipart([ident, corr, sign(b"other", corr, out), out])
            elif how == "untagged":
                router.send_multipart([ident, corr, b"", encode(Ack("untagged"))])
            elif how == "untagged-error":
                router.send_multipart([ident, corr, b"", encode(Error("", "rejected: no"))])
            else:
                out = encode(Ack("ok"))
                router.send_multipart([ident, corr, sign(b"key", corr, out), out])

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    try:
        with pytest.raises(PeerUnreachable):
            client.call(Done("wrong-tag", True), 0.3)
        with pytest.raises(AuthError):
            client.call(Done("untagged", True), 5)
        assert isinstance(client.call(Done("untagged-error", True), 5), Error)
        assert client.call(Done("fine", True), 5) == Ack("ok")
    finally:
        stop.set()
        t.join(5)
        client.close()
        router.close(linger=0)


def test_server_serves_after_many_clients_come_and_go():
    server = ControlServer(_echo)
    try:
        for i in range(30):
            c = ControlClient(server.address)
            assert c.call(Done(f"c{i}", True), 5) == Ack(f"c{i}")
            c.close()
    finally:
        server.close()


def test_inline_types_are_served_by_the_listener():
    """Declared-quick types are served without handing the listener role on; the rest still go
    to a thread of their own, so a slow one does not hold up the inline ones."""
    gate = threading.Event()
    seen: list[str] = []

    def handler(msg: Any, peer: bytes) -> Any:
        seen.append(getattr(msg, "request_id", msg.TYPE))
        if isinstance(msg, KeepAlive):
            gate.wait(10)  # slow, and not declared inline
            return Ack("slow")
        if msg.request_id == "deferred":
            d = Deferred()
            threading.Timer(0.02, lambda: d.resolve(Ack("deferred"))).start()
            return d
        return Ack(msg.request_id)

    server = ControlServer(handler, workers=3, inline=("done",), secret=b"k")
    client = ControlClient(server.address, secret=b"k")
    stranger = ControlClient(server.address, secret=b"not-k")
    try:
        slow = client.start(KeepAlive("r", ["x"]))
        deadline = time.monotonic() + 5
        while "keepalive" not in seen and time.monotonic() < deadline:
            time.sleep(0.005)
        for i in range(50):  # served while the slow handler holds its thread
            assert client.call(Done(f"i{i}", True), 5) == Ack(f"i{i}")
        assert client.call(Done("deferred", True), 5) == Ack("deferred")
        assert isinstance(stranger.call(Done("nope", True), 5), Error)  # still checked first
        errors = _run_threads(8, lambda i: [client.call(Done(f"{i}.{j}", True), 10) == Ack(f"{i}.{j}") or pytest.fail("wrong") for j in range(50)])
        assert errors == []
        gate.set()
        assert slow.result(5) == Ack("slow")
        assert "nope" not in seen
    finally:
        gate.set()
        for c in (client, stranger):
            c.close()
        server.close()


def test_an_engine_process_raises_its_open_file_limit_and_never_lowers_it():
    import resource
    import subprocess
    import sys

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    script = ("import resource; from hawk.serve.common import raise_open_file_limit as r; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
              "resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); print(r(), r(128), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    raised, again, now = (int(x) for x in out.stdout.split())
    want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    assert raised == again == now == max(256, want)
