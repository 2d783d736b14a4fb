"""Host time of the engines' block pool per allocation, against the pool's size (CPU only).

An engine allocates blocks on every admission and each time a decoding sequence crosses a block
boundary (at batch 64 with 16-token blocks, four allocations per step on average). This times one
allocate + free of ``--blocks`` ids, with a quarter of the pool held in scattered pieces, for
``hawk.engine.block_manager.BlockManager`` (a min-heap) and, in the same run, the free list it
replaced (a deque, sorted in full on each allocation), per pool size.

    python benchmarks/block_pool_probe.py --sizes 512,8192,65536 --json block_pool.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hawk.engine.block_manager import BlockManager


class SortedDequePool:
    """The earlier free list, kept here only as this probe's baseline."""

    def __init__(self, num_blocks: int) -> None:
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    def allocate(self, n: int, owner: str) -> list[int]:
        ids = sorted(self._free)[:n]
        chosen = set(ids)
        self._free = deque(b for b in self._free if b not in chosen)
        for b in ids:
            self._owner[b] = owner
        return ids

    def free(self, ids: list[int]) -> None:
        for b in ids:
            del self._owner[b]
            self._free.append(b)


def fragment(pool: Any, num_blocks: int, seed: int) -> None:
    """Hold a quarter of the pool in 4-block pieces, every other piece freed again (a used pool)."""
    rng = random.Random(seed)
    pieces = [pool.allocate(4, f"h{i}") for i in range(num_blocks // 8)]
    rng.shuffle(pieces)
    for p in pieces[: len(pieces) // 2]:
        pool.free(p)


def time_per_call_us(pool: Any, n: int, calls: int) -> float:
    def once() -> None:
        pool.free(pool.allocate(n, "r"))

    for _ in range(min(20, calls)):
        once()
    laps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            once()
        laps.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(laps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="512,8192,65536")
    p.add_argument("--blocks", type=int, default=4, help="blocks per allocation")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    pools: dict[str, Callable[[int], Any]] = {"heap": lambda n: BlockManager(n, 16), "sorted-deque": SortedDequePool}
    records = []
    for size in (int(x) for x in a.sizes.split(",")):
        row: dict[str, Any] = {"num_blocks": size, "blocks_per_call": a.blocks}
        for name, make in pools.items():
            pool = make(size)
            fragment(pool, size, seed=size)
            calls = max(20, min(2000, 2_000_000 // size))
            row[f"{name}_us"] = round(time_per_call_us(pool, a.blocks, calls), 2)
        row["sorted_deque_over_heap"] = round(row["sorted-deque_us"] / row["heap_us"], 1)
        records.append(row)
        print(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"records": records}, f, indent=1)


if __name__ == "__main__":
    main()
