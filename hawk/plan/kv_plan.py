"""The GPU -> NPU plan of one request: where each source tile goes, and the requests that move it.

The send buffer the GPU produces holds NPU pages (tiles) grouped by destination DRAM channel,
then bank, then K/V tensor, in address order. So one channel's bytes are one contiguous extent:

    send buffer = | channel 0 | channel 1 | ... |      channel c = | bank b | bank b' |  (banks of c)
    bank b      = | tensor 0 (layer 0 K): k_b pages | tensor 1 (layer 0 V) | ... | tensor 2L-1 |

Every K/V tensor of the NPU cache has the same page map, so the request's page set is computed
once and shared by all 2L tensors: tile (t, q) lands at ``A[q] + t * B[q]`` in the send buffer.
From this one picture come the three ways of moving it:

- staging  (HAWK): one request per channel into a per-channel buffer, then intra-channel copies;
- direct         : requests straight into the cache pages, merged where contiguous;
- single         : one request into one contiguous buffer in one channel, then cross-channel copies
                   (the gn-direct-single baseline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.layouts.tt import TILE
from hawk.plan.requests import Copy, Request, Runs, merge_runs

#: Region number of the sender's send buffer in the requests a plan emits.
SEND_BUFFER = 0


def _blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _check_block_ids(name: str, ids: np.ndarray, needed: int, limit: int) -> np.ndarray:
    if ids.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of block ids, got shape {ids.shape}")
    if len(ids) < needed:
        raise ValueError(f"{name} has {len(ids)} blocks but {needed} are needed for the tokens")
    ids = ids[:needed]
    bad = ids[(ids < 0) | (ids >= limit)]
    if len(bad):
        raise ValueError(f"{name} holds block id {int(bad[0])} outside [0, {limit})")
    return ids


def shared_heads(src: GpuKVLayout, dst: NpuKVLayout) -> range:
    """Global KV heads both ranks hold: what this (prefill rank, decode rank) pair exchanges."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_kv_heads, dst.head_start + dst.num_kv_heads)
    if hi <= lo:
        raise ValueError(
            f"no shared KV heads: GPU rank holds heads [{src.heads.start}, {src.heads.stop}), "
            f"NPU rank holds [{dst.heads.start}, {dst.heads.stop})"
        )
    return range(lo, hi)


@dataclass(eq=False)
class KVTransferPlan:
    """Where every tile of one request goes. Arrays are indexed by ``q``, the request's page set."""

    src: GpuKVLayout
    dst: NpuKVLayout
    num_tokens: int
    gpu_block_ids: np.ndarray
    npu_block_ids: np.ndarray
    dst_bases: tuple[int, ...]
    heads: range
    # Per page of the shared page set (same for every tensor):
    page: np.ndarray  # page index within a tensor
    bank: np.ndarray
    channel: np.ndarray
    addr: np.ndarray  # byte address in its channel, for a tensor based at 0
    rank: np.ndarray  # position among this request's pages in the same bank
    token_start: np.ndarray  # first request token of the tile's 32 rows
    gpu_head: np.ndarray  # rank-local head on the GPU side
    col_tile: np.ndarray
    # Send-buffer geometry:
    bank_pages: np.ndarray  # k_b: pages per tensor in bank b
    bank_offset: np.ndarray  # where bank b's pages start in the send buffer
    channel_extents: list[tuple[int, int, int]] = field(default_factory=list)  # (channel, offset, length)

    @property
    def page_bytes(self) -> int:
        return self.dst.page_size

    @property
    def num_pages(self) -> int:
        """Pages per tensor."""
        return len(self.page)

    @property
    def num_tensors(self) -> int:
        return self.dst.num_tensors

    @property
    def total_bytes(self) -> int:
        return self.num_tensors * self.num_pages * self.page_bytes

    @property
    def num_channels_used(self) -> int:
        return len(self.channel_extents)

    def offset_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(A, B)`` with tile ``(t, q)`` at send-buffer byte ``A[q] + t * B[q]``."""
        pb = self.page_bytes
        a = self.bank_offset[self.bank] + self.rank * pb
        b = self.bank_pages[self.bank] * pb
        return a, b

    def send_dest(self) -> TileDest:
        """The send buffer as a transform's destination (what moves over a transport); cached with the
        placement (every transform call asks for it)."""
        memo = self._shared_memo()
        hit = memo.get(("send",))
        if hit is None:
            a, b = self.offset_terms()
            hit = memo[("send",)] = TileDest(a, b, self.page_bytes, self.total_bytes, ("send",))
        return hit

    def memory_dest(self, channel_bytes: int) -> TileDest:
        """The NPU's DRAM itself as a transform's destination: channels back to back, ``channel_bytes``
        each, tile ``(t, q)`` at ``channel[q] * channel_bytes + addr[q] + dst_bases[t]``.

        Why: a writer that can address that memory (the same GPU, in this process or through CUDA
        IPC) puts every tile in its page in one pass: no send buffer, no copy. Needs the tensor bases
        evenly spaced (lockstep allocation makes them so); raises ValueError otherwise. Cached with
        the placement: every request on it shares the arrays. Looked up by the bases themselves before
        they are checked (the check is ~20 us a pull; bases that were checked once are a hit).
        """
        memo = self._shared_memo()
        found = ("memory", int(channel_bytes), self.dst_bases)
        hit = memo.get(found)
        if hit is not None:
            return hit
        bases = np.asarray(self.dst_bases, dtype=np.int64)
        step = int(bases[1] - bases[0]) if len(bases) > 1 else 0
        if not np.array_equal(bases, bases[0] + step * np.arange(len(bases), dtype=np.int64)):
            raise ValueError("the NPU tensor bases are not evenly spaced: no single-pass destination")
        key = ("memory", int(channel_bytes), int(bases[0]), step)
        a = self.channel * int(channel_bytes) + self.addr + int(bases[0])
        b = np.full_like(a, step)
        unit = int(np.gcd.reduce(np.concatenate([[self.page_bytes, step], a])))
        last = a + (self.num_tensors - 1) * step
        lo, hi = min(int(a.min()), int(last.min())), max(int(a.max()), int(last.max()))
        extent = hi + self.page_bytes  # the furthest byte written, not the whole DRAM
        if lo < 0 or unit % 16 or hi // unit >= 2**31 or abs(step) // unit >= 2**31:
            raise ValueError(f"NPU addresses are negative, not 16-byte aligned or too large for int32 units of {unit} B")
        dest = memo[found] = TileDest(a, b, unit, extent, key)
        return dest

    def send_offsets(self) -> np.ndarray:
        """``[2L, P]`` send-buffer byte offset of every tile."""
        a, b = self.offset_terms()
        t = np.arange(self.num_tensors, dtype=np.int64)[:, None]
        return a[None, :] + t * b[None, :]

    def cache_addresses(self) -> np.ndarray:
        """``[2L, P]`` byte address of every tile's page in its channel."""
        bases = np.asarray(self.dst_bases, dtype=np.int64)[:, None]
        return bases + self.addr[None, :]

    def _runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Runs of the request's pages that are consecutive in a bank: ``(bank, first rank, first slot, pages)``.

        The same for every tensor, since all tensors share one page map: this is what keeps the
        request lists cheap to build (runs x tensors entries, not pages x tensors).
        """
        memo = self._shared_memo()
        cached = memo.get("runs")
        if cached is not None:
            return cached
        order = np.lexsort((self.rank, self.bank))  # bank-major, then rank (= slot order)
        bank, rank = self.bank[order], self.rank[order]
        slot = self.dst.page_map.slot(self.page[order])
        contiguous = self.dst.tensor_buffer(0).aligned_page == self.page_bytes
        start = np.ones(len(order), dtype=bool)
        if contiguous and len(order):
            start[1:] = (bank[1:] != bank[:-1]) | (slot[1:] != slot[:-1] + 1)
        first = np.flatnonzero(start)
        pages = np.diff(np.append(first, len(order)))
        out = (bank[first], rank[first], slot[first], pages)
        memo["runs"] = out
        return out

    def _shared_memo(self) -> dict:
        """What this plan derives from its NPU-side arrays, shared by every plan on the same placement."""
        memo = getattr(self, "_memo", None)
        if memo is None:
            memo = self._memo = {}
        return memo

    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every (run, tensor) in send-buffer order: ``(send offset, channel, cache address, length)``."""
        memo = self._shared_memo()
        cached = memo.get("pieces")
        if cached is not None:
            return cached
        bank, rank, slot, pages = self._runs()
        pb, nt = self.page_bytes, self.num_tensors
        t = np.arange(nt, dtype=np.int64)
        k = self.bank_pages[bank]
        send = self.bank_offset[bank][:, None] + (t[None, :] * k[:, None] + rank[:, None]) * pb  # [runs, 2L]
        arch = self.dst.arch
        boff = np.array([b.offset for b in arch.banks], dtype=np.int64)[bank]
        chan = np.array([b.channel for b in arch.banks], dtype=np.int64)[bank]
        ap = self.dst.tensor_buffer(0).aligned_page
        addr = boff[:, None] + np.asarray(self.dst_bases, dtype=np.int64)[None, :] + (slot * ap)[:, None]
        length = np.broadcast_to((pages * pb)[:, None], send.shape)
        order = np.argsort(send.ravel(), kind="stable")
        out = send.ravel()[order], np.repeat(chan, nt)[order], addr.ravel()[order], length.ravel()[order]
        memo["pieces"] = out
        return out

    # -- the three modes --------------------------------------------------------------------

    def direct_requests(self) -> list[Request]:
        """Requests straight into the cache pages, one per run contiguous on both sides."""
        return [Request(*r) for r in self.direct_runs()]

    def direct_runs(self) -> Runs:
        memo = self._shared_memo()
        if "direct" not in memo:
            off, chan, addr, length = self._pieces()
            memo["direct"] = merge_runs(SEND_BUFFER, off, chan, addr, length)
        return memo["direct"]

    def staging_requests(self, channel_dst: Mapping[int, int]) -> list[Request]:
        """One request per channel that receives data, into its per-channel buffer at ``channel_dst[c]``."""
        self._check_channel_dst(channel_dst)
        return [Request(SEND_BUFFER, off, c, channel_dst[c], n) for c, off, n in self.channel_extents]

    def staging_copies(self, channel_dst: Mapping[int, int]) -> list[Copy]:
        """Intra-channel copies from each per-channel buffer into the cache pages."""
        return [Copy(*r) for r in self.staging_copy_runs(channel_dst)]

    def staging_copy_runs(self, channel_dst: Mapping[int, int]) -> Runs:
        """:meth:`staging_copies` as arrays (what the device copy consumes). The last result is kept
        with the placement: an idle receiver reserves the same per-channel offsets again, and then
        its finish step (D7) reuses the runs as they are."""
        self._check_channel_dst(channel_dst)
        key = tuple(sorted((int(c), int(a)) for c, a in channel_dst.items()))
        memo = self._shared_memo()
        hit = memo.get("staging_copy")
        if hit is not None and hit[0] == key:
            return hit[1]
        off, chan, addr, length = self._pieces()
        shift = np.zeros(int(chan.max()) + 1, dtype=np.int64)
        for c, o, _ in self.channel_extents:
            shift[c] = channel_dst[c] - o  # send-buffer offset -> per-channel buffer address
        runs = merge_runs(chan, shift[chan] + off, chan, addr, length)
        memo["staging_copy"] = (key, runs)
        return runs

    def gather_copy_runs(self, channel_dst: Mapping[int, int]) -> Runs:
        """The reverse of :meth:`staging_copy_runs`: cache pages -> per-channel buffers (an NPU sender).

        Afterwards channel ``c``'s buffer holds exactly channel ``c``'s extent of the send-buffer format.
        """
        r = self.staging_copy_runs(channel_dst)
        return Runs(r.dst_region, r.dst_offset, r.src_region, r.src_offset, r.length)

    def single_requests(self, channel: int, address: int) -> list[Request]:
        """The whole send buffer as one request into one contiguous buffer (gn-direct-single)."""
        return [Request(SEND_BUFFER, 0, channel, address, self.total_bytes)]

    def single_copies(self, channel: int, address: int) -> list[Copy]:
        """Copies out of the single buffer into pages of every channel (mostly cross-channel)."""
        return [Copy(*r) for r in self.single_copy_runs(channel, address)]

    def single_copy_runs(self, channel: int, address: int) -> Runs:
        off, chan, addr, length = self._pieces()
        return merge_runs(channel, address + off, chan, addr, length)

    def channel_bytes(self) -> dict[int, int]:
        return {c: n for c, _, n in self.channel_extents}

    def _check_channel_dst(self, channel_dst: Mapping[int, int]) -> None:
        missing = [c for c, _, _ in self.channel_extents if c not in channel_dst]
        if missing:
            raise ValueError(f"no per-channel buffer offset given for channel(s) {missing}")


@dataclass(frozen=True, eq=False)
class TileDest:
    """Where a transform writes tile ``(t, q)`` of a plan: byte ``a[q] + t * b[q]`` of one flat buffer
    of at least ``extent`` bytes (its furthest byte written, plus one). Every offset is a multiple of
    ``unit`` (the kernels keep them as int32 counts of it); ``key`` names the destination for the
    caches built on it."""

    a: np.ndarray
    b: np.ndarray
    unit: int
    extent: int
    key: tuple


@dataclass(frozen=True, eq=False)
class TileGrid:
    """The request's tiles in (block, head, row_tile, col_tile) order, as block-id-free arrays.

    Depends only on the NPU layout, the shared heads and the number of NPU blocks: every request of
    that shape has the same grid, whatever its block ids (``page = npu_block_ids[j] * block_pages + local``).
    """

    j: np.ndarray  # request-local NPU block of each tile
    h: np.ndarray  # shared-head index
    rt: np.ndarray
    ct: np.ndarray
    local: np.ndarray  # page index within the tile's block


@dataclass(eq=False)
class Placement:
    """Where one request's pages sit in NPU memory and in the send buffer: everything of a plan that
    depends on the NPU side only (layout, heads, NPU block ids, tensor bases), never on GPU block ids.

    ``memo`` holds what plans derive from it (runs, pieces); plans built on one placement share it.
    """

    page: np.ndarray
    bank: np.ndarray
    channel: np.ndarray
    addr: np.ndarray
    rank: np.ndarray
    bank_pages: np.ndarray
    bank_offset: np.ndarray
    channel_extents: list[tuple[int, int, int]]
    memo: dict = field(default_factory=dict)


def tile_grid(dst: NpuKVLayout, heads: range, num_blocks: int) -> TileGrid:
    hx, rt_n, ct_n = len(heads), dst.row_tiles, dst.col_tiles
    j, h, rt, ct = (a.ravel() for a in np.meshgrid(np.arange(num_blocks), np.arange(hx), np.arange(rt_n), np.arange(ct_n), indexing="ij"))
    npu_head = h + (heads.start - dst.head_start)
    local = dst.page_index(0, npu_head, rt, ct).astype(np.int64)
    return TileGrid(j, h, rt, ct, local)


def place_pages(grid: TileGrid, nids: np.ndarray, dst: NpuKVLayout) -> Placement:
    """Apply NPU block ids to a tile grid (vectorised): pages, banks, ranks and the send-buffer geometry."""
    page = nids[grid.j] * dst.tile_strides[0] + grid.local
    bank, channel, addr = dst.tensor_buffer(0).locate(page)

    # Rank of each page among the request's pages of its bank, in address (slot) order.
    order = np.lexsort((page, bank))
    nbanks = dst.arch.num_banks
    bank_pages = np.bincount(bank, minlength=nbanks).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(bank_pages)[:-1]])
    rank = np.empty_like(page)
    rank[order] = np.arange(len(page)) - first[bank[order]]

    # Send buffer: channels in order, banks of a channel in order, 2L tensors per bank.
    pb, ntens = dst.page_size, dst.num_tensors
    bank_offset = np.zeros(nbanks, dtype=np.int64)
    extents: list[tuple[int, int, int]] = []
    pos = 0
    for c in sorted({b.channel for b in dst.arch.banks}):
        start = pos
        for b in dst.arch.banks_of_channel(c):
            bank_offset[b] = pos
            pos += int(bank_pages[b]) * ntens * pb
        if pos > start:
            extents.append((c, start, pos - start))
    return Placement(page, bank, channel, addr, rank, bank_pages, bank_offset, extents)


@dataclass(frozen=True)
class CheckedRequest:
    """A request's arguments after validation: what both the cached and the uncached planner build from."""

    num_tokens: int
    gids: np.ndarray
    nids: np.ndarray
    heads: range
    bases: tuple[int, ...]


def require_unique(nids: np.ndarray) -> np.ndarray:
    """``nids`` (NPU block ids), or ValueError when one repeats: two tiles would share a page."""
    if len(np.unique(nids)) != len(nids):
        raise ValueError(f"npu_block_ids repeats a block: {nids.tolist()}")
    return nids


def check_request(
    num_tokens: int, gpu_block_ids: Sequence[int], npu_block_ids: Sequence[int], src: GpuKVLayout, dst: NpuKVLayout,
    dst_bases: Sequence[int], unique_checked_later: bool = False,
) -> CheckedRequest:
    """The request's arguments validated. ``unique_checked_later``: the caller checks the NPU ids'
    uniqueness itself (:func:`require_unique`), e.g. only when it places ids it has not placed before."""
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    num_tokens = int(num_tokens)
    if src.num_layers != dst.num_layers:
        raise ValueError(f"layer count differs: GPU {src.num_layers}, NPU {dst.num_layers}")
    if src.head_dim != dst.head_dim:
        raise ValueError(f"head_dim differs: GPU {src.head_dim}, NPU {dst.head_dim}")
    if len(dst_bases) != dst.num_tensors:
        raise ValueError(f"dst_bases has {len(dst_bases)} entries, expected {dst.num_tensors} (2 per layer)")
    heads = shared_heads(src, dst)
    gids = _check_block_ids(
        "gpu_block_ids", np.asarray(gpu_block_ids, dtype=np.int64), _blocks_needed(num_tokens, src.block_size), src.num_blocks
    )
    nb = _blocks_needed(num_tokens, dst.block_size)
    nids = _check_block_ids("npu_block_ids", np.asarray(npu_block_ids, dtype=np.int64), nb, dst.max_num_blocks)
    if not unique_checked_later:
        require_unique(nids)
    bases = dst_bases if type(dst_bases) is tuple else tuple(int(b) for b in dst_bases)  # a tuple is taken as ints
    return CheckedRequest(num_tokens, gids, nids, heads, bases)


def assemble_plan(req: CheckedRequest, src: GpuKVLayout, dst: NpuKVLayout, grid: TileGrid, placed: Placement) -> KVTransferPlan:
    """A plan object from its parts; arrays are shared with the parts (plans are read, never written)."""
    plan = KVTransferPlan(
        src=src,
        dst=dst,
        num_tokens=req.num_tokens,
        gpu_block_ids=req.gids,
        npu_block_ids=req.nids,
        dst_bases=req.bases,
        heads=req.heads,
        page=placed.page,
        bank=placed.bank,
        channel=placed.channel,
        addr=placed.addr,
        rank=placed.rank,
        token_start=grid.j * dst.block_size + grid.rt * TILE,
        gpu_head=grid.h + (req.heads.start - src.head_start),
        col_tile=grid.ct,
        bank_pages=placed.bank_pages,
        bank_offset=placed.bank_offset,
        channel_extents=placed.channel_extents,
    )
    plan._memo = placed.memo
    return plan


def plan_kv_transfer(
    num_tokens: int,
    gpu_block_ids: Sequence[int],
    npu_block_ids: Sequence[int],
    src: GpuKVLayout,
    dst: NpuKVLayout,
    dst_bases: Sequence[int],
) -> KVTransferPlan:
    """Plan one request's KV move from a paged GPU cache into the NPU's tiled, interleaved cache.

    ``dst_bases[t]`` is the DRAM base address of NPU tensor ``t = 2*layer + kv``. GPU and NPU block
    sizes may differ; rows past ``num_tokens`` in the last NPU block are zero-padded by the transform.
    Built from scratch every call; :class:`hawk.plan.plan_cache.PlanCache` reuses the parts.
    """
    req = check_request(num_tokens, gpu_block_ids, npu_block_ids, src, dst, dst_bases)
    grid = tile_grid(dst, req.heads, len(req.nids))
    return assemble_plan(req, src, dst, grid, place_pages(grid, req.nids, dst))
