"""Known-answer tests of where the first token comes out (hawk/sim/decode.py, ``first_token_on_decode``).

vLLM's disaggregated serving (the paper's system) samples a request's first token in a decode
step that includes it; HAWK's engine sends the prefill's token when the request joins."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.decode import join_emits_first_token
from hawk.sim.paper import config_for
from hawk.sim.request import SimRequest
from hawk.sim.testbeds import here_testbed, paper_testbed
from hawk.sim.workload import RequestSpec

PREFILL = PrefillModel(0.02, 3e-4)
DECODE = DecodeModel(0.05, 0.0, 0.0)
CURVE = TransferCurve("lin", (1.0 * MiB, 100.0 * MiB), (0.004, 0.104))


def _cfg(on_decode: bool) -> SimConfig:
    return SimConfig("known", CURVE, PREFILL, DECODE, bytes_per_token=1000, contention="none", first_token_on_decode=on_decode)


def test_frameworks():
    assert join_emits_first_token("hawk") and not join_emits_first_token("vllm")
    with pytest.raises(ValueError):
        join_emits_first_token("sglang")


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
    assert config_for(paper_testbed(), "gn-hawk").first_token_on_decode
    assert not config_for(here_testbed(), "gg-direct").first_token_on_decode
    assert replace(_cfg(True)).describe()["first_token_on_decode"] is True
