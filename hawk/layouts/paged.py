"""A paged KV cache described as a hierarchical (CuTe-style) layout: where any engine puts its KV.

A layer's cache is a function from ``(kv, block, slot, head, dim)`` to an element offset inside the
tensor that layer is handed as. For each of K and V it is a base offset plus, for each of the four
coordinates, a *mode*: a tuple of ``(shape, stride)`` pairs, the fastest-varying first (CuTe's
colexicographic order). A coordinate ``x`` of a mode ``((s0, d0), (s1, d1), ...)`` sits at
``(x % s0) * d0 + (x // s0 % s1) * d1 + ...``. A plain stride is a one-pair mode; an interleaved
order (vLLM's AMX CPU cache, where 16 slots and pairs of dims are woven together) is a longer one,
so a new engine layout is new data, never a new code path: the plan, the transform reference, the
block copies and the wire all read offsets from here.

``hawk.layouts.gpu.GpuKVLayout`` (HAWK's own NHD / HND caches) answers :meth:`GpuKVLayout.paged`
with its layout in these terms; vLLM 0.32's caches are built in ``hawk.layouts.vllm``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hawk.layouts.dtypes import GPU_DTYPES, gpu_torch_dtype

#: ``((shape, stride), ...)``, fastest first.
Mode = tuple[tuple[int, int], ...]
#: One of K / V: the modes of ``(block, slot, head, dim)``.
KVModes = tuple[Mode, Mode, Mode, Mode]
COORDS = ("block", "slot", "head", "dim")


class LayoutError(ValueError):
    """A layout description that is inconsistent, or caches that do not match their layout."""


class NotStridedError(LayoutError):
    """A consumer that needs plain strides (the fused kernel) was handed an interleaved layout."""


def mode_size(mode: Mode) -> int:
    return math.prod(s for s, _ in mode)


def mode_max(mode: Mode) -> int:
    """The largest offset the mode reaches (its strides are non-negative)."""
    return sum((s - 1) * d for s, d in mode)


def mode_offset(mode: Mode, x: Any) -> Any:
    """Offset of coordinate ``x`` (an int, a numpy array or a torch tensor: broadcasting works)."""
    total = 0
    for s, d in mode:
        total = total + (x % s) * d
        x = x // s
    return total


def plain(shape: int, stride: int) -> Mode:
    return ((shape, stride),)


def check_mode(mode: Any, size: int, what: str) -> Mode:
    """``mode`` as a tuple of int pairs whose shapes multiply to ``size``; LayoutError otherwise."""
    try:
        m = tuple((int(s), int(d)) for s, d in mode)
        raw = [(s, d) for s, d in mode]
    except (TypeError, ValueError) as e:
        raise LayoutError(f"{what} mode must be (shape, stride) pairs, got {mode!r:.80}") from e
    if not m or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for p in raw for v in p):
        raise LayoutError(f"{what} mode must be a non-empty tuple of int (shape, stride) pairs, got {mode!r:.80}")
    if any(s <= 0 or d < 0 for s, d in m):
        raise LayoutError(f"{what} mode needs positive shapes and non-negative strides, got {m}")
    if mode_size(m) != size:
        raise LayoutError(f"{what} mode {m} covers {mode_size(m)} coordinates, the layout has {size}")
    return m


@dataclass(frozen=True)
class PagedKVLayout:
    """One tensor-parallel rank's per-layer paged KV cache, as a function from coordinates to offsets.

    ``modes[kv]`` are K's (kv = 0) and V's (kv = 1) modes of ``(block, slot, head, dim)``, and
    ``kv_base[kv]`` their base offsets, in elements from the start of a layer's tensor.
    ``tensor_shape`` / ``tensor_strides`` are the tensor each layer is handed as (e.g. what vLLM's
    ``register_kv_caches`` receives): :meth:`check_cache` holds caches to them, so offsets read
    from the layout are offsets in those tensors. ``head_start`` is this rank's first global KV head.
    ``name`` says what the layout was described from (informative only: it takes no part in equality).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    modes: tuple[KVModes, KVModes]
    kv_base: tuple[int, int]
    tensor_shape: tuple[int, ...]
    tensor_strides: tuple[int, ...]
    dtype: str = "bf16"
    head_start: int = 0
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for n in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise LayoutError(f"PagedKVLayout.{n} must be a positive int, got {v!r}")
        if isinstance(self.head_start, bool) or not isinstance(self.head_start, int) or self.head_start < 0:
            raise LayoutError(f"PagedKVLayout.head_start must be an int >= 0, got {self.head_start!r}")
        if self.dtype not in GPU_DTYPES:
            raise LayoutError(f"PagedKVLayout.dtype must be one of {sorted(GPU_DTYPES)}, got {self.dtype!r}")
        sizes = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if len(self.modes) != 2 or any(len(m) != 4 for m in self.modes):
            raise LayoutError("PagedKVLayout.modes must hold K's and V's four modes (block, slot, head, dim)")
        modes = tuple(tuple(check_mode(m, n, f"{'KV'[kv]} {c}") for m, n, c in zip(self.modes[kv], sizes, COORDS)) for kv in range(2))
        object.__setattr__(self, "modes", modes)
        if len(self.kv_base) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0 for b in self.kv_base):
            raise LayoutError(f"PagedKVLayout.kv_base must be two ints >= 0, got {self.kv_base!r}")
        object.__setattr__(self, "kv_base", tuple(int(b) for b in self.kv_base))
        shape, strides = tuple(self.tensor_shape), tuple(self.tensor_strides)
        if not shape or len(shape) != len(strides) or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in shape + strides):
            raise LayoutError(f"tensor shape {shape} and strides {strides} must be int tuples of one length")
        if any(s <= 0 for s in shape) or any(d < 0 for d in strides):
            raise LayoutError(f"tensor shape {shape} must be positive and strides {strides} non-negative")
        object.__setattr__(self, "tensor_shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "tensor_strides", tuple(int(d) for d in strides))
        if self.max_offset() >= self.span:
            raise LayoutError(f"the layout reaches element {self.max_offset()}, past its {self.span}-element tensor {shape}/{strides}")

    # -- the interface the plan, formats and transform read (shared with GpuKVLayout) -------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return gpu_torch_dtype(self.dtype)

    @property
    def elem_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def heads(self) -> range:
        """Global KV-head indices this rank holds."""
        return range(self.head_start, self.head_start + self.num_kv_heads)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) of one layer, all heads."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def span(self) -> int:
        """Elements a layer's tensor spans, from its first element to its last."""
        return 1 + sum((s - 1) * d for s, d in zip(self.tensor_shape, self.tensor_strides))

    @property
    def layer_bytes(self) -> int:
        """Bytes of a layer's region (:meth:`layer_bytes_view`): what a transport registers per layer."""
        return self.span * self.elem_bytes

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    def paged(self) -> PagedKVLayout:
        return self

    def element_offsets(self, kv: Any, block: Any, slot: Any, head: Any, dim: Any = 0) -> Any:
        """Element offsets inside a layer's tensor (``head`` rank-local); any argument may be an array
        or tensor, and they broadcast. K and V are evaluated separately and picked by ``kv``."""
        per = [self.kv_base[k] + sum(mode_offset(m, x) for m, x in zip(self.modes[k], (block, slot, head, dim))) for k in range(2)]
        if isinstance(kv, (int, np.integer)):
            return per[int(kv)]
        if isinstance(kv, torch.Tensor):
            return torch.where(kv == 0, torch.as_tensor(per[0], device=kv.device), torch.as_tensor(per[1], device=kv.device))
        return np.where(np.asarray(kv) == 0, per[0], per[1])

    def offset(self, kv: int, block: int, slot: int, head: int, dim: int = 0) -> int:
        """Element offset of one KV element inside its layer tensor (``head`` is rank-local)."""
        return int(self.element_offsets(kv, block, slot, head, dim))

    def max_offset(self) -> int:
        return max(self.kv_base[k] + sum(mode_max(m) for m in self.modes[k]) for k in range(2))

    def strides(self) -> dict[str, int]:
        """Element strides of ``kv, block, slot, head, dim`` where the layout is plain strides (every mode one
        pair, K and V alike but for their bases); NotStridedError for an interleaved layout."""
        k, v = self.modes
        flat = [m[0] if len(m) == 1 else None for m in k]
        if any(f is None for f in flat) or k != v or self.kv_base[0] != 0:
            raise NotStridedError(f"layout {self.name or '(unnamed)'} is not plain strides with K at 0: {self.modes}, bases {self.kv_base}")
        return {"kv": self.kv_base[1], **{c: d for c, (_, d) in zip(COORDS, flat)}}

    def strides_of(self, tensor: torch.Tensor) -> dict[str, int]:
        """:meth:`strides` for a cache :meth:`check_cache` accepted (its strides are the layout's)."""
        return self.strides()

    def check_cache(self, caches: list[torch.Tensor]) -> None:
        """Raise LayoutError unless ``caches`` are this layout's layer tensors: count, shape, strides,
        dtype, and every layer's region inside its storage."""
        if len(caches) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layer tensors, got {len(caches)}")
        for i, c in enumerate(caches):
            if tuple(c.shape) != self.tensor_shape or tuple(c.stride()) != self.tensor_strides or c.dtype != self.torch_dtype:
                raise LayoutError(
                    f"layer {i} cache is {tuple(c.shape)} strides {tuple(c.stride())} {c.dtype}; layout {self.name or ''} expects "
                    f"{self.tensor_shape} strides {self.tensor_strides} {self.torch_dtype}"
                )
            if (c.storage_offset() + self.span) * c.element_size() > c.untyped_storage().nbytes():
                raise LayoutError(f"layer {i} cache's region runs past its storage")

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """One zeroed tensor per layer, strided as the layout says (each on its own storage)."""
        return [torch.zeros(self.span, dtype=self.torch_dtype, device=device).as_strided(self.tensor_shape, self.tensor_strides)
                for _ in range(self.num_layers)]

    def layer_flat(self, cache: torch.Tensor) -> torch.Tensor:
        """A 1-D view of a layer's whole region (same memory): element offsets index it."""
        return cache.as_strided((self.span,), (1,))

    def layer_bytes_view(self, cache: torch.Tensor) -> torch.Tensor:
        """A layer's region as flat bytes (same memory): byte offsets of block pieces index it."""
        return self.layer_flat(cache).view(torch.uint8)

    def layer_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer tensors of a buffer holding the layers' regions back to back."""
        per = flat.view(self.torch_dtype).view(self.num_layers, self.span)
        return [per[i].as_strided(self.tensor_shape, self.tensor_strides) for i in range(self.num_layers)]

    # -- whole blocks (gg-*: the same layout on both sides) -------------------------------------------

    def block_pieces(self) -> tuple[int, tuple[int, ...], int]:
        """``(block stride, piece starts, piece length)`` in bytes: block ``b`` of a layer is the pieces
        ``[start + b * stride, + length)``, contiguous runs of the layer region. One piece per block in
        vLLM's layer-major layouts (a block's K and V of all heads together), one per K / V in HAWK's."""
        return _pieces(self)

    def cell_key(self) -> tuple:
        """What must agree for whole-block copies between two caches (any block counts): dims, dtype,
        heads, and where every element of a block sits among its pieces."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.head_start, _cell_signature(self))

    def compact(self, num_blocks: int) -> PagedKVLayout:
        """The layout of ``num_blocks`` blocks gathered piece-major (``[layer][piece][block]``, the
        compact form host staging moves), as 1-D layer tensors."""
        return _compact(self, num_blocks)


def _cell(layout: PagedKVLayout) -> np.ndarray:
    """Element offsets of block 0: ``[2, slot, head, dim]``."""
    kv = np.arange(2)[:, None, None, None]
    s = np.arange(layout.block_size)[None, :, None, None]
    h = np.arange(layout.num_kv_heads)[None, None, :, None]
    d = np.arange(layout.head_dim)[None, None, None, :]
    return np.broadcast_to(layout.element_offsets(kv, 0, s, h, d), (2, layout.block_size, layout.num_kv_heads, layout.head_dim))


def _block_stride(layout: PagedKVLayout) -> int:
    """The one element stride between a layer's blocks (K's and V's alike), which whole-block copies need."""
    k, v = layout.modes[0][0], layout.modes[1][0]
    if len(k) != 1 or k != v:
        raise NotStridedError(f"whole-block copies need one block stride for K and V, got {k} / {v}")
    return k[0][1] if k[0][0] > 1 else 0


@functools.lru_cache(maxsize=64)
def _pieces(layout: PagedKVLayout) -> tuple[int, tuple[int, ...], int]:
    """Block 0's offsets as runs of consecutive elements (cached: asked on every block-copy plan)."""
    offs = np.unique(_cell(layout))
    if len(offs) != 2 * layout.block_size * layout.num_kv_heads * layout.head_dim:
        raise LayoutError(f"layout {layout.name} maps two elements of one block to one offset")
    breaks = np.flatnonzero(np.diff(offs) != 1) + 1
    first = np.concatenate([[0], breaks])
    starts, lengths = offs[first], np.diff(np.append(first, len(offs)))
    if len(set(lengths.tolist())) != 1:
        raise LayoutError(f"layout {layout.name}: a block's runs differ in length ({sorted(set(lengths.tolist()))})")
    e = layout.elem_bytes
    return _block_stride(layout) * e, tuple(int(s) * e for s in starts), int(lengths[0]) * e


@functools.lru_cache(maxsize=64)
def _cell_signature(layout: PagedKVLayout) -> bytes:
    """Each element of a block as (piece index, offset in its piece), in coordinate order, digested
    (the arrays run to megabytes; keys are compared per plan)."""
    _, starts, plen = _pieces(layout)
    e = layout.elem_bytes
    cell = _cell(layout).reshape(-1) * e
    st = np.asarray(starts, dtype=np.int64)
    piece = np.searchsorted(st, cell, side="right") - 1
    return hashlib.blake2b(np.stack([piece, cell - st[piece]]).astype(np.int64).tobytes(), digest_size=20).digest()


def _compact(layout: PagedKVLayout, n: int) -> PagedKVLayout:
    """Renumber pieces: a piece ``p`` at byte ``starts[p]`` moves to ``p * n * plen``, block ``j`` to
    ``j * plen`` within it. Each mode pair must stay inside a piece or step whole piece gaps."""
    _, starts, plen = layout.block_pieces()
    e = layout.elem_bytes
    st, pl = [s // e for s in starts], plen // e
    gap = st[1] - st[0] if len(st) > 1 else 0
    if any(b - a != gap for a, b in zip(st, st[1:])) or st[0] != 0:
        raise LayoutError(f"layout {layout.name}: pieces {st} are not evenly spaced from 0, no compact form")

    def move(offset_stride: int, shape: int) -> int:
        if (shape - 1) * offset_stride < pl or shape == 1:
            return offset_stride
        if gap == 0 or offset_stride % gap:
            raise LayoutError(f"layout {layout.name}: stride {offset_stride} crosses pieces (gap {gap}), no compact form")
        return offset_stride // gap * n * pl

    def base(b: int) -> int:
        return (b // gap) * n * pl + b % gap if gap and b >= pl else b

    modes = tuple((plain(n, pl),) + tuple(tuple((s, move(d, s)) for s, d in m) for m in km[1:]) for km in layout.modes)
    span = len(st) * n * pl
    return PagedKVLayout(layout.num_layers, n, layout.block_size, layout.num_kv_heads, layout.head_dim, modes,  # type: ignore[arg-type]
                         (base(layout.kv_base[0]), base(layout.kv_base[1])), (span,), (1,), layout.dtype, layout.head_start,
                         f"{layout.name} compact")
