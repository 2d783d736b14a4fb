"""Capacity defaults: the KV cache from a memory fraction (GPU, emulated NPU DRAM), 256 sequences on a GPU.

The GPU's size is faked (``torch.cuda.get_device_properties``), so the rule's arithmetic is checked on a
CPU box; an instance built without ``--kv-tokens`` reports what it chose.
"""

from types import SimpleNamespace

import pytest
import torch

from hawk.config import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS, ConfigError
from hawk.engine import capacity
from hawk.engine.capacity import CPU_KV_TOKENS, GPU_MAX_NUM_SEQS, activation_reserve, resolve
from hawk.engine.instances import ColocatedInstance, InstanceConfig
from hawk.engine.loader import load_model
from hawk.layouts.npu import get_arch

GiB = 1 << 30
#: Llama-3.1-8B's shape: 128 KiB of bf16 KV per token in a paged cache.
MC = SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, vocab_size=128256)
WEIGHTS = 16 * GiB
PAGED_BPT = 2 * 32 * 8 * 128 * 2


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=141 * GiB))


def _cfg(**kw) -> InstanceConfig:
    base = {"model": "tiny", "dtype": "bf16", "transfer": "colocated", "prefill_device": "cuda:0"}
    return InstanceConfig(**{**base, **kw})


def test_the_gpu_rule_takes_the_fraction_less_weights_and_activations(h200):
    cap = resolve(_cfg(), MC, "colocated", WEIGHTS)
    reserve = activation_reserve(MC, 2048, GPU_MAX_NUM_SEQS + 17, torch.bfloat16) + capacity.SLACK_BYTES
    want = (int(141 * GiB * 0.9) - WEIGHTS - reserve) // PAGED_BPT // 16 * 16
    assert cap.kv_tokens == want and 800_000 < want < 900_000  # ~109 GiB of KV
    assert cap.max_num_seqs == GPU_MAX_NUM_SEQS
    assert "0.9 of 141 GiB" in cap.how and "max-num-seqs 256" in cap.describe("colocated")
    half = resolve(_cfg(gpu_memory_utilization=0.5), MC, "colocated", WEIGHTS)
    assert half.kv_tokens < cap.kv_tokens - int(0.39 * 141 * GiB) // PAGED_BPT


def test_given_values_win(h200):
    cap = resolve(_cfg(kv_tokens=65536, max_batch=64), MC, "colocated", WEIGHTS)
    assert (cap.kv_tokens, cap.max_num_seqs, cap.how) == (65536, 64, "--kv-tokens")


def test_a_cpu_keeps_the_small_defaults():
    cap = resolve(_cfg(prefill_device="cpu"), MC, "colocated", WEIGHTS)
    assert (cap.kv_tokens, cap.max_num_seqs) == (CPU_KV_TOKENS, 64)


def test_the_emulated_npu_takes_its_dram_fraction_capped_by_what_backs_it(h200):
    p150a = sum(b.capacity for b in get_arch("blackhole-p150a").banks)
    assert p150a == 32 * GiB
    on_gpu1 = resolve(_cfg(transfer="gn-hawk", decode_device="npu-emu:cuda:1"), MC, "decode", WEIGHTS, rx_bytes=GiB)
    assert on_gpu1.max_num_seqs == GPU_MAX_NUM_SEQS and "DRAM" in on_gpu1.how and "capped" not in on_gpu1.how
    assert 200_000 < on_gpu1.kv_tokens < int(32 * GiB * 0.9) // PAGED_BPT  # tiles pad, the rx buffers take a share
    less = resolve(_cfg(transfer="gn-hawk", decode_device="npu-emu:cuda:1", npu_memory_utilization=0.5), MC, "decode", WEIGHTS, rx_bytes=GiB)
    assert less.kv_tokens < on_gpu1.kv_tokens * 0.6
    on_host = resolve(_cfg(transfer="gn-hawk", decode_device="npu-emu:cpu", prefill_device="cpu"), MC, "decode", WEIGHTS)
    assert on_host.kv_tokens == CPU_KV_TOKENS and "host memory" in on_host.how and on_host.max_num_seqs == 64


def test_both_roles_on_one_gpu_leave_the_prefill_its_share(h200, monkeypatch):
    alone = resolve(_cfg(transfer="gg-direct", decode_device="cuda:1"), MC, "decode", WEIGHTS)
    shared = resolve(_cfg(transfer="gg-direct", decode_device="cuda:0"), MC, "decode", WEIGHTS)
    assert shared.kv_tokens < alone.kv_tokens - WEIGHTS // PAGED_BPT and "prefill's share" in shared.how
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=40 * GiB))
    with pytest.raises(MemoryError, match="--kv-tokens"):
        resolve(_cfg(transfer="gg-direct", decode_device="cuda:0"), MC, "decode", WEIGHTS)


def test_the_prefill_instance_keeps_the_default():
    cap = resolve(_cfg(transfer="gn-hawk", decode_device="npu-emu:cuda:1"), MC, "prefill", WEIGHTS)
    assert cap.kv_tokens == CPU_KV_TOKENS


def test_the_step_budget_is_the_devices_default_unless_given():
    """512 tokens a colocated step on a GPU, 640 on a CPU, a given value on either; a --max-num-seqs the
    default budget cannot hold is refused at validation, naming the default."""
    assert (_cfg(prefill_device="cuda:0").step_budget, _cfg(prefill_device="cpu").step_budget) == (GPU_BATCHED_TOKENS, CPU_BATCHED_TOKENS) == (512, 640)
    assert _cfg(prefill_device="cuda:0", max_num_batched_tokens=2048).step_budget == 2048
    with pytest.raises(ConfigError, match=r"\(512, its default here\) must exceed --max-num-seqs \(600\)"):
        InstanceConfig(model="tiny", transfer="colocated", prefill_device="cuda:0", max_batch=600).validate()
    InstanceConfig(model="tiny", transfer="colocated", prefill_device="cpu", max_batch=600, max_num_batched_tokens=1024).validate()
    with pytest.raises(ConfigError, match="must be below --max-num-batched-tokens"):
        InstanceConfig(model="tiny", transfer="colocated", prefill_device="cuda:0", step_token_target=512).validate()


def test_an_instance_reports_what_it_chose():
    torch.set_num_threads(1)
    loaded = load_model("tiny", "cpu", torch.float32, 0)
    inst = ColocatedInstance(InstanceConfig(model="tiny", transfer="colocated"), loaded=loaded)
    try:
        assert inst.capacity.kv_tokens == CPU_KV_TOKENS == inst.blocks.num_blocks * inst.blocks.block_size
        assert inst.capacity.max_num_seqs == 64 == inst.decode.max_batch
        assert inst.cfg.max_num_batched_tokens == CPU_BATCHED_TOKENS == inst.decode.max_num_batched_tokens
    finally:
        inst.close()
