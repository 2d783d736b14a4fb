"""The GPU side's paged KV cache, as vLLM lays it out: a shape and strides, nothing more.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` ("NHD", vLLM's
FlashAttention default) or ``[2, num_blocks, num_kv_heads, block_size, head_dim]`` ("HND"), or
``[2, num_blocks, num_kv_heads, block_size * head_dim]`` ("vec": the block order vLLM's CPU attention
kernel reads in place, its ``vec`` / ``vec16`` ISAs: in each (block, head) K is ``[D][N]``, V ``[N][D]``;
so V is HND's and K is HND's with slot and dim swapped, and K and V have strides of their own).
A layout is a function from ``(kv, block, slot, head, dim)`` to an element offset (CuTe style),
so every consumer (plan, transform, attention) reads positions from here and never re-derives them.
:meth:`GpuKVLayout.paged` gives the same function as a :class:`~hawk.layouts.paged.PagedKVLayout`
(the hierarchical form every paged cache has, vLLM 0.32's included): what the transform reference and
the block copies read, so there is one way to read offsets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from hawk.layouts.dtypes import GPU_DTYPES, gpu_torch_dtype
from hawk.layouts.paged import COORDS, NotStridedError, PagedKVLayout, plain

ORDERS = ("NHD", "HND", "vec")


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
    def layer_shape(self) -> tuple[int, ...]:
        if self.order == "NHD":
            return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.order == "vec":  # a (block, head) region is flat: K's and V's orders inside it differ
            return (2, self.num_blocks, self.num_kv_heads, self.block_size * self.head_dim)
        return (2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def strides(self) -> dict[str, int]:
        """Element strides of ``kv, block, slot, head, dim`` within one layer tensor, K's and V's alike;
        NotStridedError for "vec", whose K and V differ (:meth:`side_strides`)."""
        if self.order == "vec":
            raise NotStridedError("a 'vec' cache's K ([D][N]) and V ([N][D]) have different strides: ask side_strides(kv)")
        return self.side_strides(0)

    def side_strides(self, kv: int) -> dict[str, int]:
        """Element strides of ``kv, block, slot, head, dim`` of K (``kv`` 0) or V (1) within one layer tensor."""
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        block = bs * h * d
        kv_stride = self.num_blocks * block
        if self.order == "NHD":
            return {"kv": kv_stride, "block": block, "slot": h * d, "head": d, "dim": 1}
        if self.order == "vec" and kv == 0:
            return {"kv": kv_stride, "block": block, "slot": 1, "head": bs * d, "dim": bs}
        return {"kv": kv_stride, "block": block, "slot": d, "head": bs * d, "dim": 1}

    def strides_of(self, tensor: torch.Tensor) -> dict[str, int]:
        """Element strides of ``kv, block, slot, head, dim`` of one given layer tensor: any strides
        (a sliced view) as long as the shape is this layout's (NHD / HND; "vec" is not plain strides)."""
        if self.order == "vec":
            raise NotStridedError("a 'vec' cache's K and V have different strides; read it through paged()")
        names = ("kv", "block", "slot", "head", "dim") if self.order == "NHD" else ("kv", "block", "head", "slot", "dim")
        return dict(zip(names, tensor.stride()))

    def paged(self) -> PagedKVLayout:
        """This layout in hierarchical form (plain strides, V at ``num_blocks`` blocks past K)."""
        return _paged(self)

    def block_pieces(self) -> tuple[int, tuple[int, ...], int]:
        return self.paged().block_pieces()

    def cell_key(self) -> tuple:
        return self.paged().cell_key()

    def compact(self, num_blocks: int) -> GpuKVLayout:
        """The layout of ``num_blocks`` blocks gathered in order: the same cache with fewer blocks."""
        return replace(self, num_blocks=num_blocks)

    def layer_flat(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.reshape(-1)

    def layer_bytes_view(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.reshape(-1).view(torch.uint8)

    def layer_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer tensors of a buffer holding the layers back to back."""
        return list(flat.view(self.torch_dtype).view(self.num_layers, *self.layer_shape).unbind(0))

    def offset(self, kv: int, block: int, slot: int, head: int, dim: int = 0) -> int:
        """Element offset of one KV element inside its layer tensor (``head`` is rank-local)."""
        s = self.side_strides(kv)
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


@functools.lru_cache(maxsize=64)
def _paged(layout: GpuKVLayout) -> PagedKVLayout:
    sizes = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    k, v = (tuple(plain(n, s[c]) for n, c in zip(sizes, COORDS)) for s in (layout.side_strides(0), layout.side_strides(1)))
    strides = tuple(int(x) for x in torch.empty(0).new_empty(layout.layer_shape, device="meta").stride())
    return PagedKVLayout(layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim,
                         (k, v), (0, layout.side_strides(1)["kv"]), layout.layer_shape, strides, layout.dtype, layout.head_start,  # type: ignore[arg-type]
                         f"hawk {layout.order}")


#: The paged GPU-side layouts the plan, formats and transform take.
PAGED_LAYOUTS = (GpuKVLayout, PagedKVLayout)
