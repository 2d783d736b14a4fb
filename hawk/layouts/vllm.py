"""vLLM 0.32's paged KV caches, described as :class:`~hawk.layouts.paged.PagedKVLayout` data.

Facts (vLLM 0.32 source: ``vllm/v1/kv_cache_layout.py``, ``vllm/v1/kv_cache_interface.py``, the
attention backends):

- Every attention cache is logical ``[L, B, H, N, C]`` (layers, blocks, KV heads, block slots,
  content) with a physical stride order ``KVCacheLayout``; C is innermost in all six orders.
  ``register_kv_caches`` hands a connector one ``[B, H, N, C]`` view per layer of one buffer.
- GPU backends (FLASH_ATTN, TRITON_ATTN, FLASHINFER) split C as ``K | V`` of ``head_dim`` each
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``): plain strides, V ``head_dim`` elements
  after K. FLASH_ATTN and TRITON_ATTN declare no layout (any order; vLLM's default preference
  puts LBNHC first); FLASHINFER has no LHBNC form (and on sm100 takes LBHNC / BLHNC only).
- CPU_ATTN: LBHNC only. A ``(block, head)`` region of ``N * C`` elements holds the ``N * D`` K
  elements, then the ``N * D`` V elements, each in an order set by the ISA of the CPU kernel
  (``_get_attn_isa``; attention layers carry ``.isa``): :data:`CPU_ISA_FORMS`. Other ISAs (neon,
  vsx, vxe, rvv) write orders vLLM's Python does not describe: refused.

Nothing here imports vLLM: the layouts are built from shapes, or read from the tensors a connector
is handed (:func:`from_registered`), which are checked against the described layout, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hawk.layouts.dtypes import gpu_dtype_name
from hawk.layouts.paged import KVModes, LayoutError, Mode, PagedKVLayout, plain

#: ``KVCacheLayout`` members: the physical order of logical axes ``(L, B, H, N, C) = (0, 1, 2, 3, 4)``,
#: outermost first.
STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: What each GPU backend's kernels read, and the order vLLM picks when nothing else decides.
GPU_BACKENDS: dict[str, tuple[str, ...]] = {
    "FLASH_ATTN": tuple(STRIDE_ORDERS),
    "TRITON_ATTN": tuple(STRIDE_ORDERS),
    "FLASHINFER": ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"),
}
DEFAULT_GPU_LAYOUT = "LBNHC"
CPU_BACKEND = "CPU_ATTN"
CPU_LAYOUT = "LBHNC"


def _vec(n: int, d: int) -> tuple[tuple[Mode, Mode], tuple[Mode, Mode]]:
    """vec / vec16: K ``[D][N]`` (K(n, d) at ``d * N + n``), V ``[N][D]``."""
    return (plain(n, 1), plain(d, n)), (plain(n, d), plain(d, 1))


def _amx(n: int, d: int) -> tuple[tuple[Mode, Mode], tuple[Mode, Mode]]:
    """amx: K(n, d) at ``(n // 16) * 16D + (d // 2) * 32 + (n % 16) * 2 + d % 2``;
    V(n, d) at ``(d // 16) * 16N + (n // 2) * 32 + (d % 16) * 2 + n % 2`` (after the N*D K elements)."""
    if n % 16 or d % 16:
        raise LayoutError(f"the amx CPU cache needs block_size and head_dim multiples of 16, got {n} and {d}")
    k_slot: Mode = ((16, 2), (n // 16, 16 * d))
    k_dim: Mode = ((2, 1), (d // 2, 32))
    v_slot: Mode = ((2, 1), (n // 2, 32))
    v_dim: Mode = ((16, 2), (d // 16, 16 * n))
    return (k_slot, k_dim), (v_slot, v_dim)


#: ISA -> ``(N, D) -> ((K slot, K dim), (V slot, V dim))`` modes inside a ``(block, head)`` region
#: (V's based ``N * D`` elements in).
CPU_ISA_FORMS: dict[str, Callable[[int, int], tuple[tuple[Mode, Mode], tuple[Mode, Mode]]]] = {
    "vec": _vec,
    "vec16": _vec,
    "amx": _amx,
}


class UnsupportedVllmLayout(LayoutError):
    """A vLLM backend, ISA or stride order HAWK has no description of."""


def vllm_strides(kv_layout: str, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, content: int) -> tuple[int, ...]:
    """Element strides of logical ``(L, B, H, N, C)`` for one buffer of dense (unpadded) pages, as
    vLLM's ``compute_layout_strides`` lays them: the innermost physical axis stride 1, each next one
    the previous stride times its size."""
    order = _order(kv_layout)
    shape = (num_layers, num_blocks, num_kv_heads, block_size, content)
    strides = [0] * 5
    cur = 1
    for axis in reversed(order):
        strides[axis] = cur
        cur *= shape[axis]
    return tuple(strides)


def _order(kv_layout: str) -> tuple[int, ...]:
    try:
        return STRIDE_ORDERS[kv_layout]
    except KeyError:
        raise UnsupportedVllmLayout(f"unknown KVCacheLayout {kv_layout!r}; expected one of {list(STRIDE_ORDERS)}") from None


def gpu_layout(
    backend: str, kv_layout: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: str = "bf16", head_start: int = 0, strides: tuple[int, int, int, int] | None = None,
) -> PagedKVLayout:
    """A GPU backend's cache: plain strides, K then V along C. ``strides`` are a layer view's
    ``(B, H, N, C)`` strides (default: :func:`vllm_strides`' for one dense buffer)."""
    supported = GPU_BACKENDS.get(backend)
    if supported is None:
        raise UnsupportedVllmLayout(f"unknown vLLM GPU backend {backend!r}; described: {list(GPU_BACKENDS)} (and {CPU_BACKEND}: cpu_layout)")
    if kv_layout not in supported:
        raise UnsupportedVllmLayout(f"{backend} does not read KVCacheLayout {kv_layout!r}; it reads {list(supported)}")
    sb, sh, sn, sc = strides or vllm_strides(kv_layout, num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)[1:]
    modes: KVModes = (plain(num_blocks, sb), plain(block_size, sn), plain(num_kv_heads, sh), plain(head_dim, sc))
    return PagedKVLayout(num_layers, num_blocks, block_size, num_kv_heads, head_dim, (modes, modes), (0, head_dim * sc),
                         (num_blocks, num_kv_heads, block_size, 2 * head_dim), (sb, sh, sn, sc), dtype, head_start,
                         f"vllm {backend} {kv_layout}")


def cpu_layout(
    isa: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: str = "bf16", head_start: int = 0, block_stride: int | None = None,
) -> PagedKVLayout:
    """CPU_ATTN's cache (LBHNC): each ``(block, head)`` region is ``N * 2D`` elements, K then V in the
    ISA's order. ``block_stride`` defaults to a dense block (``H * N * 2D``)."""
    form = CPU_ISA_FORMS.get(isa)
    if form is None:
        raise UnsupportedVllmLayout(f"vLLM's CPU cache order for isa {isa!r} is not described (vLLM's Python does not say it); described: {list(CPU_ISA_FORMS)}")
    n, d, h = block_size, head_dim, num_kv_heads
    region = n * 2 * d
    sb = h * region if block_stride is None else block_stride
    (ks, kd), (vs, vd) = form(n, d)
    block, head = plain(num_blocks, sb), plain(h, region)
    return PagedKVLayout(num_layers, num_blocks, n, h, d, ((block, ks, head, kd), (block, vs, head, vd)), (0, n * d),
                         (num_blocks, h, n, 2 * d), (sb, region, 2 * d, 1), dtype, head_start, f"vllm {CPU_BACKEND} {isa}")


#: vLLM's preference when nothing else decides (``_DEFAULT_LAYOUT_PREFERENCE``): which name to give
#: strides that several orders explain (axes of size 1 make their order moot).
PREFERENCE = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")


def follows(kv_layout: str, sizes: tuple[int, ...], strides: tuple[int | None, ...]) -> bool:
    """Whether logical ``(L, B, H, N, C)`` ``strides`` (None: unknown) of ``sizes`` nest in ``kv_layout``'s
    physical order: each axis (of size > 1) steps at least the whole extent of the axes inside it."""
    inner = 0
    for axis in reversed(_order(kv_layout)):
        st, n = strides[axis], sizes[axis]
        if n == 1 or st is None:
            continue
        if st < inner:
            return False
        inner = st * n
    return True


def physical_order(sizes: tuple[int, ...], strides: tuple[int | None, ...]) -> str | None:
    """The first KVCacheLayout in vLLM's preference whose order ``strides`` follow, or None."""
    return next((o for o in PREFERENCE if follows(o, sizes, strides)), None)


def from_registered(
    kv_caches: Mapping[str, torch.Tensor], backend: str, isa: str | None, head_dim: int, head_start: int = 0,
    dtype: str | None = None, kv_layout: str | None = None,
) -> PagedKVLayout:
    """The layout of what vLLM's ``register_kv_caches`` hands a connector: one ``[B, H, N, 2 * head_dim]``
    view per layer (in the dict's order, the model's layer order), read from their shapes, strides and
    storage offsets. ``backend`` is vLLM's attention backend name, ``isa`` the CPU kernel's (CPU_ATTN:
    the layers' ``.isa``), ``kv_layout`` the resolved ``KVCacheLayout`` name if known (checked against
    the strides). The caches to hand the plan and transform are ``list(kv_caches.values())``.
    Raises LayoutError (UnsupportedVllmLayout) where the tensors disagree with each other or with the
    described layout, or nothing describes them."""
    caches = list(kv_caches.values())
    if not caches:
        raise LayoutError("register_kv_caches handed no tensors")
    c0 = caches[0]
    if c0.dim() != 4:
        raise LayoutError(f"expected [num_blocks, kv_heads, block_size, 2*head_dim] layer views, got shape {tuple(c0.shape)}")
    b, h, n, c = (int(x) for x in c0.shape)
    if c != 2 * head_dim:
        raise LayoutError(f"content dim is {c}, expected 2*head_dim = {2 * head_dim} (K then V)")
    name = gpu_dtype_name(c0.dtype)
    if dtype is not None and dtype != name:
        raise LayoutError(f"caches are {name}, expected {dtype}")
    for k, t in kv_caches.items():
        if t.shape != c0.shape or t.stride() != c0.stride() or t.dtype != c0.dtype or t.device != c0.device:
            raise LayoutError(f"layer {k!r} is {tuple(t.shape)}/{t.stride()} {t.dtype} on {t.device}; the first layer is "
                              f"{tuple(c0.shape)}/{c0.stride()} {c0.dtype} on {c0.device}")
    strides = tuple(int(s) for s in c0.stride())
    steps = {t.data_ptr() - p.data_ptr() for p, t in zip(caches, caches[1:])}
    layer_stride = steps.pop() // c0.element_size() if len(steps) == 1 else None
    if layer_stride is not None and layer_stride <= 0:
        raise LayoutError(f"layer views step {layer_stride} elements: not in layer order")
    sizes = (len(caches), b, h, n, c)
    if backend == CPU_BACKEND:
        if isa is None:
            raise LayoutError("CPU_ATTN caches need the CPU kernel's isa (the attention layers' .isa)")
        lay = cpu_layout(isa, len(caches), b, n, h, head_dim, name, head_start, strides[0])
        if strides[1:] != lay.tensor_strides[1:]:
            raise LayoutError(f"CPU_ATTN wants dense (block, head) regions of {n}x{c} (strides (_, {n * c}, {c}, 1)), got {strides}")
        if not follows(CPU_LAYOUT, sizes, (layer_stride, *strides)):
            raise LayoutError(f"CPU_ATTN reads {CPU_LAYOUT} only; these views step {layer_stride} elements per layer with strides {strides}")
    else:
        if strides[3] != 1:
            raise LayoutError(f"GPU backends read K and V as contiguous head_dim rows (C stride 1), got strides {strides}")
        if kv_layout is not None and not follows(kv_layout, sizes, (layer_stride, *strides)):
            raise LayoutError(f"caches' strides {strides} (layer step {layer_stride}) do not follow the given {kv_layout}")
        kv_layout = kv_layout or physical_order(sizes, (layer_stride, *strides))
        if kv_layout is None:
            raise LayoutError(f"strides {strides} (layer step {layer_stride}) follow no KVCacheLayout")
        lay = gpu_layout(backend, kv_layout, len(caches), b, n, h, head_dim, name, head_start, strides)  # type: ignore[arg-type]
    lay.check_cache(caches)
    return lay


def allocate(layout: PagedKVLayout, kv_layout: str, device: torch.device | str = "cpu", buffer: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per-layer views of one buffer (zeroed, or ``buffer``: 1-D, the layout's dtype), placed as vLLM
    places them (layer ``l`` at ``l`` times the layer stride of ``kv_layout``): test and benchmark
    caches that are exactly what vLLM registers."""
    full = vllm_strides(kv_layout, layout.num_layers, layout.num_blocks, layout.num_kv_heads, layout.block_size, 2 * layout.head_dim)
    if full[1:] != layout.tensor_strides:
        raise LayoutError(f"{layout.name}'s strides {layout.tensor_strides} are not {kv_layout}'s dense {full[1:]}")
    total = layout.num_layers * layout.num_blocks * layout.num_kv_heads * layout.block_size * 2 * layout.head_dim
    if buffer is None:
        buffer = torch.zeros(total, dtype=layout.torch_dtype, device=device)
    elif buffer.dim() != 1 or buffer.numel() != total or buffer.dtype != layout.torch_dtype:
        raise LayoutError(f"buffer must be 1-D {layout.torch_dtype} of {total} elements, got {tuple(buffer.shape)} {buffer.dtype}")
    return [buffer.as_strided(layout.tensor_shape, layout.tensor_strides, buffer.storage_offset() + i * full[0]) for i in range(layout.num_layers)]
