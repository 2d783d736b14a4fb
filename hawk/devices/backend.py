"""The seam where an NPU plugs into HAWK.

HAWK needs four things from an NPU: its DRAM as per-channel windows a transfer engine can
register (``channel_memory``, on ``torch_device``), an allocator that places buffers as the NPU's
runtime does (``allocator``, ``interleaved_pages``), byte reads/writes, and device-side copies (the
intra-channel finish of HAWK, the cross-channel rearrangement of the single-buffer baseline). The emulated device implements them over torch memory. A real
Tenstorrent backend would implement them with ttnn / tt-umd, registering one tt-kmd dma-buf TLB
window per DRAM bank (docs/design.md §3) as the per-channel RDMA regions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from hawk.devices.dram_allocator import Allocation, BankUsage, DramAllocator
from hawk.layouts.npu import NpuArch
from hawk.plan.requests import Copy, Runs


class NpuBackend(ABC):
    """An NPU's DRAM as HAWK sees it."""

    arch: NpuArch
    allocator: DramAllocator
    name: str

    @property
    @abstractmethod
    def torch_device(self) -> torch.device:
        """Where channel memory is addressable by torch (for an emulation: its backing memory)."""

    @abstractmethod
    def channel_memory(self, channel: int) -> torch.Tensor:
        """A uint8 view of one channel's whole address window: what a transfer engine registers."""

    @abstractmethod
    def read(self, channel: int, address: int, nbytes: int) -> torch.Tensor:
        """Bytes at ``address`` in ``channel`` (a copy or a view; callers must not keep it past writes)."""

    @abstractmethod
    def write(self, channel: int, address: int, data: torch.Tensor) -> None:
        """Store uint8 ``data`` at ``address`` in ``channel``."""

    @abstractmethod
    def interleaved_pages(self, base: int, aligned_page: int, slots: int) -> torch.Tensor:
        """``[banks, slots, aligned_page]`` uint8 view of a buffer's pages; page i is at ``[bank(i), slot(i)]`` of its page map.

        How decode kernels on the emulated device read and update tiles where they live.
        """

    @abstractmethod
    def copy(self, copies: Sequence[Copy] | Runs) -> None:
        """Run device-side copies (``src_region``/``dst_region`` are channels), as one batch where possible."""

    def synchronize(self) -> None:
        """Wait for device-side work issued so far."""

    # -- allocation is the runtime's, shared by every backend ---------------------------------

    def allocate_interleaved(self, size_per_bank: int, owner: str) -> Allocation:
        return self.allocator.allocate_interleaved(size_per_bank, owner)

    def allocate_in_bank(self, bank: int, size: int, owner: str) -> Allocation:
        return self.allocator.allocate_in_bank(bank, size, owner)

    def free(self, alloc: Allocation) -> None:
        self.allocator.free(alloc)

    def usage(self) -> list[BankUsage]:
        return self.allocator.usage()

    def channel_usage(self) -> dict[int, tuple[int, int]]:
        """``channel -> (used bytes, capacity)`` summed over the channel's banks."""
        out: dict[int, tuple[int, int]] = {}
        for u in self.usage():
            used, cap = out.get(u.channel, (0, 0))
            out[u.channel] = (used + u.used, cap + u.capacity)
        return out
