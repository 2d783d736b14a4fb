"""The serving layer's pure parts: request validation, error messages, stop strings (no model)."""

import pytest
from pydantic import ValidationError

from hawk.serve.common import validation_message
from hawk.serve.generation import StopMatcher
from hawk.serve.protocol import upstream_error
from hawk.serve.protocol import (
    ChatCompletionChunk,
    ChatChunkChoice,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    CompletionChoice,
    Delta,
    Usage,
    UsageReport,
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


# ---- seeds and lone surrogates: refused up front with a clear message ------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_must_fit_64_bits(seed):
    msg = _message(CompletionRequest, {"prompt": "x", "seed": seed, "temperature": 1.0})
    assert "seed" in msg and "2**64" in msg


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63), None])
def test_seed_bounds_are_inclusive_exclusive(seed):
    assert CompletionRequest.model_validate({"prompt": "x", "seed": seed}).seed == seed


@pytest.mark.parametrize("cls, body, where", [
    (CompletionRequest, {"prompt": "a\ud800b"}, "prompt"),
    (CompletionRequest, {"prompt": ["\udfff"]}, "prompt[0]"),
    (CompletionRequest, {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop[1]"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi\ud83e"}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udd85"}]}]}, "messages[0].content[0].text"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, "messages[0].name"),
])
def test_lone_surrogates_are_refused(cls, body, where):
    msg = _message(cls, body)
    assert msg.startswith(f"{where} contains a lone surrogate")


def test_surrogate_pairs_are_fine():
    r = CompletionRequest.model_validate({"prompt": "\ud83e\udd85".encode("utf-16", "surrogatepass").decode("utf-16")})
    assert r.prompt == "🦅"


# ---- the router's detokenisation: nothing held back at the end -------------------------------


def _decode_stream(events: list[dict]) -> list:
    """Run a Generation against a fake prefill + decode pair; returns its deltas."""
    import asyncio
    import json

    import httpx

    from hawk.engine.config import preset
    from hawk.engine.sequence import SamplingParams
    from hawk.engine.tokenizer import Tokenizer
    from hawk.serve.contract import CONTRACT_VERSION
    from hawk.serve.generation import Generation

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/prefill":
            return httpx.Response(200, json={"version": CONTRACT_VERSION, "request_id": "r", "num_prompt_tokens": 2, "first_token": 65, "kv": {"address": "x", "request_id": "r"}})
        body = "".join(json.dumps({"version": CONTRACT_VERSION, **e}) + "\n" for e in events)
        return httpx.Response(200, text=body, headers={"content-type": "application/x-ndjson"})

    async def go() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            tok = Tokenizer.byte_level(preset("tiny"))
            gen = Generation(client, "http://p", "http://d", "r", [1, 2], SamplingParams(max_tokens=8), tok, [], 0.0)
            await gen.start()
            return [d async for d in gen.deltas()]

    return asyncio.run(go())


def test_router_flushes_an_unfinished_character_at_the_end():
    ev = [{"token": 65}, {"token": 0xE2}, {"token": 0x82, "finish_reason": "length"}]
    deltas = _decode_stream(ev)
    assert "".join(d.text for d in deltas) == "A\ufffd" and deltas[-1].finish_reason == "length"


def test_router_streams_invalid_bytes_without_waiting():
    ev = [{"token": 0xFF}, {"token": 0xFE}, {"token": 65, "finish_reason": "length"}]
    deltas = _decode_stream(ev)
    assert [d.text for d in deltas] == ["\ufffd", "\ufffd", "A"]


@pytest.mark.parametrize(
    "cls, body, field",
    [
        (CompletionRequest, {"prompt": "x", "temperature": "0.5"}, "temperature"),
        (CompletionRequest, {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 16.0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "stream": "true"}, "stream"),
        (CompletionRequest, {"prompt": "x", "seed": "7"}, "seed"),
        (CompletionRequest, {"prompt": "x", "top_p": True}, "top_p"),
        (CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}, "temperature"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "8"}, "max_completion_tokens"),
    ],
)
def test_types_are_strict_as_openai_s(cls, body, field):
    """OpenAI refuses a string where a number or a boolean belongs (and a decimal where an integer
    does); a lenient server hides the client's bug. Numbers stay numbers: 1 is a fine temperature."""
    assert field in _message(cls, body)


def test_strict_types_still_take_what_openai_takes():
    r = CompletionRequest.model_validate({"prompt": [1, 2], "temperature": 1, "top_p": 0.5, "stream": True, "stream_options": {"include_usage": True}, "seed": 3})
    assert r.temperature == 1.0 and r.usage_report is UsageReport.FINAL
    m = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "a"}], "max_tokens": 4})
    assert m.requested_max_tokens == 4
