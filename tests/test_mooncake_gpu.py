"""Mooncake's nvlink_intra protocol between two processes: GPU memory to GPU memory over CUDA IPC (gpu).

Needs a CUDA build of the engine (mooncake-transfer-engine-cuda13) and CUDA; the peer's memory is on
cuda:1 where there are two GPUs (NVLink on the H200 box), else on cuda:0 beside ours. Runs in
scripts/mooncake_gpu.sh before the benchmark.
"""

from __future__ import annotations

import pytest
import torch

from hawk.transport import Desc, available, make_transport
from tests.test_transport import (
    SENTINEL,
    STAGE_BYTES,
    PeerProcess,
    check_many_descriptors,
    check_read_channels,
    check_write_channels,
    hawk_regions,
    pattern,
    register_hawk_regions,
)


def _cuda_engine() -> bool:
    if not (torch.cuda.is_available() and available("mooncake")):
        return False
    from hawk.transport.mooncake_transport import _cuda_capable_build

    return _cuda_capable_build()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_engine(), reason="needs CUDA and Mooncake's CUDA build")]
ENGINE = "mooncake"
OPTIONS = {"protocol": "nvlink_intra", "transfer_timeout_s": 10}
MINE = "cuda:0"


def peer_device() -> str:
    return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


@pytest.fixture(scope="module")
def session():
    proc = PeerProcess(ENGINE, hawk_regions(2, peer_device()), OPTIONS)
    t = make_transport(ENGINE, **OPTIONS)
    register_hawk_regions(t, 1, MINE)
    t.register("big", torch.zeros(STAGE_BYTES, dtype=torch.uint8, device=MINE))
    peer = t.connect(proc.metadata)
    yield t, peer, proc
    t.close()
    proc.close()


def test_read_channels_gpu_to_gpu(session):
    t, peer, proc = session
    check_read_channels(t, peer, proc, peer_stage_seed=2)


def test_write_channels_gpu_to_gpu(session):
    t, peer, proc = session
    check_write_channels(t, peer, proc, my_stage_seed=1)


def test_3000_descriptors(session):
    t, peer, _ = session
    delta = check_many_descriptors(t, peer, 3000)
    assert delta["batches"] == 1 and delta["engine_requests"] == 3 and delta["completed"] == 1


def test_regions_sharing_an_allocation_survive_a_neighbour_deregistering(session):
    # Small tensors share one caching-allocator segment (one cudaMalloc): the engine registers it once.
    t, peer, _ = session
    a = torch.full((4096,), SENTINEL, dtype=torch.uint8, device=MINE)
    b = torch.full((4096,), SENTINEL, dtype=torch.uint8, device=MINE)
    t.register("a", a)
    t.register("b", b)
    t.deregister("a")
    t.transfer("READ", peer, [Desc("b", 0, "stage", 100, 4096)], timeout_s=10)
    torch.cuda.synchronize()
    assert torch.equal(b.cpu(), pattern(STAGE_BYTES, 2)[100:4196])
    t.deregister("b")


def test_peer_region_registered_after_connect_is_refused(session):
    t, peer, proc = session
    meta = proc.register("late", 8192, 9, peer_device())
    assert t.connect(meta) == peer
    with pytest.raises(ValueError, match="registered after"):
        t.submit("READ", peer, [Desc("big", 0, "late", 0, 4096)])


def test_host_regions_are_refused():
    t = make_transport(ENGINE, **OPTIONS)
    try:
        with pytest.raises(ValueError, match="CUDA memory only"):
            t.register("host", torch.zeros(64, dtype=torch.uint8))
    finally:
        t.close()
