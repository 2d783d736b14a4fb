"""Whole instances, assembled: a prefill instance (model + paged GPU cache + HAWK sender), a decode
instance (model + NPU or GPU cache + HAWK receiver), and the colocated reference (no transfer).

These are what the servers wrap and what tests and benchmarks drive directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hawk.connector.configs import GpuSide, NpuSide, get_config, make_receiver, make_sender
from hawk.devices.emulated import open_npu
from hawk.engine.block_manager import BlockManager
from hawk.engine.decode_engine import DecodeEngine, LocalKV, RemoteKV
from hawk.engine.loader import LoadedModel, load_model
from hawk.engine.npu_attention import NpuTileAttention
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.prefill_engine import PrefillEngine
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.cost_model import cost_model_for
from hawk.transport.registry import make_transport

MiB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class InstanceConfig:
    """Everything an instance needs to start; the command line fills it."""

    model: str = "smollm2-135m"
    dtype: str = "fp32"  # compute dtype
    transfer: str = "gn-hawk"  # gg-host | gn-host | gg-direct | gn-direct-single | gn-hawk | colocated
    transport: str = "nixl"
    prefill_device: str = "cpu"
    decode_device: str = "npu-emu:cpu"  # npu-emu:cpu, npu-emu:cuda:N (gn-*); cpu or cuda:N (gg-*)
    arch: str = "blackhole-p150a"
    kv_dtype: str = "bf16"  # NPU KV dtype: bf16 | bfp8_b
    gpu_kv_dtype: str = "bf16"  # the paged GPU cache (vLLM's kv_cache_dtype)
    npu_shard_pages: int = 1  # the NPU cache's page map: 1 = interleaved (tt-metal), more = block-cyclic
    gpu_block_size: int = 16
    npu_block_size: int = 64
    kv_tokens: int = 8192  # KV-cache capacity of each instance, in tokens
    staging_mb: int = 64
    rx_mb: int = 64
    landing_mode: str = "auto"
    post: str = "pull"
    host: str = "127.0.0.1"
    kv_port: int = 0
    seed: int = 0
    kv_ttl_s: float = 30.0
    max_batch: int = 64  # decode: sequences per step (and the largest CUDA-graph bucket)
    max_model_len: int = 0  # decode: longest prompt + output accepted; 0 = the model's context length
    graphs: bool | None = None  # decode CUDA graphs: None = when the device and backend allow
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> "InstanceConfig":
        """Refuse inconsistent options before anything is started; returns self."""
        from hawk.layouts.dtypes import check_npu_dtype
        from hawk.transport.registry import TRANSPORTS

        self.torch_dtype  # noqa: B018 - raises for an unknown compute dtype
        check_npu_dtype(self.kv_dtype)
        get_arch(self.arch)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; expected one of {list(TRANSPORTS)}")
        if self.landing_mode not in ("auto", "staging", "direct"):
            raise ValueError(f"landing mode must be auto, staging or direct, got {self.landing_mode!r}")
        if self.post not in ("pull", "push"):
            raise ValueError(f"post must be pull or push, got {self.post!r}")
        for name in ("kv_tokens", "staging_mb", "rx_mb", "gpu_block_size", "npu_block_size", "max_batch", "npu_shard_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's), got {self.max_model_len}")
        if self.transfer == "colocated":
            return self
        if get_config(self.transfer).prefill_on == "npu":
            raise ValueError(
                f"{self.transfer} sends from an NPU prefill instance, and HAWK has no NPU prefill engine yet: "
                "the reverse direction runs in `hawk bench transfer --configs ng-hawk` and the connector tests"
            )
        on_npu = get_config(self.transfer).decode_on == "npu"
        if on_npu != self.decode_device.startswith("npu-emu"):
            want = "npu-emu:cpu or npu-emu:cuda:N" if on_npu else "cpu or cuda:N"
            raise ValueError(f"{self.transfer} decodes on {'an NPU' if on_npu else 'a GPU'}: --decode-device must be {want}, not {self.decode_device!r}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown compute dtype {self.dtype!r}; expected one of {list(DTYPES)}") from None

    @property
    def decode_compute_device(self) -> str:
        """Where decode math runs: beside the emulated NPU's memory, or on the decode GPU."""
        if self.decode_device.startswith("npu-emu"):
            return self.decode_device.partition(":")[2] or "cpu"
        return self.decode_device


def held(reservations: list[Any]) -> list[dict[str, Any]]:
    """What is reserved, by which request, since when: the ledger rows as plain data."""
    now = time.monotonic()
    return [{"request": r.owner, "buffer": r.buffer, "offset": r.offset, "bytes": r.size, "held_s": round(now - r.since, 3)} for r in reservations]


def _decode_len(cfg: InstanceConfig, mc: Any) -> int:
    """Longest sequence a decode backend must address: sizes its block tables (copied every step)."""
    return min(cfg.max_model_len or mc.max_position_embeddings, cfg.kv_tokens)


def _gpu_layout(cfg: InstanceConfig, mc: Any, tokens: int) -> GpuKVLayout:
    blocks = -(-tokens // cfg.gpu_block_size)
    return GpuKVLayout(mc.num_layers, blocks, cfg.gpu_block_size, mc.num_kv_heads, mc.head_dim, cfg.gpu_kv_dtype)


class PrefillInstance:
    """The GPU role: batched prefill into a vLLM-layout paged cache, KV offered through HAWK's sender."""

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        if cfg.transfer == "colocated":
            raise ValueError("colocated mode has no separate prefill instance (use ColocatedInstance)")
        self.cfg = cfg.validate()
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, cfg.torch_dtype, cfg.seed)
        mc = self.loaded.config
        self.layout = _gpu_layout(cfg, mc, cfg.kv_tokens)
        self.caches = self.layout.allocate(cfg.prefill_device)
        self.transport = make_transport(cfg.transport)
        self.sender = make_sender(
            cfg.transfer, self.transport, self.caches, self.layout, cfg.staging_mb * MiB,
            host=cfg.host, port=cfg.kv_port, ttl_s=cfg.kv_ttl_s,
        )
        self.engine = PrefillEngine(self.loaded.model, self.layout, self.caches, self.sender.add)

    @property
    def kv_address(self) -> str:
        return self.sender.address

    def accounting(self) -> dict[str, Any]:
        a = self.sender.accounting()
        return {
            "staging_reservations": len(a["staging"]),
            "staging_bytes": sum(r.size for r in a["staging"]),
            "staging_held": held(a["staging"]),
            "kv_waiting": a["waiting"],
            "kv_in_flight": a["in_flight"],
            "draining": a["draining"],
            "gpu_blocks_used": self.engine.blocks.num_blocks - self.engine.blocks.num_free,
            "gpu_blocks_total": self.engine.blocks.num_blocks,
        }

    def close(self) -> None:
        self.engine.close()
        self.sender.close()
        self.transport.close()


class DecodeInstance:
    """The NPU role (emulated NPU, tiled KV cache) or, for gg-*, a GPU with a paged cache."""

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        self.cfg = cfg.validate()
        tc = get_config(cfg.transfer)
        compute = cfg.decode_compute_device
        self.loaded = loaded or load_model(cfg.model, compute, cfg.torch_dtype, cfg.seed)
        mc = self.loaded.config
        self.transport = make_transport(cfg.transport)
        rx = cfg.rx_mb * MiB
        self.npu = None
        if tc.decode_on == "npu":
            arch0 = get_arch(cfg.arch)
            blocks = -(-cfg.kv_tokens // cfg.npu_block_size)
            probe = NpuKVLayout(arch0, mc.num_layers, blocks, mc.num_kv_heads, cfg.npu_block_size, mc.head_dim, cfg.kv_dtype, shard_pages=cfg.npu_shard_pages)
            kv_per_bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank
            rx_per_bank = rx if cfg.transfer == "gn-direct-single" else -(-rx // arch0.num_channels)
            bank = int((kv_per_bank + rx_per_bank) * 1.25) + 4 * MiB
            self.npu = open_npu(cfg.decode_device, cfg.arch, bank_capacity=-(-bank // MiB) * MiB)
            layout = NpuKVLayout(self.npu.arch, mc.num_layers, blocks, mc.num_kv_heads, cfg.npu_block_size, mc.head_dim, cfg.kv_dtype, shard_pages=cfg.npu_shard_pages)
            self.kv = NpuKVCacheMemory(self.npu, layout)
            attn: Any = NpuTileAttention(self.kv, max_batch=cfg.max_batch, max_model_len=_decode_len(cfg, mc))
            self.blocks = BlockManager(blocks, cfg.npu_block_size)
            memory = cfg.decode_device.partition(":")[2] or "cpu"
            side: Any = NpuSide(self.npu, self.kv, rx, cost_model_for(cfg.transport, memory), cfg.landing_mode)
        else:
            layout_g = _gpu_layout(cfg, mc, cfg.kv_tokens)
            self.caches = layout_g.allocate(compute)
            attn = PagedAttention(layout_g, self.caches, max_batch=cfg.max_batch, max_model_len=_decode_len(cfg, mc))
            self.blocks = BlockManager(layout_g.num_blocks, layout_g.block_size)
            side = GpuSide(self.caches, layout_g, rx)
        self.receiver = make_receiver(cfg.transfer, self.transport, side, post=cfg.post)
        eos = tuple(self.loaded.config.eos_token_ids)
        self.engine = DecodeEngine(
            self.loaded.model, attn, RemoteKV(self.blocks, self.receiver), eos, cfg.max_batch,
            graphs=cfg.graphs, max_model_len=cfg.max_model_len or None,
        )
        self.engine.warmup()  # capture the decode graphs before traffic (none on a CPU)

    def accounting(self) -> dict[str, Any]:
        a = self.receiver.accounting()
        out = {
            "rx_reservations": len(a["reservations"]),
            "rx_bytes": sum(r.size for r in a["reservations"]),
            "rx_held": held(a["reservations"]),
            "draining": a["draining"],
            "kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks,
        }
        if self.npu is not None:
            out["npu_channels"] = {c: {"used": u, "capacity": cap} for c, (u, cap) in self.npu.channel_usage().items()}
        return out

    def close(self) -> None:
        self.engine.close()
        self.receiver.close()
        self.transport.close()
        if self.npu is not None:
            self.kv.close()


class ColocatedInstance:
    """The oracle: one model prefilling and decoding over one paged cache, with no transfer."""

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        self.cfg = cfg
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, cfg.torch_dtype, cfg.seed)
        mc = self.loaded.config
        self.layout = _gpu_layout(cfg, mc, cfg.kv_tokens)
        self.caches = self.layout.allocate(cfg.prefill_device)
        self.blocks = BlockManager(self.layout.num_blocks, self.layout.block_size)
        self._handed: dict[str, list[int]] = {}
        self.prefill = PrefillEngine(self.loaded.model, self.layout, self.caches, self._handoff, block_manager=self.blocks)
        attn = PagedAttention(self.layout, self.caches, max_batch=cfg.max_batch, max_model_len=_decode_len(cfg, mc))
        self.decode = DecodeEngine(
            self.loaded.model, attn, LocalKV(self.blocks), tuple(mc.eos_token_ids), cfg.max_batch,
            graphs=cfg.graphs, max_model_len=cfg.max_model_len or None,
        )
        self.decode.warmup()

    def _handoff(self, request_id: str, num_tokens: int, blocks: list[int], free: Any) -> None:
        self._handed[request_id] = blocks  # the decode engine takes these blocks over as they are

    def take_blocks(self, request_id: str) -> list[int]:
        return self._handed.pop(request_id)

    def discard(self, request_id: str) -> bool:
        """Free a prefilled request's blocks that will never be decoded (its client left)."""
        blocks = self._handed.pop(request_id, None)
        if blocks is not None:
            self.blocks.free(blocks)
        return blocks is not None

    def accounting(self) -> dict[str, Any]:
        return {"kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free, "kv_blocks_total": self.blocks.num_blocks, "handed_over": len(self._handed)}

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        for b in self._handed.values():
            self.blocks.free(b)
        self._handed.clear()
