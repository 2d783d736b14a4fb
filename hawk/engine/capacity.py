"""How big an instance's KV cache and batch are when the user does not say: vLLM's rule.

vLLM sizes its cache from ``--gpu-memory-utilization`` (0.9 of the GPU for weights, activations and
KV together) and allows 256 sequences; a fixed default would hand a user of a 141 GB GPU a sliver
of it. Here:

- **a GPU** (the colocated engine, a gg-* decode): ``gpu_memory_utilization`` of the device's
  total memory, less the weights of every engine on that device, less an activation reserve for the
  largest forward this instance runs (:func:`activation_reserve`), divided by the paged cache's bytes
  per token. With both roles on one GPU (a disaggregated system on GPU0) the decode counts the
  prefill's weights, activations, staging and cache as taken. The rule uses totals, not the free
  memory of the moment, so two processes starting side by side and the ranks of a tensor-parallel
  instance all get the same answer.
- **the emulated NPU** (gn-* decode): ``npu_memory_utilization`` of the architecture's DRAM (the
  sum of its banks, e.g. 32 GiB on a p150a), less the receive buffers, in tiled bytes per token;
  and no more than the memory that backs the emulation can hold (the GPU rule on ``npu-emu:cuda:N``,
  the CPU default on ``npu-emu:cpu``).
- **a CPU** (and a prefill instance, whose cache only holds prompts until they are pulled, and whose
  staging buffers are sized from it): ``CPU_KV_TOKENS``.

``--kv-tokens`` overrides all of this. ``max_num_seqs`` is 256 where the decode runs on a GPU
(the NPU emulated on one included) and 64 on a CPU, unless ``--max-num-seqs`` is given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hawk.config import DEFAULT_KV_TOKENS, ServeConfig
from hawk.layouts.device import parse_device
from hawk.layouts.npu import NpuKVLayout, get_arch

#: KV tokens where no memory rule applies (a CPU, a prefill instance).
CPU_KV_TOKENS = DEFAULT_KV_TOKENS
#: Decode batch where none is given: vLLM's default on a GPU, a quarter of it on a CPU.
GPU_MAX_NUM_SEQS, CPU_MAX_NUM_SEQS = 256, 64
#: Left for the CUDA context, cuBLAS workspaces and the allocator's slack, beyond the activations.
SLACK_BYTES = 1 << 30


@dataclass(frozen=True)
class Capacity:
    """An instance's resolved KV capacity and batch, and how they were chosen (printed at start)."""

    kv_tokens: int
    max_num_seqs: int
    how: str

    def describe(self, role: str) -> str:
        return f"{role}: KV cache {self.kv_tokens} tokens ({self.how}), max-num-seqs {self.max_num_seqs}"


def default_max_num_seqs(cfg: ServeConfig) -> int:
    """``--max-num-seqs`` if given, else 256 where the decode computes on a GPU, else 64."""
    if cfg.max_batch is not None:
        return cfg.max_batch
    device = cfg.prefill_device if cfg.transfer == "colocated" else cfg.decode_compute_device
    return GPU_MAX_NUM_SEQS if device.startswith("cuda") else CPU_MAX_NUM_SEQS


def with_max_num_seqs(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with ``max_batch`` filled in (the engines read it as a number)."""
    return cfg if cfg.max_batch is not None else dataclasses.replace(cfg, max_batch=default_max_num_seqs(cfg))


def activation_reserve(mc: Any, tokens: int, rows: int, dtype: torch.dtype) -> int:
    """Bytes a forward of ``tokens`` tokens and ``rows`` logits rows may hold at its peak: the
    residual stream, the fused QKV and gate/up outputs and their successors twice over (eager and
    graph pools), and fp32 logits three times (graph output, greedy scratch, a sampling copy)."""
    per_token = 2 * (4 * mc.hidden_size + 3 * mc.intermediate_size + 2 * mc.num_kv_heads * mc.head_dim)
    return tokens * per_token * dtype.itemsize + 3 * rows * mc.vocab_size * 4


def _paged_bytes_per_token(cfg: ServeConfig, mc: Any, heads: int) -> int:
    return 2 * mc.num_layers * heads * mc.head_dim * torch.empty((), dtype=_gpu_kv_dtype(cfg)).element_size()


def _gpu_kv_dtype(cfg: ServeConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.gpu_kv_dtype]


def _forward_tokens(cfg: ServeConfig) -> int:
    return max(cfg.step_budget, cfg.max_prefill_chunk or 0, cfg.prefill_graph_tokens or 0, 1)


def _gpu_bytes(cfg: ServeConfig, mc: Any, device: torch.device, weight_bytes: int, dtype: torch.dtype, shared_with_prefill: bool) -> tuple[int, str]:
    """What ``gpu_memory_utilization`` of ``device`` leaves for this instance's KV, and how."""
    total = torch.cuda.get_device_properties(device).total_memory
    seqs = default_max_num_seqs(cfg)
    reserve = activation_reserve(mc, _forward_tokens(cfg), seqs + 17, dtype) + SLACK_BYTES
    taken = weight_bytes + reserve
    how = f"{cfg.gpu_memory_utilization:g} of {total / 2**30:.0f} GiB less {weight_bytes / 2**30:.1f} GiB weights, {reserve / 2**30:.1f} GiB activations"
    if shared_with_prefill:  # the prefill on the same GPU: its weights, activations, cache and staging
        prefill_cache = (cfg.kv_tokens or CPU_KV_TOKENS) * _paged_bytes_per_token(cfg, mc, mc.num_kv_heads)
        staging = (cfg.staging_mb or 0) << 20 or prefill_cache
        taken += weight_bytes + reserve + prefill_cache + staging
        how += ", and the prefill's share of the same GPU"
    return int(total * cfg.gpu_memory_utilization) - taken, how


def prefill_capacity(cfg: ServeConfig) -> Capacity:
    """A prefill instance's: ``--kv-tokens``, else :data:`CPU_KV_TOKENS` on any device (its cache only
    holds prompts until they are pulled, so no memory rule sizes it); needs no model."""
    if cfg.kv_tokens is not None:
        return Capacity(cfg.kv_tokens, default_max_num_seqs(cfg), "--kv-tokens")
    return Capacity(CPU_KV_TOKENS, default_max_num_seqs(cfg), "a prefill instance's default: it holds prompts until they are pulled")


def resolve(cfg: ServeConfig, mc: Any, role: str, weight_bytes: int, heads: int | None = None, rx_bytes: int = 0) -> Capacity:
    """The KV tokens and batch of an instance of ``role`` ("colocated", "decode", "prefill") whose
    model (``mc``, ``weight_bytes`` on its device) is loaded; ``heads``: this rank's KV heads."""
    seqs = default_max_num_seqs(cfg)
    if cfg.kv_tokens is not None:
        return Capacity(cfg.kv_tokens, seqs, "--kv-tokens")
    if role == "prefill":
        return prefill_capacity(cfg)
    heads = heads or mc.num_kv_heads
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    spec = parse_device(cfg.prefill_device if role == "colocated" else cfg.decode_device)
    compute = torch.device(spec.torch_device)
    shared = role == "decode" and parse_device(cfg.prefill_device).torch_device == spec.torch_device
    gpu: tuple[int, str] | None = None
    if compute.type == "cuda":
        gpu = _gpu_bytes(cfg, mc, compute, weight_bytes, dtype, shared)
    if role == "decode" and spec.is_npu:
        lay = NpuKVLayout(get_arch(cfg.arch), mc.num_layers, 1, heads, cfg.npu_block_size, mc.head_dim, cfg.kv_dtype,
                          shard_pages=cfg.npu_shard_pages)
        dram = sum(b.capacity for b in get_arch(cfg.arch).banks)
        tokens = (int(dram * cfg.npu_memory_utilization) - rx_bytes) // lay.bytes_per_token()
        how = f"{cfg.npu_memory_utilization:g} of the emulated {cfg.arch}'s {dram / 2**30:.0f} GiB DRAM"
        if gpu is not None:
            backing = gpu[0] // lay.bytes_per_token()
            if backing < tokens:
                tokens, how = backing, f"{how}, capped by the GPU backing it: {gpu[1]}"
        elif CPU_KV_TOKENS < tokens:
            tokens, how = CPU_KV_TOKENS, f"{how}, capped at {CPU_KV_TOKENS} in host memory (npu-emu:cpu)"
        return Capacity(_at_least_one_block(tokens, cfg.npu_block_size), seqs, how)
    if gpu is None:
        return Capacity(CPU_KV_TOKENS, seqs, "the CPU default")
    tokens = gpu[0] // _paged_bytes_per_token(cfg, mc, heads)
    return Capacity(_at_least_one_block(tokens, cfg.gpu_block_size), seqs, gpu[1])


def _at_least_one_block(tokens: int, block: int) -> int:
    if tokens < block:
        raise MemoryError(f"no room for a KV cache: the memory rule leaves {max(0, tokens)} tokens; lower the other "
                          "engines' share, raise --gpu-memory-utilization / --npu-memory-utilization, or give --kv-tokens")
    return tokens // block * block


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters and buffers (what it holds on its device)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
