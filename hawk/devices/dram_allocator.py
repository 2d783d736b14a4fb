"""Where buffers go in NPU DRAM, the way tt-metal's allocator places them.

An interleaved buffer takes the same address range in every bank (tt-metal allocates DRAM
interleaved buffers in lockstep), so it fits only where *all* banks are free. A bank-local buffer
takes a range in one bank. That asymmetry is why one big single-channel receive buffer
(gn-direct-single) starves later interleaved allocations while HAWK's per-channel buffers do not.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from hawk.layouts.npu import NpuArch


class NpuOutOfMemory(MemoryError):
    """An allocation did not fit; the message names the channel (and bank) that ran out."""

    def __init__(self, message: str, channel: int, bank: int):
        super().__init__(message)
        self.channel = channel
        self.bank = bank


@dataclass(frozen=True)
class Allocation:
    """A placed buffer: ``banks`` share the byte range ``[address, address + size)`` of each bank."""

    id: int
    address: int
    size: int
    banks: tuple[int, ...]
    owner: str
    since: float = field(compare=False)

    @property
    def interleaved(self) -> bool:
        return len(self.banks) > 1


@dataclass(frozen=True)
class BankUsage:
    bank: int
    channel: int
    capacity: int
    used: int
    largest_free: int


class _FreeList:
    """Free byte ranges of one bank, sorted and coalesced."""

    def __init__(self, capacity: int):
        self.ranges: list[tuple[int, int]] = [(0, capacity)]

    def take(self, start: int, size: int) -> None:
        for i, (s, e) in enumerate(self.ranges):
            if s <= start and start + size <= e:
                pieces = [(s, start), (start + size, e)]
                self.ranges[i : i + 1] = [p for p in pieces if p[1] > p[0]]
                return
        raise AssertionError(f"range [{start}, {start + size}) is not free")

    def give(self, start: int, size: int) -> None:
        self.ranges.append((start, start + size))
        self.ranges.sort()
        merged: list[tuple[int, int]] = []
        for s, e in self.ranges:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        self.ranges = merged

    def free_bytes(self) -> int:
        return sum(e - s for s, e in self.ranges)

    def largest(self) -> int:
        return max((e - s for s, e in self.ranges), default=0)


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class DramAllocator:
    """First-fit allocator over an arch's banks, with per-bank accounting."""

    def __init__(self, arch: NpuArch):
        self.arch = arch
        self._free = [_FreeList(b.capacity) for b in arch.banks]
        self._live: dict[int, Allocation] = {}
        self._next = 1
        self._lock = threading.Lock()

    def allocate_interleaved(self, size_per_bank: int, owner: str) -> Allocation:
        """Reserve ``size_per_bank`` bytes at one address common to every bank."""
        size = self.arch.aligned(self._check_size(size_per_bank))
        with self._lock:
            common = self._free[0].ranges
            for fl in self._free[1:]:
                common = _intersect(common, fl.ranges)
            for s, e in common:
                if e - s >= size:
                    return self._place(s, size, tuple(range(self.arch.num_banks)), owner)
            worst = min(range(self.arch.num_banks), key=lambda b: self._free[b].largest())
            raise NpuOutOfMemory(
                f"NPU out of memory in channel {self.arch.banks[worst].channel} (bank {worst}): interleaved buffer "
                f"for {owner!r} needs {size} B in every bank at one address; bank {worst} has "
                f"{self._free[worst].free_bytes()} B free, largest range {self._free[worst].largest()} B",
                channel=self.arch.banks[worst].channel,
                bank=worst,
            )

    def allocate_in_bank(self, bank: int, size: int, owner: str) -> Allocation:
        """Reserve ``size`` contiguous bytes inside one bank (one channel's address window)."""
        if not 0 <= bank < self.arch.num_banks:
            raise ValueError(f"bank {bank} out of range [0, {self.arch.num_banks})")
        size = self.arch.aligned(self._check_size(size))
        with self._lock:
            for s, e in self._free[bank].ranges:
                if e - s >= size:
                    return self._place(s, size, (bank,), owner)
            fl = self._free[bank]
            raise NpuOutOfMemory(
                f"NPU out of memory in channel {self.arch.banks[bank].channel} (bank {bank}): {owner!r} needs "
                f"{size} contiguous B; {fl.free_bytes()} B free, largest range {fl.largest()} B",
                channel=self.arch.banks[bank].channel,
                bank=bank,
            )

    def free(self, alloc: Allocation) -> None:
        with self._lock:
            if self._live.pop(alloc.id, None) is None:
                raise ValueError(f"allocation {alloc.id} ({alloc.owner!r}) is not live (double free?)")
            for b in alloc.banks:
                self._free[b].give(alloc.address, alloc.size)

    def live(self) -> list[Allocation]:
        with self._lock:
            return sorted(self._live.values(), key=lambda a: a.id)

    def usage(self) -> list[BankUsage]:
        with self._lock:
            return [
                BankUsage(i, b.channel, b.capacity, b.capacity - self._free[i].free_bytes(), self._free[i].largest())
                for i, b in enumerate(self.arch.banks)
            ]

    def _place(self, start: int, size: int, banks: tuple[int, ...], owner: str) -> Allocation:
        for b in banks:
            self._free[b].take(start, size)
        alloc = Allocation(self._next, start, size, banks, owner, time.monotonic())
        self._next += 1
        self._live[alloc.id] = alloc
        return alloc

    @staticmethod
    def _check_size(size: int) -> int:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"allocation size must be a positive int, got {size!r}")
        return size
