"""The GPU side's paged KV cache, as vLLM lays it out: a shape and strides, nothing more.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD", vLLM's
FlashAttention default) or ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` ("HND").
A layout is a function from ``(kv, block, slot, head, dim)`` to an element offset (CuTe style),
so every consumer (plan, transform, attention) reads positions from here and never re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hawk.layouts.dtypes import GPU_DTYPES, gpu_torch_dtype

ORDERS = ("NHD", "HND")


@dataclass(frozen=True)
class GpuKVLayout:
    """A per-layer paged KV cache of one tensor-parallel rank.

    ``head_start`` is the global index of this rank's first KV head, so two sides with
    different tensor parallelism can agree on which heads they share.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    order: str = "NHD"
    head_start: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GpuKVLayout.{name} must be a positive int, got {v!r}")
        if self.head_start < 0:
            raise ValueError(f"GpuKVLayout.head_start must be >= 0, got {self.head_start}")
        if self.order not in ORDERS:
            raise ValueError(f"GpuKVLayout.order must be one of {ORDERS}, got {self.order!r}")
        if self.dtype not in GPU_DTYPES:
            raise ValueError(f"GpuKVLayout.dtype must be one of {sorted(GPU_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return gpu_torch_dtype(self.dtype)

    @property
    def elem_bytes(self) -> int:
        return self.torch_dtype.itemsize  # no tensor per call: planning asks this per block

    @property
    def heads(self) -> range:
        """Global KV-head indices this rank holds."""
        return range(self.head_start, self.head_start + self.num_kv_heads)

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        if self.order == "NHD":
            return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return (2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def strides(self) -> dict[str, int]:
        """Element strides of ``kv, block, slot, head, dim`` within one layer tensor."""
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        block = bs * h * d
        kv = self.num_blocks * block
        if self.order == "NHD":
            return {"kv": kv, "block": block, "slot": h * d, "head": d, "dim": 1}
        return {"kv": kv, "block": block, "slot": d, "head": bs * d, "dim": 1}

    def offset(self, kv: int, block: int, slot: int, head: int, dim: int = 0) -> int:
        """Element offset of one KV element inside its layer tensor (``head`` is rank-local)."""
        s = self.strides()
        return kv * s["kv"] + block * s["block"] + slot * s["slot"] + head * s["head"] + dim * s["dim"]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) of one layer, all heads: the unit vLLM transfers."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """One zeroed tensor per layer, shaped as vLLM allocates it."""
        return [torch.zeros(self.layer_shape, dtype=self.torch_dtype, device=device) for _ in range(self.num_layers)]

    def check_cache(self, caches: list[torch.Tensor]) -> None:
        """Raise if ``caches`` does not have this layout's layer count, shape and dtype."""
        if len(caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layer tensors, got {len(caches)}")
        for i, c in enumerate(caches):
            if tuple(c.shape) != self.layer_shape or c.dtype != self.torch_dtype:
                raise ValueError(
                    f"layer {i} cache has shape {tuple(c.shape)} {c.dtype}, layout expects {self.layer_shape} {self.torch_dtype}"
                )
