"""Known-answer tests of vLLM's decode request flow (hawk/sim/decode.py, ``VLLM_DECODE_FLOW``).

vLLM's disaggregated serving (the paper's system) admits a request between steps and samples its
first token in a decode step that includes it; HAWK's engine sends the prefill's token when the
request joins."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.decode import VLLM_DECODE_FLOW
from hawk.sim.paper import config_for
from hawk.sim.request import SimRequest
from hawk.sim.testbeds import here_testbed, paper_testbed
from hawk.sim.workload import RequestSpec

PREFILL = PrefillModel(0.02, 3e-4)
DECODE = DecodeModel(0.05, 0.0, 0.0)
CURVE = TransferCurve("lin", (1.0 * MiB, 100.0 * MiB), (0.004, 0.104))


def _cfg(on_decode: bool) -> SimConfig:
    return SimConfig("known", CURVE, PREFILL, DECODE, bytes_per_token=1000, contention="none", first_token_on_decode=on_decode)


def test_vllm_flow_admits_a_mid_step_arrival_when_the_step_ends():
    """With vLLM's flow a request whose prefill ends while a step runs starts its pull at that
    step's end; without it, at once."""
    for flow, expect_at_step_end in ((VLLM_DECODE_FLOW, True), ({}, False)):
        first = SimRequest(RequestSpec(0, 0.0, 100, 50))
        second = SimRequest(RequestSpec(1, 0.5, 300, 3))
        Cluster(replace(_cfg(False), **flow)).run([first, second])
        prefilled = 0.5 + PREFILL.batch_time([300])
        assert second.t_prefilled == pytest.approx(prefilled, abs=1e-12)
        step_ends = [first.t_first + k * DECODE.base_s for k in range(-1, 60)]
        end = min(t for t in step_ends if t >= prefilled - 1e-12)
        assert second.t_admitted == pytest.approx(end if expect_at_step_end else prefilled, abs=1e-9)


@pytest.mark.parametrize("on_decode", [False, True])
def test_a_lone_request_by_hand(on_decode: bool):
    """Alone: TTFT = prefill + transfer (+ one decode step when the decode makes the first token);
    the tokens after it are one step apart either way, and the request takes output_len - 1 steps
    at the join or output_len steps on the decode."""
    r = SimRequest(RequestSpec(0, 0.0, 1000, 4))
    Cluster(_cfg(on_decode)).run([r])
    ready = PREFILL.batch_time([1000]) + CURVE.latency(1000 * 1000)
    assert r.t_first == pytest.approx(ready + (DECODE.base_s if on_decode else 0.0), abs=1e-12)
    assert r.t_last - r.t_first == pytest.approx(3 * DECODE.base_s, abs=1e-12)
    assert r.tokens == 4 and r.finished


def test_a_request_ready_mid_step_waits_for_that_step_then_its_own():
    """A second request whose KV lands while the first one's step runs gets its first token at the
    end of the step after that one: the rest of the running step plus one full step."""
    first = SimRequest(RequestSpec(0, 0.0, 100, 50))
    second = SimRequest(RequestSpec(1, 0.5, 300, 3))
    Cluster(_cfg(True)).run([first, second])
    ready = 0.5 + PREFILL.batch_time([300]) + CURVE.latency(300 * 1000)
    step_ends = [first.t_first + k * DECODE.base_s for k in range(60)]
    assert min(abs(t - ready) for t in step_ends) > 1e-3  # not a tie with a step end
    next_end = min(t for t in step_ends if t >= ready - 1e-12)
    assert second.t_first == pytest.approx(next_end + DECODE.base_s, abs=1e-9)


def test_a_one_token_request_finishes_on_its_first_step():
    r = SimRequest(RequestSpec(0, 0.0, 100, 1))
    Cluster(_cfg(True)).run([r])
    assert r.finished and r.tokens == 1 and r.t_first == r.t_last


def test_the_paper_testbed_follows_vllm_and_here_follows_hawk():
    paper, here = config_for(paper_testbed(), "gn-hawk"), config_for(here_testbed(), "gg-direct")
    assert paper.first_token_on_decode and paper.admit_between_steps
    assert not here.first_token_on_decode and not here.admit_between_steps
    assert replace(_cfg(True)).describe()["first_token_on_decode"] is True
