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


@dataclass(frozen=True, eq=False)
class Runs:
    """Pieces as five parallel arrays; iterating yields ``(sr, so, dr, do, len)`` tuples.

    Plans hand these to device copies as arrays (no per-run Python objects on the hot path);
    :class:`Request` / :class:`Copy` lists come from them where an API wants objects.
    """

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def __iter__(self):
        cols = (self.src_region, self.src_offset, self.dst_region, self.dst_offset, self.length)
        return iter(zip(*(c.tolist() for c in cols)))

    def total_bytes(self) -> int:
        return int(self.length.sum())


def merge_runs(
    src_region: np.ndarray,
    src: np.ndarray,
    dst_region: np.ndarray,
    dst: np.ndarray,
    length: int | np.ndarray,
) -> Runs:
    """Coalesce pieces that continue each other on both sides into runs.

    Pieces are taken in the given order; a piece extends the current run when it starts where
    the run ends in the same source and destination regions. This is what turns thousands of
    page-sized pieces into a handful of large requests.
    """
    src = np.asarray(src, dtype=np.int64)
    n = len(src)
    lens = np.broadcast_to(np.asarray(length, dtype=np.int64), (n,))
    src_region = np.broadcast_to(np.asarray(src_region, dtype=np.int64), (n,))
    dst_region = np.broadcast_to(np.asarray(dst_region, dtype=np.int64), (n,))
    dst = np.asarray(dst, dtype=np.int64)
    cont = np.zeros(n, dtype=bool)
    if n > 1:
        cont[1:] = (
            (src_region[1:] == src_region[:-1])
            & (dst_region[1:] == dst_region[:-1])
            & (src[1:] == src[:-1] + lens[:-1])
            & (dst[1:] == dst[:-1] + lens[:-1])
        )
    starts = np.flatnonzero(~cont)
    ends = np.append(starts[1:], n)
    csum = np.concatenate([[0], np.cumsum(lens)])
    return Runs(src_region[starts], src[starts], dst_region[starts], dst[starts], csum[ends] - csum[starts])
