"""A tiny, independent model of NPU channel memory for tests: bytes per channel, pages read by address."""

from __future__ import annotations

import numpy as np
import torch

from hawk.layouts.npu import NpuKVLayout
from hawk.layouts.tt import tilize, untilize


class ChannelMemory:
    def __init__(self, layout: NpuKVLayout, bases: list[int]):
        self.layout = layout
        self.bases = bases
        arch = layout.arch
        self.mem = {c: np.zeros(arch.channel_capacity(c), dtype=np.uint8) for c in range(arch.num_channels)}
        self.bank_capacity = arch.banks[0].capacity
        assert max(bases) + layout.tensor_buffer(0).bytes_per_bank <= self.bank_capacity

    def write(self, channel: int, addr: int, data: np.ndarray) -> None:
        self.mem[channel][addr : addr + len(data)] = data

    def read(self, channel: int, addr: int, n: int) -> np.ndarray:
        return self.mem[channel][addr : addr + n]

    def read_tensor(self, t: int) -> torch.Tensor:
        """Untilize NPU tensor ``t`` straight from its pages (page map only; no plan involved)."""
        lay = self.layout
        buf = lay.tensor_buffer(self.bases[t])
        _, chan, addr = buf.locate(np.arange(lay.pages_per_tensor))
        pb = lay.page_size
        raw = np.concatenate([self.read(int(c), int(a), pb) for c, a in zip(chan, addr)])
        return untilize(torch.from_numpy(raw), lay.tensor_shape, lay.dtype)

    def write_tensor(self, t: int, x: torch.Tensor) -> None:
        """Tilize ``x`` and scatter its pages to where the page map puts them."""
        lay = self.layout
        _, chan, addr = lay.tensor_buffer(self.bases[t]).locate(np.arange(lay.pages_per_tensor))
        pages = tilize(x, lay.dtype).numpy().reshape(len(chan), -1)
        for c, a, page in zip(chan, addr, pages):
            self.write(int(c), int(a), page)
