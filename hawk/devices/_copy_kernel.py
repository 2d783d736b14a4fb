"""Triton kernel behind :func:`hawk.devices.batched_copy.batched_copy` (imported only on CUDA)."""

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_words_kernel(words, src_ptr, dst_ptr, len_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    n = tl.load(len_ptr + i)
    if start < n:
        s = tl.load(src_ptr + i)
        d = tl.load(dst_ptr + i)
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(words + d + offs, tl.load(words + s + offs, mask=m), mask=m)


def copy_words(words: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lens: torch.Tensor, max_len: int, block: int) -> None:
    grid = (src.numel(), triton.cdiv(max_len, block))
    with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        _copy_words_kernel[grid](words, src, dst, lens, BLOCK=block)
