"""Tensor parallelism, Megatron style: which slice of each weight a rank holds, the rank group
that sums the row-parallel partial products, and which ranks of two instances exchange KV.

One process per rank. Column-parallel layers (``wq``/``wk``/``wv``, ``gate``/``up``) keep a
contiguous range of output rows; row-parallel layers (``wo``, ``down``) keep the matching input
columns, and their partial outputs are summed over the group. Embedding, norms and the LM head
are replicated. A rank owns the KV heads ``[rank * H / tp, (rank + 1) * H / tp)`` and the query
heads that attend to them, so attention never crosses ranks.

The sum over ranks is deterministic: each rank gathers every partial and adds them in rank order
(a ring all-reduce would add in a different order per chunk), so every rank holds bit-identical
activations and a run is reproducible. It is not bitwise equal to TP1, whose single matmul adds the
same products in the BLAS kernel's order; docs/tensor_parallel.md says what the tests assert.

Layering: torch only (the model imports this module, so it must not import the model).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: Parameter-name suffix -> the dimension a rank slices (0: output rows, 1: input columns).
_SPLIT = {"attn.wq": 0, "attn.wk": 0, "attn.wv": 0, "mlp.gate": 0, "mlp.up": 0, "attn.wo": 1, "mlp.down": 1}


@dataclass(frozen=True)
class Shard:
    """This rank's position in its instance: ``rank`` of ``size`` (``Shard()`` = no parallelism)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad shard: rank {self.rank} of {self.size}")

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def split(self, n: int, what: str = "dimension") -> range:
        """This rank's contiguous part of ``n`` (which the size must divide)."""
        if n % self.size:
            raise ValueError(f"tensor parallelism {self.size} does not divide the {what} ({n})")
        per = n // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def check(self, num_kv_heads: int, intermediate_size: int) -> None:
        """Refuse a degree that does not divide the KV heads (query heads follow) or the MLP."""
        self.split(num_kv_heads, "number of KV heads")
        self.split(intermediate_size, "MLP intermediate size")

    def kv_heads(self, num_kv_heads: int) -> range:
        """Global KV heads this rank owns: its layouts' ``head_start`` and ``num_kv_heads``."""
        return self.split(num_kv_heads, "number of KV heads")


def split_dim(name: str) -> int | None:
    """The dimension of parameter ``name`` that ranks split, or None when it is replicated."""
    m = re.fullmatch(r"layers\.\d+\.(\w+\.\w+)\.weight", name)
    return _SPLIT.get(m.group(1)) if m else None


def shard_slice(name: str, full_shape: tuple[int, ...], shard: Shard) -> tuple[int | None, range]:
    """``(dim, index range along dim)`` of ``name``'s slice on this rank; ``(None, ...)`` = all of it."""
    dim = split_dim(name) if shard.parallel else None
    if dim is None:
        return None, range(full_shape[0] if full_shape else 1)
    return dim, shard.split(full_shape[dim], name)


def take_slice(name: str, full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """This rank's slice of a whole tensor (for loaders that cannot read a slice directly)."""
    dim, rows = shard_slice(name, tuple(full.shape), shard)
    return full if dim is None else full.narrow(dim, rows.start, len(rows)).contiguous()


class TPGroup:
    """One instance's ranks, over a gloo (CPU) or NCCL (CUDA) process group of its own.

    Built from a TCPStore rather than ``init_process_group``, so a process can hold the rank 0 of
    a prefill instance and of a decode instance at once (the equivalence check does).
    """

    def __init__(self, shard: Shard, port: int, backend: str = "gloo", timeout_s: float = 60.0, host: str = "127.0.0.1"):
        self.shard = shard
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, shard.size, shard.rank == 0, timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore("hawk-tp", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefix, shard.rank, shard.size)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, shard.rank, shard.size, timeout)

    @staticmethod
    def free_port(host: str = "127.0.0.1") -> int:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``x``, added in rank order (identical bits on every rank)."""
        parts = [torch.empty_like(x) for _ in range(self.shard.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out


def kv_request_id(request_id: str, decode_rank: int, decode_tp: int) -> str:
    """The name under which a prefill rank offers one decode rank its part of a request's KV.

    With one decode rank the request id itself (TP1 <-> TP1 is unchanged); with several, each
    decode rank pulls its own entry, so a prefill rank holds one reservation per (sender, receiver).
    """
    return request_id if decode_tp == 1 else f"{request_id}#d{decode_rank}"


def overlapping_ranks(heads: range, num_kv_heads: int, other_tp: int) -> list[int]:
    """Ranks of an instance with ``other_tp`` ranks whose KV heads intersect ``heads``."""
    out = []
    for r in range(other_tp):
        theirs = Shard(r, other_tp).kv_heads(num_kv_heads)
        if max(theirs.start, heads.start) < min(theirs.stop, heads.stop):
            out.append(r)
    return out
