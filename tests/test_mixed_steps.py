"""Mixed steps (colocated): decode tokens and prefill chunks in one forward under a token budget.

Each forward is recorded as the runner sees it (its slices), so the tests check the schedule
itself, not timings: the budget holds, every running sequence is in every step (a long prompt
costs a running decode at most one budget-bounded step per token), and preemption in a mixed
batch still yields the tokens of the threaded engines (prefill and decode as separate forwards).
"""

import json
import os
import threading
import time
from dataclasses import replace

import pytest
import torch

from hawk.config import ConfigError
from hawk.engine import decode_engine, step_trace
from hawk.engine.decode_engine import (
    MIXED_PREFILL_SEQS,
    DecodeEngine,
    LocalKV,
    TokenEvent,
)
from hawk.engine.instances import ColocatedInstance, InstanceConfig
from hawk.engine.loader import load_model
from hawk.engine.runner import StepPath
from hawk.engine.sequence import SamplingParams
from tests.blocks import blocks_back
from tests.test_runner import CpuStepRunner

BUDGET = 96


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model("tiny", "cpu", torch.float32, 0)


def _instance(loaded, mixed: bool = True, kv_tokens: int = 4096, max_batch: int = 8, chunk: int = 2048,
              overlap: bool = False, target: int = 0) -> ColocatedInstance:
    """``overlap``: async scheduling as on a GPU (each step launched before the previous one is
    read; on the CPU the tokens are ready at once, but the schedule is the GPU's)."""
    cfg = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=kv_tokens, gpu_kv_dtype="fp32", mixed_steps=mixed,
                         max_num_batched_tokens=BUDGET, max_batch=max_batch, max_prefill_chunk=chunk, step_token_target=target)
    inst = ColocatedInstance(cfg, loaded=loaded)
    inst.decode.overlap = overlap
    return inst


def _prompt(n: int, salt: int = 5) -> list[int]:
    return [(13 * i + salt) % 250 + 1 for i in range(n)]


def _record(monkeypatch, inst: ColocatedInstance) -> list[list[tuple[int, int]]]:
    """Every forward of the decode engine's runner, as [(start, q_len)] per row."""
    log: list[list[tuple[int, int]]] = []
    real = inst.decode.runner.step

    def step(tokens, slices, ids=None):
        log.append([(s.start, s.q_len) for s in slices])
        inst.device_ids.append(0 if ids is None else ids.shape[0])
        return real(tokens, slices, ids=ids)

    inst.device_ids = []  # per forward: how many leading rows took their ids from the device

    monkeypatch.setattr(inst.decode.runner, "step", step)
    return log


class Client:
    """Prefill then decode one request through the colocated instance, as the servers do. The prompt is
    submitted from the caller's thread, so clients made in a loop queue in order; a thread hands it to
    decode when its prefill ends, unless ``hand_over`` is False (the caller then calls ``decode``)."""

    def __init__(self, inst: ColocatedInstance, rid: str, prompt: list[int], params: SamplingParams, hand_over: bool = True):
        self.inst, self.rid, self.prompt, self.params = inst, rid, prompt, params
        self.tokens: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()
        self.prefilled = inst.prefill.submit(rid, prompt, params)
        self.thread = threading.Thread(target=self._run) if hand_over else None
        if self.thread:
            self.thread.start()

    def _run(self) -> None:
        self.decode(self.prefilled.result(120))

    def decode(self, r) -> None:
        self.inst.decode.submit(self.rid, r.num_prompt_tokens, r.first_token, self.params, self.inst.take_blocks(self.rid), self._on)

    def _on(self, ev: TokenEvent) -> None:
        if ev.token is not None:
            self.tokens.append(ev.token)
        if ev.error:
            self.error = ev.error
        if ev.finish_reason:
            self.done.set()

    def wait(self) -> list[int]:
        assert self.done.wait(120), f"{self.rid} did not finish"
        if self.thread:
            self.thread.join(10)
        return self.tokens


def _decoding(inst: ColocatedInstance, max_tokens: int, tokens: int) -> Client:
    """A request already decoding (``tokens`` out) when the test's own prompt arrives."""
    running = Client(inst, "dec", _prompt(20, 9), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while len(running.tokens) < tokens:
        assert not running.done.wait(0.005)
    return running


def _serve(inst: ColocatedInstance, n: int, max_tokens: int = 24) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clients = [Client(inst, f"r{i}", _prompt(30 + 41 * i, i), params) for i in range(n)]
    return {c.rid: c.wait() for c in clients}


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_keeps_the_token_budget_and_prompts_share_steps_with_decodes(loaded, monkeypatch, overlap):
    inst = _instance(loaded, overlap=overlap)
    try:
        log = _record(monkeypatch, inst)
        out = _serve(inst, 6)
        assert all(len(t) == 24 for t in out.values())
        assert log and all(sum(q for _, q in step) <= BUDGET for step in log)
        mixed = [s for s in log if any(q > 1 for _, q in s) and any(q == 1 for _, q in s)]
        assert mixed, "no step carried decode tokens and a prefill chunk together"
        assert inst.decode.stats()["steps_mixed"] >= len(mixed)
        assert blocks_back(inst, 10)
    finally:
        inst.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_prompt_delays_a_running_decode_by_one_bounded_step_per_token(loaded, monkeypatch, overlap):
    """While a 700-token prompt is prefilled in chunks, the running request is in every forward:
    each of its tokens waits for exactly one step, whose prefill share is the budget less the
    decode rows. Overlapped, each chunk's step is launched before the previous one is read, and
    the next chunk continues where the in-flight one ends."""
    inst = _instance(loaded, overlap=overlap)
    try:
        running = _decoding(inst, 400, 3)
        log = _record(monkeypatch, inst)
        res = inst.prefill.submit("long", _prompt(700, 3), SamplingParams(max_tokens=1)).result(120)
        steps = list(log)
        inst.decode.abort("dec")
        running.wait()
        inst.discard("long")
        chunks = [s for s in steps if any(q > 1 for _, q in s)]
        assert res.timings["prefill_chunks"] == len(chunks) >= 700 // BUDGET
        for s in chunks:  # the decode row is there, the chunk took what it left
            assert s[0][1] == 1 and sum(q for _, q in s[1:]) <= BUDGET - 1
        assert sum(q for s in chunks for _, q in s[1:]) == 700
        starts = [s[1][0] for s in chunks]
        assert starts == sorted(starts) and starts[0] == 0  # chunk after chunk, none planned twice
        ahead = [d for s, d in zip(steps, inst.device_ids[-len(steps):]) if any(q > 1 for _, q in s) and d]
        assert (len(ahead) >= len(chunks) - 2) if overlap else not ahead
        assert blocks_back(inst, 10)
    finally:
        inst.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_in_mixed_steps_gives_the_tokens_of_separate_forwards(loaded, overlap):
    """A cache too small for the batch: sequences are swapped out and back while prompts are being
    prefilled in the same forwards; every request still gets the tokens the threaded engines give
    with room to spare."""
    ref = _instance(loaded, mixed=False, kv_tokens=4096)
    try:
        want = _serve(ref, 6, max_tokens=64)
    finally:
        ref.close()
    tight = _instance(loaded, mixed=True, kv_tokens=320, overlap=overlap)  # the six need 1155 tokens at their peaks
    try:
        got = _serve(tight, 6, max_tokens=64)
        stats = tight.decode.stats()
        assert stats["preemptions"] >= 1 and stats["steps_mixed"] >= 1
        assert got == want
        assert blocks_back(tight, 10)
    finally:
        tight.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_mixed_forward_fails_its_requests_frees_their_blocks_and_serves_on(loaded, monkeypatch, overlap):
    inst = _instance(loaded, overlap=overlap)
    try:
        running = _decoding(inst, 200, 2)
        real = inst.decode.runner.step

        def step(tokens, slices, ids=None):
            if any(s.q_len > 1 for s in slices):
                raise RuntimeError("device fell over")
            return real(tokens, slices, ids=ids)

        monkeypatch.setattr(inst.decode.runner, "step", step)
        with pytest.raises(Exception, match="fell over"):
            inst.prefill.submit("doomed", _prompt(150), SamplingParams(max_tokens=1)).result(60)
        running.wait()
        assert running.error and "fell over" in running.error
        monkeypatch.undo()
        assert blocks_back(inst, 10) and inst.prefill.stats()["prefilling"] == 0
        assert _serve(inst, 2, max_tokens=4) and blocks_back(inst, 10)
    finally:
        inst.close()


def test_overlapped_mixed_steps_give_the_synchronous_tokens_and_free_everything(loaded, monkeypatch):
    """Async scheduling with prompts arriving: steps launched before the previous one is read carry
    prefill chunks and rows that joined since (host ids after the device ones), and every request
    gets the tokens of the synchronous loop; nothing is left held."""
    sync = _instance(loaded)
    try:
        want = _serve(sync, 6)
    finally:
        sync.close()
    inst = _instance(loaded, overlap=True)
    try:
        log = _record(monkeypatch, inst)
        assert _serve(inst, 6) == want
        ahead = [(s, d) for s, d in zip(log, inst.device_ids) if d]
        assert any(any(q > 1 for _, q in s) for s, _ in ahead), "no overlapped step carried a prefill chunk"
        assert any(sum(q == 1 for _, q in s) > d for s, d in ahead), "no row joined an overlapped step"
        assert blocks_back(inst, 10) and inst.prefill.stats()["prefilling"] == 0
    finally:
        inst.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_overlapped_mixed_steps_give_the_synchronous_tokens(monkeypatch):
    """The same on CUDA, where overlap is the default: graph replays (decode steps, and mixed steps
    through the prefill graphs), device ids for the running rows, the chunks' logits read after the
    next step's launch, and the event a step's prompts wait on."""
    cfg = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=4096, dtype="bf16", prefill_device="cuda:0",
                         mixed_steps=True, max_num_batched_tokens=BUDGET, max_batch=8)
    sync = ColocatedInstance(replace(cfg, async_scheduling=False))
    try:
        want = _serve(sync, 6)
    finally:
        sync.close()
    inst = ColocatedInstance(cfg)
    try:
        assert inst.decode.overlap and inst.decode.runner.use_graphs
        log = _record(monkeypatch, inst)
        assert _serve(inst, 6) == want
        ahead = [s for s, d in zip(log, inst.device_ids) if d]
        assert any(any(q > 1 for _, q in s) for s in ahead), "no overlapped step carried a prefill chunk"
        assert blocks_back(inst, 10) and inst.prefill.stats()["prefilling"] == 0
    finally:
        inst.close()


def _seventeen_then_a_long_prompt(inst: ColocatedInstance, max_tokens: int) -> dict[str, list[int]]:
    """Seventeen requests decoding, then a 400-token prompt whose chunks ride beside all of them: steps
    of 18 sequences and more, past what a prefill graph holds (MIXED_PREFILL_SEQS). ``max_tokens``
    keeps the seventeen running while those chunks are prefilled (the prompt is submitted from this
    thread once they all decode: a fast device needs more steps of margin). The seventeen go to decode
    together from this thread once all are prefilled: a thread each let a loaded box start one so late
    that the first had finished."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clients = [Client(inst, f"r{i}", _prompt(20 + i, i), params, hand_over=False) for i in range(MIXED_PREFILL_SEQS + 1)]
    for c, r in [(c, c.prefilled.result(120)) for c in clients]:
        c.decode(r)
    deadline = time.monotonic() + 120
    while min(len(c.tokens) for c in clients) < 1:  # all seventeen decode
        assert time.monotonic() < deadline and not any(c.done.is_set() for c in clients)
        time.sleep(0.005)
    late = Client(inst, "late", _prompt(400, 3), params)
    return {c.rid: c.wait() for c in [*clients, late]}


def _past_16_serve_like_separate_forwards(cfg: InstanceConfig, monkeypatch, max_tokens: int, loaded=None,
                                         mixed_graphs: bool = True) -> None:
    """The steps carrying the long prompt's chunks beside the seventeen running rows replay mixed graphs
    (or, with ``mixed_graphs`` off, run as one forward of graph pieces), overlapped: the running rows'
    ids from the device; every request gets the tokens of prefill and decode run as separate forwards
    (``mixed_steps=False``)."""
    cfg = replace(cfg, mixed_graphs=mixed_graphs)
    ref = ColocatedInstance(replace(cfg, mixed_steps=False), loaded=loaded)
    try:
        want = _seventeen_then_a_long_prompt(ref, max_tokens)
    finally:
        ref.close()
    inst = ColocatedInstance(cfg, loaded=loaded)
    try:
        runner = inst.decode.runner
        assert inst.decode.overlap
        if mixed_graphs:  # captured at start: every token bucket for one and two chunks, each decode bucket
            assert sorted(runner._mixed_graphs) == [(t, s) for t in runner.prefill_tokens for s in (1, 2)] and not runner._piecewise
        else:
            assert sorted(runner._piecewise) == runner.prefill_tokens
        paths: list[tuple[int, bool, StepPath]] = []  # (sequences, carries a chunk, path) per step
        real = runner.step

        def step(tokens, slices, ids=None):
            out = real(tokens, slices, ids=ids)
            paths.append((len(slices), any(s.q_len > 1 for s in slices), out.path))
            return out

        monkeypatch.setattr(runner, "step", step)
        assert _seventeen_then_a_long_prompt(inst, max_tokens) == want
        past = [p for n, chunk, p in paths if n > MIXED_PREFILL_SEQS and chunk]
        assert len(past) >= 400 // BUDGET and set(past) == {StepPath.GRAPH if mixed_graphs else StepPath.PIECEWISE}
        assert inst.decode.stats()["steps_piecewise"] == sum(p is StepPath.PIECEWISE for *_, p in paths)
        assert blocks_back(inst, 10) and inst.prefill.stats()["prefilling"] == 0
    finally:
        inst.close()


@pytest.mark.parametrize("mixed_graphs", [True, False])
def test_mixed_steps_past_16_sequences_replay_mixed_graphs_with_the_tokens_of_separate_forwards(loaded, monkeypatch, mixed_graphs):
    """On the CPU with the runner's graph paths enabled by their stand-ins (tests/test_runner.py: decode,
    prefill and mixed "graphs" replayed eagerly; pieces are called where graphs cannot run)."""
    monkeypatch.setattr(decode_engine, "ModelRunner", CpuStepRunner)
    cfg = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=16384, gpu_kv_dtype="fp32", mixed_steps=True,
                         max_num_batched_tokens=BUDGET, max_batch=32, async_scheduling=True)
    _past_16_serve_like_separate_forwards(cfg, monkeypatch, 48, loaded, mixed_graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mixed_graphs", [True, False])
def test_on_a_gpu_mixed_steps_past_16_sequences_replay_mixed_graphs_with_the_tokens_of_separate_forwards(monkeypatch, mixed_graphs):
    """The same with CUDA graphs, fp32 (where a padded GEMM's rounding cannot flip a greedy token)."""
    cfg = InstanceConfig(model="tiny", transfer="colocated", kv_tokens=16384, dtype="fp32", gpu_kv_dtype="fp32",
                         prefill_device="cuda:0", mixed_steps=True, max_num_batched_tokens=BUDGET, max_batch=32)
    _past_16_serve_like_separate_forwards(cfg, monkeypatch, 160, mixed_graphs=mixed_graphs)


def test_closing_with_a_mixed_step_in_flight_fails_its_prompts_and_frees_their_blocks(loaded):
    inst = _instance(loaded, overlap=True)
    running = _decoding(inst, 400, 2)
    fut = inst.prefill.submit("cut", _prompt(600), SamplingParams(max_tokens=4))
    while inst.decode.stats()["steps_mixed"] < 2:  # the long prompt is being prefilled beside the decode
        assert not fut.done()
        threading.Event().wait(0.005)
    inst.close()
    assert fut.done() and (fut.cancelled() or fut.exception() is not None)
    running.done.wait(10)
    assert inst.blocks.num_free == inst.blocks.num_blocks


def test_the_budget_must_leave_room_for_prefill(loaded):
    with pytest.raises(ConfigError, match="max-num-batched-tokens"):
        InstanceConfig(transfer="colocated", max_batch=256, max_num_batched_tokens=256).validate()
    InstanceConfig(transfer="colocated", max_batch=256, max_num_batched_tokens=256, mixed_steps=False).validate()
    with pytest.raises(ValueError, match="must exceed max_batch"):
        DecodeEngine(loaded.model, None, LocalKV(None), max_batch=8, prefill=object(), max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="step_token_target"):
        DecodeEngine(loaded.model, None, LocalKV(None), max_batch=8, max_num_batched_tokens=96, step_token_target=96)


# ---- a step token target ----------------------------------------------------------------------

TARGET = 40


class _Backlog:
    """A stepped prefill's backlog, as the decode engine asks for it."""

    def __init__(self, tokens: int) -> None:
        self.tokens, self.asked = tokens, []

    def backlog_exceeds(self, tokens: int) -> bool:
        self.asked.append(tokens)
        return self.tokens > tokens


def _budget(engine: DecodeEngine, rows: int, backlog: int) -> int:
    engine.prefill, engine._running = _Backlog(backlog), [object()] * rows
    return engine._prefill_budget()


def test_a_step_token_target_holds_while_the_prompts_keep_up_and_yields_the_budget_when_they_queue(loaded):
    """Target 40, budget 96: beside 1 row a step takes 39 prompt tokens while at most
    ``step_target_backlog`` such steps wait (4: 156 tokens), the whole 95 past that; with as many rows
    as the target it takes the whole budget (a target step would carry nothing); no target, always
    the whole budget."""
    inst = _instance(loaded, target=TARGET)
    try:
        e = inst.decode
        assert e.step_token_target == TARGET and e.step_target_backlog == InstanceConfig.step_target_backlog
        assert _budget(e, 1, 100) == TARGET - 1 and e.prefill.asked == [e.step_target_backlog * (TARGET - 1)]
        e.step_target_backlog = 4
        assert _budget(e, 1, 156) == TARGET - 1 and _budget(e, 1, 157) == BUDGET - 1
        assert _budget(e, 30, 10) == TARGET - 30 and _budget(e, TARGET, 10) == BUDGET - TARGET
        e.step_token_target = 0
        assert _budget(e, 1, 10) == BUDGET - 1
    finally:
        inst.decode.prefill = inst.prefill
        inst.decode._running = []
        inst.close()
    with pytest.raises(ConfigError, match="step-token-target"):
        InstanceConfig(transfer="colocated", max_num_batched_tokens=96, step_token_target=96).validate()


def test_with_a_step_token_target_a_prompt_beside_a_decode_rides_in_target_steps(loaded, monkeypatch):
    """A 100-token prompt beside one running request (a backlog of a few target steps): every step that
    carries it holds at most the target, decode row included, and the request's tokens are the ones
    a whole-budget engine gives."""
    out = {}
    for target in (0, TARGET):
        inst = _instance(loaded, target=target)
        try:
            running = _decoding(inst, 200, 3)  # long enough to outlast the prompt's steps on a starved box
            log = _record(monkeypatch, inst)
            res = inst.prefill.submit("p", _prompt(100, 7), SamplingParams(max_tokens=1)).result(120)
            chunks = [s for s in list(log) if any(q > 1 for _, q in s)]
            out[target] = (running.wait(), res.first_token)
            assert all(s[0][1] == 1 for s in chunks), chunks  # the decode row leads every step of the prompt
            assert sum(q for s in chunks for _, q in s[1:]) == 100
            if target:
                assert all(sum(q for _, q in s) <= TARGET for s in chunks) and len(chunks) == -(-100 // (TARGET - 1))
            else:
                assert len(chunks) == -(-100 // (BUDGET - 1))
            inst.discard("p")
            assert blocks_back(inst, 10)
        finally:
            inst.close()
    assert out[0] == out[TARGET]


def test_the_prefill_backlog_counts_queued_prompts_and_the_unplanned_rest_of_started_ones(loaded):
    inst = _instance(loaded)
    pre = inst.prefill
    try:
        with pre._cv:  # as the engine's planner sees it, without a step racing the test
            started = type("J", (), {"prompt_ids": [1] * 50, "planned": 30})()
            queued = type("J", (), {"prompt_ids": [1] * 40})()
            pre._active.append(started)
            pre._queue.append(queued)
        assert pre.backlog_exceeds(59) and not pre.backlog_exceeds(60)  # 20 left of the first, 40 of the second
        with pre._cv:
            pre._active.remove(started)
            pre._queue.remove(queued)
        assert not pre.backlog_exceeds(0)
    finally:
        inst.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_trace_writes_one_line_per_step_with_what_it_carried(loaded, monkeypatch, tmp_path, overlap):
    """HAWK_STEP_TRACE: every forward the engine ran is one line, in order, its decode rows, their
    cached tokens and its prompt chunks as the runner got them; every prompt token is in some line."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_trace.ENV, str(path))
    inst = _instance(loaded, overlap=overlap)
    try:
        log = _record(monkeypatch, inst)
        out = _serve(inst, 6)
        assert all(len(t) == 24 for t in out.values())
    finally:
        inst.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(log) > 0
    for line, fwd in zip(lines, log):
        rows = line["rows"]
        assert rows + line["chunks"] == len(fwd)
        assert line["context"] == sum(start for start, _ in fwd[:rows])
        assert line["longest"] == max((start for start, _ in fwd[:rows]), default=0)
        assert line["prompt_tokens"] == sum(q for _, q in fwd[rows:])
        assert line["spans"] == [list(x) for x in fwd[rows:]]
        assert line["pid"] == os.getpid() and line["launch_ms"] > 0 and line["device_ms"] is None
    assert sum(x["prompt_tokens"] for x in lines) == sum(30 + 41 * i for i in range(6))
    assert any(x["rows"] and x["prompt_tokens"] for x in lines)
