"""Algorithm 1 between two processes over real engines (NIXL, Mooncake) on loopback, and a peer that dies."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from hawk.connector.algorithm1 import KVSender, KVTransferFailed
from hawk.transport.registry import available, make_transport
from tests.kv_fixtures import dst_blocks_for

os.environ.setdefault("UCX_NET_DEVICES", "lo")


class SlowPushSender(KVSender):
    """Takes its time before posting a push, so a test can kill it mid-transfer."""

    def _push(self, msg):
        time.sleep(30)
        return super()._push(msg)


def _prefill_child(conn, config: str, transport: str, slow: bool, device: str = "cpu") -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    from hawk.connector import configs
    from tests.kv_fixtures import make_source_sender, sources

    src, caches, src_kv = sources(config, 0, device)  # the same KV the decode side's fixture expects
    t = make_transport(transport)
    if slow:
        configs.KVSender = SlowPushSender  # type: ignore[attr-defined]
    sender = make_source_sender(config, t, src, caches, src_kv, ttl_s=60)
    conn.send(sender.address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "add":
            sender.add(*cmd[1:])
            conn.send("ok")
        elif cmd[0] == "acct":
            a = sender.accounting()
            conn.send({k: len(v) if isinstance(v, list) else v for k, v in a.items()})
        else:
            break
    sender.close()
    t.close()


def _start(config, transport, slow=False, device="cpu"):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_prefill_child, args=(child, config, transport, slow, device), daemon=True)
    p.start()
    assert parent.poll(60), "prefill child did not start"
    return p, parent, parent.recv()


def _receiver(config, transport, post="pull", timeout_s=10.0, device="cpu"):
    from tests.kv_fixtures import make_pair

    # Reuse the fixture's decode side; its own in-process sender stays idle.
    pair = make_pair(config, make_transport(transport), make_transport(transport), post=post, timeout_s=timeout_s, device=device)
    return pair


ENGINES = [e for e in ("nixl", "mooncake") if available(e)]


@pytest.mark.parametrize("transport", ENGINES)
@pytest.mark.parametrize("config", ["gn-hawk", "gg-direct", "ng-hawk"])
def test_two_processes_move_the_kv(transport, config):
    proc, conn, address = _start(config, transport)
    pair = _receiver(config, transport)
    try:
        for i, (tokens, gblocks) in enumerate([(150, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (33, [12, 5, 9])]):
            conn.send(("add", f"r{i}", tokens, gblocks))
            assert conn.recv() == "ok"
            dst = dst_blocks_for(config, tokens, start=2)
            res = pair.receiver.pull(address, f"r{i}", dst)
            assert pair.landed(tokens, gblocks, dst), "bytes did not arrive intact where the plan put them"
            if (config == "gn-hawk" and res.mode == "staging") or config == "ng-hawk":
                assert res.requests == 8  # one request per p150a channel
        conn.send(("acct",))
        acct = conn.recv()
        deadline = time.monotonic() + 5
        while (acct["staging"] or acct["in_flight"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            conn.send(("acct",))
            acct = conn.recv()
        assert acct["staging"] == 0 and acct["in_flight"] == 0 and acct["waiting"] == 0
        assert pair.receiver.accounting() == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}
    finally:
        conn.send(("stop",))
        proc.join(20)
        pair.close()


@pytest.mark.parametrize("transport", ENGINES[:1])
def test_prefill_killed_mid_transfer_releases_decode_side(transport):
    """The decode side holds per-channel reservations (D3) when the prefill dies before the push lands.
    The pull waits on a 30 s timeout, yet fails within seconds: the dead process's port refuses connections."""
    proc, conn, address = _start("gn-hawk", transport, slow=True)
    pair = _receiver("gn-hawk", transport, post="push", timeout_s=30.0)
    pair.receiver.landing.mode = "staging"
    try:
        conn.send(("add", "r", 100, [0, 1, 2, 3, 4, 5, 6]))
        assert conn.recv() == "ok"
        killer = mp.get_context("spawn").Process(target=_kill_later, args=(proc.pid, 0.5))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(KVTransferFailed, match="refuses connections"):
            pair.receiver.pull(address, "r", [0, 1])
        assert time.monotonic() - t0 < 8
        killer.join(10)
        proc.join(5)
        assert not proc.is_alive()
        deadline = time.monotonic() + pair.td.drain_s + 5
        while pair.receiver.accounting()["draining"] and time.monotonic() < deadline:
            time.sleep(0.1)
            pair.receiver.reap()
        assert pair.receiver.accounting() == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}
        # The decode side keeps working with a new prefill.
        proc2, conn2, address2 = _start("gn-hawk", transport)
        try:
            conn2.send(("add", "r2", 40, [5, 6, 7]))
            assert conn2.recv() == "ok"
            pair.receiver.post = "pull"
            pair.receiver.pull(address2, "r2", [3])
            assert pair.landed(40, [5, 6, 7], [3])
        finally:
            conn2.send(("stop",))
            proc2.join(20)
    finally:
        if proc.is_alive():
            proc.kill()
        pair.close()


def _kill_later(pid: int, delay: float) -> None:
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.gpu
@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("kind", ["pull", "layerwise"])
@pytest.mark.parametrize("config", ["gn-hawk", "gg-direct"])
def test_gpu_two_processes_one_gpu_write_the_pages_themselves(config, direct, kind, monkeypatch):
    """gn-hawk (and gg-direct's pull) between two processes on one GPU (auto -> cuda-ipc): the prefill
    writes the decode's memory itself through CUDA IPC (a landed pull, a direct layer-wise push), or
    stages / lets the decode READ (HAWK_DIRECT_WRITE=0); the bytes land either way and nothing stays
    held on either side."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if config == "gg-direct" and kind == "layerwise":
        pytest.skip("gg-direct's layer-wise push posts its blocks as WRITEs")
    monkeypatch.setenv("HAWK_DIRECT_WRITE", direct)  # the child inherits it (spawned after this)
    proc, conn, address = _start(config, "auto", device="cuda:0")
    pair = _receiver(config, "auto", device="cuda:0")
    try:
        for i, (tokens, gblocks) in enumerate([(150, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (33, [12, 5, 9])]):
            dst = dst_blocks_for(config, tokens, start=2 * i)
            if kind == "pull":
                conn.send(("add", f"r{i}", tokens, gblocks))
                assert conn.recv() == "ok"
                res = pair.receiver.pull(address, f"r{i}", dst)
            else:  # the destination first; the prefill already finished, so it pushes the request whole
                conn.send(("add", f"r{i}", tokens, gblocks))
                assert conn.recv() == "ok"
                res = pair.receiver.push_to(address, f"r{i}", dst, tokens)
            assert pair.landed(tokens, gblocks, dst), "bytes did not arrive intact where the plan put them"
            assert (res.requests == 0) == (direct == "1"), res  # written by the transform: no transport request
            if kind == "pull":
                assert (res.mode == "landed") == (direct == "1")
                if direct == "1":  # D2 left while the transform ran; D7 waited on the prefill's CUDA IPC event
                    assert "transfer_wait_s" in res.timings, res.timings
        conn.send(("acct",))
        acct = conn.recv()
        deadline = time.monotonic() + 5
        while (acct["staging"] or acct["in_flight"] or acct["pushes"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            conn.send(("acct",))
            acct = conn.recv()
        assert acct["staging"] == 0 and acct["in_flight"] == 0 and acct["waiting"] == 0 and acct["pushes"] == 0
        assert pair.receiver.accounting() == {"reservations": [], "draining": 0, "expecting": [], "waiting_for_room": []}
    finally:
        conn.send(("stop",))
        proc.join(20)
        pair.close()
