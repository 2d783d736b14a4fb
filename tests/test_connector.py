"""Algorithm 1 end to end: the five configurations, the push variant, and release on every path.

gn-hawk's sender can address the decode's memory here (one process, the local transport): by default it
lands a pull itself (``HAWK_DIRECT_WRITE``); tests that inject transport faults keep the staged path."""

import random
import threading
import time

import pytest

from hawk.connector.algorithm1 import KVTransferFailed
from hawk.connector.configs import CONFIGS
from hawk.connector.control import ControlClient
from hawk.connector.messages import Done, Error, PullRequest
from hawk.transport.local import LocalTransport
from tests.kv_fixtures import dst_blocks_for, make_pair


def _settled(pair, timeout=3.0):
    """Wait for asynchronous releases, then return both sides' accounting."""
    deadline = time.monotonic() + timeout
    while True:
        pair.receiver.reap()
        pair.sender.reap()
        s, r = pair.sender.accounting(), pair.receiver.accounting()
        clean = not s["staging"] and not s["in_flight"] and not s["waiting"] and not s["draining"] and not r["reservations"] and not r["draining"]
        if clean or time.monotonic() > deadline:
            return s, r
        time.sleep(0.02)


@pytest.fixture
def staged(monkeypatch):
    """The sender never writes the decode's memory itself: transport faults reach gn-hawk's pulls."""
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "0")


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("post", ["pull", "push"])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_every_configuration_lands_the_kv(config, post, direct, monkeypatch):
    monkeypatch.setenv("HAWK_DIRECT_WRITE", direct)
    pair = make_pair(config, LocalTransport(), LocalTransport(), post=post)
    try:
        for i, (tokens, gblocks) in enumerate([(100, [9, 3, 4, 5, 6, 7, 8]), (1, [0]), (64, [10, 11, 12, 13])]):
            pair.add(f"r{i}", tokens, gblocks)
            dst = dst_blocks_for(config, tokens, start=1)
            res = pair.receiver.pull(pair.sender.address, f"r{i}", dst)
            assert pair.landed(tokens, gblocks, dst)
            assert res.num_tokens == tokens and res.bytes > 0
            # a pull lands straight in the decode's memory where the prefill can address it: HAWK's tiles and gg-direct's blocks
            assert (res.mode == "landed") == (config in ("gn-hawk", "gg-direct") and direct == "1")
            assert res.mode != "landed" or res.requests == 0
        s, r = _settled(pair)
        assert not s["staging"] and not r["reservations"]
        assert sorted(pair.freed) == ["r0", "r1", "r2"]  # every prefill's blocks went back exactly once
    finally:
        pair.close()


def test_hawk_sends_one_request_per_channel():
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    pair.receiver.landing.mode = "staging"
    try:
        pair.add("r", 200, list(range(13)))
        res = pair.receiver.pull(pair.sender.address, "r", [2, 5, 7, 9])
        assert res.mode == "staging" and res.requests == 8  # p150a: 8 DRAM channels
        assert pair.landed(200, list(range(13)), [2, 5, 7, 9])
    finally:
        pair.close()


class FaultyLocal(LocalTransport):
    """Local copies, with batch failures and hangs on demand."""

    fault = "none"

    def _engine_poll(self, h):
        if self.fault == "fail":
            return "ERROR", "injected batch failure"
        if self.fault == "hang":
            return "PENDING", None
        return super()._engine_poll(h)


def test_reservations_released_after_many_faulty_transfers(staged):
    """220 transfers mixing successes with every fault kind, including the prefill dying mid-transfer;
    both ledgers (and every dead prefill's) end empty, and every prefill block comes back exactly once."""
    tp, td = LocalTransport(), FaultyLocal()
    pair = make_pair("gn-hawk", tp, td, ttl_s=0.5, timeout_s=0.3)
    rng = random.Random(7)
    kinds = ["ok"] * 4 + ["fail", "hang", "bad-meta", "never-pulled", "receiver-vanishes", "unknown-request", "garbage", "prefill-dies"]
    seen = {k: 0 for k in kinds}
    good_extents = pair.sender.fmt.extents
    raw = ControlClient(pair.sender.address)
    pair.receiver.connect(pair.sender.address)
    try:
        for i in range(220):
            kind = rng.choice(kinds)
            seen[kind] += 1
            rid, tokens = f"q{i}", rng.randint(1, 300)
            gblocks = rng.sample(range(64), -(-tokens // 16))
            dst = rng.sample(range(16), -(-tokens // 64))
            if kind != "unknown-request":
                pair.add(rid, tokens, gblocks)
            if kind == "never-pulled":
                continue
            if kind == "receiver-vanishes":  # D1 sent, then the decode side is gone: no D9 ever
                reply = raw.call(PullRequest(rid, pair.receiver._senders[pair.sender.address].receiver, dst), 2.0)
                assert reply.TYPE == "ready"
                held = [r for r in pair.sender.accounting()["staging"] if r.owner == rid]
                assert len(held) == 1 and held[0].size == reply.total_bytes and held[0].since <= time.monotonic()
                continue
            if kind == "garbage":
                reply = raw.call(PullRequest(rid, "nobody", dst), 2.0)
                assert isinstance(reply, Error) and "unknown receiver" in reply.message
                pair.sender.discard(rid)
                continue
            td.fault = kind if kind in ("fail", "hang") else "hang" if kind == "prefill-dies" else "none"
            if kind == "prefill-dies":  # the batch is in flight when the prefill process goes away
                dying = pair.sender
                threading.Timer(0.1, lambda d=dying: (d.close(), d.transport.close())).start()
            if kind == "bad-meta":
                pair.sender.fmt.extents = lambda plan: [[0, 0, 64]]
            try:
                if kind == "ok":
                    pair.receiver.pull(pair.sender.address, rid, dst)
                    assert pair.landed(tokens, gblocks, dst)
                else:
                    with pytest.raises(KVTransferFailed) as err:
                        pair.receiver.pull(pair.sender.address, rid, dst)
                    assert rid in str(err.value)
            finally:
                td.fault = "none"
                pair.sender.fmt.extents = good_extents
            if kind == "prefill-dies":
                time.sleep(0.15)
                pair.respawn_sender(LocalTransport())
                good_extents = pair.sender.fmt.extents
                raw.close()
                raw = ControlClient(pair.sender.address)
                pair.receiver.connect(pair.sender.address)
        assert all(seen.values()), seen
        time.sleep(0.6)  # past the TTL: un-pulled and abandoned requests expire
        s, r = _settled(pair, timeout=5)
        assert s == {"staging": [], "waiting": [], "staging_queue": [], "in_flight": [], "draining": 0, "pushes": [], "expected": []}, s
        assert r == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}, r
        assert len(pair.dead_senders) == seen["prefill-dies"]
        for dead in pair.dead_senders:
            assert dead.accounting() == {"staging": [], "waiting": [], "staging_queue": [], "in_flight": [], "draining": 0, "pushes": [], "expected": []}
        # Every prefill's blocks came back exactly once, whatever happened to its transfer.
        added = [f"q{i}" for i in range(220)]
        assert sorted(pair.freed) == sorted(x for x in added if x in pair.freed)
        assert len(pair.freed) == len(set(pair.freed))
        assert len(pair.freed) == 220 - seen["unknown-request"]
        # And the pair still works.
        pair.add("after", 50, [1, 2, 3, 4])
        pair.receiver.pull(pair.sender.address, "after", [3])
        assert pair.landed(50, [1, 2, 3, 4], [3])
    finally:
        raw.close()
        pair.close()


def test_mismatched_layout_is_refused_at_handshake():
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    other = make_pair("gg-direct", LocalTransport(), LocalTransport())
    try:
        with pytest.raises(KVTransferFailed, match="send format"):
            other.receiver.connect(pair.sender.address)
    finally:
        pair.close()
        other.close()


def test_pull_from_a_dead_prefill_fails_cleanly():
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport(), timeout_s=0.5)
    try:
        pair.add("r", 10, [0])
        address = pair.sender.address
        pair.receiver.connect(address)
        pair.sender.close()  # the prefill goes away
        with pytest.raises(KVTransferFailed, match="did not answer"):
            pair.receiver.pull(address, "r", [0])
        assert pair.receiver.accounting() == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}
        assert pair.freed == ["r"]  # closing the sender gave its blocks back
    finally:
        pair.close()


@pytest.mark.parametrize("path", ["staged", "landed"])
def test_a_failing_transform_gives_everything_back(path, monkeypatch):
    """The transform fails inside P3, into staging or straight into the decode's pages: the pull fails,
    the blocks come back once, nothing stays reserved on either side, and the next pull works."""
    monkeypatch.setenv("HAWK_DIRECT_WRITE", "1" if path == "landed" else "0")
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    name = "land" if path == "landed" else "produce"
    good = getattr(pair.sender.fmt, name)

    def broken(plan, out, *events):
        raise RuntimeError("kernel fault")

    try:
        pair.add("bad", 40, [0, 1, 2])
        setattr(pair.sender.fmt, name, broken)
        with pytest.raises(KVTransferFailed, match="kernel fault"):
            pair.receiver.pull(pair.sender.address, "bad", [0])
        assert pair.freed == ["bad"]
        assert pair.sender.accounting()["staging"] == [] and pair.sender.accounting()["in_flight"] == []
        assert pair.receiver.accounting() == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}
        setattr(pair.sender.fmt, name, good)
        pair.add("good", 40, [0, 1, 2])
        pair.receiver.pull(pair.sender.address, "good", [0])
        assert pair.landed(40, [0, 1, 2], [0])
    finally:
        pair.close()


def test_a_landed_pull_keeps_the_prefill_blocks_until_done():
    """A landed pull's blocks stay with the prefill after D2 (a transform answered early may still read
    them) and come back exactly once: at D9, ok or not (a decode that fails after a landed D2 says so),
    when no D9 comes (TTL) and when the prefill closes. Its D2 names no block ids and no extents."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport(), ttl_s=1.0)
    raw = ControlClient(pair.sender.address)
    gblocks = [9, 3, 4, 5, 6, 7, 8]
    try:
        pair.receiver.connect(pair.sender.address)
        rx = pair.receiver._senders[pair.sender.address].receiver

        def landed_by_hand(rid: str) -> None:
            pair.add(rid, 100, gblocks)
            reply = raw.call(PullRequest(rid, rx, [1, 2], True), 2.0)
            assert reply.landed and reply.src_block_ids == [] and reply.extents == [] and reply.total_bytes > 0, reply
            assert pair.landed(100, gblocks, [1, 2])
            assert rid not in pair.freed and rid in pair.sender.accounting()["in_flight"]

        for rid, ok in (("ok", True), ("failed", False)):
            landed_by_hand(rid)
            raw.call(Done(rid, ok, "" if ok else "the decode failed"), 2.0)
            assert pair.freed.count(rid) == 1 and rid not in pair.sender.accounting()["in_flight"]

        def broken() -> None:
            raise ValueError("pages not visible")

        pair.add("decode-fails", 100, gblocks)
        pair.receiver.landing.finish_layers = broken  # D7 of the landed pull fails: D9 says so
        with pytest.raises(KVTransferFailed, match="pages not visible"):
            pair.receiver.pull(pair.sender.address, "decode-fails", [1, 2])
        del pair.receiver.landing.finish_layers
        landed_by_hand("silent")  # no D9 ever: the TTL gives the blocks back
        _settled(pair)
        assert sorted(pair.freed) == ["decode-fails", "failed", "ok", "silent"]
        landed_by_hand("open")
        pair.sender.close()  # with its D9 still to come
        assert sorted(pair.freed) == ["decode-fails", "failed", "ok", "open", "silent"]
    finally:
        raw.close()
        pair.close()


def test_no_plan_ahead_while_the_prefill_lands_and_correct_bytes_when_it_declines(monkeypatch):
    """The decode plans ahead of D2 (``_warm``) only where it does not expect a landed pull: after a
    landed D2 it skips the plan; when the prefill then declines to land (HAWK_DIRECT_WRITE=0) the pull is
    planned after D2 and lands the right bytes, and the next pull plans ahead again."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    warmed: list[str] = []
    warm = pair.receiver.landing.warm
    pair.receiver.landing.warm = lambda *a: (warmed.append(rid), warm(*a))
    try:
        for i, (direct, planned_ahead) in enumerate([
            ("1", True),  # a CPU route in one process is no device copy: not expected to land at first
            ("1", False),
            ("0", False),  # expected to land, declined: planned after D2
            ("0", True),
            ("1", True),
            ("1", False),
        ]):
            monkeypatch.setenv("HAWK_DIRECT_WRITE", direct)
            rid, tokens, gblocks, dst = f"r{i}", 100 + i, [9, 3, 4, 5, 6, 7, 8], [2 + i % 3, 7]
            pair.add(rid, tokens, gblocks)
            res = pair.receiver.pull(pair.sender.address, rid, dst, num_tokens=tokens)
            assert (rid in warmed) == planned_ahead and (res.mode == "landed") == (direct == "1"), (rid, warmed, res.mode)
            assert pair.landed(tokens, gblocks, dst)
        s, r = _settled(pair)
        assert not s["staging"] and not s["in_flight"] and not r["reservations"]
        assert sorted(pair.freed) == [f"r{i}" for i in range(6)]
    finally:
        pair.close()


def test_a_device_copy_route_plans_with_the_device_figures():
    """The receiver marks a sender whose batches are copies inside one GPU (a same-host engine, every
    CUDA region on one device, no pacing); ChannelLanding then chooses with its device figures, and
    with its link figures for any other sender."""
    from types import SimpleNamespace

    from hawk.connector.algorithm1 import KVReceiver
    from hawk.plan.cost_model import CostModel
    from hawk.transport.base import RegionInfo
    from hawk.transport.paced import PacedTransport

    def route(mine: list, theirs: list, name: str = "local", engine: str | None = None) -> bool:
        t = SimpleNamespace(name=name, regions=lambda: {r.name: r for r in mine},
                            remote_regions=lambda peer: {r.name: r for r in theirs})
        if engine is not None:
            t.engine_for = lambda peer: engine
        return KVReceiver._device_copy(SimpleNamespace(transport=t), "peer")

    g0, g0b, g1 = (RegionInfo(n, 1 << 20, 4096, "cuda", d) for n, d in (("a", 0), ("b", 0), ("c", 1)))
    host = RegionInfo("h", 1 << 20, 4096, "cpu", -1)
    assert route([g0], [g0b]) and route([g0], [g0b], name="auto", engine="cuda-ipc")
    assert not route([g0], [g1])  # two GPUs: a peer copy over the link
    assert not route([g0, host], [g0b])  # host memory on one side
    assert not route([g0], [g0b], name="auto", engine="nixl")
    paced = PacedTransport(LocalTransport(), 200.0)
    try:
        assert not KVReceiver._device_copy(SimpleNamespace(transport=paced), "peer")
    finally:
        paced.close()

    p = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    try:
        landing = p.receiver.landing
        landing.cost = CostModel(1.0, 1e12, 1e12)  # dear requests: stage
        landing.device_cost = CostModel(0.0, 1e12, 1e6)  # free requests, a slow copy: place directly
        plan = SimpleNamespace(num_channels_used=8, total_bytes=1 << 20, direct_runs=lambda: range(100))
        assert landing.choose(plan, {"device_copy": True}) == "direct"
        assert landing.choose(plan, {"device_copy": False}) == "staging" and landing.choose(plan) == "staging"
        landing.mode = "staging"
        assert landing.choose(plan, {"device_copy": True}) == "staging"
    finally:
        p.close()


def test_only_a_decode_in_another_process_on_the_gpu_waits_on_ipc_events(monkeypatch):
    """A landed pull may be answered before its transform ends only where the decode can wait on the
    prefill's CUDA IPC event: a device copy through cuda-ipc to another process. In one process, over
    a network engine or with HAWK_IPC_EVENTS=0 the decode does not offer it, and a pull in one process
    lands as before (its D1 says no, its D2 names no event)."""
    import dataclasses
    import os
    from types import SimpleNamespace

    import msgpack

    from hawk.connector.algorithm1 import KVReceiver
    from hawk.connector.messages import KVReady, decode, encode
    from hawk.transport.base import RegionInfo

    g0 = RegionInfo("a", 1 << 20, 4096, "cuda", 3)

    def device(engine: str, pid: object, device_copy: bool = True) -> int | None:
        t = SimpleNamespace(name="auto", engine_for=lambda peer: engine, regions=lambda: {"a": g0})
        return KVReceiver._event_device(SimpleNamespace(transport=t), "peer", {"device_copy": device_copy, "pid": pid})

    assert device("cuda-ipc", os.getpid() + 1) == 3
    assert device("cuda-ipc", os.getpid()) is None and device("local", os.getpid() + 1) is None
    assert device("cuda-ipc", None) is None and device("cuda-ipc", os.getpid() + 1, device_copy=False) is None
    monkeypatch.setenv("HAWK_IPC_EVENTS", "0")
    assert device("cuda-ipc", os.getpid() + 1) is None

    # the new fields cross the wire; a peer that predates them decodes to "no event"
    m = PullRequest("r", "rx", [1, 2], True, True)
    k = KVReady("r", "npu-tiles", 3, [0], "", 0, 10, [], landed=True, ready_event=bytes(range(64)))
    assert decode(encode(m)) == m and decode(encode(k)) == k
    old = {kk: v for kk, v in dataclasses.asdict(k).items() if kk != "ready_event"}
    assert decode(msgpack.packb({"v": 1, "type": "ready", **old}, use_bin_type=True)).ready_event == b""

    monkeypatch.delenv("HAWK_IPC_EVENTS")
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    try:
        pair.add("r", 40, [0, 1, 2])
        pair.receiver.pull(pair.sender.address, "r", [0])
        assert pair.receiver._senders[pair.sender.address].info["event_device"] is None
        assert pair.landed(40, [0, 1, 2], [0])
    finally:
        pair.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("config", ["gn-hawk", "gg-direct"])
def test_repeated_landed_pulls_reuse_what_they_keep_and_land_the_current_kv(config, device):
    """A landed pull keeps what it set up (both formats: the whole plan; gg-direct: the landing copies on
    it; gn-hawk: the transform bound to the decode's DRAM), so a repeat of a request's shape and blocks
    reuses it. Each pull still lands the rows the prefill's cache holds now, and a request with other
    blocks (either side) or another token count is set up anew and lands its own rows. On a GPU: the
    one-launch copy (gg-direct) and the fused kernel (gn-hawk) in one process."""
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pair = make_pair(config, LocalTransport(), LocalTransport(), device=device)
    first = (100, [9, 3, 4, 5, 6, 7, 8], 1)
    requests = [first, first, (100, [10, 11, 12, 13, 14, 15, 16], 1), (100, first[1], 3), (60, first[1], 1), first]
    try:
        for i, (tokens, gblocks, start) in enumerate(requests):
            for c in pair.caches:  # a new prefill's KV in the same blocks
                c.copy_(torch.randn(c.shape).to(c.dtype))
            pair.add(f"r{i}", tokens, gblocks)
            dst = dst_blocks_for(config, tokens, start)
            res = pair.receiver.pull(pair.sender.address, f"r{i}", dst, num_tokens=tokens)
            assert res.mode == "landed" and pair.landed(tokens, gblocks, dst), i
        fmt = pair.sender.fmt
        assert (fmt._plans.hits, fmt._plans.misses) == (2, 4)
        if config == "gn-hawk":
            assert (fmt._landings.hits, fmt._landings.misses) == (2, 4)
        s, r = _settled(pair)
        assert not s["in_flight"] and not r["reservations"] and sorted(pair.freed) == [f"r{i}" for i in range(len(requests))]
    finally:
        pair.close()


def test_the_destination_travels_packed_to_a_prefill_that_reads_it_and_listed_to_one_that_does_not():
    """D1 names the destination blocks as packed int64 bytes to a prefill whose handshake offers
    ``packed_ids`` and as a list to one that does not (an older prefill would see no blocks); both land.
    A D1 that names them both ways, or packs a partial id, is refused and the prefill's blocks go back."""
    from hawk.connector.messages import pack_ids, unpack_ids

    pair = make_pair("gg-direct", LocalTransport(), LocalTransport())
    raw = ControlClient(pair.sender.address)
    gblocks, dst = [9, 3, 4, 5, 6, 7, 8], dst_blocks_for("gg-direct", 100, 1)
    try:
        pair.receiver.connect(pair.sender.address)
        s = pair.receiver._senders[pair.sender.address]
        sent = []
        start = s.client.start
        s.client.start = lambda m: (sent.append(m), start(m))[1]
        assert s.info["packed_ids"] is True
        for rid, packed in (("packed", True), ("listed", False)):
            if not packed:
                del s.info["packed_ids"]  # as from a prefill that predates it
            pair.add(rid, 100, gblocks)
            pair.receiver.pull(pair.sender.address, rid, dst)
            assert pair.landed(100, gblocks, dst)
            m = sent[-1]
            assert (m.dst_block_ids, unpack_ids(m.dst_ids).tolist()) == (([], dst) if packed else (dst, []))
        for rid, msg, why in (("both", PullRequest("both", s.receiver, dst, True, dst_ids=pack_ids(dst)), "both"),
                              ("partial", PullRequest("partial", s.receiver, [], True, dst_ids=pack_ids(dst)[:-1]), "multiple of 8")):
            pair.add(rid, 100, gblocks)
            reply = raw.call(msg, 2.0)
            assert isinstance(reply, Error) and why in reply.message, reply
            assert rid in pair.freed and rid not in pair.sender.accounting()["waiting"]
        with pytest.raises(ValueError, match="flat"):
            pack_ids([[1, 2]])
        _settled(pair)
        assert sorted(pair.freed) == ["both", "listed", "packed", "partial"]
    finally:
        raw.close()
        pair.close()


def test_a_kept_gn_hawk_landing_is_bound_to_its_plan_and_to_the_decode_memory():
    """gn-hawk's sender binds a landed transform per (plan, decode DRAM): the same plan landing in another
    decode's memory binds its own and writes there, each landing writes what the cache holds at that
    moment, and another plan into the same memory is bound anew."""
    import numpy as np
    import torch

    from hawk.devices.emulated import open_npu
    from hawk.layouts.npu import NpuKVLayout
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory
    from tests.kv_fixtures import NPU_BLOCK, D, H, L

    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport())
    npu_b = open_npu("npu-emu:cpu", "blackhole-p150a", bank_capacity=4 << 20)
    kv_b = NpuKVCacheMemory(npu_b, NpuKVLayout(npu_b.arch, L, 16, H, NPU_BLOCK, D))  # the same bases as the pair's decode
    try:
        pair.receiver.connect(pair.sender.address)
        fmt, receiver = pair.sender.fmt, next(iter(pair.sender._receivers.values()))
        mem_a, mem_b = pair.sender._receiver_memory(receiver), [npu_b.channel_memory(c) for c in range(npu_b.arch.num_channels)]
        assert kv_b.bases == pair.kv.bases
        plan = fmt.plan(100, np.asarray([9, 3, 4, 5, 6, 7, 8]), receiver.info, [1, 2])
        assert fmt.land(plan, mem_a) is not None and fmt.land(plan, mem_b) is not None
        assert torch.equal(pair.kv.npu.memory, npu_b.memory) and bool(npu_b.memory.any())
        for c in pair.caches:
            c.mul_(-2)
        fmt.land(plan, mem_b)  # the kept call reads the cache as it is now
        assert not torch.equal(pair.kv.npu.memory, npu_b.memory)
        fmt.land(plan, mem_a)
        assert torch.equal(pair.kv.npu.memory, npu_b.memory) and pair.landed(100, [9, 3, 4, 5, 6, 7, 8], [1, 2])
        other = fmt.plan(100, np.asarray([10, 11, 12, 13, 14, 15, 16]), receiver.info, [1, 2])
        fmt.land(other, mem_a)
        assert pair.landed(100, [10, 11, 12, 13, 14, 15, 16], [1, 2])
        assert (fmt._landings.hits, fmt._landings.misses) == (2, 3)
    finally:
        kv_b.close()
        pair.close()


def test_a_pull_that_comes_before_its_request_is_added_waits_for_it():
    """An owner that names the KV before it hands the blocks over (a vLLM prefill answers its client before
    its worker's next step) lets a D1 wait ``handoff_wait_s`` for the add; without the wait it is refused."""
    pair = make_pair("gg-direct", LocalTransport(), LocalTransport())
    try:
        dst = dst_blocks_for("gg-direct", 20, start=1)
        with pytest.raises(KVTransferFailed, match="no KV waiting"):
            pair.receiver.pull(pair.sender.address, "early", dst)
        pair.sender.handoff_wait_s = 3.0
        threading.Timer(0.3, pair.add, args=("late", 20, [2, 3])).start()
        res = pair.receiver.pull(pair.sender.address, "late", dst)
        assert res.num_tokens == 20 and pair.landed(20, [2, 3], dst)
        s, r = _settled(pair)
        assert pair.freed == ["late"] and not s["in_flight"] and not r["reservations"]
    finally:
        pair.close()


def test_a_pull_for_kv_no_longer_held_is_refused_at_once_with_why():
    """A D1 for a request whose KV expired, was pulled or was discarded does not wait ``handoff_wait_s``
    for an add that will not come: the decode hears why at once (a late decode fails fast and clearly)."""
    pair = make_pair("gg-direct", LocalTransport(), LocalTransport(), ttl_s=0.3)
    try:
        pair.sender.handoff_wait_s = 30.0
        dst = dst_blocks_for("gg-direct", 20, start=1)
        pair.add("pulled", 20, [2, 3])
        pair.receiver.pull(pair.sender.address, "pulled", dst)
        pair.add("expired", 20, [4, 5])
        pair.add("discarded", 20, [6, 7])
        assert pair.sender.discard("discarded")
        deadline = time.monotonic() + 5
        while "expired" in pair.sender.accounting()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid, why in [("pulled", "pulled already"), ("expired", "not pulled within the TTL of 0.3 s"), ("discarded", "discarded by the prefill")]:
            t0 = time.monotonic()
            with pytest.raises(KVTransferFailed, match=why + r", \d+\.\d s before this pull"):  # and how long before it
                pair.receiver.pull(pair.sender.address, rid, dst, timeout_s=20)
            assert time.monotonic() - t0 < 5  # refused, not waited for
        _settled(pair)
        assert sorted(pair.freed) == ["discarded", "expired", "pulled"]
    finally:
        pair.close()


def test_a_stalled_prefill_process_moves_its_deadlines_instead_of_expiring_them():
    """The reaper wakes 100 s late: the process did not run, so no keep-alive or D9 could have been taken,
    and the waiting KV gets 100 s more instead of expiring; rounds on time expire it at its deadline."""
    pair = make_pair("gn-hawk", LocalTransport(), LocalTransport(), ttl_s=30.0)
    try:
        t0 = time.monotonic()
        pair.add("r", 20, [2, 3])
        assert pair.sender._reap_tick(t0, 0.2, now=t0 + 100) == t0 + 100.2
        assert pair.sender.accounting()["waiting"] == ["r"]  # its 30 s TTL is over, but 100 s of it were a stall
        pair.sender._reap_tick(t0 + 129, 0.2, now=t0 + 129.1)  # on time: nothing moves, and 129 s is not yet due
        assert pair.sender.accounting()["waiting"] == ["r"]
        pair.sender._reap_tick(t0 + 131, 0.2, now=t0 + 131.1)
        assert pair.sender.accounting()["waiting"] == [] and pair.freed == ["r"]
    finally:
        pair.close()
