"""The router <-> instance contract: versioned messages refused when they do not match, and named
faults mapped to HTTP statuses by one table."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hawk import errors as E
from hawk.serve.contract import (
    CONTRACT_VERSION,
    Accounting,
    DecodeRequest,
    InstanceInfo,
    KVRef,
    PrefillRequest,
    PrefillResponse,
    TokenLine,
    receive,
)
from hawk.serve.errors import STATUS, from_code, http_error, status_of

PREFILL = {"request_id": "r", "prompt_ids": [1, 2], "params": {"max_tokens": 4}}


def test_messages_round_trip_with_the_version():
    m = PrefillRequest.of(**PREFILL)
    assert m.version == CONTRACT_VERSION
    assert PrefillRequest.model_validate_json(m.model_dump_json()) == m
    d = DecodeRequest.of(request_id="r", prompt_len=2, first_token=5, kv=KVRef(address="tcp://x", request_id="r"))
    assert DecodeRequest.model_validate(d.model_dump()) == d


@pytest.mark.parametrize("model, body", [(PrefillRequest, PREFILL), (TokenLine, {"token": 3})])
def test_a_wrong_version_is_refused_with_a_sentence(model, body):
    with pytest.raises(ValidationError, match=f"contract version {CONTRACT_VERSION + 1} is not this side's"):
        model.model_validate({"version": CONTRACT_VERSION + 1, **body})


@pytest.mark.parametrize(
    "model, body, missing",
    [
        (PrefillRequest, PREFILL, "version"),
        (PrefillRequest, {"version": CONTRACT_VERSION, "prompt_ids": [1]}, "request_id"),
        (PrefillResponse, {"version": CONTRACT_VERSION, "request_id": "r", "first_token": 1, "num_prompt_tokens": 2}, "kv"),
        (DecodeRequest, {"version": CONTRACT_VERSION, "request_id": "r", "prompt_len": 2, "first_token": 1}, "kv"),
        (InstanceInfo, {"version": CONTRACT_VERSION, "role": "decode", "model": "m", "transfer": "gn-hawk", "transport": "nixl", "device": "cpu", "vocab_size": 9}, "max_model_len"),
    ],
)
def test_missing_fields_are_refused(model, body, missing):
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert any(err["loc"][0] == missing and err["type"] == "missing" for err in e.value.errors())


def test_unknown_fields_are_refused_except_in_accounting():
    with pytest.raises(ValidationError):
        PrefillRequest.model_validate({"version": CONTRACT_VERSION, **PREFILL, "surprise": 1})
    a = Accounting.model_validate({"version": CONTRACT_VERSION, "role": "prefill", "gpu_blocks_used": 3})
    assert a.numbers() == {"gpu_blocks_used": 3}


def test_the_router_reports_a_broken_answer_as_the_instances_fault():
    with pytest.raises(E.BadUpstream, match="malformed PrefillResponse"):
        receive(PrefillResponse, b'{"version": 1, "request_id": "r"}', "prefill at x")
    with pytest.raises(E.BadUpstream, match="version"):
        receive(TokenLine, '{"version": 999, "token": 1}', "decode at y")
    assert http_error(E.BadUpstream("x")).status == 502


@pytest.mark.parametrize(
    "fault, status, code",
    [
        (E.PromptTooLong("long"), 400, "context_length_exceeded"),
        (E.UnknownKV("none"), 400, "unknown_kv"),
        (E.BadRequest("bad"), 400, None),
        (E.ContractMismatch("v2"), 400, "contract_mismatch"),
        (E.DuplicateRequest("twice"), 409, "duplicate_request_id"),
        (E.Aborted("gone"), 499, "aborted"),
        (E.EngineUnavailable("down"), 503, "instance_unavailable"),
        (E.BadUpstream("junk"), 502, "bad_upstream"),
        (E.HawkError("unnamed"), 500, None),
    ],
)
def test_status_table(fault, status, code):
    e = http_error(fault)
    assert (e.status, e.code, e.message) == (status, code, str(fault))
    assert e.type == ("server_error" if status >= 500 else "invalid_request_error")


def test_every_row_is_reachable_and_codes_map_back():
    for cls, (status, _, code) in STATUS.items():
        assert status_of(cls("x"))[0] == status  # no row is shadowed by a base listed earlier
        if code is not None:
            assert type(from_code(code, "m")) is cls
    assert from_code("nobody-knows", "m") is None


def test_named_faults_stay_catchable_as_before():
    """Components may raise them where they raised ValueError / RuntimeError."""
    assert issubclass(E.DuplicateRequest, ValueError) and issubclass(E.PromptTooLong, ValueError)
    assert issubclass(E.EngineUnavailable, RuntimeError)
