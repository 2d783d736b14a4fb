"""Chunked prefill: a long prompt over several iterations gives the same KV and first token as one
forward, lets a colocated decode keep stepping meanwhile, and gives its blocks back when cancelled."""

import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from hawk.engine.decode_engine import TokenEvent
from hawk.engine.instances import ColocatedInstance, InstanceConfig
from hawk.engine.loader import load_model
from hawk.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model("tiny", "cpu", torch.float32, 0)


def _colocated(loaded, chunk: int, kv_tokens: int = 2048, kv_dtype: str = "fp32") -> ColocatedInstance:
    # the threaded prefill engine (--no-mixed-steps): its own forwards, which these tests watch
    cfg = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=kv_tokens, gpu_kv_dtype=kv_dtype, max_prefill_chunk=chunk, mixed_steps=False)
    return ColocatedInstance(cfg, loaded=loaded)


def _prompt(n: int, salt: int = 5) -> list[int]:
    return [(13 * i + salt) % 250 + 1 for i in range(n)]


def _chunk_log(monkeypatch, engine, delay_s: float = 0.0) -> list[tuple[float, list[tuple[int, int]]]]:
    """Record (end time, [(start, q_len)]) of every prefill forward; ``delay_s`` makes each one
    long, like a big chunk on a real device, so interleaving is visible on a fast CPU model."""
    log: list[tuple[float, list[tuple[int, int]]]] = []
    real = engine.runner.forward

    def forward(tokens, slices):
        out = real(tokens, slices)
        time.sleep(delay_s)
        log.append((time.monotonic(), [(s.start, s.q_len) for s in slices]))
        return out

    monkeypatch.setattr(engine.runner, "forward", forward)
    return log


def test_chunked_prefill_matches_one_forward(loaded, monkeypatch):
    """Same first token, same cached K/V. Not bit-equal: a GEMM over 50 rows may round otherwise
    than one over 203 (batch variance, ~1e-7 in fp32), so an fp32 cache is compared tightly."""
    whole, chunked = _colocated(loaded, 0, 512), _colocated(loaded, 50, 512)
    try:
        log = _chunk_log(monkeypatch, chunked.prefill)
        prompt = _prompt(203)  # chunks 50, 50, 50, 50, 3: boundaries inside blocks of 16
        a = whole.prefill.submit("w", prompt, GREEDY).result(60)
        b = chunked.prefill.submit("c", prompt, GREEDY).result(60)
        assert [s for _, ss in log for s in ss] == [(0, 50), (50, 50), (100, 50), (150, 50), (200, 3)]
        assert a.first_token == b.first_token and a.num_prompt_tokens == b.num_prompt_tokens == 203
        assert b.timings["prefill_chunks"] == 5 and a.timings["prefill_chunks"] == 1
        for ca, cb in zip(whole.caches, chunked.caches):
            torch.testing.assert_close(ca[:, a.block_ids], cb[:, b.block_ids], atol=1e-5, rtol=1e-5)
    finally:
        whole.close()
        chunked.close()


def test_short_prompts_share_an_iteration_with_a_chunk(loaded, monkeypatch):
    """The iteration budget is the chunk: a queued short prompt fills what a long one leaves."""
    inst = _colocated(loaded, 64)
    try:
        log = _chunk_log(monkeypatch, inst.prefill)
        gate = threading.Event()
        real = inst.prefill.runner.forward

        def gated(tokens, slices):
            gate.wait(10)
            return real(tokens, slices)

        monkeypatch.setattr(inst.prefill.runner, "forward", gated)
        long_f = inst.prefill.submit("long", _prompt(100), GREEDY)
        short_f = inst.prefill.submit("short", _prompt(10, 7), GREEDY)
        gate.set()
        assert long_f.result(60).timings["prefill_chunks"] == 2 and short_f.result(60).first_token >= 0
        # The long one fills the first iteration; its rest (36) and the short one (10) share the second.
        assert [ss for _, ss in log] == [[(0, 64)], [(64, 36), (0, 10)]]
        for rid in ("long", "short"):
            inst.discard(rid)
    finally:
        inst.close()


class Timed:
    """A decode client recording when each token arrived."""

    def __init__(self):
        self.times: list[float] = []
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent):
        if ev.token is not None:
            self.times.append(time.monotonic())
        if ev.finish_reason:
            self.done.set()


def test_a_running_decode_keeps_stepping_while_a_long_prompt_is_chunked(loaded, monkeypatch):
    inst = _colocated(loaded, 64, kv_tokens=4096)
    try:
        params = SamplingParams(max_tokens=1500, ignore_eos=True)
        r = inst.prefill.submit("dec", _prompt(20, 9), params).result(60)
        col = Timed()
        inst.decode.submit("dec", r.num_prompt_tokens, r.first_token, params, inst.take_blocks("dec"), col)
        while len(col.times) < 3:
            assert not col.done.is_set()
            time.sleep(0.005)
        log = _chunk_log(monkeypatch, inst.prefill, delay_s=0.02)
        long_prompt = _prompt(640, 3)
        res = inst.prefill.submit("long", long_prompt, GREEDY).result(60)
        first_token_at = time.monotonic()
        assert res.timings["prefill_chunks"] == 10 and len(log) == 10
        first_chunk_end = log[0][0]
        between = [t for t in col.times if first_chunk_end < t < first_token_at]
        assert between, "no decode token arrived while the long prompt was being prefilled"
        # Tokens land between chunks, not only in one burst: several chunk gaps saw a decode step.
        gaps = sum(any(log[i][0] < t < log[i + 1][0] for t in col.times) for i in range(len(log) - 1))
        assert gaps >= 3
        assert inst.decode.abort("dec") and col.done.wait(10)
        inst.discard("long")
    finally:
        inst.close()


def _free_after(inst: ColocatedInstance, want: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while inst.blocks.num_free != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return inst.blocks.num_free


@pytest.mark.parametrize("how", ["engine", "client"])
def test_cancelling_mid_chunks_frees_the_blocks(loaded, monkeypatch, how):
    """Cancelled between chunks, by the engine's cancel (what /internal/abort calls) or the
    client's ``future.cancel()``: the blocks come back and the engine serves the next prompt."""
    inst = _colocated(loaded, 32, kv_tokens=1024)
    try:
        total = inst.blocks.num_blocks
        first_chunk, proceed = threading.Event(), threading.Event()
        real = inst.prefill.runner.forward

        def forward(tokens, slices):
            out = real(tokens, slices)
            first_chunk.set()
            proceed.wait(10)
            return out

        monkeypatch.setattr(inst.prefill.runner, "forward", forward)
        fut = inst.prefill.submit("victim", _prompt(300), GREEDY)
        assert first_chunk.wait(10)
        assert inst.blocks.num_free == total - inst.blocks.blocks_for(300)  # the whole prompt's blocks, up front
        assert inst.prefill.cancel("victim") if how == "engine" else fut.cancel()
        proceed.set()
        with pytest.raises(CancelledError):
            fut.result(10)
        assert _free_after(inst, total) == total
        assert inst.prefill.stats()["prefilling"] == 0 and not inst.prefill.cancel("victim")
        monkeypatch.undo()
        ok = inst.prefill.submit("next", _prompt(100, 4), GREEDY).result(60)
        assert ok.first_token >= 0 and inst.discard("next")
        assert inst.blocks.num_free == total
    finally:
        inst.close()


def test_a_failing_chunk_fails_the_request_and_frees_its_blocks(loaded, monkeypatch):
    inst = _colocated(loaded, 32, kv_tokens=1024)
    try:
        total = inst.blocks.num_blocks
        real = inst.prefill.runner.forward

        def forward(tokens, slices):
            if any(s.start >= 64 for s in slices):
                raise RuntimeError("device fell over")
            return real(tokens, slices)

        monkeypatch.setattr(inst.prefill.runner, "forward", forward)
        with pytest.raises(RuntimeError, match="fell over"):
            inst.prefill.submit("doomed", _prompt(200), GREEDY).result(30)
        assert _free_after(inst, total) == total and inst.prefill.stats()["prefilling"] == 0
    finally:
        inst.close()


def test_the_chunk_is_a_config_field():
    assert InstanceConfig().max_prefill_chunk == 2048
    with pytest.raises(ValueError):
        InstanceConfig(max_prefill_chunk=-1).validate()
