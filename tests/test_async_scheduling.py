"""Overlapped decode steps (async scheduling): the same tokens as a synchronous loop, and no block
freed while a step that may still write it is in flight.

On a GPU the overlap is the default; here (CPU) it is switched on, so the engine's bookkeeping runs
the same code: step N+1 launched on step N's device tokens before they are read, sequences that
finish at step N riding along in step N+1 (and the rest chaining on past them), any other change to
the batch draining the step in flight.
"""

import threading
from dataclasses import replace

import pytest
import torch

from hawk.engine.decode_engine import KVHandle, TokenEvent
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance
from hawk.engine.sequence import SamplingParams
from tests.blocks import blocks_back

CFG = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=1024)


class Collector:
    def __init__(self):
        self.tokens, self.done, self.reason = [], threading.Event(), None

    def __call__(self, ev: TokenEvent):
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.finish_reason:
            self.reason = ev.finish_reason
            self.done.set()


class Spy:
    """Counts the steps launched on device ids, and checks every block release against the step in flight."""

    def __init__(self, engine):
        self.engine, self.chained, self.shrunk, self.deferred, self.early = engine, 0, 0, 0, []
        step, release, defer = engine.runner.step, engine.kv.release, engine._release

        def spy_step(tokens, slices, ids=None):
            self.chained += ids is not None
            f = engine._inflight  # still the step this one chains from
            self.shrunk += ids is not None and f is not None and ids.shape[0] < len(f.batch)
            return step(tokens, slices, ids=ids) if ids is not None else step(tokens, slices)

        def spy_release(seq):
            f = engine._inflight
            if f is not None and any(e.seq is seq for e in f.batch):
                self.early.append(seq.request_id)  # freed while a step holding its row runs
            return release(seq)

        def spy_defer(e):
            f = engine._inflight
            self.deferred += f is not None and f.holds(e)
            return defer(e)

        engine.runner.step, engine.kv.release, engine._release = spy_step, spy_release, spy_defer


class System:
    """A colocated instance, or a prefill and a decode instance joined by the local transport."""

    def __init__(self, cfg, loaded=None):
        if cfg.transfer == "colocated":
            self.c = ColocatedInstance(cfg, loaded=loaded)
            self.decode, self.blocks, self.loaded, self.parts = self.c.decode, self.c.blocks, self.c.loaded, [self.c]
            return
        self.p = PrefillInstance(replace(cfg, kv_tokens=4 * cfg.kv_tokens), loaded=loaded)
        self.d = DecodeInstance(cfg, loaded=self.p.loaded)
        self.decode, self.blocks, self.loaded, self.parts = self.d.engine, self.d.blocks, self.p.loaded, [self.p, self.d]

    def submit(self, rid, prompt, params, col):
        if hasattr(self, "c"):
            r = self.c.prefill.submit(rid, prompt, params).result(60)
            self.decode.submit(rid, r.num_prompt_tokens, r.first_token, params, self.c.take_blocks(rid), col)
        else:
            r = self.p.engine.submit(rid, prompt, params).result(60)
            self.decode.submit(rid, r.num_prompt_tokens, r.first_token, params, KVHandle(self.p.kv_address, rid), col)

    def close(self):
        for part in self.parts:
            part.close()


def _pair(cfg):
    sync = System(replace(cfg, async_scheduling=False))
    return sync, System(replace(cfg, async_scheduling=True), loaded=sync.loaded)


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    sync, overlap = _pair(CFG)
    yield sync, overlap
    sync.close()
    overlap.close()


def _run(inst, requests, abort_after=None):
    """Submit ``requests`` ``[(rid, prompt, params)]`` together; abort ``abort_after = (rid, n)``
    once it has n tokens. Returns each request's collector."""
    cols = {}
    for rid, prompt, params in requests:
        col = cols[rid] = Collector()
        if abort_after and rid == abort_after[0]:
            n, inner = abort_after[1], col

            def col(ev, inner=inner, rid=rid, n=n):  # noqa: PLW2901 - the wrapped collector
                inner(ev)
                if len(inner.tokens) == n:
                    threading.Thread(target=inst.decode.abort, args=(rid,)).start()

        inst.submit(rid, prompt, params, col)
    for c in cols.values():
        assert c.done.wait(60)
    return cols


def _requests(stop: dict[str, int] | None = None):
    stop = stop or {}
    out = []
    for i, n in enumerate([1, 2, 5, 9, 17, 24]):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=(stop[rid],) if rid in stop else ())
        out.append((rid, [(11 * i + 5 * j) % 200 + 3 for j in range(7 + 3 * i)], params))
    return out


def test_overlapped_steps_give_the_synchronous_tokens_and_free_blocks_only_after_their_step(engines):
    _same_tokens_and_late_frees(*engines)


@pytest.mark.gpu
@pytest.mark.parametrize("transfer", ["colocated", "gn-hawk"])
def test_on_a_gpu_overlapped_graph_steps_give_the_synchronous_tokens(transfer):
    """On a GPU the steps replay CUDA graphs (paged, and the emulated NPU's tiles in GPU memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = replace(CFG, transfer=transfer, dtype="bf16", prefill_device="cuda:0", transport="local",
                  decode_device="npu-emu:cuda:0", kv_tokens=1024, staging_mb=8, rx_mb=8)
    sync, overlap = _pair(cfg)
    try:
        assert overlap.decode.runner.use_graphs
        sync_default = System(replace(cfg, async_scheduling=None), loaded=sync.loaded)
        try:
            assert sync_default.decode.overlap  # a GPU overlaps by default
        finally:
            sync_default.close()
        _same_tokens_and_late_frees(sync, overlap)
    finally:
        sync.close()
        overlap.close()


def _same_tokens_and_late_frees(sync, overlap):
    assert not sync.decode.overlap and overlap.decode.overlap
    ref = _run(sync, _requests())
    # stop tokens that end r3 and r5 mid-run, while the others go on: their last step rides along
    stop = {"r3": ref["r3"].tokens[4], "r5": ref["r5"].tokens[10]}
    want = _run(sync, _requests(stop))
    assert want["r3"].reason == "stop" and want["r5"].reason == "stop"
    spy, before = Spy(overlap.decode), overlap.decode.stats()
    got = _run(overlap, _requests(stop))
    for rid, col in want.items():
        assert got[rid].tokens == col.tokens and got[rid].reason == col.reason, rid
    assert spy.chained > 0  # steps did launch on the previous step's device tokens
    assert spy.shrunk > 0  # also past a row that finished (its last step rode along): the others' ids picked on the device
    after = overlap.decode.stats()  # and the engine counts them (/metrics: hawk_decode_engine_steps_*)
    assert after["steps_overlapped"] - before["steps_overlapped"] == spy.chained
    assert after["steps_synchronous"] > before["steps_synchronous"] and sync.decode.stats()["steps_overlapped"] == 0
    assert spy.deferred > 0  # a sequence finished while the step after it was in flight ...
    assert spy.early == []  # ... and its blocks came back only after that step
    assert blocks_back(overlap, 5) and blocks_back(sync, 5)


def test_seeded_sampling_is_the_same_overlapped(engines):
    sync, overlap = engines
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=1234, ignore_eos=True)
    reqs = [("s0", [4, 5, 6, 7], params), ("s1", [9, 8, 7], replace(params, seed=7, max_tokens=5))]
    want, got = _run(sync, reqs), _run(overlap, reqs)
    assert {r: c.tokens for r, c in got.items()} == {r: c.tokens for r, c in want.items()}


def test_an_abort_mid_chain_frees_its_blocks_and_the_rest_go_on(engines):
    sync, overlap = engines
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    reqs = [("a-long", [3, 1, 4, 1, 5], long), ("a-other", [2, 7, 1, 8], SamplingParams(max_tokens=30, ignore_eos=True))]
    want = _run(sync, reqs)
    spy = Spy(overlap.decode)
    got = _run(overlap, reqs, abort_after=("a-long", 6))
    assert got["a-long"].reason == "abort" and 6 <= len(got["a-long"].tokens) < 60
    assert got["a-long"].tokens == want["a-long"].tokens[: len(got["a-long"].tokens)]
    assert got["a-other"].tokens == want["a-other"].tokens
    assert spy.early == [] and blocks_back(overlap, 5)


def test_a_failing_chained_step_fails_its_batch_and_the_engine_serves_on(engines, monkeypatch):
    _, overlap = engines
    real = overlap.decode.runner.step
    calls = {"n": 0}

    def fail_third_chained(tokens, slices, ids=None):
        if ids is not None:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected step failure")
            return real(tokens, slices, ids=ids)
        return real(tokens, slices)

    monkeypatch.setattr(overlap.decode.runner, "step", fail_third_chained)
    got = _run(overlap, [("f0", [5, 5, 5], SamplingParams(max_tokens=20, ignore_eos=True))])
    assert got["f0"].reason == "error" and calls["n"] == 3
    monkeypatch.undo()
    assert blocks_back(overlap, 5)
    after = _run(overlap, [("f1", [5, 5, 5], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert after["f1"].reason == "length" and len(after["f1"].tokens) == 4


def test_a_sequence_ending_at_the_context_length_rides_along_within_it():
    """Its last token's step is followed by a ride-along step at position max_model_len - 1: the
    last position, in a block it was always going to need."""
    sync, overlap = _pair(replace(CFG, max_model_len=64, kv_tokens=128))
    try:
        reqs = [("edge", list(range(3, 43)), SamplingParams(max_tokens=24, ignore_eos=True)),
                ("mate", [7, 7, 7], SamplingParams(max_tokens=40, ignore_eos=True))]
        want, spy = _run(sync, reqs), Spy(overlap.decode)
        got = _run(overlap, reqs)
        assert got["edge"].tokens == want["edge"].tokens and len(got["edge"].tokens) == 24
        assert got["mate"].tokens == want["mate"].tokens
        assert spy.deferred > 0 and spy.early == [] and blocks_back(overlap, 5)
    finally:
        sync.close()
        overlap.close()
