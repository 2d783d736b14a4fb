"""The decoder's elementwise steps and attention as a CPU computes them: in fp32, rounded once.

Why: a vLLM prefill hands its KV to HAWK's decode, and greedy decoding gives one vLLM instance's
tokens only if HAWK's decode step produces vLLM's bits; a near-tie between two logits flips on one
ulp. vLLM's CPU path (measured op by op, ``benchmarks/vllm_cpu_numerics_probe.py``) works as follows, and so
does HAWK's on a CPU:

* RoPE rotates in fp32 with cos/sin read from the model-dtype table and rounds once (the torch ops
  of :func:`hawk.engine.model.rope_rolled` round each product and the sum: 22 % of bf16 q/k differed);
* the fused residual add normalises the fp32 sum, before it is rounded into the residual stream
  (23 % of bf16 norm outputs differed by 1-2 ulp when the rounded residual was normalised);
* attention computes scores, softmax and the weighted sum of V in fp32 and rounds the output once
  and divides by the softmax sum last (torch's fused SDPA kernel rounds elsewhere: 18 % of bf16 outputs
  differed). Computed so, about 1 in 9,000 outputs still differs by one ulp: vLLM's C++ kernel sums in
  SIMD lanes, tile by tile, with an online softmax and its own exp, which torch's matmuls do not
  reproduce. So where vLLM is installed HAWK calls that kernel itself
  (:mod:`hawk.engine.vllm_cpu_kernel`: no output differs) and :func:`attend_widened` is the form
  without vLLM (and with ``HAWK_CPU_ATTENTION=torch``).

On a GPU the model keeps the ``*_ref`` forms of :mod:`hawk.engine.triton_ops`, which its fused kernels
reproduce (and which round as vLLM's CUDA kernels do). For fp32 activations both forms are the same.
"""

from __future__ import annotations

import torch

#: Query rows per fp32 score block in :func:`attend_widened` (bounds its ``[H, rows, Tk]`` buffer).
QUERY_CHUNK = 256


def rope_widened(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, H, D]`` (rotate_half convention) computed in fp32 and rounded once to ``x``'s dtype.

    ``cos, sin_signed [T, D]`` as :meth:`~hawk.engine.model.RotaryTable.lookup` gives them (model dtype;
    rotate_half's sign folded into ``sin_signed``, so ``x2 * -sin`` is exact and the sum is ``x1 cos - x2 sin``).
    """
    xf = x.float()
    out = xf * cos.float()[:, None, :] + xf.roll(x.shape[-1] // 2, -1) * sin_signed.float()[:, None, :]
    return out.to(x.dtype)


def add_rms_norm_widened(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(residual + x), residual + x)`` with the norm taken of the fp32 sum, not of the sum rounded.

    The residual is updated in place (rounded to its dtype); with no residual ``x`` becomes it. The
    normalised row rounds to the model dtype before the weight multiply, as in the reference.
    """
    if residual is None:
        total, residual = x.float(), x
    else:
        total = x.float() + residual.float()
        residual.copy_(total)
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def attend_widened(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q [Tq, Hq, D]`` over ``k, v [Tk, Hkv, D]`` in fp32, rounded once to ``q``'s dtype.

    ``mask [Tq, Tk]`` (True: may attend) or None (every query sees every key). Grouped heads share
    their K/V without copies: each KV head's queries are one ``[G * rows, D]`` matrix.
    """
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, Tk]
    vf = v.float().transpose(0, 1)  # [Hkv, Tk, D]
    scale = d ** -0.5
    outs = []
    for r0 in range(0, tq, QUERY_CHUNK):
        qc = q[r0 : r0 + QUERY_CHUNK].float()
        rows = qc.shape[0]
        qg = qc.view(rows, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * rows, d)
        scores = torch.bmm(qg, kf) * scale  # [Hkv, G * rows, Tk]
        if mask is not None:
            m = mask[r0 : r0 + rows]
            scores = scores.view(hkv, g, rows, tk).masked_fill(~m, float("-inf")).view(hkv, g * rows, tk)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        o = torch.bmm(weights, vf) / weights.sum(-1, keepdim=True)  # [Hkv, G * rows, D], normalised last
        outs.append(o.view(hkv, g, rows, d).permute(2, 0, 1, 3).reshape(rows, hq, d))
    return torch.cat(outs).to(q.dtype)


def widens(t: torch.Tensor) -> bool:
    """Whether ``t``'s computation takes the forms above: a CPU tensor in a 16-bit float dtype."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)
