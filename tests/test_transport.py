"""Transport interface: the in-process "local" transport, validation, errors, registry, host staging.

Also holds the two-process harness (PeerProcess) and the engine-agnostic checks that
test_transport_nixl.py and test_transport_mooncake.py run against real engines over loopback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hawk.transport import (
    TRANSPORTS,
    ConnectError,
    Desc,
    DescArray,
    TransferError,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    make_transport,
)
from hawk.transport.local import LocalTransport

SENTINEL = 0xA5
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def pattern(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Deterministic bytes that differ per offset and per region (period 251, a prime)."""
    return ((torch.arange(n, dtype=torch.int64) * 7 + seed * 13) % 251).to(torch.uint8).to(device)


# ============================================================================ two-process harness
def _peer_main(conn: Any, engine: str, options: dict[str, Any], regions: dict[str, tuple[int, int, str]]) -> None:
    """Child: register regions (name -> (nbytes, seed, device); seed 0 = sentinel), serve simple commands."""
    from hawk.transport import make_transport

    t = make_transport(engine, **options)
    for name, (n, seed, dev) in regions.items():
        t.register(name, pattern(n, seed, dev) if seed else torch.full((n,), SENTINEL, dtype=torch.uint8, device=dev))
    conn.send(t.metadata())
    while conn.poll(300):  # parent gone for 5 min: give up
        cmd, *args = conn.recv()
        if cmd == "get":
            conn.send(t.tensor(args[0]).cpu().numpy().tobytes())
        elif cmd == "register":
            name, n, seed, dev = args
            t.register(name, pattern(n, seed, dev))
            conn.send(t.metadata())
        elif cmd == "exit":
            break
    t.close()
    conn.send("closed")


class PeerProcess:
    """A transport in a spawned process, driven over a Pipe; every receive has a timeout."""

    def __init__(self, engine: str, regions: dict[str, tuple[int, int, str]], options: dict | None = None,
                 timeout_s: float = 60.0) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, engine, options or {}, regions), daemon=True)
        self.proc.start()
        child.close()
        self.metadata = self._recv(timeout_s)

    def _recv(self, timeout_s: float = 30.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer process did not answer within {timeout_s} s (alive={self.proc.is_alive()})")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"peer process exited (exit code {self.proc.exitcode})") from None

    def get(self, name: str) -> np.ndarray:
        self.conn.send(("get", name))
        return np.frombuffer(self._recv(), dtype=np.uint8)

    def register(self, name: str, n: int, seed: int, device: str = "cpu") -> bytes:
        self.conn.send(("register", name, n, seed, device))
        return self._recv()

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                self._recv(30)
            except (OSError, RuntimeError, TimeoutError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


N_CH = 8
CH_BYTES = 256 << 10
STAGE_BYTES = N_CH * CH_BYTES


def hawk_regions(stage_seed: int, device: str = "cpu") -> dict[str, tuple[int, int, str]]:
    """A HAWK-like region set: one staging buffer (pattern) and 8 per-channel buffers (sentinel)."""
    regs = {"stage": (STAGE_BYTES, stage_seed, device)}
    regs.update({f"ch{c}": (CH_BYTES, 0, device) for c in range(N_CH)})
    return regs


def register_hawk_regions(t: Any, stage_seed: int, device: str = "cpu") -> None:
    for name, (n, seed, dev) in hawk_regions(stage_seed, device).items():
        t.register(name, pattern(n, seed, dev) if seed else torch.full((n,), SENTINEL, dtype=torch.uint8, device=dev))


def channel_descs(push: bool = False) -> list[Desc]:
    """One descriptor per channel with odd sizes/offsets between stage[c-th slice] and ch{c}[offset].

    Pull (READ): local ch{c} <- remote stage. Push (WRITE): local stage -> remote ch{c}.
    """
    out = []
    for c in range(N_CH):
        length, ch_off, stage_off = CH_BYTES // 2 + 4093 * c + 1, 17 * c + 3, c * CH_BYTES + 5 * c
        if push:
            out.append(Desc("stage", stage_off, f"ch{c}", ch_off, length))
        else:
            out.append(Desc(f"ch{c}", ch_off, "stage", stage_off, length))
    return out


def expect_channels(get_ch, stage: np.ndarray, push: bool = False) -> None:
    """Each ch region holds its slice of stage at the right offset and the sentinel everywhere else."""
    for d in channel_descs(push):
        ch_name, ch_off, st_off = (d.remote_region, d.remote_offset, d.local_offset) if push else (
            d.local_region, d.local_offset, d.remote_offset)  # fmt: skip
        want = np.full(CH_BYTES, SENTINEL, dtype=np.uint8)
        want[ch_off : ch_off + d.length] = stage[st_off : st_off + d.length]
        np.testing.assert_array_equal(get_ch(ch_name), want, err_msg=ch_name)


def check_read_channels(t: Any, peer: str, proc: PeerProcess | None, peer_stage_seed: int) -> None:
    """Decode-style pull: 8 per-channel requests as ONE batch, bytes land at the right offsets only."""
    descs = channel_descs()
    before = t.stats()
    h = t.submit("READ", peer, descs)
    t.wait(h, timeout_s=30)
    t.release(h)
    expect_channels(lambda n: t.tensor(n).cpu().numpy(), pattern(STAGE_BYTES, peer_stage_seed).numpy())
    after = t.stats()
    assert after["batches"] - before["batches"] == 1
    assert after["descriptors"] - before["descriptors"] == N_CH
    assert after["bytes"] - before["bytes"] == sum(d.length for d in descs)
    assert after["last_batch_descriptors"] == N_CH


def check_write_channels(t: Any, peer: str, proc: PeerProcess, my_stage_seed: int) -> None:
    """Push: WRITE our staging slices into the peer's channel buffers; untouched peer bytes stay sentinel."""
    h = t.submit("WRITE", peer, channel_descs(push=True))
    t.wait(h, timeout_s=30)
    t.release(h)
    expect_channels(proc.get, pattern(STAGE_BYTES, my_stage_seed).numpy(), push=True)
    np.testing.assert_array_equal(proc.get("stage"), pattern(STAGE_BYTES, 2).numpy())  # source side untouched


def check_many_descriptors(t: Any, peer: str, n: int, size: int = 512, as_array: bool = False) -> dict[str, int]:
    """``n`` small scattered requests in one batch (reversed order; a DescArray with ``as_array``);
    returns the stats delta."""
    big = t.tensor("big")
    big.fill_(SENTINEL)
    before = t.stats()
    descs = [Desc("big", i * size, "stage", (n - 1 - i) * size + 1, size) for i in range(n)]
    h = t.submit("READ", peer, DescArray.from_descs(descs) if as_array else descs)
    t.wait(h, timeout_s=60)
    t.release(h)
    stage = pattern(STAGE_BYTES, 2).numpy()
    got = big.cpu().numpy()
    want = np.full(big.numel(), SENTINEL, dtype=np.uint8)
    for i in range(n):
        want[i * size : (i + 1) * size] = stage[(n - 1 - i) * size + 1 : (n - i) * size + 1]
    np.testing.assert_array_equal(got, want)
    after = t.stats()
    return {k: after[k] - before[k] for k in after if k not in ("last_batch_descriptors", "max_batch_descriptors")}


def check_invalid(t: Any, peer: str) -> None:
    """Bad descriptors raise ValueError naming the bad value, and nothing is counted."""
    before = t.stats()
    bad = [
        (Desc("nope", 0, "stage", 0, 8), "nope"),
        (Desc("ch0", 0, "nope", 0, 8), "nope"),
        (Desc("ch0", CH_BYTES - 4, "stage", 0, 8), f"local_offset={CH_BYTES - 4}"),
        (Desc("ch0", 0, "stage", STAGE_BYTES, 1), f"remote_offset={STAGE_BYTES}"),
        (Desc("ch0", -1, "stage", 0, 8), "local_offset=-1"),
        (Desc("ch0", 0, "stage", 0, 0), "length=0"),
        (Desc("ch0", 0, "stage", 0, -5), "length=-5"),
    ]
    for form in (list, DescArray.from_descs):  # a list of Desc, and the same batch as arrays
        for d, needle in bad:
            with pytest.raises(ValueError, match=needle):
                t.submit("READ", peer, form([Desc("ch1", 0, "stage", 0, 8), d]))
        with pytest.raises(ValueError, match="empty"):
            t.submit("READ", peer, form([]))
    with pytest.raises(ValueError, match="op="):
        t.submit("COPY", peer, [Desc("ch0", 0, "stage", 0, 8)])
    with pytest.raises(TransportError, match="unknown peer"):
        t.submit("READ", "no-such-peer", [Desc("ch0", 0, "stage", 0, 8)])
    assert t.stats() == before


def check_peer_killed(engine: str, options: dict | None = None, bound_s: float = 30.0) -> None:
    """A peer killed mid-session, with a 64 MB batch in flight: nothing hangs; later batches fail with
    TransferError in bounded time; close() stays quick."""
    bulk = 64 << 20
    proc = PeerProcess(engine, {**hawk_regions(2), "bulk": (bulk, 3, "cpu")}, options)
    t = make_transport(engine, **(options or {}))
    try:
        register_hawk_regions(t, 1)
        t.register("bulk", torch.zeros(bulk, dtype=torch.uint8))
        peer = t.connect(proc.metadata)
        t.transfer("READ", peer, channel_descs(), timeout_s=30)
        t0 = time.monotonic()
        eighth = bulk // 8
        h = t.submit("READ", peer, [Desc("bulk", i * eighth, "bulk", i * eighth, eighth) for i in range(8)])
        proc.kill()
        try:  # it may have finished before the kill; either way it must not hang
            t.wait(h, timeout_s=20)
        except TransferError:
            pass
        t.release(h)
        with pytest.raises(TransferError, match=engine):
            for _ in range(3):  # the first batch after a kill may still succeed on some transports
                h = t.submit("READ", peer, channel_descs())
                try:
                    t.wait(h, timeout_s=10)
                finally:
                    t.release(h)
        assert time.monotonic() - t0 < bound_s
        assert t.stats()["failed"] + t.stats()["timeouts"] >= 1
    finally:
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 40.0
        proc.close()


# ============================================================================ local transport
@pytest.fixture
def pair():
    a, b = LocalTransport(), LocalTransport()
    register_hawk_regions(a, 1)
    register_hawk_regions(b, 2)
    yield a, b
    a.close()
    b.close()


def test_local_read_write_channels(pair):
    a, b = pair
    peer = a.connect(b.metadata())
    check_read_channels(a, peer, None, 2)  # type: ignore[arg-type]
    a.transfer("WRITE", peer, channel_descs(push=True), timeout_s=5)
    expect_channels(lambda n: b.tensor(n).numpy(), pattern(STAGE_BYTES, 1).numpy(), push=True)
    st_ = a.stats()
    assert (st_["batches"], st_["read_batches"], st_["write_batches"]) == (2, 1, 1)
    assert st_["descriptors"] == 2 * N_CH and st_["completed"] == 2 and st_["failed"] == 0


def test_peer_memory_spans_only_regions_that_follow_each_other():
    """peer_memory: regions back to back in one allocation, in the order asked, as one tensor whose writes
    land in the peer's memory; anything else (a gap, another order, another storage, an unknown name, a
    paced transport) gives None."""
    from hawk.transport.paced import PacedTransport

    a, b = LocalTransport(), LocalTransport()
    dram = torch.zeros(4, 256, dtype=torch.uint8)
    for c in range(3):
        b.register(f"ch{c}", dram[c])
    b.register("gap", dram[3, 128:])
    b.register("alone", torch.zeros(256, dtype=torch.uint8))
    try:
        peer = a.connect(b.metadata())
        span = a.peer_memory(peer, ["ch0", "ch1", "ch2"])
        assert span is not None and span.numel() == 3 * 256 and span.data_ptr() == dram.data_ptr()
        span[300] = 7  # channel 1, byte 44: the peer's own tensor sees it
        assert int(dram[1, 44]) == 7
        assert a.peer_memory(peer, ["ch1", "ch2"]).data_ptr() == dram[1].data_ptr()
        for names in (["ch1", "ch0"], ["ch2", "gap"], ["ch0", "alone"], ["ch0", "nope"]):
            assert a.peer_memory(peer, names) is None, names
        paced = PacedTransport(a, 100.0)
        assert paced.peer_memory(peer, ["ch0"]) is None  # every byte it moves must be paced
    finally:
        a.close()
        b.close()


def test_local_invalid_descriptors(pair):
    a, b = pair
    check_invalid(a, a.connect(b.metadata()))


def test_connect_is_idempotent_and_refreshes_regions(pair):
    a, b = pair
    p1 = a.connect(b.metadata())
    assert a.connect(b.metadata()) == p1 and a.peers() == [p1]
    with pytest.raises(ValueError, match="extra"):
        a.submit("READ", p1, [Desc("ch0", 0, "extra", 0, 4)])
    b.register("extra", torch.arange(16, dtype=torch.int32))  # 64 bytes, non-uint8 dtype
    assert a.connect(b.metadata()) == p1
    a.transfer("READ", p1, [Desc("ch0", 0, "extra", 4, 8)], timeout_s=5)
    assert a.tensor("ch0")[:8].view(torch.int32).tolist() == [1, 2]
    a.disconnect(p1)
    a.disconnect(p1)  # no-op
    assert a.peers() == []


def test_register_rejects_bad_tensors():
    with LocalTransport() as t:
        with pytest.raises(ValueError, match="contiguous"):
            t.register("x", torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="empty"):
            t.register("x", torch.zeros(0))
        with pytest.raises(ValueError, match="Tensor"):
            t.register("x", np.zeros(4))  # type: ignore[arg-type]
        info = t.register("x", torch.zeros(4, dtype=torch.float64))
        assert (info.length, info.device, info.device_id) == (32, "cpu", -1)
        with pytest.raises(ValueError, match="already"):
            t.register("x", torch.zeros(4))
        t.deregister("x")
        with pytest.raises(ValueError, match="unknown region"):
            t.deregister("x")
    with pytest.raises(TransportError, match="closed"):
        t.register("y", torch.zeros(4))


def test_bad_metadata_is_rejected():
    with LocalTransport() as t:
        with pytest.raises(ConnectError, match="malformed"):
            t.connect(b"\x00garbage")
        with pytest.raises(ConnectError, match="malformed"):
            t.connect(msgpack.packb({"hello": 1}))
        doc = msgpack.unpackb(t.metadata())
        with pytest.raises(ConnectError, match="version"):
            t.connect(msgpack.packb({**doc, "hawk_transport": 99}))
        with pytest.raises(ConnectError, match="'nixl'"):
            t.connect(msgpack.packb({**doc, "engine": "nixl"}))
        with pytest.raises(ConnectError, match="process"):
            t.connect(msgpack.packb({**doc, "pid": doc["pid"] + 1}))
        with pytest.raises(ConnectError, match="malformed region"):
            t.connect(msgpack.packb({**doc, "regions": {"r": [0, -3, "cpu", -1]}}))
        with pytest.raises(ConnectError, match="no open transport"):
            t.connect(msgpack.packb({**doc, "agent": "ghost"}))


def test_closed_peer_fails_the_batch(pair):
    a, b = pair
    peer = a.connect(b.metadata())
    b.close()
    h = a.submit("READ", peer, channel_descs())
    assert a.poll(h) == "ERROR"
    with pytest.raises(TransferError, match=r"local: READ batch .* failed: .*closed"):
        a.wait(h, timeout_s=1)
    a.release(h)
    a.release(h)  # idempotent
    assert a.stats()["failed"] == 1


class _NeverDone(LocalTransport):
    name = "local"

    def _engine_poll(self, h):
        return "PENDING", None


def test_wait_times_out_and_deregister_refuses_in_flight():
    a, b = _NeverDone(), LocalTransport()
    try:
        a.register("x", torch.zeros(64, dtype=torch.uint8))
        b.register("y", torch.ones(64, dtype=torch.uint8))
        peer = a.connect(b.metadata())
        h = a.submit("WRITE", peer, [Desc("x", 0, "y", 0, 64)])
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="not done after 0.2"):
            a.wait(h, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - t0 < 2.0
        assert issubclass(TransferTimeout, TransferError)
        with pytest.raises(TransportError, match="in-flight"):
            a.deregister("x")
        a.release(h)
        with pytest.raises(TransferError, match="released before it completed"):
            a.wait(h, timeout_s=5)
        a.deregister("x")
        assert a.stats()["timeouts"] == 1
    finally:
        a.close()
        b.close()


def test_context_manager_closes_everything():
    with LocalTransport() as a, LocalTransport() as b:
        a.register("x", torch.zeros(8, dtype=torch.uint8))
        b.register("y", torch.ones(8, dtype=torch.uint8))
        peer = a.connect(b.metadata())
        h = a.submit("READ", peer, [Desc("x", 0, "y", 0, 8)])
    assert a.closed and b.closed and a.regions() == {} and a.peers() == []
    a.release(h)
    a.close()  # idempotent
    with pytest.raises(TransportError, match="closed"):
        a.submit("READ", peer, [Desc("x", 0, "y", 0, 8)])


@st.composite
def batches(draw):
    """Random regions and a batch whose destination ranges do not overlap."""
    local_sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    remote_sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=4))
    op = draw(st.sampled_from(["READ", "WRITE"]))
    dst_sizes = local_sizes if op == "READ" else remote_sizes
    used = [np.zeros(n, dtype=bool) for n in dst_sizes]
    descs = []
    for _ in range(draw(st.integers(1, 12))):
        li, ri = draw(st.integers(0, len(local_sizes) - 1)), draw(st.integers(0, len(remote_sizes) - 1))
        ln = draw(st.integers(1, min(local_sizes[li], remote_sizes[ri])))
        lo, ro = draw(st.integers(0, local_sizes[li] - ln)), draw(st.integers(0, remote_sizes[ri] - ln))
        di, do = (li, lo) if op == "READ" else (ri, ro)
        if used[di][do : do + ln].any():
            continue
        used[di][do : do + ln] = True
        descs.append(Desc(f"l{li}", lo, f"r{ri}", ro, ln))
    return local_sizes, remote_sizes, op, descs


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.booleans())
def test_local_matches_numpy_reference(case, as_array):
    """Random batches, given as a list of Desc or as a DescArray, land as numpy slicing says."""
    local_sizes, remote_sizes, op, descs = case
    if not descs:
        return
    rng = np.random.default_rng(len(descs))
    lmem = [rng.integers(0, 256, n, dtype=np.uint8) for n in local_sizes]
    rmem = [rng.integers(0, 256, n, dtype=np.uint8) for n in remote_sizes]
    with LocalTransport() as a, LocalTransport() as b:
        for i, m in enumerate(lmem):
            a.register(f"l{i}", torch.from_numpy(m.copy()))
        for i, m in enumerate(rmem):
            b.register(f"r{i}", torch.from_numpy(m.copy()))
        a.transfer(op, a.connect(b.metadata()), DescArray.from_descs(descs) if as_array else descs, timeout_s=5)
        for d in descs:  # the reference: plain numpy slicing
            li, ri = int(d.local_region[1:]), int(d.remote_region[1:])
            lsl = slice(d.local_offset, d.local_offset + d.length)
            rsl = slice(d.remote_offset, d.remote_offset + d.length)
            if op == "READ":
                lmem[li][lsl] = rmem[ri][rsl]
            else:
                rmem[ri][rsl] = lmem[li][lsl]
        for i, m in enumerate(lmem):
            np.testing.assert_array_equal(a.tensor(f"l{i}").numpy(), m)
        for i, m in enumerate(rmem):
            np.testing.assert_array_equal(b.tensor(f"r{i}").numpy(), m)
        assert a.stats()["descriptors"] == len(descs)


def test_desc_array_is_the_list_it_stands_for():
    descs = [Desc("ch1", 8, "stage", 0, 16), Desc("ch0", 0, "stage", 64, 8), Desc("ch1", 32, "big", 4, 4)]
    arr = DescArray.from_descs(descs)
    assert len(arr) == 3 and list(arr) == descs and arr[1:] == descs[1:] and arr[-1] == descs[-1]
    assert arr.local_names == ("ch1", "ch0") and arr.remote_names == ("stage", "big")
    assert arr.nbytes == 28
    more = [Desc("ch2", 0, "big", 8, 8), Desc("ch0", 16, "stage", 0, 4)]
    both = DescArray.concat([arr, more, []])  # arrays and lists, names merged, order kept
    assert list(both) == descs + more and both.local_names == ("ch1", "ch0", "ch2") and both.remote_names == ("stage", "big")
    with pytest.raises(ValueError, match="one length"):
        DescArray(("a",), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64), ("b",), np.zeros(2, dtype=np.int64),
                  np.zeros(2, dtype=np.int64), np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="outside its 1 names"):
        DescArray(("a",), np.array([1]), np.zeros(1, dtype=np.int64), ("b",), np.zeros(1, dtype=np.int64),
                  np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))


def test_nixl_descriptor_groups_from_arrays_equal_those_from_segments():
    """NIXL's descriptor lists built with numpy from a SegArray equal the per-Segment build, memory
    types (host and CUDA regions on both sides) included."""
    from hawk.transport.base import RegionInfo, resolve, resolve_array
    from hawk.transport.nixl_transport import _array_groups, _segment_groups

    local = {"h": RegionInfo("h", 1 << 20, 4096, "cpu", -1), "g": RegionInfo("g", 1 << 30, 4096, "cuda", 1)}
    remote = {"H": RegionInfo("H", 1 << 24, 4096, "cpu", -1), "G": RegionInfo("G", 1 << 32, 4096, "cuda", 0)}
    rng = np.random.default_rng(3)
    descs = [Desc(str(rng.choice(["h", "g"])), int(rng.integers(0, 2048)), str(rng.choice(["H", "G"])),
                  int(rng.integers(0, 2048)), int(rng.integers(1, 2048))) for _ in range(200)]
    want = {k: (lo.tolist(), re.tolist()) for k, lo, re in _segment_groups(resolve(descs, local, remote, "p"))}
    got = {k: (lo.tolist(), re.tolist()) for k, lo, re in _array_groups(resolve_array(DescArray.from_descs(descs), local, remote, "p"))}
    assert got.keys() == want.keys() and len(want) == 4
    for k in want:  # the same rows; the array build keeps the batch's order within a group
        assert got[k] == want[k], k


# ============================================================================ registry
def test_registry_names_and_errors():
    assert TRANSPORTS == ("nixl", "mooncake", "local", "cuda-ipc", "auto")
    with pytest.raises(ValueError, match="unknown transport 'rdma'.*nixl, mooncake, local, cuda-ipc"):
        make_transport("rdma")
    with pytest.raises(ValueError, match="bad options"):
        make_transport("local", colour="blue")
    with make_transport("local", agent_name="named-agent") as t:
        assert t.agent_name == "named-agent" and t.name == "local"
    if not CUDA:
        with pytest.raises(TransportUnavailable, match="CUDA"):
            make_transport("cuda-ipc")


@pytest.mark.parametrize(
    "engine, modules, hint",
    [
        ("nixl", ["nixl", "nixl._api"], "pip install --no-deps nixl"),
        ("mooncake", ["mooncake", "mooncake.engine"], "pip install mooncake"),
    ],
)
def test_missing_engine_says_what_to_install(monkeypatch, engine, modules, hint):
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # makes `import m` raise ImportError
    with pytest.raises(TransportUnavailable, match=hint) as e:
        make_transport(engine)
    assert isinstance(e.value, ImportError)


# ============================================================================ host staging
@pytest.mark.gpu
@gpu
def test_local_cpu_cuda_copies():
    with LocalTransport() as a, LocalTransport() as b:
        register_hawk_regions(a, 1, "cuda")
        register_hawk_regions(b, 2, "cpu")
        peer = a.connect(b.metadata())
        check_read_channels(a, peer, None, 2)  # type: ignore[arg-type]
        a.transfer("WRITE", peer, channel_descs(push=True), timeout_s=10)  # cuda -> cpu
        expect_channels(lambda n: b.tensor(n).numpy(), pattern(STAGE_BYTES, 1).numpy(), push=True)
        c = LocalTransport()
        register_hawk_regions(c, 4, "cuda")
        p2 = a.connect(c.metadata())
        for d in channel_descs():
            a.tensor(d.local_region).fill_(SENTINEL)
        check_read_channels(a, p2, None, 4)  # type: ignore[arg-type]  # cuda -> cuda
        c.close()


@pytest.mark.gpu
@gpu
def test_same_gpu_array_batches_follow_region_changes():
    """Array batches on one GPU keep their regions' addresses from one batch to the next (looked up
    once per set of regions), but a region that comes or goes on either side is looked up again: a
    peer region replaced since connect() fails the batch, and after reconnecting the copies go to the
    new memory, never the old."""
    n = 1 << 16
    with LocalTransport() as a, LocalTransport() as b:
        for i in range(4):
            a.register(f"a{i}", torch.zeros(n, dtype=torch.uint8, device="cuda"))
            b.register(f"b{i}", torch.full((n,), i + 1, dtype=torch.uint8, device="cuda"))
        peer = a.connect(b.metadata())
        arr = DescArray.from_descs([Desc(f"a{i}", 0, f"b{i}", 4096, 8192) for i in range(4)])
        for _ in range(2):  # the second batch uses the addresses kept from the first
            a.transfer("READ", peer, arr, timeout_s=10)
            assert all(int(a.tensor(f"a{i}")[:8192].float().mean()) == i + 1 for i in range(4))
        old = b.tensor("b2")
        b.deregister("b2")
        b.register("b2", torch.full((2 * n,), 9, dtype=torch.uint8, device="cuda"))
        with pytest.raises(TransferError, match="changed since connect"):
            a.transfer("READ", peer, arr, timeout_s=10)
        peer = a.connect(b.metadata())
        a.transfer("READ", peer, arr, timeout_s=10)
        assert int(a.tensor("a2")[:8192].min()) == 9
        old.fill_(0)
        a.tensor("a2").fill_(7)
        a.transfer("WRITE", peer, arr, timeout_s=10)  # into the new b2; the old one stays as it was
        torch.cuda.synchronize()
        assert int(b.tensor("b2")[4096 : 4096 + 8192].min()) == 7 and int(old.max()) == 0


@pytest.mark.gpu
@gpu
def test_cuda_ipc_two_processes():
    proc = PeerProcess("cuda-ipc", hawk_regions(2, "cuda"))
    t = make_transport("cuda-ipc")
    try:
        register_hawk_regions(t, 1, "cuda")
        t.register("host", torch.zeros(64, dtype=torch.uint8))  # local host memory may be one end
        peer = t.connect(proc.metadata)
        check_read_channels(t, peer, proc, 2)
        check_write_channels(t, peer, proc, 1)
        t.transfer("READ", peer, [Desc("host", 0, "stage", 64, 64)], timeout_s=10)
        assert torch.equal(t.tensor("host"), pattern(STAGE_BYTES, 2)[64:128])
        check_invalid(t, peer)
        meta = proc.register("late", 4096, 9, "cuda")
        assert t.connect(meta) == peer
        t.transfer("READ", peer, [Desc("ch0", 0, "late", 0, 4096)], timeout_s=10)
        assert torch.equal(t.tensor("ch0")[:4096].cpu(), pattern(4096, 9))
    finally:
        t.close()
        proc.close()
