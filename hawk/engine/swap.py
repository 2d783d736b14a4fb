"""Copying a sequence's KV blocks out of a decode cache to host memory and back (preemption by swap).

A disaggregated decode instance cannot recompute a preempted sequence's KV: the NPU backend has
no prefill, and the prompt's KV came over the wire. So preemption swaps: the raw bytes of the
victim's blocks go to host memory, the blocks are freed, and on resume the bytes are written into
whatever blocks are free then. Bytes are copied as they are (tiles, bfloat8_b exponents and all),
so a resumed sequence attends over exactly the KV it had, and generates exactly the same tokens.

The swappers only read and write blocks through the caches' public layout objects and memory
views; the attention backends' logic is untouched (they address blocks by id each step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hawk.layouts.gpu import GpuKVLayout
from hawk.memory.npu_kv_cache import NpuKVCacheMemory


class SwapError(RuntimeError):
    """A swap could not be done (no swapper for this cache, or host data that does not fit)."""


@dataclass
class SwappedKV:
    """A preempted sequence's KV on the host: one tensor per cache tensor, blocks in sequence order."""

    num_blocks: int
    data: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


class BlockSwapper(Protocol):
    def swap_out(self, block_ids: Sequence[int]) -> SwappedKV:
        """Copy ``block_ids`` (in order) to host memory; the blocks may be freed afterwards."""
        ...

    def swap_in(self, kv: SwappedKV, block_ids: Sequence[int]) -> None:
        """Write ``kv`` into the first ``kv.num_blocks`` of ``block_ids`` (a sequence's new blocks)."""
        ...


def _check_in(kv: SwappedKV, block_ids: Sequence[int]) -> None:
    if len(block_ids) < kv.num_blocks:
        raise SwapError(f"{kv.num_blocks} swapped blocks need as many destination blocks, got {len(block_ids)}")


class PagedSwapper:
    """The vLLM-layout paged cache: per layer ``[2, num_blocks, ...]``; a block is ``cache[:, b]``."""

    def __init__(self, layout: GpuKVLayout, caches: Sequence[torch.Tensor]):
        layout.check_cache(list(caches))
        self.layout, self.caches = layout, list(caches)

    def swap_out(self, block_ids: Sequence[int]) -> SwappedKV:
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.caches[0].device)
        return SwappedKV(len(block_ids), [c.index_select(1, idx).to("cpu") for c in self.caches])

    def swap_in(self, kv: SwappedKV, block_ids: Sequence[int]) -> None:
        _check_in(kv, block_ids)
        idx = torch.tensor(list(block_ids)[: kv.num_blocks], dtype=torch.int64, device=self.caches[0].device)
        for c, d in zip(self.caches, kv.data):
            c.index_copy_(1, idx, d.to(c.device))


class NpuPageSwapper:
    """The NPU's tiled cache: block ``b`` of tensor ``t`` is pages ``b*tiles_per_block + [0, tiles)``,
    placed in banks by the layout's page map; each page's ``page_size`` bytes are what is copied."""

    def __init__(self, kv: NpuKVCacheMemory):
        self.kv = kv
        self.layout = kv.layout

    def _pages(self, block_ids: Sequence[int]) -> torch.Tensor:
        lay = self.layout
        device = self.kv.pages(0).device
        blocks = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
        return (blocks[:, None] * lay.tiles_per_block + torch.arange(lay.tiles_per_block, device=device)).reshape(-1)

    def swap_out(self, block_ids: Sequence[int]) -> SwappedKV:
        pages, pm, size = self._pages(block_ids), self.layout.page_map, self.layout.page_size
        bank, slot = pm.bank(pages), pm.slot(pages)
        data = [self.kv.pages(t)[bank, slot, :size].to("cpu") for t in range(self.layout.num_tensors)]
        return SwappedKV(len(block_ids), data)

    def swap_in(self, kv: SwappedKV, block_ids: Sequence[int]) -> None:
        _check_in(kv, block_ids)
        pages = self._pages(list(block_ids)[: kv.num_blocks])
        for t, d in enumerate(kv.data):
            self.kv.write_pages(t, pages, d.to(pages.device))


def swapper_for(attn: Any) -> BlockSwapper | None:
    """The swapper for a decode backend's cache, found through its public attributes; None when
    the backend's cache is of neither kind (then the engine cannot preempt by swapping)."""
    kv = getattr(attn, "kv", None)
    if isinstance(kv, NpuKVCacheMemory):
        return NpuPageSwapper(kv)
    layout, caches = getattr(attn, "layout", None), getattr(attn, "caches", None)
    if isinstance(layout, GpuKVLayout) and caches is not None:
        return PagedSwapper(layout, caches)
    return None
