"""Fixed-size KV blocks handed out and taken back; the engines' memory admission control."""

from __future__ import annotations

import threading
from collections import deque


class OutOfBlocks(MemoryError):
    pass


class BlockManager:
    """A free list of ``num_blocks`` block ids of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
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
            ids = sorted(self._free)[:n]
            chosen = set(ids)
            self._free = deque(b for b in self._free if b not in chosen)
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
        with self._lock:
            for b in ids:
                if self._owner.pop(b, None) is None:
                    raise ValueError(f"block {b} is not allocated (double free?)")
                self._free.append(b)

    def owners(self) -> dict[str, int]:
        """``owner -> blocks held`` (accounting)."""
        with self._lock:
            out: dict[str, int] = {}
            for o in self._owner.values():
                out[o] = out.get(o, 0) + 1
            return out
