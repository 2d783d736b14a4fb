"""NIXL (UCX) between two processes over loopback: bytes, offsets, request counts, faults."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only (children inherit it)

import pytest
import torch

from hawk.transport import Desc, available, make_transport
from tests.test_transport import (
    STAGE_BYTES,
    PeerProcess,
    check_invalid,
    check_many_descriptors,
    check_peer_killed,
    check_read_channels,
    check_write_channels,
    hawk_regions,
    pattern,
    register_hawk_regions,
)

pytestmark = pytest.mark.skipif(not available("nixl"), reason="nixl is not installed")
ENGINE = "nixl"


def test_peer_killed_mid_session():
    # Runs first, before the module's session fixture exists: on a 2-core box every live NIXL agent
    # keeps one core busy (its progress thread spins), which slows spawning a new peer process ~5x.
    check_peer_killed(ENGINE)


@pytest.fixture(scope="module")
def session():
    proc = PeerProcess(ENGINE, hawk_regions(2))
    t = make_transport(ENGINE)
    register_hawk_regions(t, 1)
    t.register("big", torch.zeros(STAGE_BYTES, dtype=torch.uint8))
    peer = t.connect(proc.metadata)
    yield t, peer, proc
    t.close()
    proc.close()


def test_read_one_batch_of_channel_requests(session):
    t, peer, proc = session
    check_read_channels(t, peer, proc, peer_stage_seed=2)


def test_write_one_batch_of_channel_requests(session):
    t, peer, proc = session
    check_write_channels(t, peer, proc, my_stage_seed=1)


@pytest.mark.parametrize("as_array", [False, True])
def test_many_small_descriptors_are_one_request(session, as_array):
    t, peer, _ = session
    delta = check_many_descriptors(t, peer, 3000, as_array=as_array)
    assert delta["batches"] == 1 and delta["descriptors"] == 3000 and delta["engine_requests"] == 1
    assert delta["bytes"] == 3000 * 512 and delta["completed"] == 1


def test_invalid_descriptors(session):
    t, peer, _ = session
    check_invalid(t, peer)


def test_reconnect_refreshes_peer_regions(session):
    t, peer, proc = session
    meta = proc.register("late", 8192, 9)
    assert t.connect(meta) == peer  # same peer id: idempotent, and it now knows "late"
    t.transfer("READ", peer, [Desc("big", 0, "late", 100, 8000)], timeout_s=10)
    assert torch.equal(t.tensor("big")[:8000], pattern(8192, 9)[100:8100])


def test_metadata_carries_region_table(session):
    t, peer, _ = session
    regions = t.remote_regions(peer)
    assert regions["stage"].length == STAGE_BYTES and regions["stage"].device == "cpu"
    assert {f"ch{c}" for c in range(8)} <= set(regions)


def test_a_paused_agent_config_keeps_its_delay_against_the_wrappers_zero():
    """NIXL's wrapper sets ``pthrDelay = 0`` on every agent config (a progress thread that never pauses keeps a
    core busy): the config HAWK's agents use keeps the pause; other configs are untouched."""
    import nixl._api as api

    from hawk.transport.nixl_transport import _delayed_config, pause_progress_threads

    base = api.nixlBind.nixlAgentConfig
    paused = _delayed_config(base, 200)(True)
    paused.pthrDelay = 0
    assert paused.pthrDelay == 200
    plain = base(True)
    plain.pthrDelay = 0
    assert plain.pthrDelay == 0
    assert pause_progress_threads(0) == 0 and api.nixlBind.nixlAgentConfig is base  # 0: nothing changed


def test_the_benchmarks_sitecustomize_pauses_every_agent_of_a_process():
    """hawk bench vllm-pd's vllm-nixl-paused starts vLLM with nixl_pause/ first on PYTHONPATH: every NIXL agent
    config made in that process, vLLM's NixlConnector's included, then keeps a pause."""
    import subprocess
    import sys

    from hawk.bench.vllm_pd import NIXL_PAUSE_DIR

    code = ("import nixl._api as api\nc = api.nixlBind.nixlAgentConfig(True)\nc.pthrDelay = 0\nprint(c.pthrDelay)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(NIXL_PAUSE_DIR), os.environ.get("PYTHONPATH")])),
           "HAWK_NIXL_PROGRESS_DELAY_US": "150", "UCX_MODULES": "^ib*"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["150"], out.stderr[-2000:]
