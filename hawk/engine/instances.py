"""Whole instances, assembled: a prefill instance (model + paged GPU cache + HAWK sender), a decode
instance (model + NPU or GPU cache + HAWK receiver), and the colocated reference (no transfer).

These are what the servers wrap and what tests and benchmarks drive directly.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hawk.config import ServeConfig
from hawk.connector.configs import GpuSide, NpuSide, get_config, make_receiver, make_sender
from hawk.devices.emulated import open_npu
from hawk.engine.block_manager import BlockManager
from hawk.engine.decode_engine import DecodeEngine, LocalKV, RemoteKV
from hawk.engine.loader import LoadedModel, load_model
from hawk.engine.npu_attention import NpuTileAttention
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.prefill_engine import PrefillEngine
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.device import parse_device
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.cost_model import cost_model_for
from hawk.transport.registry import make_transport

MiB = 1 << 20
LOOPBACK = "127.0.0.1"  # the KV control socket's address when the config names none
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


#: What an instance needs to start is the serving config, described once in ``hawk/config.py``.
InstanceConfig = ServeConfig


def compute_dtype(cfg: ServeConfig) -> torch.dtype:
    """The torch dtype of ``cfg.dtype`` (the config itself stays torch-free)."""
    return DTYPES[cfg.dtype]


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
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, compute_dtype(cfg), cfg.seed)
        mc = self.loaded.config
        self.layout = _gpu_layout(cfg, mc, cfg.kv_tokens)
        self.caches = self.layout.allocate(cfg.prefill_device)
        self.transport = make_transport(cfg.transport)
        self.sender = make_sender(
            cfg.transfer, self.transport, self.caches, self.layout, cfg.staging_mb * MiB,
            host=cfg.kv_host or LOOPBACK, port=cfg.kv_port, ttl_s=cfg.kv_ttl_s,
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
        self.loaded = loaded or load_model(cfg.model, compute, compute_dtype(cfg), cfg.seed)
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
            memory = parse_device(cfg.decode_device).memory_kind
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
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, compute_dtype(cfg), cfg.seed)
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
