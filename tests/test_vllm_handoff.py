"""The prompt+first-token P/D handoff's requests and the client's answer (hawk/integrations/vllm/handoff.py),
without vLLM. (Real vLLM servers: tests/test_vllm_pd.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hawk.errors import BadUpstream
from hawk.integrations.vllm.handoff import (
    Continue,
    Done,
    after_prefill,
    prefill_request,
    standard_only,
)
from hawk.integrations.vllm.params import (
    HANDLE_VERSION,
    Handoff,
    KVHandle,
    handoff_form,
    handoff_params,
)

ids = st.lists(st.integers(0, 50_000), min_size=1, max_size=300)


def prefill_answer(prompt: list[int], first: int, text: str = "x", finish: str = "length", handle: bool = True) -> dict[str, Any]:
    """What a vLLM prefill with HawkConnector answers to prefill_request (return_token_ids on)."""
    h = KVHandle(version=HANDLE_VERSION, address="tcp://127.0.0.1:1", request_id="cmpl-1", num_tokens=len(prompt), first_token=first,
                 transfer="gg-direct")
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": finish, "prompt_token_ids": prompt, "token_ids": [first]}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "kv_transfer_params": handoff_params(h) if handle else None}


@given(prompt=ids, first=st.integers(0, 50_000), max_tokens=st.integers(2, 4096), min_tokens=st.integers(0, 2),
       first_text=st.text(max_size=4), rest=st.lists(st.integers(0, 50_000), max_size=8), rest_text=st.text(max_size=8))
def test_the_decode_continues_the_prompt_plus_first_token_and_the_client_sees_one_answer(prompt, first, max_tokens, min_tokens,
                                                                                       first_text, rest, rest_text):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": min_tokens, "temperature": 0, "ignore_eos": True}
    pre = prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == {"do_remote_decode": True} and pre["return_token_ids"]
    assert pre.get("min_tokens", 0) <= 1 and pre["prompt"] == prompt and pre["ignore_eos"]
    answer = prefill_answer(prompt, first, first_text)
    c = after_prefill(body, answer)
    assert isinstance(c, Continue)
    assert c.body["prompt"] == [*prompt, first] and c.body["max_tokens"] == max_tokens - 1
    assert c.body.get("min_tokens", 0) == max(0, min_tokens - 1)
    assert c.body["kv_transfer_params"] == answer["kv_transfer_params"]  # the handle travels as the prefill answered it
    assert handoff_form(c.handle, c.body["prompt"]) is Handoff.PROMPT_PLUS_FIRST_TOKEN  # what the decode's connector loads
    assert body["prompt"] == prompt and body["max_tokens"] == max_tokens  # the client's request is left alone
    decode = {"choices": [{"index": 0, "text": rest_text, "finish_reason": "length", "token_ids": rest, "prompt_token_ids": c.body["prompt"]}],
              "usage": {"prompt_tokens": len(prompt) + 1, "completion_tokens": len(rest), "total_tokens": len(prompt) + 1 + len(rest)},
              "kv_transfer_params": None}
    out = c.answer(decode)
    (choice,) = out["choices"]
    assert choice["text"] == first_text + rest_text and choice["token_ids"] == [first, *rest] and choice["prompt_token_ids"] == prompt
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(rest) + 1, "total_tokens": len(prompt) + 1 + len(rest)}
    assert "kv_transfer_params" not in out


@pytest.mark.parametrize("finish", ["stop", "abort"])
def test_a_first_token_that_ends_the_request_is_the_answer(finish):
    """An end token or stop string at the first token: vLLM's prefill kept no KV (the connector holds only
    length-capped requests), so no decode is asked."""
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 8}
    answer = prefill_answer([1, 2], 0, finish=finish, handle=False)
    assert after_prefill(body, answer) == Done(answer)


def test_a_client_asking_for_one_token_gets_the_prefills_answer():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 1}
    assert "kv_transfer_params" not in prefill_request(body)
    answer = prefill_answer([1, 2], 5, handle=False)
    assert after_prefill(body, answer) == Done(answer)


def test_a_request_without_max_tokens_gets_vllms_default():
    body = {"model": "m", "prompt": [1, 2]}
    c = after_prefill(body, prefill_answer([1, 2], 5))
    assert isinstance(c, Continue) and c.body["max_tokens"] == 15


def test_streaming_clients_get_a_plain_prefill_request():
    pre = prefill_request({"model": "m", "prompt": [1], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert pre["stream"] is False and "stream_options" not in pre


def test_a_prefill_answer_without_handle_or_ids_or_with_other_ids_is_the_upstreams_fault():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}
    with pytest.raises(BadUpstream, match="HawkConnector"):
        after_prefill(body, prefill_answer([1, 2, 3], 5, handle=False))
    no_ids = prefill_answer([1, 2, 3], 5)
    del no_ids["choices"][0]["prompt_token_ids"]
    with pytest.raises(BadUpstream, match="return_token_ids"):
        after_prefill(body, no_ids)
    other = prefill_answer([1, 2, 3], 5)
    other["choices"][0]["token_ids"] = [6]
    with pytest.raises(BadUpstream, match="disagrees"):
        after_prefill(body, other)
    two = prefill_answer([1, 2, 3], 5)
    two["choices"].append(two["choices"][0])
    with pytest.raises(BadUpstream, match="2 choices"):
        after_prefill(body, two)


@pytest.mark.parametrize(("extra", "why"), [
    ({}, []),
    ({"stop": ["\n"], "stop_token_ids": [2], "repetition_penalty": 1.1, "seed": 3}, []),
    ({"stop": "\n\n"}, ["a stop string of more than one character"]),
    ({"n": 2}, ["several choices"]),
    ({"frequency_penalty": 0.5}, ["frequency or presence penalty"]),
    ({"logprobs": 1}, ["echo or logprobs"]),
])
def test_what_the_prompt_plus_first_token_form_cannot_keep(extra, why):
    assert standard_only({"model": "m", "prompt": [1], "max_tokens": 4, **extra}) == why
