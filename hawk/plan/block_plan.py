"""The GPU -> GPU plan (gg-* baselines, and the host-staged path): whole vLLM blocks, no layout change.

A layer's block is a few contiguous pieces of its region (:meth:`PagedKVLayout.block_pieces`: K and V
in HAWK's caches, one piece of K and V of all heads in vLLM's layer-major ones, one per head in
head-major ones). A request's KV in "compact" form is its blocks' pieces gathered in order,
``[layers][pieces][blocks]``: for HAWK's caches exactly a paged layout whose block ids are ``0..n-1``,
in general the layout's :meth:`compact` form. That is what host staging moves, and what the gn-host
baseline re-tiles on the NPU side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.paged import PagedKVLayout
from hawk.plan.requests import Copy, Request, Runs, merge_runs

#: A paged GPU-side cache: HAWK's own, or a hierarchical description (vLLM's).
Paged = GpuKVLayout | PagedKVLayout


@dataclass(eq=False)
class BlockCopyPlan:
    src: Paged
    num_tokens: int
    src_block_ids: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    @property
    def compact_layout(self) -> Paged:
        """The layout of the compact buffer (the request's blocks renumbered ``0..n-1``), per layer."""
        return self.src.compact(self.num_blocks)

    @property
    def total_bytes(self) -> int:
        _, starts, plen = self.src.block_pieces()
        return self.src.num_layers * len(starts) * self.num_blocks * plen

    def _runs(self, layouts: Sequence[Paged], *id_lists: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Runs of request blocks whose ids go up by one in every list: ``(first j, blocks)``; one block
        each where a layout's blocks are not back to back (a piece shorter than the block stride)."""
        n = self.num_blocks
        start = np.ones(n, dtype=bool)
        if n > 1 and all(stride == plen for stride, _, plen in (lay.block_pieces() for lay in layouts)):
            start[1:] = False
            for ids in id_lists:
                start[1:] |= ids[1:] != ids[:-1] + 1
        first = np.flatnonzero(start)
        return first, np.diff(np.append(first, n))

    def _expand(self, first: np.ndarray, count: np.ndarray, ids: np.ndarray, layout: Paged) -> tuple[np.ndarray, ...]:
        """Per ``(layer, piece, run)``: layer, byte offset in that layer's region, offset in the compact buffer, length."""
        stride, starts, plen = layout.block_pieces()
        nl, n, npc = layout.num_layers, self.num_blocks, len(starts)
        lp = np.arange(nl * npc, dtype=np.int64)[:, None]  # layer * pieces + piece
        cache = np.asarray(starts, dtype=np.int64)[lp % npc] + ids[first][None, :] * stride
        compact = (lp * n + first[None, :]) * plen
        shape = (nl * npc, len(first))
        return (np.broadcast_to(lp // npc, shape).ravel(), cache.ravel(), compact.ravel(), np.broadcast_to(count * plen, shape).ravel())

    def gather_copies(self) -> list[Copy]:
        """Cache (region = layer) -> compact buffer (region -1) runs."""
        first, count = self._runs([self.src], self.src_block_ids)
        layer, off, comp, length = self._expand(first, count, self.src_block_ids, self.src)
        return [Copy(*r) for r in merge_runs(layer, off, -1, comp, length)]

    def scatter_copies(self, dst: Paged, dst_block_ids: Sequence[int]) -> list[Copy]:
        """Compact buffer (region -1) -> destination cache (region = layer) runs."""
        ids = self._check_dst(dst, dst_block_ids)
        first, count = self._runs([dst], ids)
        layer, off, comp, length = self._expand(first, count, ids, dst)
        return [Copy(*r) for r in merge_runs(-1, comp, layer, off, length)]

    def direct_requests(self, dst: Paged, dst_block_ids: Sequence[int]) -> list[Request]:
        """Source cache -> destination cache, region = layer on both sides, merged where contiguous."""
        return [Request(*r) for r in self.direct_runs(dst, dst_block_ids)]

    def direct_runs(self, dst: Paged, dst_block_ids: Sequence[int]) -> Runs:
        """:meth:`direct_requests` as arrays (a device copy takes them without an object per run)."""
        ids = self._check_dst(dst, dst_block_ids)
        first, count = self._runs([self.src, dst], self.src_block_ids, ids)
        layer, src_off, _, length = self._expand(first, count, self.src_block_ids, self.src)
        _, dst_off, _, _ = self._expand(first, count, ids, dst)
        return merge_runs(layer, src_off, layer, dst_off, length)

    def _check_dst(self, dst: Paged, dst_block_ids: Sequence[int]) -> np.ndarray:
        if self.src.cell_key() != dst.cell_key():  # dims, dtype, heads, and a block's pieces element by element
            s, d = self.src, dst
            raise ValueError(f"GPU->GPU block copy needs matching layouts except num_blocks: source {s.num_layers}L {s.block_size}x"
                             f"{s.num_kv_heads}x{s.head_dim} {s.dtype} heads {s.heads} ({s.paged().name}), destination "
                             f"{d.num_layers}L {d.block_size}x{d.num_kv_heads}x{d.head_dim} {d.dtype} heads {d.heads} ({d.paged().name})")
        ids = np.asarray(dst_block_ids, dtype=np.int64)
        if len(ids) < self.num_blocks:
            raise ValueError(f"destination has {len(ids)} blocks, the request needs {self.num_blocks}")
        ids = ids[: self.num_blocks]
        bad = ids[(ids < 0) | (ids >= dst.num_blocks)]
        if len(bad):
            raise ValueError(f"destination block id {int(bad[0])} outside [0, {dst.num_blocks})")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"destination block ids repeat: {ids.tolist()}")
        return ids


def plan_block_copy(num_tokens: int, src_block_ids: Sequence[int], src: Paged) -> BlockCopyPlan:
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    need = -(-int(num_tokens) // src.block_size)
    ids = np.asarray(src_block_ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) < need:
        raise ValueError(f"src_block_ids has {ids.size} blocks but {need} are needed for {num_tokens} tokens")
    ids = ids[:need]
    bad = ids[(ids < 0) | (ids >= src.num_blocks)]
    if len(bad):
        raise ValueError(f"src_block_ids holds block id {int(bad[0])} outside [0, {src.num_blocks})")
    return BlockCopyPlan(src, int(num_tokens), ids)
