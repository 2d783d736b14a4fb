"""Layer-wise requests that wait for the prefill: whole instances (tiny model, CPU).

In the layer-wise flow the decode admits a request before its prefill runs and waits, holding its
blocks, until the prefill's forward pushes the KV. That wait lasts as long as the prefill's queue.
Two things broke under load: each waiting request held one of the decode's few transfer threads,
so only that many requests could ever reach the prefill (the rest stayed queued on the decode,
undelivered to a prefill that could have batched them), and a wait longer than the KV TTL (or the
receiver's timeout) failed the request although both instances were healthy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from hawk.bench.equivalence import run_colocated
from hawk.engine.decode_engine import KVPush, TokenEvent
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance
from hawk.engine.sequence import SamplingParams

N = 10  # more than the decode's transfer threads (4)
TTL_S = 0.6
BASE = InstanceConfig(model="tiny", transport="local", kv_tokens=2048, staging_mb=8, rx_mb=8, kv_flow="layerwise", kv_ttl_s=TTL_S)


class Tokens:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.finish_reason is not None:
            self.error = ev.error
            self.done.set()


@pytest.mark.parametrize("transfer", ["gn-hawk", "gg-direct"])
def test_many_requests_wait_out_a_long_prefill_queue(transfer):
    cfg = replace(BASE, transfer=transfer, decode_device="npu-emu:cpu" if transfer == "gn-hawk" else "cpu")
    p = PrefillInstance(cfg)
    d = DecodeInstance(cfg, loaded=p.loaded)
    colo = ColocatedInstance(replace(cfg, transfer="colocated", kv_flow="pull"), loaded=p.loaded)
    d.rank.receiver.timeout_s = 2 * TTL_S  # each ask for the outcome is short; the queue is longer
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[3 + (7 * i + j) % 200 for j in range(20 + 9 * i)] for i in range(N)]
    try:
        handles, outs = [], []
        for i, ids in enumerate(prompts):
            h, out = KVPush(p.kv_address, f"r{i}"), Tokens()
            d.engine.submit(f"r{i}", len(ids), 0, params, h, out)
            handles.append(h)
            outs.append(out)
        # every request reaches the prefill (hands its blocks over), none waits for another's push
        for h in handles:
            assert h.handed.wait(10), f"{h.request_id} never handed its blocks to the prefill"
        assert d.engine.stats()["transferring"] == N
        time.sleep(5 * TTL_S)  # the prefill's queue: longer than the TTL and the receiver's timeout
        assert p.sender.accounting()["pushes"] == sorted(f"r{i}" for i in range(N))  # still wanted
        futures = [p.engine.submit(f"r{i}", ids, params) for i, ids in enumerate(prompts)]  # one queue
        for h, f in zip(handles, futures):
            h.first_token.set_result(f.result(60).first_token)
        for i, out in enumerate(outs):
            assert out.done.wait(60) and out.error is None, (i, out.error)
            want, _ = run_colocated(colo, prompts[i], params, f"c{i}")
            assert out.tokens == want, i
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (p.sender.accounting()["pushes"] or d.blocks.num_free != d.blocks.num_blocks):
            time.sleep(0.05)
        assert not p.sender.accounting()["pushes"] and d.blocks.num_free == d.blocks.num_blocks
    finally:
        colo.close()
        d.close()
        p.close()


def test_closing_the_decode_ends_waits_for_a_queued_prefill():
    """A decode closed while its layer-wise requests wait for the prefill ends at once (their waits
    are cancelled), and the prefill forgets their destinations."""
    cfg = replace(BASE, transfer="gn-hawk", decode_device="npu-emu:cpu")
    p = PrefillInstance(cfg)
    d = DecodeInstance(cfg, loaded=p.loaded)
    try:
        outs = []
        for i in range(3):
            h, out = KVPush(p.kv_address, f"q{i}"), Tokens()
            d.engine.submit(f"q{i}", 30, 0, SamplingParams(max_tokens=2), h, out)
            assert h.handed.wait(10)
            outs.append(out)
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5
        while p.sender.accounting()["pushes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not p.sender.accounting()["pushes"]
    finally:
        d.close()
        p.close()


def test_aborting_a_request_that_waits_for_the_prefill_ends_it_at_once():
    """The decode aborts a handed-over request whose prefill has not run: its wait ends at once
    (the prefill hears D9 and forgets the destination), and its blocks come back."""
    cfg = replace(BASE, transfer="gn-hawk", decode_device="npu-emu:cpu")
    p = PrefillInstance(cfg)
    d = DecodeInstance(cfg, loaded=p.loaded)
    d.rank.receiver.timeout_s = 30.0  # ending by a timeout would show here
    try:
        h, out = KVPush(p.kv_address, "a"), Tokens()
        d.engine.submit("a", 30, 0, SamplingParams(max_tokens=2), h, out)
        assert h.handed.wait(10)
        t0 = time.monotonic()
        assert d.engine.abort("a")
        assert out.done.wait(5) and time.monotonic() - t0 < 5
        deadline = time.monotonic() + 5
        while (p.sender.accounting()["pushes"] or d.blocks.num_free != d.blocks.num_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not p.sender.accounting()["pushes"] and d.blocks.num_free == d.blocks.num_blocks
    finally:
        d.close()
        p.close()
