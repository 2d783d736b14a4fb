"""A CPU engine's threads per step: a step that carries prompt tokens runs on more threads (it borrows
the serving core), a decode-only step and the attention kernel on the engine's own, and the tokens are
the same as with one thread throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hawk.bench.procs import children, cmdline
from hawk.engine import vllm_cpu_kernel
from hawk.engine.config import preset
from hawk.engine.instances import ColocatedInstance, InstanceConfig, step_threads
from hawk.engine.loader import load_model
from hawk.engine.sequence import SamplingParams
from hawk.engine.step_threads import KernelThreads, StepThreads, attention_threads
from hawk.integrations.vllm.servers import free_port, stop_group
from tests.blocks import blocks_back
from tests.test_mixed_steps import Client, _prompt
from tests.test_router_workers import _healthy

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_count_follows_the_steps_prompt_tokens(restore_threads):
    st = StepThreads(1, 2)
    assert st.borrows and st.count(0) == 1 and st.count(1) == 2 and st.count(300) == 2
    assert not StepThreads(2, 2).borrows
    for bad in ((0, 1), (2, 1)):
        with pytest.raises(ValueError, match="step threads"):
            StepThreads(*bad)
    assert st.enter(5) == 2 and torch.get_num_threads() == 2
    assert st.enter(0) == 1 and torch.get_num_threads() == 1


def test_the_kernel_runs_at_the_engines_count_and_the_step_gets_its_own_back(restore_threads):
    seen: list[int | None] = []

    def other_thread() -> None:  # no engine step ran here: the kernel's count is left alone
        seen.append(attention_threads())

    t = threading.Thread(target=other_thread)
    t.start(), t.join()
    assert seen == [None]
    StepThreads(1, 2).enter(64)
    with KernelThreads():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_instances_borrow_only_on_a_cpu_where_asked():
    cfg = InstanceConfig(model="tiny", transfer="colocated", threads=1, prompt_threads=2)
    assert step_threads(cfg) == StepThreads(1, 2)
    assert step_threads(InstanceConfig(model="tiny", transfer="colocated", threads=1)) is None
    assert step_threads(InstanceConfig(model="tiny", transfer="colocated", threads=2, prompt_threads=2)) is None
    assert step_threads(InstanceConfig(model="tiny", transfer="colocated", prefill_device="cuda:0", threads=1, prompt_threads=2)) is None


def _serve(threads: StepThreads | None, monkeypatch) -> tuple[dict[str, list[int]], list[tuple[int, int]], list[int]]:
    """Four requests through a bf16 colocated instance (vLLM's attention kernel where it loads); the
    tokens, every forward's (prompt tokens, torch threads), and the attention kernel's thread counts."""
    torch.set_num_threads(threads.prompt if threads else 1)  # as the launcher: the most a step runs on
    loaded = load_model("tiny", "cpu", torch.bfloat16, 0)
    cfg = InstanceConfig(model="tiny", transfer="colocated", dtype="bf16", kv_tokens=4096, max_batch=8,
                         max_num_batched_tokens=96, threads=threads.base if threads else 1,
                         prompt_threads=threads.prompt if threads else None)
    inst = ColocatedInstance(cfg, loaded=loaded)
    prompt_tokens: list[int] = []
    counts: list[int] = []
    kernel: list[int] = []
    real = inst.decode.runner.step

    class Entered(StepThreads):
        def enter(self, n: int) -> int:
            prompt_tokens.append(n)
            return super().enter(n)

    def step(tokens, slices, ids=None):
        counts.append(torch.get_num_threads())
        return real(tokens, slices, ids=ids)

    if threads is not None:
        assert inst.decode.step_threads == threads
        inst.decode.step_threads = Entered(threads.base, threads.prompt)

    class Recorded(KernelThreads):
        def __enter__(self) -> None:
            super().__enter__()
            kernel.append(torch.get_num_threads())

    monkeypatch.setattr(inst.decode.runner, "step", step)
    monkeypatch.setattr(vllm_cpu_kernel, "KernelThreads", Recorded)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        clients = [Client(inst, f"r{i}", _prompt(40 + 37 * i, i), params) for i in range(4)]
        out = {c.rid: c.wait() for c in clients}
        assert blocks_back(inst, 10)
    finally:
        inst.close()
    steps = list(zip(prompt_tokens, counts, strict=True)) if threads is not None else []
    return out, steps, kernel


@TWO_CORES
def test_prompt_steps_borrow_a_thread_and_the_tokens_do_not_change(monkeypatch, restore_threads):
    alone, _, _ = _serve(None, monkeypatch)
    borrowed, steps, kernel = _serve(StepThreads(1, 2), monkeypatch)
    assert borrowed == alone
    assert {n for p, n in steps if p} == {2}, "a step with prompt tokens ran on the engine's own thread"
    assert {n for p, n in steps if not p} == {1}, "a decode-only step borrowed"
    if vllm_cpu_kernel.kernel_isa(preset("tiny").head_dim, torch.bfloat16) is not None:  # vLLM's kernel runs here
        assert kernel and set(kernel) == {1}, "vLLM's attention kernel ran at the borrowed count"


@TWO_CORES
def test_hawk_serve_starts_its_cpu_engine_with_a_thread_place_on_the_serving_core(tmp_path):
    """The launcher's default on a CPU: the engine computes on its cores, a prompt step borrows the
    serving core, and OpenMP is given one place per core before the engine process loads it (a place
    on a core the process may not use is dropped, with a warning, and the borrowed thread with it)."""
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hawk", "serve", "--model", "tiny", "--transfer", "colocated", "--port", str(port),
                                 "--no-warmup"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _healthy(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        with httpx.Client(trust_env=False, timeout=60) as c:
            r = c.post(f"{url}/v1/completions", json={"prompt": _prompt(200), "max_tokens": 4, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        engine = next(p for p in children(proc.pid) if "hawk-engine=colocated" in cmdline(p))
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{engine}/environ").read_bytes().split(b"\0") if b"=" in kv)
        text = log.read_text()
        assert f"torch threads per engine {len(cores) - 1} ({len(cores)} for a step with prompt tokens)" in text
        assert env[b"OMP_PLACES"].decode() == ",".join(f"{{{c}}}" for c in cores)
        assert "places reduced" not in text, text
    finally:
        stop_group(proc, kill=True)
