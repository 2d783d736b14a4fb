"""The vocabulary every plan speaks: transfer requests and device-side copies, and how to merge them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    """One transfer-engine request: ``length`` bytes from a source region to a destination region.

    Regions are small integers whose meaning the plan defines (a channel of the NPU, a layer
    tensor of a GPU cache, the sender's staging buffer); the connector names them for the engine.
    """

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class Copy:
    """A copy inside the destination device after the bytes arrived (intra- or cross-channel)."""

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int

    @property
    def cross_region(self) -> bool:
        return self.src_region != self.dst_region


def merge_runs(
    src_region: np.ndarray,
    src: np.ndarray,
    dst_region: np.ndarray,
    dst: np.ndarray,
    length: int | np.ndarray,
) -> list[tuple[int, int, int, int, int]]:
    """Coalesce pieces that continue each other on both sides into ``(sr, so, dr, do, len)`` runs.

    Pieces are taken in the given order; a piece extends the current run when it starts where
    the run ends in the same source and destination regions. This is what turns thousands of
    page-sized pieces into a handful of large requests.
    """
    n = len(src)
    if n == 0:
        return []
    lens = np.broadcast_to(np.asarray(length, dtype=np.int64), (n,))
    src_region = np.asarray(src_region, dtype=np.int64)
    dst_region = np.asarray(dst_region, dtype=np.int64)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    cont = np.ones(n, dtype=bool)
    cont[0] = False
    cont[1:] = (
        (src_region[1:] == src_region[:-1])
        & (dst_region[1:] == dst_region[:-1])
        & (src[1:] == src[:-1] + lens[:-1])
        & (dst[1:] == dst[:-1] + lens[:-1])
    )
    starts = np.flatnonzero(~cont)
    ends = np.append(starts[1:], n)
    csum = np.concatenate([[0], np.cumsum(lens)])
    run_len = csum[ends] - csum[starts]
    return [
        (int(src_region[s]), int(src[s]), int(dst_region[s]), int(dst[s]), int(rl))
        for s, rl in zip(starts, run_len)
    ]
