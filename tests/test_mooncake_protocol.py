"""Mooncake protocol selection (tcp / rdma / nvlink_intra) against a fake engine: no Mooncake needed.

The real engines run in test_transport_mooncake.py (TCP, loopback) and test_mooncake_gpu.py (nvlink_intra,
CUDA, marked gpu). Here: which steering variable each protocol sets around ``initialize``, the default from
HAWK_MOONCAKE_PROTOCOL, protocol checks at connect, nvlink_intra's per-allocation registration counts and
its refusal of peer regions the engine has not cached.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import pytest
import torch

import hawk.transport.mooncake_transport as mt
from hawk.transport import ConnectError, TransportError, TransportUnavailable
from hawk.transport.base import METADATA_VERSION, RegionInfo, Segment

STEERING = ("MC_FORCE_TCP", "MC_FORCE_HCA", "MC_INTRANODE_NVLINK", "MC_FORCE_MNNVL")


class FakeEngine:
    """The calls MooncakeTransport makes, recorded; ``initialize`` snapshots the steering variables."""

    instances: list[FakeEngine] = []
    init_rc = 0

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.env_at_init: dict[str, str | None] = {}
        FakeEngine.instances.append(self)

    def initialize(self, host: str, metadata: str, protocol: str, device: str) -> int:
        self.env_at_init = {k: os.environ.get(k) for k in STEERING}
        self.calls.append(("initialize", host, metadata, protocol, device))
        return FakeEngine.init_rc

    def get_rpc_port(self) -> int:
        return 15000 + len(FakeEngine.instances)

    def register_memory(self, addr: int, length: int, location: str) -> int:
        self.calls.append(("register", addr, length, location))
        return 0

    def unregister_memory(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0

    def send_probe(self, segment: str) -> int:
        self.calls.append(("probe", segment))
        return 0

    def get_first_buffer_address(self, segment: str) -> int:
        self.calls.append(("fetch", segment))
        return 0

    def batch_transfer_async_read(self, *a: Any) -> int:
        return 1

    batch_transfer_async_write = batch_transfer_async_read

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        return 0

    def named(self, what: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == what]


@pytest.fixture
def fake(monkeypatch):
    FakeEngine.instances.clear()
    FakeEngine.init_rc = 0
    monkeypatch.setattr(mt, "_load_engine", lambda: FakeEngine)
    monkeypatch.setattr(mt, "_CUDA_BUILD", True)
    for k in (*STEERING, mt.DEFAULT_PROTOCOL_ENV):
        monkeypatch.delenv(k, raising=False)
    made: list[mt.MooncakeTransport] = []

    def make(**kw: Any) -> mt.MooncakeTransport:
        t = mt.MooncakeTransport(**kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("protocol", mt.PROTOCOLS)
def test_each_protocol_sets_only_its_variable_around_initialize(fake, protocol):
    t = fake(protocol=protocol)
    eng = FakeEngine.instances[-1]
    assert eng.named("initialize") == [("initialize", "127.0.0.1", "P2PHANDSHAKE", protocol, "")]
    want = mt.PROTOCOL_ENV[protocol]
    assert {k: v for k, v in eng.env_at_init.items() if v is not None} == {want: "1"}
    assert all(os.environ.get(k) is None for k in STEERING)  # restored: nothing leaks to other engines
    assert t.protocol == protocol


def test_user_steering_variables_are_restored(fake, monkeypatch):
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    monkeypatch.setenv("MC_FORCE_MNNVL", "yes")
    fake(protocol="tcp")
    eng = FakeEngine.instances[-1]
    assert eng.env_at_init["MC_FORCE_TCP"] == "1" and eng.env_at_init["MC_INTRANODE_NVLINK"] is None
    assert eng.env_at_init["MC_FORCE_MNNVL"] is None
    assert os.environ["MC_INTRANODE_NVLINK"] == "1" and os.environ["MC_FORCE_MNNVL"] == "yes"
    assert "MC_FORCE_TCP" not in os.environ


def test_default_protocol_comes_from_the_environment(fake, monkeypatch):
    assert fake().protocol == "tcp"
    monkeypatch.setenv(mt.DEFAULT_PROTOCOL_ENV, "nvlink_intra")
    assert fake().protocol == "nvlink_intra"
    assert fake(protocol="tcp").protocol == "tcp"  # an explicit protocol wins


def test_unknown_protocol_is_refused(fake, monkeypatch):
    with pytest.raises(ValueError, match="'nvlink'.*tcp, rdma, nvlink_intra"):
        fake(protocol="nvlink")
    monkeypatch.setenv(mt.DEFAULT_PROTOCOL_ENV, "cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        fake()


def test_nvlink_intra_needs_a_cuda_build(fake, monkeypatch):
    monkeypatch.setattr(mt, "_CUDA_BUILD", False)
    with pytest.raises(TransportUnavailable, match="nvlink_intra.*CUDA build"):
        fake(protocol="nvlink_intra")
    assert fake(protocol="tcp").protocol == "tcp"


def test_failed_initialize_names_the_protocol(fake):
    FakeEngine.init_rc = -1
    with pytest.raises(TransportError, match="nvlink_intra.*returned -1.*Unsupported transport"):
        fake(protocol="nvlink_intra")


def test_cuda_build_is_read_from_the_engine_file(monkeypatch, tmp_path):
    import sys
    import types

    for content, want in ((b"\x7fELF...libcudart.so.13\x00...", True), (b"\x7fELF...libc.so.6\x00", False)):
        so = tmp_path / f"engine{int(want)}.so"
        so.write_bytes(content)
        pkg = types.ModuleType("mooncake.engine")
        pkg.__file__ = str(so)
        monkeypatch.setitem(sys.modules, "mooncake.engine", pkg)
        monkeypatch.setattr(mt, "_CUDA_BUILD", None)
        assert mt._cuda_capable_build() is want


# ----------------------------------------------------------------------------------- metadata
def blob(segment_md: bytes, regions: dict[str, list[Any]], agent: str = "peer-1") -> bytes:
    doc = {
        "hawk_transport": METADATA_VERSION,
        "engine": "mooncake",
        "agent": agent,
        "host": "h",
        "pid": 1,
        "regions": regions,
        "engine_md": segment_md,
    }
    return msgpack.packb(doc, use_bin_type=True)


def test_engine_metadata_carries_the_protocol():
    md = mt.encode_engine_md("127.0.0.1:123", "nvlink_intra")
    assert mt.decode_engine_md(md) == ("127.0.0.1:123", "nvlink_intra")
    assert mt.decode_engine_md(b"127.0.0.1:123") == ("127.0.0.1:123", "tcp")  # older blobs: a bare segment


def test_protocol_mismatch_is_a_connect_error(fake):
    t = fake(protocol="tcp")
    with pytest.raises(ConnectError, match="'nvlink_intra'.*'tcp'"):
        t.connect(blob(mt.encode_engine_md("127.0.0.1:9", "nvlink_intra"), {"s": [4096, 64, "cpu", -1]}))
    peer = t.connect(blob(b"127.0.0.1:9", {"s": [4096, 64, "cpu", -1]}))  # a bare segment is TCP
    assert peer == "127.0.0.1:9"
    assert FakeEngine.instances[-1].named("fetch") == []  # TCP: no segment fetch at connect


# ------------------------------------------------------------------------------- nvlink_intra
def cuda_region(name: str, addr: int, length: int, dev: int = 0) -> RegionInfo:
    return RegionInfo(name, addr, length, "cuda", dev)


def test_nvlink_intra_refuses_host_regions(fake):
    t = fake(protocol="nvlink_intra")
    with pytest.raises(ValueError, match="nvlink_intra.*CUDA memory only"):
        t.register("host", torch.zeros(64, dtype=torch.uint8))
    assert FakeEngine.instances[-1].named("register") == []


def test_nvlink_intra_counts_regions_per_allocation(fake, monkeypatch):
    # Two regions in one cudaMalloc allocation (base 0x1000), one alone (base 0x9000).
    monkeypatch.setattr(mt, "_alloc_range", lambda info: (0x1000 if info.addr < 0x9000 else 0x9000, 0x8000))
    t = fake(protocol="nvlink_intra")
    eng = FakeEngine.instances[-1]
    a, b, c = cuda_region("a", 0x1000, 256), cuda_region("b", 0x2000, 256), cuda_region("c", 0x9000, 256, 1)
    tokens = {r.name: t._engine_register(r, torch.empty(0)) for r in (a, b, c)}
    assert eng.named("register") == [("register", 0x1000, 256, "cuda:0"), ("register", 0x9000, 256, "cuda:1")]
    t._engine_deregister(a, tokens["a"])
    assert eng.named("unregister") == []  # "b" still lives in that allocation: the engine keeps it
    t._engine_deregister(b, tokens["b"])
    t._engine_deregister(c, tokens["c"])
    assert eng.named("unregister") == [("unregister", 0x2000), ("unregister", 0x9000)]
    assert t._allocs == {}


def test_nvlink_intra_fetches_the_peer_at_connect_and_refuses_later_regions(fake):
    t = fake(protocol="nvlink_intra")
    eng = FakeEngine.instances[-1]
    md = mt.encode_engine_md("127.0.0.1:77", "nvlink_intra")
    peer = t.connect(blob(md, {"stage": [0x10000, 4096, "cuda", 1]}))
    assert eng.named("probe") == [("probe", "127.0.0.1:77")] and eng.named("fetch") == [("fetch", "127.0.0.1:77")]
    local = cuda_region("ch0", 0x5000, 4096)
    stage = cuda_region("stage", 0x10000, 4096, 1)
    t._engine_validate(t._peer(peer), [Segment(local, 0, stage, 0, 64), Segment(local, 64, stage, 64, 64)])
    # The peer registers "late" and sends new metadata: same engine_md, so the region table is refreshed
    # but the engine's cached segment is not; a descriptor into "late" must not reach the engine.
    assert t.connect(blob(md, {"stage": [0x10000, 4096, "cuda", 1], "late": [0x90000, 4096, "cuda", 1]})) == peer
    late = cuda_region("late", 0x90000, 4096, 1)
    with pytest.raises(ValueError, match="'late'.*registered after"):
        t._engine_validate(t._peer(peer), [Segment(local, 0, stage, 0, 64), Segment(local, 0, late, 0, 64)])
    assert eng.named("fetch") == [("fetch", "127.0.0.1:77")]


def test_tcp_does_not_restrict_peer_regions(fake):
    t = fake(protocol="tcp")
    md = mt.encode_engine_md("127.0.0.1:78", "tcp")
    peer = t.connect(blob(md, {"stage": [0x10000, 4096, "cpu", -1]}))
    t.connect(blob(md, {"stage": [0x10000, 4096, "cpu", -1], "late": [0x90000, 4096, "cpu", -1]}))
    local = RegionInfo("ch0", 0x5000, 4096, "cpu", -1)
    t._engine_validate(t._peer(peer), [Segment(local, 0, RegionInfo("late", 0x90000, 4096, "cpu", -1), 0, 64)])
