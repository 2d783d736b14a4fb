"""Plans reused across requests of the same shape: the host work of planning taken off the hot path.

Why: every transfer plans on both sides, and on a fast link that fixed host work is as large as the
transfer itself (issue 9). A plan splits into parts that depend on less than the whole request:

- the tile grid  : (NPU layout, shared heads, NPU block count)           - no block ids at all;
- the placement  : grid + NPU block ids + tensor bases                   - no GPU block ids;
- the plan       : placement + GPU block ids (only the transform reads them).

Each part is kept in a small LRU keyed by exactly what it depends on, so a repeated shape reuses
the grid, a repeated destination (the decode's allocator hands the same blocks back) reuses the
placement and everything derived from it (runs, pieces, the direct request list), and applying new
block ids is vectorised numpy over the grid. A cached plan is byte-identical to an uncached one:
both are assembled by the same functions from the same parts (tests/test_plan_cache.py).

The decode side warms the cache while its D1 request is in flight (``warm``), so planning after D2
is a lookup.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.plan.kv_plan import (
    KVTransferPlan,
    Placement,
    TileGrid,
    assemble_plan,
    check_request,
    place_pages,
    require_unique,
    shared_heads,
    tile_grid,
)

V = TypeVar("V")


class LRU(Generic[V]):
    """A small thread-safe least-recently-used map; ``get_or_build`` builds outside the lock."""

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._d: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], V]) -> V:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                self.hits += 1
                return v
            self.misses += 1
        v = build()  # two threads may build the same key: both results are equal, the last one stays
        with self._lock:
            self._d[key] = v
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return v

    def __len__(self) -> int:
        return len(self._d)


def _ids_key(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype=np.int64).tobytes()


class PlanCache:
    """Cached :func:`hawk.plan.kv_plan.plan_kv_transfer`: same arguments, same checks, same plan bytes."""

    def __init__(self, grids: int = 64, placements: int = 256):
        self.grids: LRU[TileGrid] = LRU(grids)
        self.placements: LRU[Placement] = LRU(placements)

    def _grid(self, dst: NpuKVLayout, heads: range, num_blocks: int) -> TileGrid:
        return self.grids.get_or_build((dst, heads.start, heads.stop, num_blocks), lambda: tile_grid(dst, heads, num_blocks))

    def _placement(self, grid: TileGrid, nids: np.ndarray, dst: NpuKVLayout, heads: range, bases: tuple[int, ...]) -> Placement:
        """Keyed by the ids' bytes: a hit means these very ids were placed (and found unique) before."""
        key = (dst, heads.start, heads.stop, _ids_key(nids), bases)
        return self.placements.get_or_build(key, lambda: place_pages(grid, require_unique(nids), dst))

    def kv_plan(
        self,
        num_tokens: int,
        gpu_block_ids: Sequence[int],
        npu_block_ids: Sequence[int],
        src: GpuKVLayout,
        dst: NpuKVLayout,
        dst_bases: Sequence[int],
    ) -> KVTransferPlan:
        req = check_request(num_tokens, gpu_block_ids, npu_block_ids, src, dst, dst_bases, unique_checked_later=True)
        grid = self._grid(dst, req.heads, len(req.nids))
        return assemble_plan(req, src, dst, grid, self._placement(grid, req.nids, dst, req.heads, req.bases))

    def warm(self, num_tokens: int, npu_block_ids: Sequence[int], src: GpuKVLayout, dst: NpuKVLayout, dst_bases: Sequence[int]) -> None:
        """Build what a plan for this destination needs before the source's block ids are known
        (the decode side, while D1 is in flight): grid, placement, runs and the direct request list."""
        heads = shared_heads(src, dst)
        nb = -(-int(num_tokens) // dst.block_size)
        nids = np.asarray(npu_block_ids, dtype=np.int64)[:nb]
        if len(nids) < nb or len(np.unique(nids)) != nb or nids.min() < 0 or nids.max() >= dst.max_num_blocks:
            return  # the real plan will say what is wrong
        grid = self._grid(dst, heads, nb)
        placed = self._placement(grid, nids, dst, heads, tuple(int(b) for b in dst_bases))
        if "direct" not in placed.memo:
            req = check_request(int(num_tokens), np.zeros(-(-int(num_tokens) // src.block_size), dtype=np.int64), nids, src, dst, dst_bases)
            assemble_plan(req, src, dst, grid, placed).direct_runs()  # fills placed.memo (no GPU ids involved)


#: The process's cache (both connector sides use it; plans are keyed by everything they depend on).
PLANS = PlanCache()
