"""Fixed-size KV blocks handed out and taken back; the engines' memory admission control."""

from __future__ import annotations

import heapq
import threading


class OutOfBlocks(MemoryError):
    pass


class BlockManager:
    """A free list of ``num_blocks`` block ids of ``block_size`` tokens.

    The free ids are a min-heap, so a request gets the lowest free ids (a fresh request's blocks are
    contiguous when they can be) in O(n log N) for n blocks of N: an engine allocates on every
    admission and whenever a decoding sequence crosses a block boundary, and a sorted copy of the
    whole free list per call cost milliseconds on a large cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks))  # a min-heap (sorted is one)
        self._owner: dict[int, str] = {}
        self._lock = threading.Lock()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return self.num_free >= n

    def allocate(self, n: int, owner: str) -> list[int]:
        """``n`` blocks, lowest ids first (so a fresh request's blocks are contiguous when they can be)."""
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocks(f"{owner!r} needs {n} KV blocks, {len(self._free)} of {self.num_blocks} free")
            ids = [heapq.heappop(self._free) for _ in range(n)]
            for b in ids:
                self._owner[b] = owner
            return ids

    def try_allocate(self, n: int, owner: str) -> list[int] | None:
        """Like :meth:`allocate`, but None when short: check and take in one step, since another
        engine may share this pool (colocated prefill and decode)."""
        try:
            return self.allocate(n, owner)
        except OutOfBlocks:
            return None

    def free(self, ids: list[int]) -> None:
        """Give ``ids`` back; all or none: a double free is refused before any id moves, so one bad
        id never strands the rest of the list."""
        with self._lock:
            bad = next((b for b in ids if b not in self._owner), None)
            if bad is None and len(set(ids)) != len(ids):
                bad = next(b for i, b in enumerate(ids) if b in ids[:i])
            if bad is not None:
                raise ValueError(f"block {bad} is not allocated (double free?)")
            for b in ids:
                del self._owner[b]
                heapq.heappush(self._free, b)

    def owners(self) -> dict[str, int]:
        """``owner -> blocks held`` (accounting)."""
        with self._lock:
            out: dict[str, int] = {}
            for o in self._owner.values():
                out[o] = out.get(o, 0) + 1
            return out
