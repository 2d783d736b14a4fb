"""A pull whose KV fits the decode's empty receive buffer waits for room at D3 instead of failing.

Seen on one H200 (gn-host, Summarization, 1 GiB host-rx): a 3972-token request failed with
"needs 522190848 B, 645922816 of 1073741824 B free and no free range is large enough": concurrent
smaller pulls had fragmented the first-fit buffer. Here the buffers are fragmented with live
reservations in the landing's real ledgers; the pull waits (in arrival order), completes once the
blockers go, and nothing stays reserved on any path."""

import threading
import time

import pytest

from hawk.connector.algorithm1 import KVTransferFailed
from hawk.memory.reservations import BufferFull, NeverFits, NoRoomInTime, RangeReservations, Reservation
from hawk.transport.local import LocalTransport
from tests.kv_fixtures import dst_blocks_for, make_pair

TOKENS = 64
BIG, SMALL = [0, 1, 2, 3], [4, 5]  # source blocks: 64 and 32 tokens


def _needs(pair, tokens: int, blocks: list[int]) -> dict[str, int]:
    """Bytes one pull of ``tokens`` reserves in each of the landing's ledgers (a real pull, by name)."""
    landing = pair.receiver.landing
    taken: dict[str, int] = {}
    reserve = landing.reserve

    def recorded(plan, owner, ttl_s, peer=None):
        held = reserve(plan, owner, ttl_s, peer)
        taken.update({r.buffer: r.size for r in held.reservations.values()})
        return held

    landing.reserve = recorded
    try:
        pair.add("probe", tokens, blocks)
        pair.receiver.pull(pair.sender.address, "probe", dst_blocks_for(pair.config, tokens, start=3))
    finally:
        landing.reserve = reserve
    assert taken and not landing.live()
    return taken


def _fragment(ledger: RangeReservations, need: int) -> list[Reservation]:
    """Fill ``ledger`` with free ranges of about ``need / 2`` between small pinned reservations: at
    least ``need`` bytes free, none of it in one range. Returns the pins: releasing them makes room."""
    a = ledger.alignment
    assert need >= 4 * a, (ledger.name, need, a)
    gap = need // 2 // a * a
    gaps, pins = [], []
    while True:
        try:
            gaps.append(ledger.reserve(gap, "gap"))
            pins.append(ledger.reserve(a, "pin"))
        except BufferFull:
            break
    for g in gaps:
        ledger.release(g)
    assert ledger.capacity - ledger.used >= need  # enough in total ...
    with pytest.raises(BufferFull):  # ... and no range large enough: what failed the request before
        ledger.release(ledger.reserve(need, "check"))
    return pins


def _until(what, timeout: float = 10.0) -> None:
    """Wait for a state (not a duration): fails only if it never comes."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "state never reached"
        time.sleep(0.01)


def _pull_in_thread(pair, rid: str, tokens: int, blocks: list[int], start: int) -> tuple[threading.Thread, dict, list[int]]:
    pair.add(rid, tokens, blocks)
    dst = dst_blocks_for(pair.config, tokens, start=start)
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = pair.receiver.pull(pair.sender.address, rid, dst)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out, dst


def _clean(pair, timeout: float = 10.0) -> None:
    """Both sides hold nothing (the prefill's D9 and drain releases are asynchronous)."""
    def empty() -> bool:
        pair.receiver.reap()
        pair.sender.reap()
        s, r = pair.sender.accounting(), pair.receiver.accounting()
        return not (s["staging"] or s["in_flight"] or s["draining"] or r["reservations"] or r["draining"] or r["waiting_for_room"])

    _until(empty, timeout)


def _pair(config: str, monkeypatch, **kw):
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0")  # the sender stages: D3 reserves on the decode
    pair = make_pair(config, LocalTransport(), LocalTransport(), **kw)
    if config == "gn-hawk":
        pair.receiver.landing.mode = "staging"  # the per-channel DRAM buffers, not direct placement
    return pair


@pytest.mark.parametrize("config", ["gn-host", "gg-host", "gn-hawk", "gn-direct-single", "ng-hawk"])
def test_a_pull_waits_out_fragmentation_and_lands_once_the_blockers_go(config, monkeypatch):
    pair = _pair(config, monkeypatch)
    try:
        landing = pair.receiver.landing
        needs = _needs(pair, TOKENS, BIG)
        ledgers = {led.name: led for led in landing.ledgers()}
        pins = {name: _fragment(ledgers[name], n) for name, n in needs.items()}
        t, out, dst = _pull_in_thread(pair, "big", TOKENS, BIG, start=1)
        _until(lambda: pair.receiver.accounting()["waiting_for_room"] == ["big"] or not t.is_alive())
        assert "error" not in out, out  # before the fix: BufferFull at once
        for name, held in pins.items():
            for p in held:
                ledgers[name].release(p)
        t.join(30)
        assert not t.is_alive() and "result" in out, out
        assert pair.landed(TOKENS, BIG, dst)
        assert out["result"].timings["reserve_s"] > 0
        _clean(pair)
        assert landing.live() == [] and sorted(pair.freed) == ["big", "probe"]
    finally:
        pair.close()


def test_a_small_request_does_not_overtake_a_waiting_large_one(monkeypatch):
    """Arrival order: the small pull would fit a free gap, but it waits behind the large one, so a
    stream of small requests cannot keep re-fragmenting the buffer and starve it."""
    pair = _pair("gn-host", monkeypatch)
    try:
        landing = pair.receiver.landing
        need = _needs(pair, TOKENS, BIG)["host-rx"]
        pins = _fragment(landing.rx.ledger, need)
        order: list[str] = []
        reserve = landing.reserve

        def recorded(plan, owner, ttl_s, peer=None):
            held = reserve(plan, owner, ttl_s, peer)
            order.append(owner)
            return held

        landing.reserve = recorded
        big = _pull_in_thread(pair, "big", TOKENS, BIG, start=1)
        _until(lambda: pair.receiver.accounting()["waiting_for_room"] == ["big"])
        small = _pull_in_thread(pair, "small", 32, SMALL, start=2)
        _until(lambda: pair.receiver.accounting()["waiting_for_room"] == ["big", "small"])
        assert order == []  # the small one fits a gap now, yet waits its turn
        for p in pins:
            landing.rx.ledger.release(p)
        for t, out, _ in (big, small):
            t.join(30)
            assert not t.is_alive() and "result" in out, out
        assert order == ["big", "small"]
        assert pair.landed(TOKENS, BIG, big[2]) and pair.landed(32, SMALL, small[2])
        _clean(pair)
        assert landing.live() == []
    finally:
        pair.close()


def test_a_pull_that_finds_no_room_before_its_deadline_fails_and_holds_nothing(monkeypatch):
    pair = _pair("gn-host", monkeypatch, timeout_s=2.0)
    try:
        ledger = pair.receiver.landing.rx.ledger
        pins = _fragment(ledger, _needs(pair, TOKENS, BIG)["host-rx"])
        pair.add("big", TOKENS, BIG)
        with pytest.raises(KVTransferFailed, match="no room before its deadline") as err:
            pair.receiver.pull(pair.sender.address, "big", dst_blocks_for("gn-host", TOKENS, start=1))
        assert isinstance(err.value.__cause__, NoRoomInTime)
        assert ledger.live() == pins  # only the test's own blockers: the pull reserved nothing
        for p in pins:
            ledger.release(p)
        _clean(pair)  # its D9 (not ok) released the prefill's staging too
        assert sorted(pair.freed) == ["big", "probe"]
    finally:
        pair.close()


def test_closing_the_receiver_ends_a_wait_for_room(monkeypatch):
    pair = _pair("gn-host", monkeypatch)
    try:
        ledger = pair.receiver.landing.rx.ledger
        _fragment(ledger, _needs(pair, TOKENS, BIG)["host-rx"])
        t, out, _ = _pull_in_thread(pair, "big", TOKENS, BIG, start=1)
        _until(lambda: pair.receiver.accounting()["waiting_for_room"] == ["big"])
        pair.receiver._room.close("the receiver closed")  # what close() does first
        t.join(30)
        assert not t.is_alive() and isinstance(out.get("error"), KVTransferFailed), out
        assert isinstance(out["error"].__cause__, NoRoomInTime) and "receiver closed" in str(out["error"])
        assert [r.owner for r in ledger.live()] == ["pin"] * len(ledger.live())
    finally:
        pair.close()


@pytest.mark.parametrize("config", ["gn-host", "gn-hawk"])
def test_a_request_larger_than_the_empty_buffer_fails_at_once(config, monkeypatch):
    probe = _pair(config, monkeypatch)
    try:
        needs = _needs(probe, TOKENS, BIG)
        channels = len(probe.receiver.landing.ledgers())  # gn-hawk splits rx over its channels
    finally:
        probe.close()
    pair = _pair(config, monkeypatch, rx_bytes=max(needs.values()) // 2 * channels)
    try:
        pair.add("huge", TOKENS, BIG)
        with pytest.raises(KVTransferFailed, match="more than the whole buffer") as err:
            pair.receiver.pull(pair.sender.address, "huge", dst_blocks_for(config, TOKENS, start=1))
        assert isinstance(err.value.__cause__, NeverFits)  # refused before queueing: it never waited
        assert pair.receiver.accounting()["waiting_for_room"] == [] and pair.receiver.landing.live() == []
        _clean(pair)
        assert pair.freed == ["huge"]
    finally:
        pair.close()
