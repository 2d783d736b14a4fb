"""The decode side's KV cache memory on the NPU: 2L interleaved tensors, placed by the device allocator."""

from __future__ import annotations

import numpy as np
import torch

from hawk.devices.backend import NpuBackend
from hawk.devices.dram_allocator import Allocation
from hawk.layouts.npu import NpuKVLayout
from hawk.layouts.tt import bytes_to_tiles, from_tiles


class NpuKVCacheMemory:
    """Allocates tensor ``t = 2*layer + kv`` of ``layout`` and exposes its pages where they live."""

    def __init__(self, npu: NpuBackend, layout: NpuKVLayout, owner: str = "kv-cache"):
        if npu.arch.num_banks != layout.arch.num_banks:
            raise ValueError(f"layout is for {layout.arch.name}, device is {npu.arch.name}")
        self.npu = npu
        self.layout = layout
        buf = layout.tensor_buffer(0)
        self.allocs: list[Allocation] = []
        try:
            for t in range(layout.num_tensors):
                self.allocs.append(npu.allocate_interleaved(buf.bytes_per_bank, f"{owner}:L{t // 2}{'KV'[t % 2]}"))
        except BaseException:
            self.close()
            raise
        slots = buf.page_map.slots_per_bank(layout.pages_per_tensor)
        self._views = [npu.interleaved_pages(a.address, buf.aligned_page, slots) for a in self.allocs]
        self._bases = tuple(int(a.address) for a in self.allocs)  # fixed for the cache's life; planning reads it per request

    @property
    def bases(self) -> tuple[int, ...]:
        return self._bases

    def pages(self, t: int) -> torch.Tensor:
        """``[banks, slots, aligned_page]`` view of tensor ``t``'s pages (index it with the page map)."""
        return self._views[t]

    def read_blocks(self, t: int, blocks: torch.Tensor) -> torch.Tensor:
        """Decode blocks of tensor ``t`` to float32 ``[n, heads, block_size, head_dim]``."""
        lay = self.layout
        n = blocks.numel()
        page = (blocks.to(torch.int64)[:, None] * lay.tiles_per_block + torch.arange(lay.tiles_per_block, device=blocks.device)).reshape(-1)
        pm = lay.page_map
        raw = self._views[t][pm.bank(page), pm.slot(page), : lay.page_size]
        return from_tiles(bytes_to_tiles(raw, lay.dtype), (n, lay.num_kv_heads, lay.block_size, lay.head_dim))

    def read_tensor(self, t: int) -> torch.Tensor:
        blocks = torch.arange(self.layout.max_num_blocks, device=self.npu.torch_device)
        return self.read_blocks(t, blocks)

    def page_locations(self, t: int, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _, chan, addr = self.layout.tensor_buffer(self.allocs[t].address).locate(pages)
        return chan, addr

    def close(self) -> None:
        for a in self.allocs:
            self.npu.free(a)
        self.allocs = []

    def write_pages(self, t: int, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Store encoded tiles ``data [n, page_size]`` as pages ``pages`` of tensor ``t`` (a scatter on the device)."""
        pm = self.layout.page_map
        pages = pages.to(torch.int64)
        self._views[t][pm.bank(pages), pm.slot(pages), : self.layout.page_size] = data
