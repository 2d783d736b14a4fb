"""The router's lengths for a request, against the instances' limits (no model, no HTTP)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from hawk.serve.contract import InstanceInfo  # noqa: E402
from hawk.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from hawk.serve.router import Instance, InstancePool, Router, RouterConfig  # noqa: E402

CONTEXT = 2048


def _router() -> Router:
    def info(role: str) -> InstanceInfo:
        return InstanceInfo.of(role=role, model="m", transfer="hawk", transport="local", device="cpu", max_model_len=CONTEXT, vocab_size=10)

    cfg = RouterConfig(["http://p"], ["http://d"])
    router = Router(cfg, tokenizer=None)
    router.pool = InstancePool([Instance("http://p", "prefill", info("prefill"))], [Instance("http://d", "decode", info("decode"))])
    return router


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context():
    """As vLLM and OpenAI: no limit given, the chat may run to the end of the context (it used to
    stop at an undocumented 512 tokens)."""
    router = _router()
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    params = router.sampling(req, 10, req.requested_max_tokens, default_max=router.cfg.default_chat_max_tokens)
    assert params.max_tokens == CONTEXT - 10


def test_an_operator_cap_and_an_explicit_limit_still_hold():
    router = _router()
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7})
    assert router.sampling(req, 10, req.requested_max_tokens, default_max=None).max_tokens == 7
    bare = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert router.sampling(bare, 10, None, default_max=100).max_tokens == 100
    assert router.sampling(bare, CONTEXT - 3, None, default_max=100).max_tokens == 3  # what is left
    comp = CompletionRequest.model_validate({"prompt": "hi"})
    assert router.sampling(comp, 10, comp.max_tokens, default_max=16).max_tokens == 16  # OpenAI's completion default
