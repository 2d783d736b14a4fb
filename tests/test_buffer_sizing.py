"""Transfer buffers sized for the longest request, and prompts they can never hold refused up front.

``--staging-mb`` / ``--rx-mb`` default to auto (``hawk.engine.instances.auto_buffer_mb``): room for the KV
of the longest request an instance holds, in the form Algorithm 1 reserves it, never under 64 MiB.
An explicit size is used as given, and a prompt whose KV cannot fit it even when it is empty is a
400 ``context_length_exceeded`` before prefill (the bug this guards: the 8B preset with 64 MiB buffers
prefilled every prompt over 512 tokens and then failed its transfer).

The arithmetic needs only model shapes (no weights); the instance and server tests use a random
model with the tiny preset's size but 4 KiB of KV per token, so a 1 MiB buffer holds 256 tokens.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.bench.equivalence import run_disaggregated  # noqa: E402
from hawk.config import AUTO_BUFFER_MIN_MB, ServeConfig, defaults  # noqa: E402
from hawk.engine.config import preset  # noqa: E402
from hawk.engine.instances import DecodeInstance, PrefillInstance  # noqa: E402
from hawk.engine.loader import LoadedModel  # noqa: E402
from hawk.engine.model import LlamaModel  # noqa: E402
from hawk.engine.sequence import SamplingParams  # noqa: E402
from hawk.engine.transfer_buffers import auto_buffer_mb, buffer_mb, kv_limits, max_request_tokens, transfer_buffer_bytes  # noqa: E402
from hawk.engine.tokenizer import Tokenizer  # noqa: E402
from hawk.errors import PromptTooLong  # noqa: E402
from hawk.layouts.gpu import GpuKVLayout  # noqa: E402
from hawk.layouts.npu import NpuKVLayout, get_arch  # noqa: E402
from hawk.plan.block_plan import plan_block_copy  # noqa: E402
from hawk.plan.kv_plan import plan_kv_transfer  # noqa: E402

MiB = 1 << 20
KiB = 1 << 10
NPU = {"gn-hawk", "gn-host", "gn-direct-single"}


def cfg_for(transfer: str = "gn-hawk", **kw) -> ServeConfig:
    dev = "npu-emu:cpu" if transfer in NPU else "cpu"
    return defaults(transfer=transfer, decode_device=dev, **kw).validate()


# ============================================================================ the rule, as arithmetic


def test_auto_is_the_default_and_explicit_values_are_kept():
    assert ServeConfig().staging_mb is None and ServeConfig().rx_mb is None
    mc = preset("llama-3.1-8b")
    cfg = cfg_for(staging_mb=7, rx_mb=9)
    assert buffer_mb(cfg, mc, "staging") == 7 and buffer_mb(cfg, mc, "rx") == 9
    assert ServeConfig.from_json(cfg_for().to_json()).staging_mb is None  # the launcher's child spec keeps "auto"


def test_small_preset_gets_the_floor():
    """tiny: 2048 tokens (its context) x 512 B of KV per token = 1 MiB, so auto is the 64 MiB floor."""
    mc = preset("tiny")
    cfg = cfg_for()
    assert max_request_tokens(cfg, mc) == 2048  # min(--kv-tokens 8192, context 2048)
    assert transfer_buffer_bytes(cfg, mc, "staging", 2048) == 2048 * mc.kv_bytes_per_token()
    for t in ("gn-hawk", "gn-direct-single", "gn-host", "gg-host", "gg-direct"):
        c = cfg_for(t)
        assert auto_buffer_mb(c, mc, "staging") == auto_buffer_mb(c, mc, "rx") == AUTO_BUFFER_MIN_MB == 64, t
    assert transfer_buffer_bytes(cfg_for("gg-direct"), mc, "staging", 2048) == 0  # read in place: nothing staged
    assert transfer_buffer_bytes(cfg_for("gg-direct"), mc, "rx", 2048) == 0


def test_the_8b_shape():
    """Llama-3.1-8B: 128 KiB of KV per token; --kv-tokens 8192 -> 1 GiB of bf16 tiles (544 MiB in bfloat8_b)."""
    mc = preset("llama-3.1-8b")
    assert mc.kv_bytes_per_token() == 128 * KiB
    cfg = cfg_for()
    assert transfer_buffer_bytes(cfg, mc, "staging", 640) == 83886080  # the failing request of the bug report
    assert auto_buffer_mb(cfg, mc, "staging") == auto_buffer_mb(cfg, mc, "rx") == 1024
    for t in ("gn-direct-single", "gn-host", "gg-host"):
        assert auto_buffer_mb(cfg_for(t), mc, "staging") == auto_buffer_mb(cfg_for(t), mc, "rx") == 1024, t
    bfp8 = cfg_for(kv_dtype="bfp8_b")  # tiles of 1088 B: what crosses the wire is smaller
    assert auto_buffer_mb(bfp8, mc, "staging") == auto_buffer_mb(bfp8, mc, "rx") == 8192 // 64 * 64 * 64 * 1088 // MiB == 544
    assert auto_buffer_mb(cfg_for("gn-host", kv_dtype="bfp8_b"), mc, "staging") == 1024  # gn-host sends bf16 blocks
    assert auto_buffer_mb(cfg_for(max_model_len=4096), mc, "staging") == 512
    assert auto_buffer_mb(cfg_for(kv_tokens=100_000), mc, "rx") == -(-100_000 // 64) * 8 * MiB // MiB
    assert auto_buffer_mb(cfg_for("gg-direct"), mc, "staging") == 64


def test_tensor_parallel_ranks_size_for_their_heads():
    mc = preset("llama-3.1-8b")
    whole = transfer_buffer_bytes(cfg_for(), mc, "staging", 8192)
    # two prefill ranks of 4 heads each: each stages half; the decode pulls 4 heads at a time
    assert transfer_buffer_bytes(cfg_for(prefill_tp=2), mc, "staging", 8192) == whole // 2
    assert transfer_buffer_bytes(cfg_for(prefill_tp=2), mc, "rx", 8192) == whole // 2
    # two decode ranks: the one prefill rank stages both entries at once; each decode rank gets half
    assert transfer_buffer_bytes(cfg_for(decode_tp=2), mc, "staging", 8192) == whole
    assert transfer_buffer_bytes(cfg_for(decode_tp=2), mc, "rx", 8192) == whole // 2
    # compact blocks hold every head of the prefill rank, whichever decode rank asks
    assert transfer_buffer_bytes(cfg_for("gn-host", decode_tp=2), mc, "staging", 8192) == 2 * whole


def test_the_bug_report_request_is_refused_by_explicit_64_mib():
    mc = preset("llama-3.1-8b")
    cfg = cfg_for(staging_mb=64, rx_mb=64)
    limits = kv_limits(cfg, mc, {"staging": 64 * MiB, "rx": 64 * MiB}, 8192)
    assert [(x.buffer, x.tokens) for x in limits] == [("staging", 512), ("rx", 512)]
    assert kv_limits(cfg_for(), mc, {"staging": 1024 * MiB, "rx": 1024 * MiB}, 8192) == []  # auto: no limit
    with pytest.raises(ValueError, match="--staging-mb 1 .* cannot hold the KV of even a one-token prompt"):
        kv_limits(cfg, mc, {"staging": 1 * MiB}, 8192)  # one NPU block of the 8B is 8 MiB


def test_layerwise_and_direct_landings_need_no_receive_buffer():
    mc = preset("llama-3.1-8b")
    assert transfer_buffer_bytes(cfg_for(kv_flow="layerwise"), mc, "rx", 8192) == 0
    assert transfer_buffer_bytes(cfg_for(kv_flow="layerwise"), mc, "staging", 8192) == 1 << 30  # layer-major, same bytes
    assert transfer_buffer_bytes(cfg_for(landing_mode="direct"), mc, "rx", 8192) == 0


# ============================================================================ the rule against real plans


@pytest.mark.parametrize(
    "arch, heads, head_dim, npu_block, shard, dtype",
    [
        ("blackhole-p150a", 2, 32, 64, 1, "bf16"),  # 4 tiles a block over 8 banks: unevenly spread
        ("blackhole-p150a", 3, 64, 64, 1, "bfp8_b"),  # SmolLM2's 12 tiles a block
        ("blackhole-p150a", 8, 128, 64, 1, "bf16"),  # the 8B: 64 tiles a block, 8 per bank
        ("blackhole-p100a", 3, 64, 32, 1, "bf16"),  # 7 channels
        ("wormhole-n300", 2, 64, 64, 1, "bf16"),  # two banks per channel
        ("blackhole-p150a", 2, 64, 64, 3, "bf16"),  # block-cyclic shards of 3 pages
    ],
)
def test_bounds_hold_for_real_plans(arch, heads, head_dim, npu_block, shard, dtype):
    """Whatever blocks a request gets, its plan never asks for more than the rule sized: the staging
    bytes, and in every channel of gn-hawk's receive buffer (``rx / channels`` each)."""
    layers, tokens = 2, 700
    mc = preset("tiny").replace(num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=head_dim)
    cfg = cfg_for(arch=arch, npu_block_size=npu_block, npu_shard_pages=shard, kv_dtype=dtype)
    staging, rx = (transfer_buffer_bytes(cfg, mc, b, tokens) for b in ("staging", "rx"))
    per_channel = rx // get_arch(arch).num_channels
    src = GpuKVLayout(layers, 64, 16, heads, head_dim)
    nb = -(-tokens // npu_block)
    dst = NpuKVLayout(get_arch(arch), layers, 4 * nb, heads, npu_block, head_dim, dtype, shard_pages=shard)
    bases = [i * 10 * MiB for i in range(dst.num_tensors)]
    rng = np.random.default_rng(0)
    gpu = list(range(-(-tokens // 16)))
    worst = 0
    for trial in range(40):
        npu = list(range(nb)) if trial == 0 else rng.choice(4 * nb, nb, replace=False).tolist()
        plan = plan_kv_transfer(tokens, gpu, npu, src, dst, bases)
        assert -(-plan.total_bytes // 256) * 256 == staging
        worst = max(worst, max(plan.channel_bytes().values()))
    assert worst <= per_channel
    if heads * (npu_block // 32) * (head_dim // 32) % (shard * get_arch(arch).num_banks) == 0:
        assert get_arch(arch).aligned(worst) == per_channel  # evenly spread blocks: the bound is exact
    single = transfer_buffer_bytes(cfg_for("gn-direct-single", arch=arch, npu_block_size=npu_block, npu_shard_pages=shard, kv_dtype=dtype), mc, "rx", tokens)
    assert single == get_arch(arch).aligned(plan.total_bytes)
    host = cfg_for("gn-host", arch=arch, npu_block_size=npu_block)
    assert transfer_buffer_bytes(host, mc, "staging", tokens) == transfer_buffer_bytes(host, mc, "rx", tokens) == plan_block_copy(tokens, gpu, src).total_bytes


# ============================================================================ instances


def wide_model() -> LoadedModel:
    """The tiny preset's size with 4 KiB of KV per token (8 layers x 4 KV heads of 32): 256 KiB per NPU block."""
    cfg = preset("tiny").replace(num_layers=8, num_heads=4, num_kv_heads=4, head_dim=32)
    assert cfg.kv_bytes_per_token() == 4 * KiB
    return LoadedModel(LlamaModel.from_config(cfg, seed=5), Tokenizer.byte_level(cfg), cfg, "wide")


@pytest.fixture(scope="module")
def wide():
    torch.set_num_threads(1)
    return wide_model()


BASE = dict(model="wide", transport="local", kv_tokens=1024, kv_ttl_s=60.0)


def _ids(n: int) -> list[int]:
    return [(7 * i) % 250 + 1 for i in range(n)]


def _drained(p: PrefillInstance, d: DecodeInstance, timeout_s: float = 10.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if p.drained() and d.drained():
            return True
        time.sleep(0.05)
    return False


def test_instances_size_auto_and_keep_explicit_values(wide):
    cfg = ServeConfig(**BASE).validate()
    p, d = PrefillInstance(cfg, loaded=wide), DecodeInstance(cfg, loaded=wide)
    try:
        assert p.rank.staging_bytes == p.sender.fmt.staging.ledger.capacity == 64 * MiB  # 4 MiB of KV: the floor
        assert d.rank.rx_bytes == 64 * MiB
        assert p.kv_limits == [] and d.kv_limits == [] and p.engine.max_prompt_tokens == 1024
    finally:
        p.close(), d.close()
    cfg = replace(cfg, staging_mb=3, rx_mb=2)
    p, d = PrefillInstance(cfg, loaded=wide), DecodeInstance(cfg, loaded=wide)
    try:
        assert p.sender.fmt.staging.ledger.capacity == 3 * MiB
        assert {led.capacity for led in d.receiver.landing.buffers.ledgers.values()} == {2 * MiB // 8}
    finally:
        p.close(), d.close()


def test_too_small_staging_refuses_before_prefill_and_a_fitting_prompt_works(wide):
    cfg = ServeConfig(**BASE, staging_mb=1).validate()  # 1 MiB = 4 NPU blocks = 256 tokens of this model's KV
    p, d = PrefillInstance(cfg, loaded=wide), DecodeInstance(cfg, loaded=wide)
    try:
        assert [(x.buffer, x.tokens) for x in p.kv_limits] == [("staging", 256)]
        assert p.engine.max_prompt_tokens == 256 and d.kv_limits == []  # the decode's receive buffers are auto
        with pytest.raises(PromptTooLong, match=r"prompt of 300 tokens: its KV needs 1310720 B of the prefill's staging buffer \(--staging-mb 1 MiB"):
            p.check_prompt(300)
        with pytest.raises(PromptTooLong):
            p.engine.submit("long", _ids(257), SamplingParams(max_tokens=2))
        assert p.engine.stats()["waiting"] == 0 and p.drained()  # nothing ran, nothing is held
        toks, info = run_disaggregated(p, d, _ids(256), SamplingParams(max_tokens=3, ignore_eos=True), "fits")
        assert len(toks) == 3, info
        assert _drained(p, d)
    finally:
        p.close(), d.close()


def test_too_small_receive_buffers_refuse_on_both_sides(wide):
    cfg = ServeConfig(**BASE, rx_mb=1).validate()  # 128 KiB a channel = 4 blocks' worth (one page of each block per bank)
    p, d = PrefillInstance(cfg, loaded=wide), DecodeInstance(cfg, loaded=wide)
    try:
        assert [(x.buffer, x.tokens) for x in p.kv_limits] == [("rx", 256)]  # the prefill knows the decode's config
        assert [(x.buffer, x.tokens) for x in d.kv_limits] == [("rx", 256)]
        with pytest.raises(PromptTooLong, match=r"the decode's receive buffers \(--rx-mb 1 MiB"):
            d.check_prompt(257)
        d.check_prompt(256)
    finally:
        p.close(), d.close()


# ============================================================================ over HTTP


@pytest.fixture(scope="module")
def served(wide):
    """Prefill with 1 MiB of staging, and a second decode whose receive buffers are smaller than
    its prefill's config says (roles started with different options): each refusal is a 400."""
    from hawk.serve.common import ThreadedServer
    from hawk.serve.decode_server import create_decode_app
    from hawk.serve.prefill_server import create_prefill_app
    from hawk.serve.router import RouterConfig, create_router_app

    cfg = ServeConfig(**BASE, staging_mb=1).validate()
    p = PrefillInstance(cfg, loaded=wide)
    p2 = PrefillInstance(replace(cfg, staging_mb=None), loaded=wide)
    d = DecodeInstance(cfg, loaded=wide)
    d_small = DecodeInstance(replace(cfg, rx_mb=1), loaded=wide)
    servers = [ThreadedServer(create_prefill_app(p)).start(), ThreadedServer(create_decode_app(d)).start()]
    servers += [ThreadedServer(create_prefill_app(p2)).start(), ThreadedServer(create_decode_app(d_small)).start()]
    servers.append(ThreadedServer(create_router_app(RouterConfig([servers[0].url], [servers[1].url], default_temperature=0.0))).start())
    servers.append(ThreadedServer(create_router_app(RouterConfig([servers[2].url], [servers[3].url], default_temperature=0.0))).start())
    yield {"p": p, "p2": p2, "d": d, "d_small": d_small, "prefill": servers[0].url, "router": servers[4].url, "router_small_rx": servers[5].url}
    for s in reversed(servers):
        s.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, trust_env=False, timeout=60)


def test_router_refuses_a_prompt_the_staging_can_never_hold(served):
    r = _post(served["router"], "/v1/completions", {"prompt": _ids(300), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "prompts up to 256" in err["message"]
    assert served["p"].drained()
    ok = _post(served["router"], "/v1/completions", {"prompt": _ids(250), "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3


def test_prefill_server_says_which_buffer(served):
    from hawk.serve.contract import CONTRACT_VERSION

    body = {"version": CONTRACT_VERSION, "request_id": "too-long", "prompt_ids": _ids(300), "params": {"max_tokens": 2}}
    r = _post(served["prefill"], "/internal/prefill", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "--staging-mb 1 MiB" in err["message"], err
    assert served["p"].drained()


def test_decode_refuses_what_its_receive_buffers_cannot_hold(served):
    """A prefill sized by another config prefills; the decode refuses before pulling (400, not a
    failed transfer) and the router's abort frees the prefilled KV."""
    r = _post(served["router_small_rx"], "/v1/completions", {"prompt": _ids(300), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "--rx-mb 1 MiB" in err["message"], err
    assert _drained(served["p2"], served["d_small"])
    ok = _post(served["router_small_rx"], "/v1/completions", {"prompt": _ids(200), "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
