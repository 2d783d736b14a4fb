"""The registered transfer buffers of each configuration, each with its reservation ledger.

- GPU side: one staging region (HAWK's "GPU RDMA buffer") the transform writes into.
- NPU side, HAWK: one buffer per DRAM channel, so bytes land in the channel their pages live in.
- NPU side, gn-direct-single: one contiguous buffer, which can only live in one channel's window.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hawk.devices.backend import NpuBackend
from hawk.devices.dram_allocator import Allocation
from hawk.memory.reservations import RangeReservations, Reservation


class StagingBuffer:
    """A device byte region that holds transformed KV until the peer has pulled it."""

    def __init__(self, capacity: int, device: str | torch.device = "cpu", name: str = "staging", pin: bool = False):
        self.tensor = torch.empty(capacity, dtype=torch.uint8, device=device, pin_memory=pin and torch.device(device).type == "cpu")
        self.ledger = RangeReservations(name, capacity, alignment=256)
        self.name = name

    def reserve(self, size: int, owner: str, ttl_s: float | None = None) -> Reservation:
        return self.ledger.reserve(size, owner, ttl_s)

    def view(self, res: Reservation) -> torch.Tensor:
        return self.tensor[res.offset : res.offset + res.size]


class ChannelBuffers:
    """HAWK's per-channel receive buffers: ``bytes_per_channel`` in the first bank of every channel."""

    def __init__(self, npu: NpuBackend, bytes_per_channel: int, owner: str = "hawk-rx"):
        self.npu = npu
        arch = npu.arch
        self.allocs: dict[int, Allocation] = {}
        self.ledgers: dict[int, RangeReservations] = {}
        try:
            for c in range(arch.num_channels):
                bank = arch.banks_of_channel(c)[0]
                self.allocs[c] = npu.allocate_in_bank(bank, bytes_per_channel, f"{owner}:ch{c}")
                self.ledgers[c] = RangeReservations(f"{owner}:ch{c}", bytes_per_channel, alignment=arch.alignment)
        except BaseException:
            self.close()
            raise

    def base(self, channel: int) -> int:
        """Channel address of the buffer's first byte."""
        a = self.allocs[channel]
        return self.npu.arch.banks[a.banks[0]].offset + a.address

    def reserve(self, bytes_by_channel: Mapping[int, int], owner: str, ttl_s: float | None = None) -> dict[int, Reservation]:
        """Reserve in every channel at once, or in none (a partial reservation is rolled back)."""
        got: dict[int, Reservation] = {}
        try:
            for c, n in bytes_by_channel.items():
                got[c] = self.ledgers[c].reserve(n, owner, ttl_s)
        except BaseException:
            for c, r in got.items():
                self.ledgers[c].release(r, announce=False)  # an undo: nothing waited for these bytes
            raise
        return got

    def require_fits(self, bytes_by_channel: Mapping[int, int], owner: str) -> None:
        """Raise :class:`~hawk.memory.reservations.NeverFits` unless every channel's share fits its
        empty buffer (else waiting for releases never helps)."""
        for c, n in bytes_by_channel.items():
            self.ledgers[c].require_fits(n, owner)

    def address(self, res: Reservation, channel: int) -> int:
        return self.base(channel) + res.offset

    def release(self, held: Mapping[int, Reservation]) -> None:
        for c, r in held.items():
            self.ledgers[c].release(r)

    def live(self) -> list[Reservation]:
        return [r for led in self.ledgers.values() for r in led.live()]

    def close(self) -> None:
        for a in self.allocs.values():
            self.npu.free(a)
        self.allocs.clear()


class SingleBuffer:
    """The gn-direct-single receive buffer: one contiguous range, necessarily inside one channel."""

    def __init__(self, npu: NpuBackend, size: int, channel: int = 0, owner: str = "single-rx"):
        self.npu = npu
        self.channel = channel
        bank = npu.arch.banks_of_channel(channel)[0]
        self.alloc = npu.allocate_in_bank(bank, size, owner)
        self.ledger = RangeReservations(owner, size, alignment=npu.arch.alignment)

    def base(self) -> int:
        return self.npu.arch.banks[self.alloc.banks[0]].offset + self.alloc.address

    def reserve(self, size: int, owner: str, ttl_s: float | None = None) -> Reservation:
        return self.ledger.reserve(size, owner, ttl_s)

    def address(self, res: Reservation) -> int:
        return self.base() + res.offset

    def release(self, res: Reservation) -> None:
        self.ledger.release(res)

    def live(self) -> list[Reservation]:
        return self.ledger.live()

    def close(self) -> None:
        if self.alloc is not None:
            self.npu.free(self.alloc)
            self.alloc = None
