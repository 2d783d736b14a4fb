"""The simulator's prefill staging buffer: bytes held from P4 until the KV has landed, first come first served;
the paged blocks are free from P6, when the KV is staged."""

import pytest
import simpy

from hawk.sim.calibration import TransferCurve
from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.request import SimRequest
from hawk.sim.staging import StagingPool
from hawk.sim.transfer import KVTransferService
from hawk.sim.workload import RequestSpec


def test_the_pool_serves_in_arrival_order():
    env = simpy.Environment()
    pool = StagingPool(env, 10)
    a, b, c = pool.acquire(6), pool.acquire(6), pool.acquire(3)
    assert a.triggered and not b.triggered
    assert not c.triggered  # 3 bytes are free, but c came after b
    pool.release(6)
    assert b.triggered and c.triggered and pool.used == 9
    pool.release(6)
    pool.release(3)
    assert pool.used == 0 and pool.peak_queue == 2


def test_a_request_larger_than_the_buffer_takes_it_whole():
    env = simpy.Environment()
    pool = StagingPool(env, 10)
    assert pool.acquire(25).triggered and pool.used == 10
    assert not pool.acquire(1).triggered


def _landed_at(staging_bytes, sizes, starts):
    """When each request's KV lands: a 1 s/byte transfer curve, no link contention."""
    env = simpy.Environment()
    svc = KVTransferService(env, TransferCurve("lin", (1.0, 100.0), (1.0, 100.0)), 1, scope="none", staging_bytes=staging_bytes)
    out = {}

    def go(i, r, start):
        yield env.timeout(start)
        yield from svc.move(r)
        out[i] = env.now

    for i, (n, t) in enumerate(zip(sizes, starts)):
        env.process(go(i, SimRequest(RequestSpec(i, t, n, 1), prefill=0, decode=0), t))
    env.run()
    return [out[i] for i in range(len(sizes))]


def test_transfers_queue_for_staging_and_overlap_without_a_limit():
    assert _landed_at(None, [10, 10], [0, 0]) == [pytest.approx(10), pytest.approx(10)]
    # room for one: the second waits for the first to land (10 s), then takes its own 10 s
    assert _landed_at(15, [10, 10], [0, 0]) == [pytest.approx(10), pytest.approx(20)]
    # room for both: as unlimited
    assert _landed_at(20, [10, 10], [0, 1]) == [pytest.approx(10), pytest.approx(11)]


def _prefill_starts(staging_bytes):
    """Two 10-token prompts at t=0 on a prefill that holds one prompt's KV: 1 s prefills, a 1 s/byte
    transfer (10 s a request), no link contention."""
    cfg = SimConfig("p6", TransferCurve("lin", (1.0, 100.0), (1.0, 100.0)),
                    PrefillModel(0.0, 0.1, max_batch_tokens=10, kv_capacity_tokens=10),
                    DecodeModel(0.0, 0.0, 0.0, max_batch=8), bytes_per_token=1, contention="none",
                    staging_bytes=staging_bytes)
    reqs = [SimRequest(RequestSpec(i, 0.0, 10, 1)) for i in range(2)]
    Cluster(cfg).run(reqs)
    return [r.t_prefill_start for r in reqs], [r.t_first for r in reqs]


def test_a_staged_pull_frees_the_prefills_blocks_as_it_is_staged():
    """P6: once a pull's KV is in the prefill's staging, its paged blocks are reused, so the next prompt
    is prefilled while the first crosses; without staging (direct reads) the blocks are read until the
    KV lands, and the next prefill waits for that."""
    starts, firsts = _prefill_starts(100)
    assert starts == [pytest.approx(0.0), pytest.approx(1.0)]
    assert firsts == [pytest.approx(11.0), pytest.approx(12.0)]
    starts, firsts = _prefill_starts(None)
    assert starts == [pytest.approx(0.0), pytest.approx(11.0)]
    assert firsts == [pytest.approx(11.0), pytest.approx(22.0)]
