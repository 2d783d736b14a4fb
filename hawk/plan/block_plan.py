"""The GPU -> GPU plan (gg-* baselines, and the host-staged path): whole vLLM blocks, no layout change.

A request's KV in "compact" form is its blocks gathered in order, ``[layers][K, V][blocks]`` of
``block_bytes`` each: exactly a paged layout whose block ids are ``0..n-1``. That is what host
staging moves, and what the gn-host baseline re-tiles on the NPU side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.plan.requests import Copy, Request, Runs, merge_runs


def _block_bytes(layout: GpuKVLayout) -> int:
    """``layout.block_bytes`` without its probe tensor (``GpuKVLayout.elem_bytes`` allocates one per call:
    microseconds, on every plan's size and request list)."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * layout.torch_dtype.itemsize


@dataclass(eq=False)
class BlockCopyPlan:
    src: GpuKVLayout
    num_tokens: int
    src_block_ids: np.ndarray

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    @property
    def compact_layout(self) -> GpuKVLayout:
        """The request's blocks renumbered ``0..n-1``: the layout of the compact buffer, per layer."""
        return replace(self.src, num_blocks=self.num_blocks)

    @property
    def total_bytes(self) -> int:
        return self.src.num_layers * 2 * self.num_blocks * _block_bytes(self.src)

    def _runs(self, *id_lists: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Runs of request blocks whose ids go up by one in every list: ``(first j, blocks)``."""
        n = self.num_blocks
        start = np.ones(n, dtype=bool)
        if n > 1:
            start[1:] = False
            for ids in id_lists:
                start[1:] |= ids[1:] != ids[:-1] + 1
        first = np.flatnonzero(start)
        return first, np.diff(np.append(first, n))

    def _expand(self, first: np.ndarray, count: np.ndarray, ids: np.ndarray, layout: GpuKVLayout) -> tuple[np.ndarray, ...]:
        """Per ``(layer, kv, run)``: layer, byte offset in that layer's cache, offset in the compact buffer, length."""
        nl, n, bb = layout.num_layers, self.num_blocks, _block_bytes(layout)
        lk = np.arange(nl * 2, dtype=np.int64)[:, None]  # layer * 2 + kv
        cache = (lk % 2) * layout.num_blocks * bb + ids[first][None, :] * bb
        compact = (lk * n + first[None, :]) * bb
        shape = (nl * 2, len(first))
        return (np.broadcast_to(lk // 2, shape).ravel(), cache.ravel(), compact.ravel(), np.broadcast_to(count * bb, shape).ravel())

    def gather_copies(self) -> list[Copy]:
        """Cache (region = layer) -> compact buffer (region -1) runs."""
        first, count = self._runs(self.src_block_ids)
        layer, off, comp, length = self._expand(first, count, self.src_block_ids, self.src)
        return [Copy(*r) for r in merge_runs(layer, off, -1, comp, length)]

    def scatter_copies(self, dst: GpuKVLayout, dst_block_ids: Sequence[int]) -> list[Copy]:
        """Compact buffer (region -1) -> destination cache (region = layer) runs."""
        ids = self._check_dst(dst, dst_block_ids)
        first, count = self._runs(ids)
        layer, off, comp, length = self._expand(first, count, ids, dst)
        return [Copy(*r) for r in merge_runs(-1, comp, layer, off, length)]

    def direct_requests(self, dst: GpuKVLayout, dst_block_ids: Sequence[int]) -> list[Request]:
        """Source cache -> destination cache, region = layer on both sides, merged where contiguous."""
        return [Request(*r) for r in self.direct_runs(dst, dst_block_ids)]

    def direct_runs(self, dst: GpuKVLayout, dst_block_ids: Sequence[int]) -> Runs:
        """:meth:`direct_requests` as arrays (a device copy takes them without an object per run)."""
        ids = self._check_dst(dst, dst_block_ids)
        first, count = self._runs(self.src_block_ids, ids)
        layer, src_off, _, length = self._expand(first, count, self.src_block_ids, self.src)
        _, dst_off, _, _ = self._expand(first, count, ids, dst)
        return merge_runs(layer, src_off, layer, dst_off, length)

    def _check_dst(self, dst: GpuKVLayout, dst_block_ids: Sequence[int]) -> np.ndarray:
        s = self.src
        same = (s.num_layers, s.block_size, s.num_kv_heads, s.head_dim, s.dtype, s.order, s.head_start)
        theirs = (dst.num_layers, dst.block_size, dst.num_kv_heads, dst.head_dim, dst.dtype, dst.order, dst.head_start)
        if same != theirs:
            raise ValueError(f"GPU->GPU block copy needs matching layouts except num_blocks: source {same}, destination {theirs}")
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


def plan_block_copy(num_tokens: int, src_block_ids: Sequence[int], src: GpuKVLayout) -> BlockCopyPlan:
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
