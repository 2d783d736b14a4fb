"""HawkConnector's vLLM-free parts: the KV handle, the scheduler half's decisions, the router's vLLM prefill
answer. (Real vLLM servers: tests/test_vllm_pd.py.)"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

from hawk.engine.sequence import SamplingParams
from hawk.errors import BadRequest, BadUpstream
from hawk.integrations.vllm.params import (
    HANDLE_VERSION,
    Handoff,
    KVHandle,
    handoff_form,
    handoff_params,
    read_handle,
    wants_remote_decode,
)
from hawk.integrations.vllm.plan import StepPlan
from hawk.integrations.vllm.scheduler_half import SchedulerHalf
from hawk.integrations.vllm.settings import ConnectorSettings
from hawk.integrations.vllm.worker_half import WorkerHalf
from hawk.serve.vllm_prefill import EndedAtPrefill, prefill_body, prefill_response


class Status(enum.Enum):
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_ABORTED = 2
    FINISHED_STOPPED = 3


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    status: Status = Status.FINISHED_LENGTH_CAPPED
    output_token_ids: list[int] = field(default_factory=lambda: [42])


def handle(**kw: Any) -> KVHandle:
    base = dict(version=HANDLE_VERSION, address="tcp://127.0.0.1:5000", request_id="r-1", num_tokens=5, first_token=7, transfer="gg-direct")
    return KVHandle(**{**base, **kw})


def test_handle_round_trips_through_the_params_routers_copy():
    h = handle()
    params = handoff_params(h)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert read_handle(params) == h
    assert read_handle(None) is None and read_handle({"do_remote_prefill": True}) is None
    assert read_handle({"hawk": h.model_dump()}) is None  # no do_remote_prefill: a plain request


@pytest.mark.parametrize("bad", [{"version": HANDLE_VERSION + 1}, {"num_tokens": 0}, {"first_token": -1}, {"address": ""}, {"extra": 1}])
def test_a_malformed_or_foreign_handle_is_a_bad_request(bad):
    raw = {**handle().model_dump(), **bad}
    with pytest.raises(BadRequest, match="HAWK KV handle"):
        read_handle({"do_remote_prefill": True, "hawk": raw})


def test_settings_refuse_typos_and_npu_senders():
    assert ConnectorSettings.from_extra(None).transfer == "gn-hawk"
    with pytest.raises(ValueError, match="trasnfer"):
        ConnectorSettings.from_extra({"trasnfer": "gg-direct"})
    with pytest.raises(ValueError, match="unknown transfer"):
        ConnectorSettings.from_extra({"transfer": "gg-magic"})
    with pytest.raises(ValueError, match="NPU"):
        ConnectorSettings.from_extra({"transfer": "ng-hawk"})


def producer() -> SchedulerHalf:
    s = SchedulerHalf(ConnectorSettings.from_extra({"transfer": "gn-hawk"}), producer=True, consumer=False)
    s.set_worker_address({0: "tcp://127.0.0.1:6000"})
    return s


def test_producer_holds_only_length_capped_remote_decode_requests():
    s = producer()
    assert s.finished(Req("plain", [1, 2, 3]), [4]) == (False, None)
    assert s.finished(Req("gone", [1, 2], {"do_remote_decode": True}, Status.FINISHED_ABORTED), [5]) == (False, None)
    assert s.finished(Req("eos", [1, 2], {"do_remote_decode": True}, Status.FINISHED_STOPPED), [6]) == (False, None)
    assert s.take_plan().sends == []
    held, params = s.finished(Req("r", [1, 2, 3], {"do_remote_decode": True}), [8, 9])
    assert held
    h = read_handle(params)
    assert h is not None and (h.address, h.request_id, h.num_tokens, h.first_token, h.transfer) == ("tcp://127.0.0.1:6000", "r", 3, 42, "gn-hawk")
    plan = s.take_plan()
    assert [(j.request_id, j.num_tokens, j.block_ids) for j in plan.sends] == [("r", 3, (8, 9))]
    assert s.take_plan().sends == []  # each job is handed to the worker once


def test_producer_without_a_worker_address_does_not_hold():
    s = SchedulerHalf(ConnectorSettings(), producer=True, consumer=False)
    assert s.finished(Req("r", [1, 2], {"do_remote_decode": True}), [3]) == (False, None)
    with pytest.raises(ValueError, match="tensor parallel 1"):
        s.set_worker_address({0: "a", 1: "b"})


def test_consumer_loads_a_handle_once_and_recomputes_what_it_cannot_pull():
    s = SchedulerHalf(ConnectorSettings.from_extra({"transfer": "gg-direct"}), producer=False, consumer=True)
    params = handoff_params(handle(num_tokens=3))
    r = Req("d", [1, 2, 3], params)
    assert s.matched_tokens(r, 0) == (3, True)
    assert s.matched_tokens(r, 0) == (3, True)  # asked again before allocation (vLLM found no room last step): still a pull
    s.allocated(r, [11], 3)
    (job,) = s.take_plan().recvs
    assert (job.request_id, job.block_ids, job.handle.request_id) == ("d", (11,), "r-1")
    assert s.matched_tokens(r, 0) == (0, False)  # its load failed and vLLM rescheduled it: recompute, no second pull
    s.finished(Req("d", [1, 2, 3], params), [11])
    assert s.matched_tokens(r, 0) == (3, True)  # an id seen again after its request ended is a new request
    assert s.matched_tokens(Req("p", [1, 2, 3]), 0) == (0, False)  # a plain request
    assert s.matched_tokens(Req("hit", [1, 2, 3], params), 2) == (0, False)  # local prefix-cache hits: recompute
    assert s.matched_tokens(Req("len", [1, 2], params), 0) == (0, False)  # the handle's length disagrees
    npu = handoff_params(handle(transfer="gn-hawk", num_tokens=3))
    assert s.matched_tokens(Req("npu", [1, 2, 3], npu), 0) == (0, False)  # tiles for an NPU: not loadable here
    assert s.take_plan().recvs == []


def test_a_request_waiting_in_the_decode_is_kept_alive_until_its_blocks_are_allocated():
    """vLLM may queue a request longer than the prefill's TTL (a busy decode): from its arrival until its
    blocks are allocated, every sixth of the TTL, the step plan asks the worker to keep its KV alive."""
    s = SchedulerHalf(ConnectorSettings.from_extra({"transfer": "gg-direct", "ttl_s": 30}), producer=False, consumer=True)
    a, b = handoff_params(handle(num_tokens=3)), handoff_params(handle(num_tokens=3, request_id="r-2", address="tcp://127.0.0.1:6000"))
    ra, rb = Req("a", [1, 2, 3], a), Req("b", [1, 2, 3], b)
    s.arrived(ra)
    s.arrived(rb)
    s.arrived(Req("plain", [1, 2]))
    s.arrived(Req("npu", [1, 2, 3], handoff_params(handle(transfer="gn-hawk", num_tokens=3))))  # not pullable here
    s.arrived(Req("bad", [1], {"do_remote_prefill": True, "hawk": {"version": 0}}))  # malformed: refused later, not here
    assert s.take_plan(now=100.0).keep_alive == {"tcp://127.0.0.1:5000": ["r-1"], "tcp://127.0.0.1:6000": ["r-2"]}
    assert s.take_plan(now=104.0).keep_alive == {}  # within a sixth of the TTL
    assert s.matched_tokens(ra, 0) == (3, True)
    assert s.take_plan(now=105.0).keep_alive == {"tcp://127.0.0.1:5000": ["r-1"], "tcp://127.0.0.1:6000": ["r-2"]}
    s.allocated(ra, [11], 3)  # its pull starts with the next step
    assert s.take_plan(now=111.0).keep_alive == {"tcp://127.0.0.1:6000": ["r-2"]}
    s.finished(rb, [])  # aborted while it waited
    assert s.take_plan(now=200.0).keep_alive == {}
    s.arrived(rc := Req("c", [1, 2], a))  # a prompt its handle does not hold: recomputed, nothing kept alive
    assert s.matched_tokens(rc, 0) == (0, False)
    assert s.take_plan(now=300.0).keep_alive == {}


def test_the_worker_sends_the_plans_keep_alives_and_counts_them():
    calls: list[tuple[str, list[str]]] = []

    class Receiver:
        def keep_alive(self, address: str, ids: list[str]) -> bool:
            calls.append((address, ids))
            if address == "dead":
                raise RuntimeError("no answer")
            return True

        def accounting(self) -> dict[str, list[str]]:
            return {"reservations": []}

    w = WorkerHalf(ConnectorSettings.from_extra({"transfer": "gg-direct"}), producer=False, consumer=True)
    w.receiver = Receiver()  # type: ignore[assignment]
    try:
        w.start(StepPlan(keep_alive={"tcp://p1": ["r-1", "r-2"], "dead": ["r-3"]}))
        w._keep_alives.shutdown(wait=True)  # the sends run off the forward path: wait for them here
        assert sorted(calls) == [("dead", ["r-3"]), ("tcp://p1", ["r-1", "r-2"])]
        assert w.ledger()["keep_alives"] == 1  # the failed one is logged, not counted, and breaks nothing
    finally:
        w.receiver = None
        w.close()


def test_consumer_loads_the_prompt_of_a_prompt_plus_first_token_request():
    """The decode's prompt is the prefill's plus its first token (7): the prompt's 3 tokens load, vLLM
    computes the first token; any other fourth token is another prompt, which recomputes."""
    s = SchedulerHalf(ConnectorSettings.from_extra({"transfer": "gg-direct"}), producer=False, consumer=True)
    params = handoff_params(handle(num_tokens=3, first_token=7))
    r = Req("d", [1, 2, 3, 7], params)
    assert s.matched_tokens(r, 0) == (3, True)
    s.allocated(r, [11], 3)
    (job,) = s.take_plan().recvs
    assert (job.request_id, job.block_ids, job.handle.num_tokens) == ("d", (11,), 3)
    assert s.matched_tokens(Req("other", [1, 2, 3, 8], params), 0) == (0, False)
    assert s.matched_tokens(Req("long", [1, 2, 3, 7, 7], params), 0) == (0, False)


def test_handoff_form_of_a_prompt_against_its_handle():
    h = handle(num_tokens=3, first_token=7)
    assert handoff_form(h, [1, 2, 3]) is Handoff.STANDARD
    assert handoff_form(h, [1, 2, 3, 7]) is Handoff.PROMPT_PLUS_FIRST_TOKEN
    assert handoff_form(h, [1, 2, 3, 8]) is None and handoff_form(h, [1, 2]) is None and handoff_form(h, [1, 2, 3, 7, 9]) is None


def test_the_routers_vllm_prefill_request_and_answer():
    body = prefill_body("m", [1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0, seed=3))
    assert body["max_tokens"] == 1 and body["prompt"] == [1, 2, 3] and body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["seed"] == 3
    h = handle(num_tokens=3)
    pre = prefill_response("rid", {"kv_transfer_params": handoff_params(h)}, "p", 0.5)
    assert (pre.request_id, pre.first_token, pre.num_prompt_tokens, pre.kv.address, pre.kv.request_id) == ("rid", 7, 3, h.address, "r-1")
    with pytest.raises(EndedAtPrefill) as e:
        prefill_response("rid", {"choices": [{"finish_reason": "stop", "token_ids": [2]}]}, "p", 0.1)
    assert e.value.token == 2
    with pytest.raises(BadUpstream, match="HawkConnector"):
        prefill_response("rid", {"choices": [{"finish_reason": "length", "token_ids": [5]}]}, "p", 0.1)
    with pytest.raises(BadUpstream, match="version"):
        prefill_response("rid", {"kv_transfer_params": {"do_remote_prefill": True, "hawk": {**h.model_dump(), "version": 99}}}, "p", 0.1)


def test_remote_decode_flag():
    assert wants_remote_decode({"do_remote_decode": True})
    assert not wants_remote_decode(None) and not wants_remote_decode({"do_remote_decode": False})
