"""One rank of an instance: what every rank of a prefill or decode instance holds (its model shard,
its heads' KV cache, its own transport and HAWK sender or receiver).

Its own module because both sides build ranks: the instances (rank 0) and the follower processes
of tensor parallelism (``tp_ranks``), which the instances start. Neither imports the other's
module for them, so the two stay free of an import circle.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from hawk.config import ServeConfig
from hawk.connector.algorithm1 import KVTransferFailed, PullResult
from hawk.connector.configs import GpuSide, NpuSide, get_config, make_receiver, make_sender
from hawk.devices.emulated import open_npu
from hawk.devices.timing import copy_model_for
from hawk.engine import capacity
from hawk.engine.block_manager import BlockManager
from hawk.engine.loader import LoadedModel, load_model
from hawk.engine.npu_attention import NpuTileAttention
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.tensor_parallel import Shard, kv_request_id, overlapping_ranks
from hawk.engine.transfer_buffers import MiB, buffer_mb, max_request_tokens
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.device import parse_device
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.cost_model import cost_model_for
from hawk.transport.registry import make_transport

log = logging.getLogger(__name__)
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


def decode_len(cfg: InstanceConfig, mc: Any) -> int:
    """Longest sequence a decode backend must address: sizes its block tables (copied every step)."""
    return min(cfg.max_model_len or mc.max_position_embeddings, cfg.kv_tokens)


def gpu_layout(cfg: InstanceConfig, mc: Any, tokens: int, shard: Shard = Shard()) -> GpuKVLayout:
    """The paged cache of one rank: its KV heads only, ``head_start`` naming the first."""
    blocks = -(-tokens // cfg.gpu_block_size)
    heads = shard.kv_heads(mc.num_kv_heads)
    return GpuKVLayout(mc.num_layers, blocks, cfg.gpu_block_size, len(heads), mc.head_dim, cfg.gpu_kv_dtype, head_start=heads.start)


class PrefillRank:
    """What every rank of a prefill instance holds: its model shard, its heads' paged cache, its
    own transport and HAWK sender (own staging buffer, own control socket)."""

    def __init__(self, cfg: InstanceConfig, shard: Shard = Shard(), loaded: LoadedModel | None = None):
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, compute_dtype(cfg), cfg.seed, shard=shard)
        mc = self.loaded.config
        self.capacity = capacity.resolve(cfg, mc, "prefill", capacity.weight_bytes(self.loaded.model))
        self.cfg, self.shard = cfg, shard  # unresolved: the transfer buffers are sized from what the user gave
        self.layout = gpu_layout(cfg, mc, self.capacity.kv_tokens, shard)
        self.caches = self.layout.allocate(cfg.prefill_device)
        self.transport = make_transport(cfg.transport)
        self.staging_bytes = buffer_mb(cfg, mc, "staging") * MiB
        if cfg.staging_mb is None:
            log.info("staging buffer: auto, %d MiB (the KV of %d tokens)", self.staging_bytes // MiB, max_request_tokens(cfg, mc))
        self.sender = make_sender(
            cfg.transfer, self.transport, self.caches, self.layout, self.staging_bytes,
            host=cfg.kv_host or LOOPBACK, port=cfg.kv_port if not shard.parallel else 0, ttl_s=cfg.kv_ttl_s, link_gbps=cfg.link_gbps,
        )

    def kv_ids(self, request_id: str) -> list[str]:
        """The entries this rank offers for a request: one per decode rank sharing its heads."""
        heads = self.layout.heads
        dtp = self.cfg.decode_tp
        return [kv_request_id(request_id, j, dtp) for j in overlapping_ranks(heads, self.loaded.config.num_kv_heads, dtp)]

    def close(self) -> None:
        self.sender.close()
        self.transport.close()


class DecodeRank:
    """What every rank of a decode instance holds: its model shard, the KV cache of its heads (NPU
    tiles or a paged cache), the attention over it, its own transport and HAWK receiver."""

    def __init__(self, cfg: InstanceConfig, shard: Shard = Shard(), loaded: LoadedModel | None = None):
        tc = get_config(cfg.transfer)
        compute = cfg.decode_compute_device
        self.loaded = loaded or load_model(cfg.model, compute, compute_dtype(cfg), cfg.seed, shard=shard)
        mc = self.loaded.config
        heads = shard.kv_heads(mc.num_kv_heads)
        self.heads = heads
        rx = self.rx_bytes = buffer_mb(cfg, mc, "rx") * MiB  # from the config as given, as the prefill sizes its staging
        if cfg.rx_mb is None:
            log.info("receive buffers: auto, %d MiB (the KV of %d tokens)", rx // MiB, max_request_tokens(cfg, mc))
        self.capacity = capacity.resolve(cfg, mc, "decode", capacity.weight_bytes(self.loaded.model), len(heads), rx)
        cfg = dataclasses.replace(cfg, kv_tokens=self.capacity.kv_tokens, max_batch=self.capacity.max_num_seqs)
        self.cfg, self.shard = cfg, shard
        self.transport = make_transport(cfg.transport)
        self.npu = None
        if tc.decode_on == "npu":
            arch0 = get_arch(cfg.arch)
            blocks = -(-cfg.kv_tokens // cfg.npu_block_size)
            probe = NpuKVLayout(arch0, mc.num_layers, blocks, len(heads), cfg.npu_block_size, mc.head_dim, cfg.kv_dtype, shard_pages=cfg.npu_shard_pages, head_start=heads.start)
            kv_per_bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank
            rx_per_bank = rx if tc.rx_in_one_bank else -(-rx // arch0.num_channels)
            bank = int((kv_per_bank + rx_per_bank) * 1.25) + 4 * MiB
            self.npu = open_npu(cfg.decode_device, cfg.arch, bank_capacity=-(-bank // MiB) * MiB, copy_timing=copy_model_for(cfg.npu_timing))
            layout = NpuKVLayout(self.npu.arch, mc.num_layers, blocks, len(heads), cfg.npu_block_size, mc.head_dim, cfg.kv_dtype, shard_pages=cfg.npu_shard_pages, head_start=heads.start)
            self.kv = NpuKVCacheMemory(self.npu, layout)
            self.attn: Any = NpuTileAttention(self.kv, max_batch=cfg.max_batch, max_model_len=decode_len(cfg, mc))
            self.blocks = BlockManager(blocks, cfg.npu_block_size)
            memory = parse_device(cfg.decode_device).memory_kind
            side: Any = NpuSide(self.npu, self.kv, rx, cost_model_for(cfg.transport, memory), cfg.landing_mode)
        else:
            layout_g = gpu_layout(cfg, mc, cfg.kv_tokens, shard)
            self.caches = layout_g.allocate(compute)
            self.attn = PagedAttention(layout_g, self.caches, max_batch=cfg.max_batch, max_model_len=decode_len(cfg, mc),
                                       decode_split_tokens=cfg.decode_split_tokens)
            self.blocks = BlockManager(layout_g.num_blocks, layout_g.block_size)
            side = GpuSide(self.caches, layout_g, rx)
        self.receiver = make_receiver(cfg.transfer, self.transport, side, post=cfg.post, link_gbps=cfg.link_gbps)

    def pull_pairs(self, address: str, request_id: str, block_ids: list[int], num_tokens: int | None = None) -> list[PullResult]:
        """This rank's part of a request: one Algorithm-1 transfer from each prefill rank (one
        address each, comma-separated) that holds some of this rank's heads."""
        out = []
        kv_id = kv_request_id(request_id, self.shard.rank, self.cfg.decode_tp)
        for addr in address.split(","):
            theirs = self.receiver.peer_layout(addr).heads
            if max(theirs.start, self.heads.start) < min(theirs.stop, self.heads.stop):
                out.append(self.receiver.pull(addr, kv_id, block_ids, num_tokens=num_tokens))
        if not out:
            raise KVTransferFailed(f"request {request_id}: no prefill rank at {address} holds KV heads {self.heads.start}..{self.heads.stop - 1}")
        return out

    def close(self) -> None:
        self.receiver.close()
        self.transport.close()
        if self.npu is not None:
            self.kv.close()


def ledger(rank: DecodeRank) -> dict[str, Any]:
    """A decode rank's receive-side ledger as plain data (``/internal/accounting``)."""
    a = rank.receiver.accounting()
    return {
        "rx_reservations": len(a["reservations"]), "rx_bytes": sum(r.size for r in a["reservations"]), "rx_held": held(a["reservations"]),
        "draining": a["draining"], "kv_expecting": a.get("expecting", []), "rx_waiting": a.get("waiting_for_room", []),
    }
