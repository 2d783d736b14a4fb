"""The serving layer's pure parts: request validation, error messages, stop strings (no model)."""

import pytest
from pydantic import ValidationError

from hawk.serve.common import validation_message
from hawk.serve.generation import StopMatcher, upstream_error
from hawk.serve.protocol import (
    ChatCompletionChunk,
    ChatChunkChoice,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    CompletionChoice,
    Delta,
    Usage,
)


def _message(cls, body):
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(body)
    # FastAPI reports body errors with a leading "body" in loc; mimic that.
    errors = [{**e, "loc": ("body", *e["loc"])} for e in ei.value.errors()]
    return validation_message(errors)[0]


def test_completion_request_defaults():
    r = CompletionRequest.model_validate({"prompt": "hi"})
    assert r.max_tokens == 16 and r.n == 1 and not r.stream and r.stop_list() == []
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3], "stop": "x"}).stop_list() == ["x"]
    assert CompletionRequest.model_validate({"prompt": ["one"]}).prompt == ["one"]


@pytest.mark.parametrize(
    "body, expect",
    [
        ({}, "missing required field 'prompt'"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n=2 is not supported"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logprobs": 3}, "logprobs is not supported"),
        ({"prompt": ["a", "b"]}, "batched prompts"),
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": {"a": 1}}, "'prompt' has an invalid type or value"),
        ({"prompt": "x", "presence_penalty": 1.0}, "presence_penalty is not supported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "only allowed when stream"),
    ],
)
def test_completion_request_errors_are_clear(body, expect):
    assert expect in _message(CompletionRequest, body)


@pytest.mark.parametrize(
    "body, expect",
    [
        ({}, "missing required field 'messages'"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_request_errors_are_clear(body, expect):
    assert expect in _message(ChatCompletionRequest, body)


def test_chat_request_max_tokens_names():
    m = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = ChatCompletionRequest.model_validate({"messages": m, "max_tokens": 5, "max_completion_tokens": 7})
    assert r.requested_max_tokens == 7
    assert r.message_dicts() == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_invalid_json_and_non_object_body_messages():
    msg, _ = validation_message([{"type": "json_invalid", "loc": ("body", 5), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}])
    assert msg.startswith("Invalid JSON in request body") and "Expecting value" in msg
    msg, _ = validation_message([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    assert "request body is missing" in msg
    msg, _ = validation_message([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}])
    assert "must be a JSON object" in msg


def test_response_shapes():
    r = CompletionResponse(id="c", model="m", choices=[CompletionChoice(text="x", finish_reason="stop")], usage=Usage.of(3, 1)).dump()
    assert list(r)[:5] == ["id", "object", "created", "model", "choices"]
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4} and "hawk" not in r
    c = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(delta=Delta(), finish_reason="stop")], hawk={"ttft_s": 0.1}).dump()
    assert c["choices"][0]["delta"] == {} and c["hawk"] == {"ttft_s": 0.1} and "usage" not in c


def test_stop_matcher_holds_back_partial_stop_strings():
    s = StopMatcher(["END", "\n\n"])
    out = []
    for piece in ["Hel", "lo E", "N", "D tail"]:
        text, hit = s.feed(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello " and hit


def test_stop_matcher_earliest_stop_wins_and_flushes():
    s = StopMatcher(["bb", "a"])
    assert s.feed("xxbba") == ("xx", True)
    s = StopMatcher(["zzz"])
    text, hit = s.feed("abcz")
    assert not hit and text == "ab"
    assert s.flush() == "cz"
    s = StopMatcher([])
    assert s.feed("abc") == ("abc", False)


def test_upstream_errors_keep_4xx_and_hide_5xx():
    e = upstream_error(400, b'{"error": {"message": "too long", "code": "context_length_exceeded"}}', "prefill")
    assert e.status == 400 and e.message == "too long" and e.code == "context_length_exceeded"
    e = upstream_error(500, b"boom", "decode at x")
    assert e.status == 502 and "boom" in e.message
