"""Many device-side copies in one launch.

HAWK's finish step is hundreds of page runs inside each channel; one torch ``copy_`` per run
would cost a kernel launch each (microseconds apiece, more than the bytes take on a GPU). On CUDA
a small Triton kernel runs them all at once; elsewhere plain slice copies do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hawk.plan.requests import Copy

_UNIT = 8  # copies move 8-byte words; offsets and lengths are multiples of the DRAM alignment (>= 32)
_BLOCK = 4096  # words per program


def _flat_offsets(copies: Sequence[Copy], stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = np.array([(c.src_region, c.src_offset, c.dst_region, c.dst_offset, c.length) for c in copies], dtype=np.int64)
    return arr[:, 0] * stride + arr[:, 1], arr[:, 2] * stride + arr[:, 3], arr[:, 4]


def _check_inside(copies: Sequence[Copy], regions: int, region_bytes: int) -> None:
    for c in copies:
        for r, o in ((c.src_region, c.src_offset), (c.dst_region, c.dst_offset)):
            if not 0 <= r < regions or o < 0 or c.length <= 0 or o + c.length > region_bytes:
                raise ValueError(f"copy {c} reaches outside device memory ({regions} regions of {region_bytes} B)")


def batched_copy(memory: torch.Tensor, copies: Sequence[Copy]) -> None:
    """Apply ``copies`` inside ``memory`` (uint8 ``[regions, region_bytes]``). Sources must not overlap targets."""
    if not copies:
        return
    if memory.dtype != torch.uint8 or memory.dim() != 2 or not memory.is_contiguous():
        raise ValueError("batched_copy needs contiguous uint8 memory shaped [regions, region_bytes]")
    _check_inside(copies, memory.shape[0], memory.shape[1])
    src, dst, lens = _flat_offsets(copies, memory.shape[1])
    flat = memory.view(-1)
    aligned = memory.shape[1] % _UNIT == 0 and not ((src | dst | lens) % _UNIT).any()
    if memory.is_cuda and aligned:
        _triton_copy(flat, src // _UNIT, dst // _UNIT, lens // _UNIT)
        return
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
        flat[d : d + n].copy_(flat[s : s + n])


def _triton_copy(flat: torch.Tensor, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
    from hawk.devices._copy_kernel import copy_words

    dev = flat.device
    words = flat.view(torch.int64)
    t = torch.as_tensor(np.stack([src, dst, lens]), device=dev)
    copy_words(words, t[0], t[1], t[2], int(lens.max()), _BLOCK)


def copy_regions(copies: Sequence[Copy], regions: dict[int, torch.Tensor]) -> None:
    """Apply copies between distinct tensors, named by region number; one slice copy per run.

    For block-granular moves (vLLM blocks between a paged cache and a compact buffer) the plans
    merge neighbouring blocks, so runs are few and large.
    """
    views = {k: v.reshape(-1).view(torch.uint8) for k, v in regions.items()}
    for c in copies:
        src, dst = views[c.src_region], views[c.dst_region]
        dst[c.dst_offset : c.dst_offset + c.length].copy_(src[c.src_offset : c.src_offset + c.length], non_blocking=True)
