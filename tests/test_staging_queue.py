"""A pull that finds the prefill's staging full waits for room in arrival order instead of failing,
and whatever it holds comes back on every path: served, cancelled by its decode, expired, shutdown.

Seen on one H200 (gn-host, Summarization, 1 GiB of host staging): 7 of 60 requests failed with
"no free range is large enough" while earlier pulls still held the buffer."""

import threading
import time

import pytest

from hawk.connector.control import ControlClient
from hawk.connector.messages import Done, Error, KVReady, PullRequest
from hawk.transport.local import LocalTransport
from tests.kv_fixtures import dst_blocks_for, make_pair

TOKENS = 64
BLOCKS = {"r0": [0, 1, 2, 3], "r1": [4, 5, 6, 7], "r2": [8, 9, 10, 11]}


def _one_request_bytes(config: str) -> int:
    pair = make_pair(config, LocalTransport(), LocalTransport())
    try:
        pair.add("probe", TOKENS, BLOCKS["r0"])
        return pair.receiver.pull(pair.sender.address, "probe", dst_blocks_for(config, TOKENS)).bytes
    finally:
        pair.close()


@pytest.fixture(params=["gn-host", "gn-hawk"])
def tight(request, monkeypatch):
    """A pair whose staging holds one request (and a half), the rest queued behind it."""
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0")  # gn-hawk stages too
    size = _one_request_bytes(request.param)
    pair = make_pair(request.param, LocalTransport(), LocalTransport(), ttl_s=30.0, staging_bytes=size + size // 2)
    raw = ControlClient(pair.sender.address)
    pair.receiver.connect(pair.sender.address)
    yield pair, raw, pair.receiver._senders[pair.sender.address].receiver
    raw.close()
    pair.close()


def _hold(pair, raw, rx, rid: str) -> KVReady:
    """D1 by hand for ``rid``: its bytes occupy staging until a D9 says otherwise."""
    pair.add(rid, TOKENS, BLOCKS[rid])
    reply = raw.call(PullRequest(rid, rx, dst_blocks_for(pair.config, TOKENS, start=4)), 5.0)
    assert isinstance(reply, KVReady), reply
    return reply


def _queued(pair, rid: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while rid not in pair.sender.accounting()["staging_queue"]:
        assert time.monotonic() < deadline, pair.sender.accounting()
        time.sleep(0.01)


def _clean(pair, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pair.sender.reap()
        a = pair.sender.accounting()
        if not (a["staging"] or a["staging_queue"] or a["in_flight"] or a["waiting"] or a["draining"]) or time.monotonic() > deadline:
            return a
        time.sleep(0.02)


def test_a_pull_waits_for_staging_and_lands_once_a_done_frees_it(tight):
    pair, raw, rx = tight
    _hold(pair, raw, rx, "r0")
    pair.add("r1", TOKENS, BLOCKS["r1"])
    dst = dst_blocks_for(pair.config, TOKENS, start=1)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(res=pair.receiver.pull(pair.sender.address, "r1", dst)))
    t.start()
    _queued(pair, "r1")
    assert "r1" not in pair.freed  # it waits holding its blocks
    raw.call(Done("r0", True), 5.0)  # D9 of the held pull: its staging goes back, the queue moves
    t.join(10)
    assert not t.is_alive() and result["res"].bytes > 0
    assert pair.landed(TOKENS, BLOCKS["r1"], dst)
    assert result["res"].timings["sender_staging_queue_s"] > 0
    a = _clean(pair)
    assert not a["staging"] and not a["staging_queue"] and not a["in_flight"], a
    assert sorted(pair.freed) == ["r0", "r1"]


def test_the_queue_keeps_arrival_order(tight):
    pair, raw, rx = tight
    _hold(pair, raw, rx, "r0")
    order: list[str] = []  # who got staging, in the order the sender staged them
    stage = pair.sender.fmt.stage

    def recorded(plan, owner, **kw):
        staged = stage(plan, owner, **kw)
        order.append(owner)
        return staged

    pair.sender.fmt.stage = recorded
    threads = []
    for rid in ("r1", "r2"):
        pair.add(rid, TOKENS, BLOCKS[rid])
        dst = dst_blocks_for(pair.config, TOKENS, start=1 if rid == "r1" else 6)
        threads.append(threading.Thread(target=pair.receiver.pull, args=(pair.sender.address, rid, dst)))
        threads[-1].start()
        _queued(pair, rid)
    assert pair.sender.accounting()["staging_queue"] == ["r1", "r2"]
    raw.call(Done("r0", True), 5.0)
    for t in threads:
        t.join(10)
    assert order == ["r1", "r2"]  # r2 never overtook r1 (each fills staging alone)
    assert not _clean(pair)["staging"]


def test_a_queued_pull_whose_decode_gives_up_gives_its_blocks_back(tight):
    pair, raw, rx = tight
    _hold(pair, raw, rx, "r0")
    pair.add("r1", TOKENS, BLOCKS["r1"])
    waiting = ControlClient(pair.sender.address)
    try:
        pending = waiting.start(PullRequest("r1", rx, dst_blocks_for(pair.config, TOKENS, start=1)))
        _queued(pair, "r1")
        raw.call(Done("r1", False, "client aborted"), 5.0)
        reply = pending.result(5.0)
        assert isinstance(reply, Error) and "cancelled by the decode" in reply.message
        assert "r1" in pair.freed and "r1" not in pair.sender.accounting()["staging_queue"]
    finally:
        waiting.close()
    raw.call(Done("r0", True), 5.0)
    a = _clean(pair)
    assert not a["staging"] and not a["staging_queue"], a
    assert sorted(pair.freed) == ["r0", "r1"]


def test_a_pull_that_waits_past_the_ttl_fails_and_releases(monkeypatch):
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0")
    size = _one_request_bytes("gn-host")
    pair = make_pair("gn-host", LocalTransport(), LocalTransport(), ttl_s=0.5, timeout_s=5.0, staging_bytes=size)
    raw = ControlClient(pair.sender.address)
    try:
        pair.receiver.connect(pair.sender.address)
        rx = pair.receiver._senders[pair.sender.address].receiver
        _hold(pair, raw, rx, "r0")  # never Done: it expires after the TTL, and so does the queued pull
        pair.add("r1", TOKENS, BLOCKS["r1"])
        reply = raw.call(PullRequest("r1", rx, dst_blocks_for("gn-host", TOKENS, start=1)), 5.0)
        # the held r0 and the queued r1 share one deadline race: r1 either expired queued or was staged after r0 expired
        if isinstance(reply, Error):
            assert "staging stayed full" in reply.message
        else:
            assert isinstance(reply, KVReady)
        time.sleep(0.6)
        a = _clean(pair)
        assert not a["staging"] and not a["staging_queue"] and not a["in_flight"], a
        assert sorted(pair.freed) == ["r0", "r1"]
    finally:
        raw.close()
        pair.close()


def test_a_request_larger_than_all_of_staging_is_refused_at_once(monkeypatch):
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0")
    size = _one_request_bytes("gn-host")
    pair = make_pair("gn-host", LocalTransport(), LocalTransport(), staging_bytes=size // 2)
    try:
        pair.add("big", TOKENS, BLOCKS["r0"])
        t0 = time.monotonic()
        with pytest.raises(Exception, match="never fit the prefill's staging"):
            pair.receiver.pull(pair.sender.address, "big", dst_blocks_for("gn-host", TOKENS))
        assert time.monotonic() - t0 < 2.0
        assert pair.freed == ["big"] and not _clean(pair)["staging_queue"]
    finally:
        pair.close()


def test_closing_the_prefill_answers_queued_pulls_and_gives_their_blocks_back(tight):
    pair, raw, rx = tight
    _hold(pair, raw, rx, "r0")
    pair.add("r1", TOKENS, BLOCKS["r1"])
    pending = raw.start(PullRequest("r1", rx, dst_blocks_for(pair.config, TOKENS, start=1)))
    _queued(pair, "r1")
    pair.sender.close()
    assert sorted(pair.freed) == ["r0", "r1"]
    reply = pending.result(5.0)
    assert isinstance(reply, Error) and "shutting down" in reply.message
    assert not pair.sender.accounting()["staging_queue"]
