"""Many device-side copies in one launch.

HAWK's finish step is hundreds of page runs inside each channel; one torch ``copy_`` per run
would cost a kernel launch each (microseconds apiece, more than the bytes take on a GPU). On CUDA
a small Triton kernel runs them all at once; elsewhere plain slice copies do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hawk.plan.requests import Copy, Runs
from hawk.transform.upload import upload_int64

_UNIT = 8  # copies move 8-byte words; offsets and lengths are multiples of the DRAM alignment (>= 32)
_BLOCK = 4096  # words per program


def as_runs(copies: Sequence[Copy] | Runs) -> Runs:
    if isinstance(copies, Runs):
        return copies
    arr = np.array([(c.src_region, c.src_offset, c.dst_region, c.dst_offset, c.length) for c in copies], dtype=np.int64).reshape(-1, 5)
    return Runs(*(arr[:, i] for i in range(5)))


def _flat_offsets(copies: Sequence[Copy] | Runs, stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r = as_runs(copies)
    return r.src_region * stride + r.src_offset, r.dst_region * stride + r.dst_offset, r.length


def _check_inside(r: Runs, regions: int, region_bytes: int) -> None:
    for reg, off in ((r.src_region, r.src_offset), (r.dst_region, r.dst_offset)):
        bad = (reg < 0) | (reg >= regions) | (off < 0) | (r.length <= 0) | (off + r.length > region_bytes)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"copy ({int(r.src_region[i])}, {int(r.src_offset[i])}) -> ({int(r.dst_region[i])}, {int(r.dst_offset[i])}) "
                f"of {int(r.length[i])} B reaches outside device memory ({regions} regions of {region_bytes} B)"
            )


#: Device offset tables of Runs objects already copied once, by (runs, memory): plans keep their Runs
#: (an idle receiver's finish reuses the same runs), so a repeat uploads and checks nothing.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batched_copy(memory: torch.Tensor, copies: Sequence[Copy] | Runs) -> None:
    """Apply ``copies`` inside ``memory`` (uint8 ``[regions, region_bytes]``). Sources must not overlap targets."""
    if not len(copies):
        return
    if memory.dtype != torch.uint8 or memory.dim() != 2 or not memory.is_contiguous():
        raise ValueError("batched_copy needs contiguous uint8 memory shaped [regions, region_bytes]")
    runs = as_runs(copies)
    flat = memory.view(-1)
    key = (memory.data_ptr(), tuple(memory.shape), memory.device)
    hit = _TABLES.get(runs) if memory.is_cuda and isinstance(copies, Runs) else None
    if hit is not None and hit[0] == key:
        _launch_copy(flat, *hit[1:])
        return
    _check_inside(runs, memory.shape[0], memory.shape[1])
    src, dst, lens = _flat_offsets(runs, memory.shape[1])
    aligned = memory.shape[1] % _UNIT == 0 and not ((src | dst | lens) % _UNIT).any()
    if memory.is_cuda and aligned:
        table = _triton_copy(flat, src // _UNIT, dst // _UNIT, lens // _UNIT)
        if isinstance(copies, Runs):
            _TABLES[runs] = (key, *table)
        return
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
        flat[d : d + n].copy_(flat[s : s + n])


def vector_align(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> int:
    """2 where every word offset and length is even (16-byte vectors; DRAM-aligned runs always are), else 1."""
    return 2 if not ((src | dst | lens) % 2).any() else 1


def _triton_copy(flat: torch.Tensor, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> tuple[torch.Tensor, int, int]:
    """Word offsets ``src``/``dst`` (8-byte units) from ``flat``'s start; they may lie before it.
    Returns what :func:`_launch_copy` needs to run the same copies again."""
    t = upload_int64(np.stack([src, dst, lens]), flat.device)  # no host sync: same stream as the launch
    align = vector_align(src, dst, lens)
    _launch_copy(flat, t, int(lens.max()), align)
    return t, int(lens.max()), align


def _launch_copy(flat: torch.Tensor, table: torch.Tensor, max_len: int, align: int) -> None:
    from hawk.devices._copy_kernel import copy_words

    words = flat if flat.dtype == torch.int64 else flat.view(torch.int64)
    copy_words(words, table[0], table[1], table[2], max_len, _BLOCK, align)


def copy_regions(copies: Sequence[Copy], regions: dict[int, torch.Tensor]) -> None:
    """Apply copies between distinct tensors, named by region number; one slice copy per run.

    For block-granular moves (vLLM blocks between a paged cache and a compact buffer) the plans
    merge neighbouring blocks, so runs are few and large.
    """
    views = {k: v.reshape(-1).view(torch.uint8) for k, v in regions.items()}
    for c in copies:
        src, dst = views[c.src_region], views[c.dst_region]
        dst[c.dst_offset : c.dst_offset + c.length].copy_(src[c.src_offset : c.src_offset + c.length], non_blocking=True)


#: The largest single copy one launch takes (the kernel's second grid axis is limited to 65535 programs).
_MAX_BYTES = 65535 * _BLOCK * _UNIT

#: Fewer pairs than this go through torch's copies: one launch plus the offsets' upload beat them only
#: when there are several.
MIN_PAIRS = 8


def copy_spans(device: torch.device, src_addr: np.ndarray, dst_addr: np.ndarray, lengths: np.ndarray, force: bool = False) -> bool:
    """Copies given as absolute addresses on one CUDA device (``src_addr[i]`` -> ``dst_addr[i]``,
    ``lengths[i]`` bytes; distinct, non-overlapping ranges) in one launch, with no tensor object per
    copy. Addresses are taken relative to one small tensor of this device, so the kernel's words
    pointer reaches every range. Returns False (nothing copied) where that does not apply: not CUDA (unless
    ``force``), fewer than :data:`MIN_PAIRS` copies (unless ``force``), an empty or non-positive length,
    or an address or length that is not a multiple of 8 bytes.

    Why: a transport batch is many contiguous byte ranges of a few registered regions; slicing a
    tensor view per range, and asking each for its device, pointer and size, costs several
    microseconds per range (on an H200 a gg-direct pull of 160 ranges took 1.5 ms to submit, for 0.02 ms
    of copying).
    Runs on the caller's current stream.
    """
    n = len(lengths)
    if n == 0 or (n < MIN_PAIRS and not force):
        return False
    dev = torch.device(device)
    if dev.type != "cuda" and not force:
        return False
    table = span_table(dev, src_addr, dst_addr, lengths)
    if table is None:
        return False
    table.run()
    return True


@dataclass(eq=False)
class SpanTable:
    """:func:`copy_spans`' copies with their offsets uploaded once: :meth:`run` issues them again on the
    current stream, with no host work but the launch (for copies that repeat between the same places):
    the launch itself is bound on the first run."""

    base: torch.Tensor  # the tensor the offsets count from (kept alive with them)
    table: torch.Tensor  # [3, n] int64 words: source, destination, length
    max_len: int
    align: int
    _launch: Callable[..., None] | None = field(default=None, init=False, repr=False)

    def run(self) -> None:
        if self._launch is None:
            from hawk.devices._copy_kernel import bind_copy_words

            self._launch = bind_copy_words(self.base, self.table[0], self.table[1], self.table[2], self.max_len, _BLOCK, self.align)
        self._launch()


def span_table(device: torch.device | str, src_addr: np.ndarray, dst_addr: np.ndarray, lengths: np.ndarray) -> SpanTable | None:
    """The copies of :func:`copy_spans` as a :class:`SpanTable` (uploaded now, on the current stream,
    not run), or None where one launch cannot take them (see :func:`span_words`)."""
    dev = torch.device(device)
    base = torch.empty(1, dtype=torch.int64, device=dev)
    words = span_words(src_addr, dst_addr, lengths, base.data_ptr())
    if words is None:
        return None
    s, d, n = words
    return SpanTable(base, upload_int64(np.stack([s, d, n]), dev), int(n.max()), vector_align(s, d, n))


def span_words(src_addr: np.ndarray, dst_addr: np.ndarray, lengths: np.ndarray,
               base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Byte ranges given as absolute addresses as the copy kernel's word table: ``(src, dst, lengths)``
    in 8-byte words, offsets from address ``base``. None where one launch cannot take them: an empty
    batch, a length that is not positive or above :data:`_MAX_BYTES`, or an address or length that is
    not a multiple of 8 bytes."""
    lens = np.asarray(lengths, dtype=np.int64)
    if len(lens) == 0 or lens.min() <= 0 or lens.max() > _MAX_BYTES:
        return None
    s = np.asarray(src_addr, dtype=np.int64) - base
    d = np.asarray(dst_addr, dtype=np.int64) - base
    if ((s | d | lens) % _UNIT).any():
        return None
    return s // _UNIT, d // _UNIT, lens // _UNIT
