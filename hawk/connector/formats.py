"""What the prefill side sends: the form a request's KV takes in the sender's registered memory.

- ``npu-tiles``: HAWK's transform output (NPU tiles grouped by channel) in a staging region.
- ``compact``  : the request's vLLM blocks gathered in order, in a staging region (host for ``*-host``).
- ``cache``    : nothing is produced; the peer reads blocks straight out of the paged cache (gg-direct).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from hawk.devices.batched_copy import copy_regions
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.plan.block_plan import BlockCopyPlan, plan_block_copy
from hawk.plan.kv_plan import KVTransferPlan, plan_kv_transfer
from hawk.transform import transform


class SendFormat(ABC):
    name: ClassVar[str]
    #: True when the peer reads the paged cache itself, so the blocks stay allocated until D9.
    reads_cache_in_place: ClassVar[bool] = False

    def __init__(self, caches: Sequence[torch.Tensor], layout: GpuKVLayout):
        layout.check_cache(list(caches))
        self.caches = list(caches)
        self.layout = layout

    @abstractmethod
    def plan(self, num_tokens: int, block_ids: Sequence[int], peer: dict[str, Any], dst_block_ids: Sequence[int]) -> Any:
        """Build this request's plan from the receiver's handshake info and its D1 request."""

    @abstractmethod
    def size(self, plan: Any) -> int:
        """Bytes to reserve in staging (0 when nothing is staged)."""

    def produce(self, plan: Any, out: torch.Tensor) -> None:
        """Write the request's bytes into ``out`` (the reserved staging range)."""

    def extents(self, plan: Any) -> list[list[int]]:
        return []


class NpuTiles(SendFormat):
    """HAWK: gather + re-block + tilize (+ bfloat8_b) + channel grouping, straight into staging."""

    name = "npu-tiles"

    def __init__(self, caches: Sequence[torch.Tensor], layout: GpuKVLayout, impl: str = "auto"):
        super().__init__(caches, layout)
        self.impl = impl

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> KVTransferPlan:
        dst = peer["layout"]
        if not isinstance(dst, NpuKVLayout):
            raise ValueError("npu-tiles needs an NPU receiver layout")
        return plan_kv_transfer(num_tokens, block_ids, dst_block_ids, self.layout, dst, peer["bases"])

    def size(self, plan: KVTransferPlan) -> int:
        return plan.total_bytes

    def produce(self, plan: KVTransferPlan, out: torch.Tensor) -> None:
        if out.device == self.caches[0].device:
            transform(self.caches, plan, out, self.impl)
        else:  # staging elsewhere (e.g. host): transform on the cache's device, then one copy
            out.copy_(transform(self.caches, plan, None, self.impl))

    def extents(self, plan: KVTransferPlan) -> list[list[int]]:
        return [list(e) for e in plan.channel_extents]


def gather_compact(caches: Sequence[torch.Tensor], plan: BlockCopyPlan) -> torch.Tensor:
    """``[layers, 2, n, ...]`` of the request's blocks, contiguous, on the caches' device."""
    ids = torch.as_tensor(plan.src_block_ids, device=caches[0].device)
    return torch.stack([c.index_select(1, ids) for c in caches])


class CompactBlocks(SendFormat):
    """The request's blocks as they are, gathered into staging (the host-staged baselines)."""

    name = "compact"

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> BlockCopyPlan:
        return plan_block_copy(num_tokens, block_ids, self.layout)

    def size(self, plan: BlockCopyPlan) -> int:
        return plan.total_bytes

    def produce(self, plan: BlockCopyPlan, out: torch.Tensor) -> None:
        if out.device == self.caches[0].device:
            copy_regions(plan.gather_copies(), {-1: out, **dict(enumerate(self.caches))})
        else:  # gather on the GPU, then one device -> host copy
            out.copy_(gather_compact(self.caches, plan).reshape(-1).view(torch.uint8), non_blocking=out.is_pinned())


class InPlace(SendFormat):
    """gg-direct: the peer reads the blocks out of the registered paged cache, layer by layer."""

    name = "cache"
    reads_cache_in_place = True

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> BlockCopyPlan:
        return plan_block_copy(num_tokens, block_ids, self.layout)

    def size(self, plan: BlockCopyPlan) -> int:
        return 0


FORMATS: dict[str, type[SendFormat]] = {f.name: f for f in (NpuTiles, CompactBlocks, InPlace)}


def cache_region(layer: int) -> str:
    """Transport region name of one layer's paged cache (both sides of gg-direct use it)."""
    return f"kv-L{layer}"
