"""The "auto" transport: which engine each peer gets (local / cuda-ipc / network), bytes, errors, forcing.

CPU tests run everywhere; the network-engine cases skip where NIXL is not installed; the CUDA paths are
marked ``gpu`` (same process on one GPU: a device copy; two processes on one GPU: CUDA IPC).
"""

from __future__ import annotations

import logging
import os
import time

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import msgpack
import pytest
import torch

from hawk.transport import (
    TRANSPORTS,
    ConnectError,
    Desc,
    TransferError,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    available,
    make_transport,
)
from hawk.transport.auto import AutoTransport, host_identity
from tests.test_transport import (
    CH_BYTES,
    SENTINEL,
    STAGE_BYTES,
    PeerProcess,
    channel_descs,
    check_invalid,
    check_read_channels,
    check_write_channels,
    expect_channels,
    hawk_regions,
    pattern,
    register_hawk_regions,
)

CUDA = torch.cuda.is_available()
NIXL = available("nixl")
needs_nixl = pytest.mark.skipif(not NIXL, reason="nixl is not installed")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture
def near_pair():
    """Two auto transports of this process without a network engine (fast: no NIXL agent)."""
    a, b = make_transport("auto", network=None), make_transport("auto", network=None)
    register_hawk_regions(a, 1)
    register_hawk_regions(b, 2)
    yield a, b
    a.close()
    b.close()


# ============================================================================ same process: local
def test_same_process_picks_local_and_moves_bytes(near_pair, caplog):
    a, b = near_pair
    with caplog.at_level(logging.INFO, logger="hawk.transport.auto"):
        peer = a.connect(b.metadata())
        assert a.connect(b.metadata()) == peer  # idempotent, logged once
    assert a.engine_for(peer) == "local" and a.routes() == {peer: "local"}
    assert a.route(peer)["reason"] == "same process"
    assert sum("-> local" in r.getMessage() for r in caplog.records) == 1
    check_read_channels(a, peer, None, 2)  # type: ignore[arg-type]
    a.transfer("WRITE", peer, channel_descs(push=True), timeout_s=5)
    expect_channels(lambda n: b.tensor(n).numpy(), pattern(STAGE_BYTES, 1).numpy(), push=True)
    st = a.stats()
    assert (st["batches"], st["read_batches"], st["write_batches"], st["completed"]) == (2, 1, 1, 2)
    assert a.batches_by_engine() == {"local": 2}
    assert a.drain_s == 0.0 and a.engines == {"near": "local"} and a.network is None


@needs_nixl
def test_same_process_picks_local_even_with_a_network_engine():
    with make_transport("auto") as a, make_transport("auto") as b:
        assert a.engines == {"near": "cuda-ipc" if CUDA else "local", "net": "nixl"}
        assert a.drain_s == 5.0  # the largest of the inner engines'
        a.register("x", torch.zeros(64, dtype=torch.uint8))
        b.register("y", pattern(64, 3))
        peer = a.connect(b.metadata())
        assert a.engine_for(peer) == "local"
        a.transfer("READ", peer, [Desc("x", 0, "y", 0, 64)], timeout_s=5)
        assert torch.equal(a.tensor("x"), pattern(64, 3))
        assert a.batches_by_engine() == {"local": 1}


def test_invalid_descriptors_and_unknown_peer(near_pair):
    a, b = near_pair
    check_invalid(a, a.connect(b.metadata()))
    with pytest.raises(TransportError, match="unknown peer"):
        a.engine_for("nobody")


def test_closed_peer_fails_the_batch_naming_the_engine(near_pair):
    a, b = near_pair
    peer = a.connect(b.metadata())
    b.close()
    h = a.submit("READ", peer, channel_descs())
    assert a.poll(h) == "ERROR"
    with pytest.raises(TransferError, match=r"auto\[local\]: READ batch .* failed: .*closed"):
        a.wait(h, timeout_s=1)
    a.release(h)
    a.release(h)
    assert a.stats()["failed"] == 1


def test_timeout_and_in_flight_deregister(near_pair, monkeypatch):
    a, b = near_pair
    peer = a.connect(b.metadata())
    monkeypatch.setattr(a._near, "_engine_poll", lambda h: ("PENDING", None))
    h = a.submit("READ", peer, channel_descs())
    with pytest.raises(TransferTimeout, match=r"auto\[local\].*not done after 0.1"):
        a.wait(h, timeout_s=0.1)
    with pytest.raises(TransportError, match="in-flight"):
        a.deregister("ch0")
    a.release(h)
    with pytest.raises(TransferError, match="released before it completed"):
        a.wait(h, timeout_s=1)
    a.deregister("ch0")
    assert "ch0" not in a._near.regions()  # deregistered from the inner engine too
    assert a.stats()["timeouts"] == 1


def test_reconnect_refreshes_regions(near_pair):
    a, b = near_pair
    p1 = a.connect(b.metadata())
    with pytest.raises(ValueError, match="extra"):
        a.submit("READ", p1, [Desc("ch0", 0, "extra", 0, 4)])
    b.register("extra", torch.arange(16, dtype=torch.int32))
    assert a.connect(b.metadata()) == p1 and a.peers() == [p1]
    a.transfer("READ", p1, [Desc("ch0", 0, "extra", 4, 8)], timeout_s=5)
    assert a.tensor("ch0")[:8].view(torch.int32).tolist() == [1, 2]
    a.disconnect(p1)
    assert a.peers() == [] and a._near.peers() == []


def test_bad_metadata_is_rejected(near_pair):
    a, b = near_pair
    doc = msgpack.unpackb(b.metadata())
    with pytest.raises(ConnectError, match="malformed"):
        a.connect(b"\x00garbage")
    with pytest.raises(ConnectError, match="'nixl'"):
        a.connect(msgpack.packb({**doc, "engine": "nixl"}))
    with pytest.raises(ConnectError, match="malformed engine metadata"):
        a.connect(msgpack.packb({**doc, "engine_md": b"junk"}))
    md = msgpack.unpackb(doc["engine_md"])
    with pytest.raises(ConnectError, match="malformed engine metadata"):
        a.connect(msgpack.packb({**doc, "engine_md": msgpack.packb({**md, "v": 99})}))
    # a plain "local" transport does not take auto's metadata either
    with make_transport("local") as plain, pytest.raises(ConnectError, match="'auto'"):
        plain.connect(b.metadata())


def test_close_closes_the_inner_engines():
    a, b = make_transport("auto", network=None), make_transport("auto", network=None)
    a.register("x", torch.zeros(8, dtype=torch.uint8))
    b.register("y", torch.ones(8, dtype=torch.uint8))
    peer = a.connect(b.metadata())
    near = a._near
    h = a.submit("READ", peer, [Desc("x", 0, "y", 0, 8)])
    a.close()
    b.close()
    assert near.closed and a.closed and a.regions() == {} and a.peers() == []
    a.release(h)
    a.close()
    with pytest.raises(TransportError, match="closed"):
        a.submit("READ", peer, [Desc("x", 0, "y", 0, 8)])


# ============================================================================ other host: network
def test_other_host_without_network_engine_is_a_connect_error():
    with make_transport("auto", network=None, host_id="elsewhere") as a, make_transport("auto", network=None) as b:
        with pytest.raises(ConnectError, match="no engine reaches peer .*another host id"):
            a.connect(b.metadata())


@needs_nixl
def test_other_host_picks_the_network_engine():
    a = make_transport("auto", host_id="host-a")
    b = make_transport("auto", host_id="host-b")
    try:
        register_hawk_regions(a, 1)
        register_hawk_regions(b, 2)
        peer = a.connect(b.metadata())
        assert a.engine_for(peer) == "nixl" and a.route(peer)["reason"] == "another host"
        check_read_channels(a, peer, None, 2)  # type: ignore[arg-type]
        back = b.connect(a.metadata())
        assert b.engine_for(back) == "nixl"
        b.transfer("WRITE", back, channel_descs(push=True), timeout_s=10)
        expect_channels(lambda n: a.tensor(n).numpy(), pattern(STAGE_BYTES, 2).numpy(), push=True)
        assert a.batches_by_engine() == {"nixl": 1} and b.batches_by_engine() == {"nixl": 1}
        check_invalid(a, peer)
    finally:
        a.close()
        b.close()


# ============================================================================ forcing
@needs_nixl
def test_forced_network_engine_is_honoured_in_one_process():
    with make_transport("auto", force="network") as a, make_transport("auto", force="nixl") as b:
        assert a.engines == {"net": "nixl"} and b.engines == {"net": "nixl"}
        a.register("x", torch.zeros(64, dtype=torch.uint8))
        b.register("y", pattern(64, 5))
        peer = a.connect(b.metadata())
        assert a.engine_for(peer) == "nixl" and a.route(peer)["reason"].startswith("forced")
        a.transfer("READ", peer, [Desc("x", 0, "y", 0, 64)], timeout_s=10)
        assert torch.equal(a.tensor("x"), pattern(64, 5))


def test_forced_local_is_honoured_and_refuses_what_it_cannot_reach():
    with make_transport("auto", force="local") as a, make_transport("auto", network=None) as b, \
            make_transport("auto", network=None, host_id="elsewhere") as c:  # fmt: skip
        assert a.engines == {"near": "local"}
        b.register("y", pattern(16, 1))
        assert a.engine_for(a.connect(b.metadata())) == "local"
        with pytest.raises(ConnectError, match=r"forced: local"):
            a.connect(c.metadata())


def test_force_and_network_options_are_checked():
    with pytest.raises(ValueError, match="force="):
        make_transport("auto", force="pigeon")
    with pytest.raises(ValueError, match="network="):
        make_transport("auto", network="pigeon")
    with pytest.raises(ValueError, match="network engine"):
        make_transport("auto", network=None, force="network")
    if not CUDA:
        with pytest.raises(TransportUnavailable, match="CUDA"):
            make_transport("auto", force="cuda-ipc")


def test_missing_network_engine_falls_back(monkeypatch):
    import sys

    for m in ("nixl", "nixl._api", "mooncake", "mooncake.engine"):
        monkeypatch.setitem(sys.modules, m, None)  # neither engine imports
    with make_transport("auto") as t:
        assert t.network is None and "near" in t.engines
    with pytest.raises(TransportUnavailable, match="nixl"):
        make_transport("auto", network="nixl")  # asked for by name: must be there


# ============================================================================ registry / identity
def test_registry_and_config_know_auto():
    from hawk import config

    assert "auto" in TRANSPORTS and "auto" in config.TRANSPORTS and available("auto")
    with make_transport("auto", network=None, agent_name="named-auto") as t:
        assert isinstance(t, AutoTransport) and t.agent_name == "named-auto" and t.name == "auto"
    assert config.ServeConfig(transport="auto").validate().transport == "auto"


def test_host_identity(monkeypatch):
    ident = host_identity()
    assert ident == host_identity() and len(ident.split("|")) == 4
    monkeypatch.setenv("HAWK_TRANSPORT_HOST_ID", "pinned")
    assert host_identity() == "pinned"


# ============================================================================ two processes, one host
@needs_nixl
def test_two_processes_host_memory_use_the_network_engine():
    """Host memory cannot travel by CUDA IPC: a same-host peer with host regions gets the network engine."""
    proc = PeerProcess("auto", hawk_regions(2))
    t = make_transport("auto")
    try:
        register_hawk_regions(t, 1)
        peer = t.connect(proc.metadata)
        assert t.engine_for(peer) == "nixl"
        assert t.route(peer)["reason"].startswith("same host, another process, cuda-ipc: ")
        check_read_channels(t, peer, proc, 2)
        check_write_channels(t, peer, proc, 1)
    finally:
        t.close()
        proc.close()


# ============================================================================ CUDA paths (gpu)
def _bandwidth_gbs(t, peer, op, local, remote, nbytes, reps=5):
    t.transfer(op, peer, [Desc(local, 0, remote, 0, nbytes)], timeout_s=30)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        t.transfer(op, peer, [Desc(local, 0, remote, 0, nbytes)], timeout_s=30)
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("copy_mode", ["raw", "torch"])
def test_gpu_same_process_same_gpu_is_a_device_copy(monkeypatch, copy_mode):
    monkeypatch.setenv("HAWK_CUDA_COPY", copy_mode)
    big = 256 << 20
    with make_transport("auto") as a, make_transport("auto") as b:
        register_hawk_regions(a, 1, "cuda")
        register_hawk_regions(b, 2, "cuda")
        a.register("big", torch.zeros(big, dtype=torch.uint8, device="cuda"))
        b.register("big", torch.ones(big, dtype=torch.uint8, device="cuda"))
        peer = a.connect(b.metadata())
        assert a.engine_for(peer) == "local"
        check_read_channels(a, peer, None, 2)  # type: ignore[arg-type]
        a.transfer("WRITE", peer, channel_descs(push=True), timeout_s=10)
        expect_channels(lambda n: b.tensor(n).cpu().numpy(), pattern(STAGE_BYTES, 1).numpy(), push=True)
        many = [Desc("big", i * 4099, "stage", (500 - i) * 512 + 1, 512) for i in range(500)]
        a.transfer("READ", peer, many, timeout_s=10)  # many small copies, odd offsets
        stage = pattern(STAGE_BYTES, 2, "cuda")
        for i in (0, 7, 499):
            assert torch.equal(a.tensor("big")[i * 4099 : i * 4099 + 512], stage[(500 - i) * 512 + 1 : (501 - i) * 512 + 1])
        gbs = _bandwidth_gbs(a, peer, "READ", "big", "big", big)
        print(f"same process, same GPU ({copy_mode}): {gbs:.0f} GB/s")
        assert gbs > 100, f"{gbs:.1f} GB/s is not a device copy"
        assert a.batches_by_engine() == {"local": 3 + 6}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_gpu_many_ranges_between_two_gpus_are_gathered_copied_and_scattered(op):
    """Many ranges between GPU0 and GPU1 in one batch (aligned: gather, one peer copy, scatter; odd: a
    copy per range): every range lands, and nothing past them is written."""
    n = 8 << 20
    with make_transport("local") as a, make_transport("local") as b:
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        a.register("x", src if op == "WRITE" else torch.zeros(n, dtype=torch.uint8, device="cuda:0"))
        b.register("x", torch.zeros(n, dtype=torch.uint8, device="cuda:1") if op == "WRITE" else src.to("cuda:1"))
        peer = a.connect(b.metadata())
        for step, odd in ((4096, 0), (4097, 1)):  # 8-byte aligned ranges, then odd ones (per-range copies)
            descs = [Desc("x", i * step + odd, "x", (300 - i) * step + odd, 1024 + 8 * (i % 5)) for i in range(300)]
            a.transfer(op, peer, descs, timeout_s=30)
            have = b.tensor("x") if op == "WRITE" else a.tensor("x")
            want = a.tensor("x") if op == "WRITE" else b.tensor("x")
            hc, wc = have.cpu(), want.cpu()
            for d in descs:
                lo, ro = (d.remote_offset, d.local_offset) if op == "WRITE" else (d.local_offset, d.remote_offset)
                assert torch.equal(hc[lo : lo + d.length], wc[ro : ro + d.length])
            if op == "WRITE":
                assert int(hc[302 * 4097 :].sum()) == 0  # nothing written past the ranges


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("copy_mode", ["raw", "torch"])
def test_gpu_two_processes_same_gpu_use_cuda_ipc(monkeypatch, copy_mode):
    monkeypatch.setenv("HAWK_CUDA_COPY", copy_mode)
    big = 256 << 20
    proc = PeerProcess("auto", {**hawk_regions(2, "cuda"), "big": (big, 0, "cuda"), "host": (4096, 4, "cpu")})
    t = make_transport("auto")
    try:
        register_hawk_regions(t, 1, "cuda")
        t.register("big", torch.zeros(big, dtype=torch.uint8, device="cuda"))
        t.register("hostbuf", torch.zeros(4096, dtype=torch.uint8))
        peer = t.connect(proc.metadata)
        assert t.engine_for(peer) == "cuda-ipc", t.route(peer)
        assert t.route(peer)["host_regions"] == ["host"]
        check_read_channels(t, peer, proc, 2)
        check_write_channels(t, peer, proc, 1)
        check_invalid(t, peer)
        t.transfer("READ", peer, [Desc("hostbuf", 0, "stage", 64, 64)], timeout_s=10)  # local host end
        assert torch.equal(t.tensor("hostbuf")[:64], pattern(STAGE_BYTES, 2)[64:128])
        if t.network is not None:  # the peer's host region goes over the network engine
            t.transfer("READ", peer, [Desc("hostbuf", 0, "host", 0, 4096)], timeout_s=10)
            assert torch.equal(t.tensor("hostbuf"), pattern(4096, 4))
            assert t.batches_by_engine().get(t.network) == 1
        else:
            with pytest.raises(ValueError, match="host region"):
                t.submit("READ", peer, [Desc("hostbuf", 0, "host", 0, 4096)])
        meta = proc.register("late", 4096, 9, "cuda")
        assert t.connect(meta) == peer and t.engine_for(peer) == "cuda-ipc"
        t.transfer("READ", peer, [Desc("ch0", 0, "late", 0, 4096)], timeout_s=10)
        assert torch.equal(t.tensor("ch0")[:4096].cpu(), pattern(4096, 9))
        gbs = _bandwidth_gbs(t, peer, "READ", "big", "big", big)
        print(f"two processes, same GPU, cuda-ipc ({copy_mode}): {gbs:.0f} GB/s")
        assert gbs > 100, f"{gbs:.1f} GB/s is not a device copy"
        assert bool((t.tensor("big") == SENTINEL).all())  # the peer's big region is all sentinel
    finally:
        t.close()
        proc.close()


@pytest.mark.gpu
@gpu
def test_gpu_cpu_only_peer_in_another_process_is_not_cuda_ipc():
    """A same-host peer whose regions are all host memory: cuda-ipc cannot reach it."""
    proc = PeerProcess("auto", {"stage": (STAGE_BYTES, 2, "cpu"), "ch0": (CH_BYTES, 0, "cpu")})
    t = make_transport("auto")
    try:
        t.register("ch0", torch.full((CH_BYTES,), SENTINEL, dtype=torch.uint8, device="cuda"))
        if t.network is None:
            with pytest.raises(ConnectError, match="no CUDA region"):
                t.connect(proc.metadata)
        else:
            peer = t.connect(proc.metadata)
            assert t.engine_for(peer) == t.network
    finally:
        t.close()
        proc.close()


# ============================================================================ through Algorithm 1
@pytest.mark.parametrize("config", ["gn-hawk", "gg-direct", "gg-host"])
@pytest.mark.parametrize("post", ["pull", "push"])
def test_connector_over_auto_lands_the_kv(config, post):
    """The connector does not care: both sides on "auto" in one process -> local, KV lands."""
    from tests.kv_fixtures import dst_blocks_for, make_pair

    tp, td = make_transport("auto", network=None), make_transport("auto", network=None)
    pair = make_pair(config, tp, td, post=post)
    try:
        pair.add("r0", 100, [9, 3, 4, 5, 6, 7, 8])
        dst = dst_blocks_for(config, 100, start=1)
        res = pair.receiver.pull(pair.sender.address, "r0", dst)
        assert pair.landed(100, [9, 3, 4, 5, 6, 7, 8], dst)
        assert set(td.routes().values()) == {"local"} and set(tp.routes().values()) == {"local"}
        if config in ("gn-hawk", "gg-direct"):  # the sender reaches the decode's memory through "local": it writes it itself
            assert res.mode == "landed" and not (td.batches_by_engine() or tp.batches_by_engine())
        else:
            assert (td if post == "pull" else tp).batches_by_engine().get("local", 0) >= 1
    finally:
        pair.close()


# ============================================================================ the decision, without CUDA
def test_decision_table(monkeypatch):
    """_candidates on hand-made peer metadata: which engines are tried, best first, and why not the others."""
    from hawk.transport import auto as auto_mod
    from hawk.transport.base import RegionInfo
    from hawk.transport.local import CudaIpcTransport

    monkeypatch.setattr(auto_mod, "gpu_identities", lambda init: ["GPU-0", "GPU-1"])
    with make_transport("auto", network=None, host_id="H") as t:
        real_near = t._near
        t._near = object.__new__(CudaIpcTransport)  # only its type is looked at
        t._net = type("Net", (), {"name": "nixl"})()
        try:
            def peer(host="H", proc="other", pid=-1, gpus=("GPU-0", "GPU-1"), dev=("cuda", 1), near="cuda-ipc"):
                md = {"v": 1, "host": host, "proc": proc, "gpus": list(gpus), "near": [near, b""], "net": ["nixl", b""]}
                regions = {"r": RegionInfo("r", 4096, 64, dev[0], dev[1])}
                return {"agent": "p", "pid": pid}, md, regions

            def engines(*a, **kw):
                return [e for e, _ in t._candidates(*peer(*a, **kw))[0]]

            assert engines() == ["cuda-ipc", "nixl"]
            assert engines(host="other-host") == ["nixl"]
            assert engines(dev=("cpu", -1)) == ["nixl"]  # host memory: no IPC handle
            assert engines(gpus=("GPU-1", "GPU-0")) == ["nixl"]  # index 1 is another GPU there
            assert engines(near="local") == ["nixl"]  # the peer has no CUDA
            assert engines(proc=auto_mod._PROCESS_TOKEN, pid=os.getpid()) == ["local", "nixl"]
            why = t._candidates(*peer(gpus=("GPU-1", "GPU-0")))[1]
            assert "CUDA_VISIBLE_DEVICES" in why
            t.force = "cuda-ipc"
            assert engines() == ["cuda-ipc"] and engines(host="other-host") == []
            t.force = "network"
            assert engines() == ["nixl"]
        finally:
            t._near, t._net, t.force = real_near, None, None
