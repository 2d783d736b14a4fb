"""An emulated Tenstorrent-like NPU: per-channel DRAM in host memory or on a CUDA device.

Faithful where HAWK depends on it: channel windows with the arch's bank offsets and capacities,
tt-metal's lockstep interleaved allocation, byte-exact pages. Not emulated: compute cores, the
NoC, DRAM timing. On CUDA its own copies run on a stream of its own, as a real device's work runs
on its own command queue: ``synchronize`` waits for the NPU's work, not for a prefill sharing the GPU.
Numbers measured on it are emulation numbers and are labelled so. With a
``copy_timing`` model (``--npu-timing p150a``) its device-side copies take at least the modelled
DRAM time (``hawk.devices.timing``): still emulation, and labelled as such.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch

from hawk.devices.backend import NpuBackend
from hawk.devices.batched_copy import batched_copy
from hawk.devices.dram_allocator import DramAllocator
from hawk.devices.timing import DramCopyModel, copy_arrays, pace_until
from hawk.layouts.device import parse_device
from hawk.layouts.npu import NpuArch, get_arch
from hawk.plan.requests import Copy, Runs

#: Default bank size of an emulated device whose memory lives in host RAM (the real 1-4 GiB banks
#: would not fit a CI machine); override with ``bank_capacity``.
DEFAULT_EMULATED_BANK_BYTES = 256 << 20


class EmulatedNpu(NpuBackend):
    """``npu-emu:<torch device>``: channel memory is one uint8 tensor ``[channels, channel_bytes]``."""

    def __init__(self, arch: NpuArch, memory_device: str | torch.device = "cpu", copy_timing: DramCopyModel | None = None):
        self.arch = arch
        self.copy_timing = copy_timing
        self.allocator = DramAllocator(arch)
        dev = torch.device(memory_device)
        cap = {arch.channel_capacity(c) for c in range(arch.num_channels)}
        bank_bytes = {b.capacity for b in arch.banks}
        tiled = all(b.channel * cap_0 + b.offset == i * arch.banks[0].capacity for i, b in enumerate(arch.banks) for cap_0 in cap)
        if len(cap) != 1 or len(bank_bytes) != 1 or not tiled:
            raise ValueError(f"emulation needs equal banks tiling equal channels in order; {arch.name} does not")
        self._memory = torch.zeros(arch.num_channels, cap.pop(), dtype=torch.uint8, device=dev)
        self._queue = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.name = f"npu-emu:{dev}"

    @contextlib.contextmanager
    def _on_queue(self) -> Iterator[None]:
        """The NPU's command queue as the current stream, after the caller's stream: what the caller
        enqueued before (e.g. bytes it wrote into a receive buffer) is there when the NPU copies."""
        if self._queue is None:
            yield
            return
        dev = self._memory.device
        self._queue.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.device(dev), torch.cuda.stream(self._queue):
            yield

    @property
    def torch_device(self) -> torch.device:
        return self._memory.device

    @property
    def memory(self) -> torch.Tensor:
        """All channels, ``[channels, channel_bytes]`` (the emulation's whole DRAM)."""
        return self._memory

    def interleaved_pages(self, base: int, aligned_page: int, slots: int) -> torch.Tensor:
        bank_bytes = self.arch.banks[0].capacity
        if base < 0 or base + slots * aligned_page > bank_bytes:
            raise ValueError(f"interleaved buffer [{base}, {base + slots * aligned_page}) exceeds a {bank_bytes} B bank")
        flat = self._memory.view(-1)  # banks tile the channels back to back: bank b starts at b * bank_bytes
        return flat.as_strided((self.arch.num_banks, slots, aligned_page), (bank_bytes, aligned_page, 1), base)

    def channel_memory(self, channel: int) -> torch.Tensor:
        self._check_channel(channel)
        return self._memory[channel]

    def read(self, channel: int, address: int, nbytes: int) -> torch.Tensor:
        self._check_range(channel, address, nbytes)
        return self._memory[channel, address : address + nbytes]

    def write(self, channel: int, address: int, data: torch.Tensor) -> None:
        if data.dtype != torch.uint8:
            raise ValueError(f"NPU writes take uint8 bytes, got {data.dtype}")
        self._check_range(channel, address, data.numel())
        with self._on_queue():
            self._memory[channel, address : address + data.numel()].copy_(data.reshape(-1), non_blocking=True)

    def copy(self, copies: Sequence[Copy] | Runs) -> None:
        if self.copy_timing is None:
            with self._on_queue():
                batched_copy(self._memory, copies)
            return
        self._paced_copy(copies)

    def _paced_copy(self, copies: Sequence[Copy] | Runs) -> None:
        """The copy, finished (synchronized), then held to the modelled DRAM time."""
        assert self.copy_timing is not None
        t0 = time.perf_counter()
        with self._on_queue():
            batched_copy(self._memory, copies)
        self.synchronize()
        pace_until(t0, self.copy_timing.copy_time(*copy_arrays(copies)))

    def synchronize(self) -> None:
        """Until the NPU's own work (its queue) has run; a prefill's kernels on the same GPU do not count."""
        if self._queue is not None:
            self._queue.synchronize()

    def _check_channel(self, channel: int) -> None:
        if not 0 <= channel < self.arch.num_channels:
            raise ValueError(f"channel {channel} out of range [0, {self.arch.num_channels})")

    def _check_range(self, channel: int, address: int, nbytes: int) -> None:
        self._check_channel(channel)
        if address < 0 or nbytes < 0 or address + nbytes > self._memory.shape[1]:
            raise ValueError(f"[{address}, {address + nbytes}) is outside channel {channel} ({self._memory.shape[1]} B)")


def open_npu(spec: str, arch: str = "blackhole-p150a", bank_capacity: int | None = None,
             copy_timing: DramCopyModel | None = None) -> NpuBackend:
    """Open an NPU by name: ``npu-emu:cpu``, ``npu-emu:cuda:1``; ``ttnn:<id>`` is the real-hardware seam.
    ``copy_timing`` paces an emulated device's copies (timing emulation; None: as fast as they run)."""
    try:
        device = parse_device(spec)
    except ValueError:
        device = None
    if device is not None and device.kind == "npu-emu":
        if bank_capacity is None and device.memory_kind != "cuda":
            bank_capacity = DEFAULT_EMULATED_BANK_BYTES
        return EmulatedNpu(get_arch(arch, bank_capacity), device.torch_device, copy_timing)
    if device is not None and device.kind == "ttnn":
        raise RuntimeError(
            "a real Tenstorrent backend needs ttnn/tt-umd and tt-kmd >= 2.10 (per-bank dma-buf export); "
            "neither is available here - use npu-emu:cpu or npu-emu:cuda:N"
        )
    raise ValueError(f"unknown NPU device {spec!r}; expected npu-emu:cpu, npu-emu:cuda:N or ttnn:N")
