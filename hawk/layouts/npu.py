"""The NPU side (Tenstorrent-style): DRAM banks and channels, interleaved page maps, the tiled KV cache.

Everything here is data. An architecture is a list of DRAM banks, each a window of one channel's
address space; a buffer maps page i to ``(bank, address)`` through a page map; the KV cache is a
tiled tensor whose tile order is a set of strides. Adding an NPU means adding a preset (or a page
map), never touching the plan or the transfer path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from hawk.layouts.dtypes import check_npu_dtype
from hawk.layouts.tt import TILE, page_bytes

GiB = 1 << 30


@dataclass(frozen=True)
class Bank:
    """One DRAM bank: a window of ``capacity`` bytes at ``offset`` in channel ``channel``'s address space."""

    channel: int
    offset: int
    capacity: int


@dataclass(frozen=True)
class NpuArch:
    """A Tenstorrent-like chip's DRAM as the allocator and the transfer path see it."""

    name: str
    banks: tuple[Bank, ...]
    alignment: int

    @property
    def num_banks(self) -> int:
        return len(self.banks)

    @property
    def num_channels(self) -> int:
        return len({b.channel for b in self.banks})

    def channel_capacity(self, channel: int) -> int:
        return max(b.offset + b.capacity for b in self.banks if b.channel == channel)

    def banks_of_channel(self, channel: int) -> list[int]:
        return [i for i, b in enumerate(self.banks) if b.channel == channel]

    def aligned(self, nbytes: int) -> int:
        a = self.alignment
        return (nbytes + a - 1) // a * a

    def with_bank_capacity(self, capacity: int) -> "NpuArch":
        """The same topology with smaller (or larger) banks: how tests and emulation size a device."""
        if capacity <= 0:
            raise ValueError(f"bank capacity must be positive, got {capacity}")
        per_channel: dict[int, int] = {}
        banks = []
        for b in self.banks:
            k = per_channel.get(b.channel, 0)
            per_channel[b.channel] = k + 1
            banks.append(Bank(b.channel, k * capacity, capacity))
        return replace(self, banks=tuple(banks))


def _one_bank_per_channel(n: int, capacity: int) -> tuple[Bank, ...]:
    return tuple(Bank(c, 0, capacity) for c in range(n))


def _two_banks_per_channel(channels: int, capacity: int) -> tuple[Bank, ...]:
    return tuple(Bank(c, k * capacity, capacity) for c in range(channels) for k in range(2))


#: Presets from tt-metal's SoC descriptors: Blackhole has one bank per GDDR6 channel;
#: Wormhole splits each of its 6 channels into two 1 GiB banks.
ARCHS: dict[str, NpuArch] = {
    "blackhole-p150a": NpuArch("blackhole-p150a", _one_bank_per_channel(8, 4 * GiB), alignment=64),
    "blackhole-p100a": NpuArch("blackhole-p100a", _one_bank_per_channel(7, 4 * GiB), alignment=64),
    "wormhole-n150": NpuArch("wormhole-n150", _two_banks_per_channel(6, 1 * GiB), alignment=32),
    "wormhole-n300": NpuArch("wormhole-n300", _two_banks_per_channel(6, 1 * GiB), alignment=32),
}


def get_arch(name: str, bank_capacity: int | None = None) -> NpuArch:
    try:
        arch = ARCHS[name]
    except KeyError:
        raise ValueError(f"unknown NPU arch {name!r}; known: {sorted(ARCHS)}") from None
    return arch.with_bank_capacity(bank_capacity) if bank_capacity else arch


@dataclass(frozen=True)
class BlockCyclic:
    """Pages dealt to banks in shards of ``shard_pages`` consecutive pages, round robin.

    ``shard_pages == 1`` is tt-metal's interleaved buffer (page i in bank ``i % N``, slot ``i // N``);
    larger shards keep runs of pages in one bank (DRAM-sharded placement), so the same request lands
    in fewer, longer runs. Within a bank a buffer's slots are contiguous from its base either way.
    Works on ints, numpy arrays and torch tensors alike.
    """

    num_banks: int
    shard_pages: int = 1

    def __post_init__(self) -> None:
        if self.num_banks <= 0 or self.shard_pages <= 0:
            raise ValueError(f"a page map needs positive num_banks and shard_pages, got {self.num_banks}, {self.shard_pages}")

    def bank(self, pages):
        return (pages // self.shard_pages) % self.num_banks

    def slot(self, pages):
        s = self.shard_pages
        return (pages // (s * self.num_banks)) * s + pages % s

    def slots_per_bank(self, num_pages: int) -> int:
        shards = -(-num_pages // self.shard_pages)
        return -(-shards // self.num_banks) * self.shard_pages


def Interleaved(num_banks: int) -> BlockCyclic:  # noqa: N802 - reads as the tt-metal term it is
    """tt-metal's interleaved page map: page i in bank ``i % N`` at slot ``i // N``."""
    return BlockCyclic(num_banks, 1)


@dataclass(frozen=True)
class NpuBuffer:
    """A DRAM buffer: ``num_pages`` pages placed by ``page_map``, at ``base`` in every bank."""

    arch: NpuArch
    base: int
    page_size: int
    num_pages: int
    page_map: BlockCyclic = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.page_map is None:
            object.__setattr__(self, "page_map", Interleaved(self.arch.num_banks))
        if self.page_map.num_banks != self.arch.num_banks:
            raise ValueError(f"page map spans {self.page_map.num_banks} banks, {self.arch.name} has {self.arch.num_banks}")

    @property
    def aligned_page(self) -> int:
        return self.arch.aligned(self.page_size)

    @property
    def bytes_per_bank(self) -> int:
        return self.page_map.slots_per_bank(self.num_pages) * self.aligned_page

    def locate(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pages -> ``(bank, channel, byte address in that channel)``."""
        pages = np.asarray(pages, dtype=np.int64)
        bank = self.page_map.bank(pages)
        slot = self.page_map.slot(pages)
        chan = np.array([b.channel for b in self.arch.banks], dtype=np.int64)[bank]
        boff = np.array([b.offset for b in self.arch.banks], dtype=np.int64)[bank]
        return bank, chan, boff + self.base + slot * self.aligned_page


@dataclass(frozen=True)
class NpuKVLayout:
    """The decode side's KV cache: per layer, K and V tensors ``[max_num_blocks, H, block_size, head_dim]``,
    TILE layout, interleaved over all DRAM banks (tt_transformers / vLLM TT plugin). ``shard_pages > 1``
    describes a block-cyclic (DRAM-sharded) placement instead, with no change anywhere else.

    Tensors are numbered ``t = 2 * layer + kv``. Tile ``(block, head, row_tile, col_tile)`` is page
    ``block*strides[0] + head*strides[1] + row_tile*strides[2] + col_tile`` of its tensor.
    """

    arch: NpuArch
    num_layers: int
    max_num_blocks: int
    num_kv_heads: int
    block_size: int = 64
    head_dim: int = 128
    dtype: str = "bf16"
    head_start: int = 0
    shard_pages: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_num_blocks", "num_kv_heads", "block_size", "head_dim", "shard_pages"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"NpuKVLayout.{name} must be a positive int, got {v!r}")
        if self.block_size % TILE:
            raise ValueError(f"NPU block_size must be a multiple of {TILE} (32 or 64), got {self.block_size}")
        if self.head_dim % TILE:
            raise ValueError(f"head_dim must be a multiple of {TILE} for the tile format, got {self.head_dim}")
        if self.head_start < 0:
            raise ValueError(f"NpuKVLayout.head_start must be >= 0, got {self.head_start}")
        check_npu_dtype(self.dtype)

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_start + self.num_kv_heads)

    @property
    def num_tensors(self) -> int:
        return 2 * self.num_layers

    @property
    def row_tiles(self) -> int:
        return self.block_size // TILE

    @property
    def col_tiles(self) -> int:
        return self.head_dim // TILE

    @property
    def tiles_per_block(self) -> int:
        return self.num_kv_heads * self.row_tiles * self.col_tiles

    @property
    def tile_strides(self) -> tuple[int, int, int, int]:
        """Page strides of ``(block, head, row_tile, col_tile)``."""
        ct = self.col_tiles
        return (self.tiles_per_block, self.row_tiles * ct, ct, 1)

    @property
    def page_size(self) -> int:
        return page_bytes(self.dtype)

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.max_num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def pages_per_tensor(self) -> int:
        return self.max_num_blocks * self.tiles_per_block

    def page_index(self, block, head, row_tile, col_tile):
        """Tile coordinates -> page index within its tensor (works on ints and numpy arrays)."""
        s = self.tile_strides
        return block * s[0] + head * s[1] + row_tile * s[2] + col_tile * s[3]

    @property
    def page_map(self) -> BlockCyclic:
        return BlockCyclic(self.arch.num_banks, self.shard_pages)

    def tensor_buffer(self, base: int) -> NpuBuffer:
        """The DRAM buffer of one K or V tensor allocated at ``base``."""
        return NpuBuffer(self.arch, base, self.page_size, self.pages_per_tensor, self.page_map)

    def bytes_per_token(self) -> int:
        """Device bytes one token costs across all layers (tiles amortized over the block)."""
        return self.num_tensors * self.tiles_per_block * self.page_size // self.block_size
