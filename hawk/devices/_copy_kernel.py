"""Triton kernel behind :func:`hawk.devices.batched_copy.batched_copy` (imported only on CUDA)."""

import contextlib
import os

import torch
import triton
import triton.language as tl

from hawk.transform.triton_kernel import launch_hooks_idle


# The offset tables are read one value each and their alignment varies per batch: no variant per alignment.
@triton.jit(do_not_specialize_on_alignment=["src_ptr", "dst_ptr", "len_ptr"])
def _copy_words_kernel(words, src_ptr, dst_ptr, len_ptr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    i = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    n = tl.multiple_of(tl.load(len_ptr + i), ALIGN)
    if start < n:
        s = tl.multiple_of(tl.load(src_ptr + i), ALIGN)
        d = tl.multiple_of(tl.load(dst_ptr + i), ALIGN)
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(words + d + offs, tl.load(words + s + offs, mask=m), mask=m)


#: Compiled kernels by what Triton's dispatcher specializes this kernel on (device, BLOCK, ALIGN and
#: the words pointer's 16-byte alignment): after a configuration's first launch through the dispatcher, its compiled
#: kernel is launched directly (as hawk.transform.triton_kernel does), skipping argument binding and
#: the cache lookup on a path that runs once per transfer batch and once per NPU finish
#: (``HAWK_TRANSFORM_LAUNCH=jit`` keeps the dispatcher here too).
_COMPILED: dict = {}
_DIRECT = {"ok": True}


def copy_words(words: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lens: torch.Tensor, max_len: int, block: int,
               align: int = 1, num_warps: int = 4, count: int | None = None,
               stream: int | None = None) -> None:
    """``lens[i]`` words from ``words[src[i]:]`` to ``words[dst[i]:]`` for the first ``count`` entries
    (default: all); ``align`` (1 or 2) divides every offset and length, so loads and stores move 16
    bytes per vector when it is 2. ``stream``: a raw CUDA stream of ``words``' device to launch on
    (default: the current one)."""
    grid = (src.numel() if count is None else count, triton.cdiv(max_len, block))
    with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():  # Triton launches on the current device
        if not words.is_cuda:
            _copy_words_kernel[grid](words, src, dst, lens, BLOCK=block, ALIGN=align, num_warps=num_warps)
            return
        idx = words.device.index
        key = (idx, block, align, num_warps, words.data_ptr() % 16 == 0)
        direct = _DIRECT["ok"] and os.environ.get("HAWK_TRANSFORM_LAUNCH", "direct") != "jit"  # the transform's switch
        compiled = _COMPILED.get(key) if direct else None
        if compiled is not None and launch_hooks_idle():
            try:
                raw = stream if stream is not None else torch._C._cuda_getCurrentRawStream(idx)
                compiled.run(grid[0], grid[1], 1, raw, compiled.function,
                             compiled.packed_metadata, None, None, None, words, src, dst, lens, block, align)
                return
            except Exception:  # noqa: BLE001 - a launcher this code does not know: the dispatcher from now on
                _DIRECT["ok"] = False
                _COMPILED.clear()
        # the dispatcher launches on the current stream
        on = contextlib.nullcontext() if stream is None else torch.cuda.stream(torch.cuda.ExternalStream(stream, device=words.device))
        with on:
            compiled = _copy_words_kernel[grid](words, src, dst, lens, BLOCK=block, ALIGN=align, num_warps=num_warps)
        if direct and getattr(compiled, "function", None) is not None and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = compiled
