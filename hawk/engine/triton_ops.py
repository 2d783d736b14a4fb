"""Small fused Triton kernels for the decoder's elementwise work, each with its torch reference.

A decode step on a GPU is launch-bound: every torch elementwise op is a kernel, and RMSNorm in
fp32 alone is about six. Each kernel here replaces several of them:

* :func:`add_rms_norm` - ``residual += x; out = rmsnorm(residual) * w`` (vLLM's
  ``fused_add_rms_norm``); without a residual (the first layer) just the norm, and the input
  becomes the residual. One program per row; the row stays in registers.
* :func:`qkv_rope` - RoPE on the q and k heads of the fused QKV projection, with cos/sin gathered
  from the whole :class:`~hawk.engine.model.RotaryTable` by position inside the kernel, writing
  q, k and v as three contiguous tensors (what the attention backends take) in one pass.
* :func:`silu_mul` - ``silu(gate) * up`` from the fused gate/up projection.

Numerics follow the torch code they replace (the ``*_ref`` functions, used on CPU and as the test
oracle): the norm runs in fp32 and rounds to the model dtype before the weight multiply, and RoPE
and SiLU round each intermediate to the activation dtype as torch's elementwise ops do, so on the
GPU the fused path differs from torch only by reduction order and FMA contraction.

Every launcher takes contiguous tensors, allocates only its outputs, reads positions on the device
and never syncs, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from hawk.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below still serve the model
    triton = tl = None  # type: ignore[assignment]

#: Whether the kernels can run (Triton importable); the model also needs a CUDA device or
#: ``TRITON_INTERPRET=1`` to use them.
AVAILABLE = triton is not None

__all__ = ["AVAILABLE", "add_rms_norm", "add_rms_norm_ref", "qkv_rope", "qkv_rope_ref", "rms_norm_ref", "silu_mul", "silu_mul_ref"]


# ---- torch references -----------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalised in fp32 (a bf16 mean of squares loses too much)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)``; with no residual, ``(norm(x), x)``.

    The residual is updated in place (as the fused kernel does), so a layer allocates nothing.
    """
    if residual is None:
        residual = x
    else:
        residual.add_(x)
    return rms_norm_ref(residual, weight, eps), residual


def qkv_rope_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous ``q [T, Hq, D], k, v [T, Hkv, D]`` from ``qkv [T, (Hq + 2 Hkv) * D]``, q and k
    rotated by the rows ``positions`` of the whole tables ``cos, sin_signed [L, D]``."""
    t, d = qkv.shape[0], cos.shape[-1]
    x = qkv.view(t, n_heads + 2 * n_kv_heads, d)
    c, s = cos[positions][:, None, :], sin_signed[positions][:, None, :]
    qk = x[:, : n_heads + n_kv_heads]
    qk = qk * c + qk.roll(d // 2, -1) * s  # rotate_half's sign lives in sin_signed
    return qk[:, :n_heads].contiguous(), qk[:, n_heads:].contiguous(), x[:, n_heads + n_kv_heads :].contiguous()


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 I]`` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- kernels --------------------------------------------------------------------------------


def _jit(fn=None, **options):  # noqa: ANN001, ANN202 - a decorator, bare or with triton.jit's options
    """``triton.jit`` where Triton is installed; the plain function (never called) elsewhere."""
    if fn is None:
        return lambda f: _jit(f, **options)
    return fn if triton is None else triton.jit(fn, **options)


@_jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_RES:
        s = (x.to(tl.float32) + tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32))
        s = s.to(x.dtype)  # the residual stream keeps the model dtype, as torch's add does
        tl.store(res_ptr + row * n + cols, s, mask=mask)
    else:
        s = x
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / n + eps)
    y = (sf * rstd).to(x.dtype).to(tl.float32)  # round to the model dtype before the weight, as torch
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


# ``T`` (tokens) and ``pos_ptr``'s alignment change with the batch: not specialized on, so an unseen
# batch shape never compiles a new variant while serving.
@_jit(do_not_specialize=["T"], do_not_specialize_on_alignment=["pos_ptr"])
def _qkv_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, T,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = D // 2
    i = tl.arange(0, half)
    src = qkv_ptr + (t * (HQ + 2 * HKV) + h) * D
    x1 = tl.load(src + i)
    x2 = tl.load(src + half + i)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * D + i).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * D + half + i).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * D + i).to(tl.float32)  # already negated (sin_signed)
    s2 = tl.load(sin_ptr + pos * D + half + i).to(tl.float32)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + roll(x, D/2) * sin_signed, each product and the sum rounded as torch rounds them.
    y1 = ((f1 * c1).to(dt).to(tl.float32) + (f2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    rot = h < HQ + HKV
    y1 = tl.where(rot, y1, x1)
    y2 = tl.where(rot, y2, x2)
    # Output: q [T, HQ, D] | k [T, HKV, D] | v [T, HKV, D], back to back in one buffer.
    is_q = h < HQ
    hk = tl.where(rot, h - HQ, h - HQ - HKV)
    base = tl.where(rot, T * HQ * D, T * (HQ + HKV) * D)
    off = tl.where(is_q, (t * HQ + h) * D, base + (t * HKV + hk) * D)
    tl.store(out_ptr + off + i, y1)
    tl.store(out_ptr + off + half + i, y2)


@_jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + t * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt)  # silu rounds to the activation dtype, then the mul
    tl.store(out_ptr + t * inter + cols, (act.to(tl.float32) * u.to(tl.float32)).to(dt), mask=mask)


# ---- launchers ------------------------------------------------------------------------------


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {x.stride()} for shape {tuple(x.shape)}")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_ref` in one kernel: ``residual`` (if given) is updated in place and
    returned; otherwise ``x`` is returned as the residual (the first layer)."""
    n = x.shape[-1]
    rows = x.numel() // n
    _check_contiguous(x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        warps = min(16, max(1, block // 256))  # ~8 values per thread
        launch(_add_rms_norm_kernel, (rows,),
               x, x if residual is None else residual, weight, out, n, eps,
               HAS_RES=residual is not None, BLOCK=block, num_warps=warps)
    return out, (x if residual is None else residual)


def qkv_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qkv_rope_ref` in one kernel: one program per (token, head) of q, k and v. ``out``: a flat
    buffer (at least ``T * (n_heads + 2 n_kv_heads) * D`` elements) to write them into, back to back,
    instead of a new one (a piecewise CUDA graph's static buffer)."""
    t, d = qkv.shape[0], cos.shape[-1]
    if d % 2 or d & (d - 1):
        raise ValueError(f"qkv_rope needs a power-of-two head_dim, got {d}")
    if qkv.numel() != t * (n_heads + 2 * n_kv_heads) * d:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {n_heads}+2*{n_kv_heads} heads of {d}")
    _check_contiguous(qkv=qkv, positions=positions, cos=cos, sin_signed=sin_signed)
    size = t * (n_heads + 2 * n_kv_heads) * d
    if out is None:
        out = torch.empty(size, dtype=qkv.dtype, device=qkv.device)
    elif out.dim() != 1 or out.numel() < size or out.dtype != qkv.dtype or out.device != qkv.device:
        raise ValueError(f"out must be a flat {qkv.dtype} buffer of at least {size} elements on {qkv.device}")
    if t:
        launch(_qkv_rope_kernel, (t, n_heads + 2 * n_kv_heads),
               qkv, positions, cos, sin_signed, out, t, HQ=n_heads, HKV=n_kv_heads, D=d, num_warps=1)
    q_end, k_end = t * n_heads * d, t * (n_heads + n_kv_heads) * d
    return (out[:q_end].view(t, n_heads, d), out[q_end:k_end].view(t, n_kv_heads, d),
            out[k_end:size].view(t, n_kv_heads, d))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_ref` in one kernel."""
    _check_contiguous(gate_up=gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if t:
        launch(_silu_mul_kernel, (t, triton.cdiv(inter, block)), gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
