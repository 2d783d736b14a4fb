"""The layer-wise flow (kv_flow=layerwise): the decode hands its blocks over before prefill, the
prefill pushes each layer as its forward finishes it. The KV lands exactly; both ledgers end empty
after success, a cancelled prefill, a transfer failure mid-push, a decode that vanishes mid-push,
and a run of many small transfers with injected faults. gn-hawk runs both ways a sender can write:
its transform straight into the decode's memory (the local transport reaches it: "direct"), and
staging + WRITE ("staged")."""

import random
import threading
import time

import pytest

from hawk.connector.algorithm1 import KVTransferFailed
from hawk.transport.local import LocalTransport
from tests.kv_fixtures import L, dst_blocks_for, make_pair

CONFIGS = ("gn-hawk", "gg-direct")


@pytest.fixture(autouse=True, params=["worker", "inline", "inline-grouped", "worker-staged", "inline-staged"])
def post_from(request, monkeypatch):
    """Every test five times: layers produced and posted by the push worker, and by the forward's
    thread (what a stream-ordered transport on CUDA gets; forced here on the CPU), one layer per post
    and all of them in one post; "staged": through staging and WRITEs although the sender could
    write the decode's memory itself."""
    monkeypatch.setenv("HAWK_LAYERWISE_INLINE", "0" if request.param.startswith("worker") else "always")
    monkeypatch.setenv("HAWK_LAYERWISE_GROUP", str(L) if request.param == "inline-grouped" else "1")
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0" if request.param.endswith("staged") else "1")
    return request.param.split("-")[0]


def _direct(config: str) -> bool:
    """Whether this run's pushes of ``config`` go straight into the decode's memory (gn-hawk's transform)."""
    import os

    return config == "gn-hawk" and os.environ["HAWK_DIRECT_WRITE"] == "1"


class Faults:
    """Fail a push on demand whichever way it writes: the transport's batches (staged) or the transform
    that writes the decode's memory (direct)."""

    def __init__(self, pair, tp):
        self.tp, self.on = tp, False
        fmt = pair.sender.fmt
        real = fmt.produce_layers_into

        def produce(plan, layers, target):
            if self.on and L - 1 in layers:  # earlier layers are written: the failure comes mid-push
                raise RuntimeError("injected transform failure")
            return real(plan, layers, target)

        fmt.produce_layers_into = produce

    def set(self, on: bool) -> None:
        self.on = self.tp.fault = on


class FaultyLocal(LocalTransport):
    """Local copies whose batches fail on demand (the sender posts the WRITEs, so it gets this one)."""

    fault = False

    def _engine_poll(self, h):
        if self.fault:
            return "ERROR", "injected batch failure"
        return super()._engine_poll(h)


def _clean(pair, timeout=3.0):
    """Both ledgers empty (waiting for asynchronous releases): the sender's staging, waiting KV,
    pushes and drain; the receiver's reservations and handed-out destinations."""
    deadline = time.monotonic() + timeout
    while True:
        pair.sender.reap()
        pair.receiver.reap()
        s, r = pair.sender.accounting(), pair.receiver.accounting()
        if not (s["staging"] or s["waiting"] or s["in_flight"] or s["pushes"] or s["draining"] or r["reservations"] or r["expecting"] or r["draining"]):
            return True
        if time.monotonic() > deadline:
            raise AssertionError(f"ledgers not empty: sender {s}, receiver {r}")
        time.sleep(0.02)


def _hand_over(pair, rid, tokens, dst):
    """Start the decode side (D1 and the wait for the push) in a thread; returns (thread, outcome).
    The prefill expects the destination first, as its callers arrange (``handed`` comes as D1 leaves)."""
    out: dict = {}
    handed = threading.Event()
    pair.sender.expect(rid)

    def go():
        try:
            out["result"] = pair.receiver.push_to(pair.sender.address, rid, dst, tokens, on_handed=handed.set)
        except Exception as e:  # noqa: BLE001
            out["error"] = e
        handed.set()

    t = threading.Thread(target=go)
    t.start()
    assert handed.wait(5)
    deadline = time.monotonic() + 5  # until the prefill holds it (or the decode side is done)
    while rid not in pair.sender.accounting()["pushes"] and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.001)
    return t, out


def _prefill(pair, rid, tokens, blocks, fail_at=None):
    """What the prefill engine does: begin the push, report each layer, hand the blocks off."""
    feed = pair.sender.begin_push(rid, tokens, blocks)
    assert feed is not None
    for layer in range(L):
        if layer == fail_at:
            feed.failed("injected forward failure")
            pair.freed.append(rid)  # the engine frees its own blocks when the forward fails
            return
        feed.layer_written(layer)
    pair.add(rid, tokens, blocks)


@pytest.mark.parametrize("config", CONFIGS)
def test_layerwise_push_lands_the_kv_and_releases_everything(config, post_from):
    pair = make_pair(config, LocalTransport(), LocalTransport())
    try:
        for i, (tokens, blocks) in enumerate([(100, [9, 3, 4, 5, 6, 7, 8]), (1, [0]), (64, [10, 11, 12, 13])]):
            dst = dst_blocks_for(config, tokens, start=1)
            t, out = _hand_over(pair, f"r{i}", tokens, dst)
            _prefill(pair, f"r{i}", tokens, blocks)
            t.join(10)
            assert "result" in out, out
            assert out["result"].mode == "layerwise" and out["result"].bytes > 0 and out["result"].num_tokens == tokens
            assert ("sender_posts" in out["result"].timings) == (post_from == "inline")  # the path asked for ran
            assert (out["result"].requests == 0) == _direct(config)  # direct: no transport request at all
            assert pair.landed(tokens, blocks, dst)
        assert _clean(pair)
        assert sorted(pair.freed) == ["r0", "r1", "r2"]  # every prefill's blocks back exactly once
    finally:
        pair.close()


@pytest.mark.parametrize("config", CONFIGS)
def test_on_a_cpu_the_worker_takes_the_layers_after_the_forward(config, post_from):
    """A CPU forward fills the cores: the push worker produces nothing until the last layer is written
    (beside the forward it only oversubscribed them), then pushes every layer."""
    if post_from != "worker":
        pytest.skip("the forward's own thread posts inline: nothing runs beside the forward")
    pair = make_pair(config, LocalTransport(), LocalTransport())
    produced: list[list[int]] = []
    fmt = pair.sender.fmt
    for name in ("produce_layers", "produce_layers_into"):
        real = getattr(fmt, name)

        def spy(plan, layers, target, real=real):
            produced.append(list(layers))
            return real(plan, layers, target)

        setattr(fmt, name, spy)
    try:
        tokens, blocks = 100, [9, 3, 4, 5, 6, 7, 8]
        dst = dst_blocks_for(config, tokens, start=1)
        t, out = _hand_over(pair, "r", tokens, dst)
        feed = pair.sender.begin_push("r", tokens, blocks)
        assert feed is not None
        for layer in range(L - 1):
            feed.layer_written(layer)
        time.sleep(0.2)  # the worker would have taken them by now
        assert produced == []
        feed.layer_written(L - 1)
        pair.add("r", tokens, blocks)
        t.join(10)
        assert "result" in out, out
        assert sorted(x for p in produced for x in p) == list(range(L)) and pair.landed(tokens, blocks, dst)
        assert _clean(pair) and pair.freed == ["r"]
    finally:
        pair.close()


def test_late_destination_pushes_the_whole_request():
    """D1 after the prefill finished (a slow decode): the KV is pushed whole, same bytes."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    try:
        pair.add("r", 100, [9, 3, 4, 5, 6, 7, 8])
        t, out = _hand_over(pair, "r", 100, [1, 2])
        t.join(10)
        assert "result" in out and pair.landed(100, [9, 3, 4, 5, 6, 7, 8], [1, 2])
        assert _clean(pair) and pair.freed == ["r"]
    finally:
        pair.close()


def test_an_expected_destination_is_waited_for_and_pushed_layer_by_layer():
    """The decode hands over while the prefill starts (``expect``): the prefill's first layer waits
    for the PushTo that comes meanwhile, then pushes layer by layer as always."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    pair.sender.destination_wait_s = 5.0
    try:
        pair.sender.expect("r")
        assert pair.sender.accounting()["expected"] == ["r"]
        started = threading.Timer(0.05, lambda: holder.append(_hand_over(pair, "r", 100, [1, 2])))
        holder: list = []
        started.start()
        t0 = time.monotonic()
        _prefill(pair, "r", 100, [9, 3, 4, 5, 6, 7, 8])  # begin_push waits for the PushTo
        assert time.monotonic() - t0 >= 0.04
        started.join(5)
        t, out = holder[0]
        t.join(10)
        assert out["result"].mode == "layerwise" and pair.landed(100, [9, 3, 4, 5, 6, 7, 8], [1, 2])
        assert pair.sender.accounting()["expected"] == []
        assert _clean(pair) and pair.freed == ["r"]
    finally:
        pair.close()


def test_an_expected_destination_that_comes_late_or_never_costs_the_prefill_only_the_wait():
    """No PushTo within ``destination_wait_s``: the forward goes on without a push, its KV waits the
    pull way and a later PushTo gets it whole; an expectation is dropped by ``discard`` (waking a
    waiter) or after the TTL."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    pair.sender.destination_wait_s = 0.05
    try:
        pair.sender.expect("late")
        t0 = time.monotonic()
        assert pair.sender.begin_push("late", 100, [9, 3, 4, 5, 6, 7, 8]) is None
        assert 0.04 <= time.monotonic() - t0 < 2
        pair.add("late", 100, [9, 3, 4, 5, 6, 7, 8])
        t, out = _hand_over(pair, "late", 100, [1, 2])
        t.join(10)
        assert "result" in out and pair.landed(100, [9, 3, 4, 5, 6, 7, 8], [1, 2])
        pair.sender.destination_wait_s = 5.0
        pair.sender.expect("gone")
        threading.Timer(0.05, pair.sender.discard, ["gone"]).start()
        t0 = time.monotonic()
        assert pair.sender.begin_push("gone", 10, [0]) is None and time.monotonic() - t0 < 2  # woken, not timed out
        pair.sender.expect("stale")
        pair.sender.reap(now=time.monotonic() + pair.sender.ttl_s + 1)
        assert pair.sender.accounting()["expected"] == []
        assert _clean(pair) and pair.freed == ["late"]
    finally:
        pair.close()


@pytest.mark.parametrize("config", CONFIGS)
def test_cancelled_prefill_fails_the_push_and_releases(config):
    pair = make_pair(config, LocalTransport(), LocalTransport())
    try:
        t, out = _hand_over(pair, "r", 100, dst_blocks_for(config, 100))
        assert pair.sender.accounting()["pushes"] == ["r"] and pair.receiver.accounting()["expecting"] == ["r"]
        assert pair.sender.discard("r")  # the prefill's client went away before its forward
        t.join(10)
        assert isinstance(out.get("error"), KVTransferFailed) and "discarded" in str(out["error"])
        assert _clean(pair)
    finally:
        pair.close()


def test_forward_failure_mid_push_releases():
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    try:
        t, out = _hand_over(pair, "r", 100, [1, 2])
        _prefill(pair, "r", 100, [9, 3, 4, 5, 6, 7, 8], fail_at=1)
        t.join(10)
        assert isinstance(out.get("error"), KVTransferFailed) and "prefill failed" in str(out["error"])
        assert _clean(pair)
    finally:
        pair.close()


@pytest.mark.parametrize("config", CONFIGS)
def test_transfer_failure_mid_push_releases(config):
    tp = FaultyLocal()
    pair = make_pair(config, tp, LocalTransport())
    try:
        t, out = _hand_over(pair, "r", 100, dst_blocks_for(config, 100))
        Faults(pair, tp).set(True)
        _prefill(pair, "r", 100, [9, 3, 4, 5, 6, 7, 8])
        t.join(10)
        assert isinstance(out.get("error"), KVTransferFailed) and "injected" in str(out["error"])
        assert _clean(pair) and pair.freed == ["r"]
    finally:
        pair.close()


def test_cancelled_push_ends_the_wait_at_once_and_releases():
    """The decode aborts a request whose prefill has not come (D1 handed over): cancel_push ends its
    wait with PushFailed at once, not after the forward or a timeout; nothing stays held."""
    from hawk.connector.algorithm1 import PushFailed

    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport(), ttl_s=30.0, timeout_s=30.0)
    try:
        t, out = _hand_over(pair, "r", 100, [1, 2])
        t0 = time.monotonic()
        assert pair.receiver.cancel_push(pair.sender.address, "r", "aborted in a test")
        t.join(10)
        assert isinstance(out.get("error"), PushFailed), out  # (its AwaitPush may reach the prefill after the Done)
        assert time.monotonic() - t0 < 5
        assert not pair.receiver.cancel_push(pair.sender.address, "r", "again")  # nothing in flight now
        assert pair.sender.begin_push("r", 100, [9, 3, 4, 5, 6, 7, 8]) is None  # the prefill pulls nothing
        assert _clean(pair)
    finally:
        pair.close()


def test_decode_vanishing_mid_push_releases_after_the_ttl():
    """D1 handed over, then the decode is gone (no AwaitPush, no Done): the prefill still finishes
    its push, and the unclaimed outcome expires with the TTL; nothing stays held."""
    from hawk.connector.messages import Ack, PushTo

    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport(), ttl_s=0.3)
    try:
        pair.receiver.connect(pair.sender.address)
        s = pair.receiver._senders[pair.sender.address]
        assert isinstance(s.client.call(PushTo("r", s.receiver, [1, 2], 100), 2.0), Ack)
        pair.receiver.close()  # the decode side goes away mid-push
        _prefill(pair, "r", 100, [9, 3, 4, 5, 6, 7, 8])
        assert _clean(pair) and pair.freed == ["r"]
    finally:
        pair.sender.close()
        pair.td.close()
        pair.tp.close()
        pair.kv.close()


def test_many_small_pushes_with_faults_end_with_empty_ledgers():
    tp = FaultyLocal()
    pair = make_pair("gn-hawk", tp, LocalTransport(), ttl_s=0.5, timeout_s=2.0)
    faults = Faults(pair, tp)
    rng = random.Random(11)
    kinds = ["ok"] * 4 + ["write-fails", "discarded", "forward-fails", "late"]
    seen: list[str] = []
    try:
        for i in range(200):
            kind, rid, tokens = rng.choice(kinds), f"q{i}", rng.randint(1, 200)
            seen.append(kind)
            blocks = rng.sample(range(64), -(-tokens // 16))
            dst = rng.sample(range(16), -(-tokens // 64))
            if kind == "late":
                pair.add(rid, tokens, blocks)
            t, out = _hand_over(pair, rid, tokens, dst)
            faults.set(kind == "write-fails")
            if kind == "discarded":
                pair.sender.discard(rid)
            elif kind == "forward-fails":
                _prefill(pair, rid, tokens, blocks, fail_at=rng.randrange(L))
            elif kind != "late":
                _prefill(pair, rid, tokens, blocks)
            t.join(10)
            faults.set(False)
            if kind in ("ok", "late"):
                assert "result" in out, (kind, out)
                assert pair.landed(tokens, blocks, dst)
            else:
                assert isinstance(out.get("error"), KVTransferFailed), (kind, out)
        assert _clean(pair)
        handed = [f"q{i}" for i, k in enumerate(seen) if k != "discarded"]  # a discarded one never had blocks
        assert sorted(pair.freed) == sorted(handed)  # every prefill's blocks back exactly once
    finally:
        pair.close()


@pytest.mark.timeout(300)
def test_engines_layerwise_tokens_equal_colocated_and_ledgers_empty():
    """Whole instances (tiny model): both flows produce the colocated oracle's first token, and every
    ledger (sender, receiver, prefill and decode blocks) is empty afterwards."""
    from hawk.bench.ttft_cli import main

    records = main(["--model", "tiny", "--prompts", "40,130", "--repeats", "1", "--warmup", "0", "--configs", ",".join(CONFIGS),
                    "--kv-flows", "pull,layerwise", "--transport", "local", "--max-prefill-chunk", "64"])
    assert {(r["config"], r["kv_flow"]) for r in records} == {(c, f) for c in CONFIGS for f in ("pull", "layerwise")}
    for r in records:
        assert r["identical"], r
        if r["kv_flow"] == "layerwise":
            assert r["kv_mode"] == "layerwise" and r["kv_exposed_ms"] is not None
