"""Small sender/receiver pairs for connector tests: every configuration, tiny shapes, in one process."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hawk.connector.configs import GpuSide, NpuSide, get_config, make_npu_sender, make_receiver, make_sender
from hawk.devices.emulated import open_npu
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.layouts.tt import tiles_to_bytes, to_tiles
from hawk.plan.cost_model import cost_model_for

L, H, D = 2, 2, 64
GPU_BLOCK, NPU_BLOCK = 16, 64


@dataclass
class Pair:
    config: str
    caches: list
    src: GpuKVLayout
    sender: object
    receiver: object
    tp: object
    td: object
    kv: object = None
    dcaches: list = field(default_factory=list)
    src_kv: object = None  # reverse direction: the NPU cache the KV comes from
    freed: list = field(default_factory=list)
    dead_senders: list = field(default_factory=list)

    def respawn_sender(self, transport) -> None:
        """The prefill instance dies and a new one takes its place (same KV cache contents)."""
        old, old_t = self.sender, self.tp
        old.close()
        old_t.close()
        self.tp = transport
        self.sender = make_sender(self.config, transport, self.caches, self.src, 1 << 20, ttl_s=old.ttl_s, reap_every_s=0.02)
        self.dead_senders.append(old)

    def add(self, rid: str, tokens: int, blocks: list[int]) -> None:
        self.sender.add(rid, tokens, blocks, lambda rid=rid: self.freed.append(rid))

    def _source_rows(self, layer: int, kv: int, tokens: int, src_blocks: list[int]) -> torch.Tensor:
        if self.src_kv is not None:  # reverse: decode the NPU tiles of the source blocks
            x = self.src_kv.read_blocks(2 * layer + kv, torch.tensor(src_blocks[: -(-tokens // NPU_BLOCK)]))
            return x.permute(0, 2, 1, 3).reshape(-1, H, D)[:tokens]
        return torch.stack([self.caches[layer][kv, src_blocks[t // GPU_BLOCK], t % GPU_BLOCK] for t in range(tokens)]).float()

    def landed(self, tokens: int, gpu_blocks: list[int], dst_blocks: list[int]) -> bool:
        """Whether the destination holds exactly the request's rows."""
        for layer in range(L):
            for kv in range(2):
                want = self._source_rows(layer, kv, tokens, gpu_blocks)
                if self.kv is not None:
                    got = self.kv.read_blocks(2 * layer + kv, torch.tensor(dst_blocks, device=self.kv.npu.torch_device))
                    got = got.permute(0, 2, 1, 3).reshape(-1, H, D)[:tokens]
                else:
                    got = torch.stack([self.dcaches[layer][kv, dst_blocks[t // GPU_BLOCK], t % GPU_BLOCK] for t in range(tokens)]).float()
                if not torch.equal(got.cpu(), want.cpu()):
                    return False
        return True

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
        self.td.close()
        self.tp.close()
        for kv in (self.kv, self.src_kv):
            if kv is not None:
                kv.close()


def sources(config: str, seed: int = 0, device: str = "cpu"):
    """The sending side's KV, seeded: a paged GPU cache (on ``device``), or (reverse direction) an NPU cache full of tiles."""
    g = torch.Generator().manual_seed(seed)
    src = GpuKVLayout(L, 64, GPU_BLOCK, H, D)
    caches = [torch.randn(src.layer_shape, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(L)]
    src_kv = None
    if get_config(config).prefill_on == "npu":
        npu = open_npu("npu-emu:cpu", "blackhole-p150a", bank_capacity=4 << 20)
        src_kv = NpuKVCacheMemory(npu, NpuKVLayout(npu.arch, L, 16, H, NPU_BLOCK, D))
        pages = torch.arange(src_kv.layout.pages_per_tensor)
        for t in range(src_kv.layout.num_tensors):
            tiles = torch.randn(len(pages), 32, 32, generator=g)
            src_kv.write_pages(t, pages, tiles_to_bytes(to_tiles(tiles), "bf16"))
    return src, caches, src_kv


def make_source_sender(config: str, tp, src, caches, src_kv, staging_bytes: int = 1 << 20, **kw):
    if src_kv is not None:
        return make_npu_sender(config, tp, src_kv, staging_bytes, **kw)
    return make_sender(config, tp, caches, src, staging_bytes, **kw)


def make_pair(config: str, tp, td, ttl_s: float = 30.0, timeout_s: float = 5.0, rx_bytes: int = 1 << 20, post: str = "pull", seed: int = 0,
              device: str = "cpu", staging_bytes: int = 1 << 20) -> Pair:
    """Both sides in this process; their KV memory (caches, the emulated NPU's DRAM) on ``device``."""
    src, caches, src_kv = sources(config, seed, device)
    sender = make_source_sender(config, tp, src, caches, src_kv, staging_bytes, ttl_s=ttl_s, reap_every_s=0.02)
    kv, dcaches = None, []
    if get_config(config).decode_on == "npu":
        npu = open_npu(f"npu-emu:{device}", "blackhole-p150a", bank_capacity=4 << 20)
        kv = NpuKVCacheMemory(npu, NpuKVLayout(npu.arch, L, 16, H, NPU_BLOCK, D))
        side = NpuSide(npu, kv, rx_bytes, cost_model_for("local", device))
    else:
        dcaches = src.allocate(device)
        side = GpuSide(dcaches, src, rx_bytes)
    receiver = make_receiver(config, td, side, post=post, timeout_s=timeout_s)
    return Pair(config, caches, src, sender, receiver, tp, td, kv, dcaches, src_kv=src_kv)


def dst_blocks_for(config: str, tokens: int, start: int = 0) -> list[int]:
    size = NPU_BLOCK if get_config(config).decode_on == "npu" else GPU_BLOCK
    return list(range(start, start + -(-tokens // size)))
