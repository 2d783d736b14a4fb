"""The prefill and decode engines under load: continuous batching, admission by memory, aborts."""

import threading
import time
from dataclasses import replace

import pytest
import torch

from hawk.bench.equivalence import run_colocated
from hawk.engine.decode_engine import KVHandle, TokenEvent
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance
from hawk.engine.sequence import SamplingParams
from hawk.errors import BadRequest, DuplicateRequest, PromptTooLong


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiny(request):
    """``async``: the decode engines overlap their steps (the default on a GPU) on the CPU too."""
    torch.set_num_threads(1)
    cfg = InstanceConfig(model="tiny", transfer="gn-hawk", transport="local", kv_tokens=512, staging_mb=8, rx_mb=8,
                         async_scheduling=request.param)
    p = PrefillInstance(replace(cfg, kv_tokens=2048))  # room for every prompt's KV while it waits to be pulled
    d = DecodeInstance(cfg)  # 512 tokens = 8 NPU blocks of 64
    c = ColocatedInstance(InstanceConfig(model="tiny", transfer="colocated", kv_tokens=2048, async_scheduling=request.param),
                          loaded=p.loaded)
    yield p, d, c
    p.close()
    d.close()
    c.close()


class Collector:
    def __init__(self):
        self.tokens, self.done, self.info = [], threading.Event(), {}

    def __call__(self, ev: TokenEvent):
        if ev.token is not None:
            self.tokens.append(ev.token)
        self.info.update(ev.info)
        if ev.finish_reason:
            self.info["finish_reason"], self.info["error"] = ev.finish_reason, ev.error
            self.done.set()


def _submit(p, d, rid, prompt, params):
    r = p.engine.submit(rid, prompt, params).result(60)
    col = Collector()
    d.engine.submit(rid, r.num_prompt_tokens, r.first_token, params, KVHandle(p.kv_address, rid), col)
    return col


def test_more_requests_than_memory_all_finish_in_batches(tiny):
    """12 requests growing to 2 NPU blocks each against 8 blocks: admitted by their prompt's block (so
    up to 7 start, one block kept as watermark), preempted by swap as they grow, the rest wait, all finish."""
    p, d, c = tiny
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(30 + i)] for i in range(12)]
    peak = {"running": 0, "waiting": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            s = d.engine.stats()
            peak["running"] = max(peak["running"], s["running"] + s["transferring"])
            peak["waiting"] = max(peak["waiting"], s["waiting"])
            time.sleep(0.002)

    w = threading.Thread(target=watch)
    w.start()
    # Prefill everything first, then hand all requests to decode at once, so memory is short for sure.
    done = [(f"load{i}", p.engine.submit(f"load{i}", x, params).result(60)) for i, x in enumerate(prompts)]
    cols = []
    for rid, r in done:
        col = Collector()
        d.engine.submit(rid, r.num_prompt_tokens, r.first_token, params, KVHandle(p.kv_address, rid), col)
        cols.append(col)
    for col in cols:
        assert col.done.wait(120), "a request never finished"
    stop.set()
    w.join()
    assert all(col.info["finish_reason"] == "length" and len(col.tokens) == 40 for col in cols)
    assert 4 < peak["running"] <= 8 and peak["waiting"] >= 1  # admitted by current need; admission made some wait
    # Batched GEMMs may round differently from single-request ones (batch variance), so compare in bulk.
    agree = total = 0
    for i, (x, col) in enumerate(zip(prompts, cols)):
        ref, _ = run_colocated(c, x, params, f"ref{i}")
        agree += sum(a == b for a, b in zip(col.tokens, ref))
        total += len(ref)
    assert agree / total >= 0.9
    time.sleep(0.1)
    assert d.accounting()["kv_blocks_used"] == 0 and d.accounting()["rx_reservations"] == 0
    assert p.accounting()["gpu_blocks_used"] == 0 and p.accounting()["staging_reservations"] == 0


def test_abort_frees_blocks_everywhere(tiny):
    p, d, _ = tiny
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    col = _submit(p, d, "long", list(range(1, 60)), params)
    while len(col.tokens) < 3:
        time.sleep(0.005)
    assert d.engine.abort("long")
    assert col.done.wait(10) and col.info["finish_reason"] == "abort"
    deadline = time.monotonic() + 5
    while d.accounting()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.accounting()["kv_blocks_used"] == 0
    assert not d.engine.abort("long")  # already gone


def test_impossible_requests_are_refused_up_front(tiny):
    p, d, _ = tiny
    with pytest.raises(BadRequest, match="empty"):
        p.engine.submit("e", [], SamplingParams())
    with pytest.raises(PromptTooLong, match="exceeds"):
        p.engine.submit("big", list(range(1, 100000)), SamplingParams())
    with pytest.raises(PromptTooLong, match="blocks"):
        d.engine.submit("x", 500, 1, SamplingParams(max_tokens=100), KVHandle(p.kv_address, "x"), Collector())
    with pytest.raises(BadRequest, match="positive"):
        d.engine.submit("z", 0, 1, SamplingParams(max_tokens=4), KVHandle(p.kv_address, "z"), Collector())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_kv_for_an_unknown_request_fails_that_request_only(tiny):
    p, d, _ = tiny
    col = Collector()
    d.engine.submit("ghost", 10, 5, SamplingParams(max_tokens=4), KVHandle(p.kv_address, "never-prefilled"), col)
    assert col.done.wait(20)
    assert col.info["finish_reason"] == "error" and "never-prefilled" in col.info["error"]
    ok = _submit(p, d, "fine", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert ok.done.wait(20) and len(ok.tokens) == 4


def test_a_block_cyclic_npu_layout_serves_the_same_tokens():
    """Another NPU page map is a layout description, not a code path: the same greedy tokens come out."""
    cfg = InstanceConfig(model="tiny", transfer="gn-hawk", transport="local", kv_tokens=512, staging_mb=8, rx_mb=8, npu_shard_pages=3)
    p = PrefillInstance(cfg)
    d = DecodeInstance(cfg)
    c = ColocatedInstance(InstanceConfig(model="tiny", transfer="colocated", kv_tokens=1024), loaded=p.loaded)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        prompt = [5, 17, 99, 3, 42] * 20
        col = _submit(p, d, "sharded", prompt, params)
        assert col.done.wait(60)
        ref, _ = run_colocated(c, prompt, params, "ref")
        assert col.tokens == ref
    finally:
        p.close()
        d.close()
        c.close()


# ---- robustness: one request's failure is that request's only ------------------------------


def _threads_alive(p, d):
    return p.engine.is_alive() and d.engine.is_alive()


def test_odd_sampling_params_are_served_and_the_engines_live(tiny):
    """Huge and negative seeds, vanishing and huge temperatures: answers, not dead threads."""
    p, d, _ = tiny
    odd = [
        SamplingParams(max_tokens=5, temperature=1e-45, seed=2**70, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.8, top_p=0.5, seed=-(2**70), ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1e300, seed=2**64, ignore_eos=True),
    ]
    cols = [_submit(p, d, f"odd{i}", [1, 2, 3, 4], params) for i, params in enumerate(odd)]
    for col in cols:
        assert col.done.wait(30) and col.info["finish_reason"] == "length" and len(col.tokens) == 5
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    ref = _submit(p, d, "odd-greedy", [1, 2, 3, 4], greedy)
    assert ref.done.wait(30) and cols[0].tokens == ref.tokens  # a vanishing temperature is greedy
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=2**70 + 3, ignore_eos=True)
    a, b = _submit(p, d, "seed-a", [9, 8, 7], seeded), _submit(p, d, "seed-b", [9, 8, 7], seeded)
    assert a.done.wait(30) and b.done.wait(30) and a.tokens == b.tokens  # same seed, same tokens
    assert _threads_alive(p, d)


def test_nan_logits_fail_only_that_request(tiny, monkeypatch):
    from hawk.engine.runner import StepOutput

    p, d, _ = tiny
    real = d.engine.runner.step

    def nan_for_victim(tokens, slices, **kw):
        out = real(tokens, slices, **kw)
        victim = d.engine._entries.get("victim")
        logits = out.logits.clone()
        for i, s in enumerate(slices):
            if victim is not None and list(s.block_ids) == victim.seq.block_ids:
                logits[i] = float("nan")
        return StepOutput(logits, None, out.path)

    monkeypatch.setattr(d.engine.runner, "step", nan_for_victim)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    victim = _submit(p, d, "victim", [5, 6, 7], params)
    other = _submit(p, d, "bystander", [5, 6, 8], params)
    assert victim.done.wait(30) and victim.info["finish_reason"] == "error" and "finite" in victim.info["error"]
    assert other.done.wait(30) and other.info["finish_reason"] == "length" and len(other.tokens) == 30
    monkeypatch.undo()
    assert _submit(p, d, "after-nan", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)).done.wait(30)
    assert _threads_alive(p, d)


def test_a_raising_callback_fails_only_its_request(tiny):
    p, d, _ = tiny

    class Raising(Collector):
        def __call__(self, ev):
            super().__call__(ev)
            if len(self.tokens) >= 2:
                raise RuntimeError("client went away")

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    r = p.engine.submit("raiser", [3, 3, 3], params).result(60)
    bad = Raising()
    d.engine.submit("raiser", r.num_prompt_tokens, r.first_token, params, KVHandle(p.kv_address, "raiser"), bad)
    good = _submit(p, d, "calm", [3, 3, 4], params)
    assert good.done.wait(30) and len(good.tokens) == 20
    deadline = time.monotonic() + 5
    while "raiser" in d.engine._entries and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "raiser" not in d.engine._entries and len(bad.tokens) == 2
    assert _threads_alive(p, d)


def test_a_first_token_failure_fails_that_prefill_and_frees_its_blocks(tiny, monkeypatch):
    from hawk.engine.sampler import NonFiniteLogits
    from hawk.errors import EngineFailure

    p, d, _ = tiny
    real = p.engine.runner.forward
    marker = [77, 77, 77, 77, 77]

    def nan_for_marker(tokens, slices):
        logits = real(tokens, slices).clone()
        for i, t in enumerate(tokens):
            if list(t) == marker:
                logits[i] = float("nan")
        return logits

    monkeypatch.setattr(p.engine.runner, "forward", nan_for_marker)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    bad = p.engine.submit("marked", marker, params)
    with pytest.raises(EngineFailure) as failed:  # the engine's fault, named; the cause kept
        bad.result(60)
    assert isinstance(failed.value.__cause__, NonFiniteLogits)
    monkeypatch.undo()
    deadline = time.monotonic() + 5
    while p.accounting()["gpu_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.accounting()["gpu_blocks_used"] == 0
    ok = p.engine.submit("unmarked", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, seed=2**80)).result(60)
    assert ok.first_token >= 0
    assert _threads_alive(p, d)


def test_a_request_id_in_use_is_refused_by_name(tiny):
    """A second decode of a live id, and KV offered twice under one id, raise DuplicateRequest where
    found (the server maps that class to 409 without reading messages)."""
    p, d, _ = tiny
    col = _submit(p, d, "dup", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    with pytest.raises(DuplicateRequest, match="already being decoded"):
        d.engine.submit("dup", 3, 5, SamplingParams(max_tokens=4), KVHandle(p.kv_address, "dup"), Collector())
    assert d.engine.abort("dup") and col.done.wait(10)
    p.sender.add("twice", 4, [], None)
    with pytest.raises(DuplicateRequest, match="already has KV waiting"):
        p.sender.add("twice", 4, [], None)
    assert p.sender.discard("twice")
