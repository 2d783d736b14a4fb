"""Triton kernel behind :func:`hawk.devices.batched_copy.batched_copy` (imported only on CUDA)."""

import contextlib
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hawk.triton_launch import launch_hooks_idle, launchable, on_device, raw_stream, run_compiled


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
    _bind(words, src, dst, lens, max_len, block, align, num_warps, count, by_address=False)(stream)


def bind_copy_words(words: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lens: torch.Tensor, max_len: int, block: int,
                    align: int = 1, num_warps: int = 4, count: int | None = None) -> Callable[[int | None], None]:
    """:func:`copy_words` with these arguments as a call to repeat (its argument: the raw stream, None for
    the current one). Why: a same-GPU landed pull repeats one copy table (:class:`~hawk.devices.batched_copy.SpanTable`),
    and working out the grid, the device and the compiled kernel's key per launch, and the launcher's
    check of every pointer, is host time on its critical path. The call holds the tensors."""
    return _bind(words, src, dst, lens, max_len, block, align, num_warps, count, by_address=True)


def _bind(words: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lens: torch.Tensor, max_len: int, block: int, align: int,
          num_warps: int, count: int | None, by_address: bool) -> Callable[[int | None], None]:
    """The launch as a call; ``by_address``: a direct launch passes the tensors' addresses (ints, which
    Triton's launcher takes as they are, where for a tensor it asks the driver whether the address is
    device memory, per pointer and launch): only for a call that holds the tensors, checked once by the
    dispatcher's first launch."""
    grid = (src.numel() if count is None else count, triton.cdiv(max_len, block))
    if not words.is_cuda:
        return lambda stream=None: _copy_words_kernel[grid](words, src, dst, lens, BLOCK=block, ALIGN=align, num_warps=num_warps)
    dev = words.device
    idx = dev.index
    key = (idx, block, align, num_warps, words.data_ptr() % 16 == 0)
    ptrs = tuple(t.data_ptr() for t in (words, src, dst, lens)) if by_address else (words, src, dst, lens)

    def run(stream: int | None = None) -> None:
        with on_device(dev):  # Triton launches on the current device
            _launch_on(idx, key, grid, words, src, dst, lens, block, align, num_warps, stream, ptrs)

    return run


def _launch_on(idx: int, key: tuple, grid: tuple[int, int], words: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               lens: torch.Tensor, block: int, align: int, num_warps: int, stream: int | None, ptrs: tuple[int, ...]) -> None:
    """:func:`copy_words` on CUDA device ``idx``, which is current: the compiled kernel's launcher once known,
    given ``ptrs`` for its four pointers (the tensors, or their addresses: see :func:`_bind`)."""
    direct = _DIRECT["ok"] and os.environ.get("HAWK_TRANSFORM_LAUNCH", "direct") != "jit"  # the transform's switch
    compiled = _COMPILED.get(key) if direct else None
    if compiled is not None and launch_hooks_idle():
        try:
            run_compiled(compiled, grid, stream if stream is not None else raw_stream(idx), (*ptrs, block, align))
            return
        except Exception:  # noqa: BLE001 - a launcher this code does not know: the dispatcher from now on
            _DIRECT["ok"] = False
            _COMPILED.clear()
    # the dispatcher launches on the current stream
    on = contextlib.nullcontext() if stream is None else torch.cuda.stream(torch.cuda.ExternalStream(stream, device=words.device))
    with on:
        compiled = _copy_words_kernel[grid](words, src, dst, lens, BLOCK=block, ALIGN=align, num_warps=num_warps)
    if direct and launchable(compiled):
        _COMPILED[key] = compiled
