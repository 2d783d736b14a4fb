"""A Llama-architecture decoder, readable top to bottom (gpt-fast style).

Inputs are a flattened ragged batch: ``input_ids [T]`` and ``positions [T]`` hold the new
tokens of several sequences back to back. Attention storage is the caller's: each layer hands
its RoPE'd q/k/v to an ``AttentionBackend`` (see attention.py), which writes k/v to whatever
cache layout it keeps and returns the attention output.

Each block carries ``(hidden, residual)``: the residual adds happen inside the norms. On CUDA the
norms, RoPE and SiLU run as fused Triton kernels (:mod:`hawk.engine.triton_ops`, ~11 launches per
layer instead of ~31); elsewhere the same steps run as the torch ops those kernels are tested against.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from hawk.engine import triton_ops, vllm_cpu_ops
from hawk.engine.attention import AttentionBackend, ContiguousKVAttention
from hawk.engine.cpu_numerics import add_rms_norm_widened, rope_widened, widens
from hawk.engine.config import ModelConfig, RopeScaling
from hawk.engine.tensor_parallel import Shard, shard_slice
from hawk.engine.triton_ops import add_rms_norm_ref, rms_norm_ref, silu_mul_ref


#: Rows up to which a CPU fp32 matmul runs as ``w @ x.T`` (:func:`linear`); 0 turns the detour off.
CPU_FEW_ROWS = int(os.environ.get("HAWK_CPU_FEW_ROWS", "8"))
#: Whether a CPU bf16 matmul runs on oneDNN-prepacked weights (:func:`linear`); "0" turns it off.
CPU_PACKED_BF16 = os.environ.get("HAWK_CPU_PACKED_BF16", "1") != "0"
#: Per weight tensor: ``((data_ptr, version), packed)``, repacked when the weight is replaced or edited in place.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x [T, in]``, ``w [out, in]`` (``F.linear`` without bias), with detours on a CPU.

    Why, fp32: torch's CPU ``F.linear`` (MKL's ``x @ w.T`` with ``w`` transposed) is slow for 1-8 rows, where
    ``w @ x.T`` (no transpose, the weight streamed once) is not: all of SmolLM2's matmuls at 2 rows took 91 ms
    as ``F.linear`` against 21 ms so, and at one row (as two: MKL's one-column product is the slow one again)
    46 against 30 ms; its decode step 133 -> 57 and 70 -> 45 ms (the CPU box, fp32, two threads;
    ``benchmarks/cpu_linear_probe.py``). The same dot products; only MKL's summation order differs.

    Why, bf16: ``F.linear`` runs oneDNN's bf16 GEMM but reorders the weight into oneDNN's blocked layout
    on every call; :func:`_packed_bf16` reorders it once and keeps it, and oneDNN's GEMM gives the same bits
    (so vLLM's CPU GEMMs' bits, see docs/vllm.md). SmolLM2's GEMMs at one row took 0.37 ms a layer against
    0.16 packed, the LM head 5.2 against 3.0 ms (the CPU box, two threads).
    """
    t = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, w)
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and CPU_PACKED_BF16:
        gemm = _packed_bf16(w)
        if gemm is not None:
            return gemm(x)
    if t > CPU_FEW_ROWS or x.dtype != torch.float32:
        return F.linear(x, w)
    rows = x if t > 1 else torch.cat([x, x])
    return torch.mm(w, rows.t())[:, :t].t().contiguous()


def _packed_bf16(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x @ w.T`` over ``w`` reordered once into oneDNN's layout for its bf16 GEMM, or None where that does
    not apply: a weight autograd tracks (the packed op has no backward) or one oneDNN cannot take."""
    if w.requires_grad and torch.is_grad_enabled():
        return None
    key = (w.data_ptr(), w._version if not w.is_inference() else -1)  # inference tensors keep no version
    entry = _PACKED.get(w)
    if entry is None or entry[0] != key:
        _PACKED[w] = entry = (key, _pack(w.detach()))
    return entry[1]


def _pack(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """vLLM's prepacked GEMM where its CPU library loads (the same bits, less overhead a call:
    :mod:`hawk.engine.vllm_cpu_ops`), else torch's oneDNN GEMM on a weight it reordered once."""
    gemm = vllm_cpu_ops.prepacked_gemm(w)
    if gemm is not None:
        return gemm
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError:
        return None
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even for bf16 weights: the mean of squares loses too much in bf16.
        return rms_norm_ref(x, self.weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``, the residual updated in place; the first layer
        has none yet (``x`` becomes it). ``fused``: one Triton kernel instead of ~7 torch ops. On a CPU
        in bf16/fp16 the norm is of the unrounded sum (:mod:`hawk.engine.cpu_numerics`)."""
        if fused:
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if widens(x):
            return add_rms_norm_widened(x, residual, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` computed in ``dtype``, Llama-3-scaled if asked.

    Llama-3 scaling keeps high frequencies (short wavelengths) as they are, divides low
    frequencies by ``factor``, and blends linearly in between, so long contexts stretch only
    the dimensions that encode long distances. The model's table uses float32 (see :class:`RotaryTable`).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=dtype, device="cpu") / head_dim
    inv = 1.0 / theta**exponents
    if scaling is None:
        return inv
    old_ctx = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    # smooth = 1 at the high-frequency edge, 0 at the low-frequency edge.
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv / scaling.factor + smooth * inv


class RotaryTable:
    """cos/sin for positions, computed once on the CPU in ``inv_freq``'s dtype and copied once per device.

    Building the table on the CPU makes it bit-identical on every device, so a prefill on a
    GPU and a decode elsewhere rotate the same position the same way. The model builds it from
    float32 frequencies, angles and cos/sin, as vLLM and Hugging Face build theirs: a vLLM
    prefill's K and HAWK's decode q are then rotated by the same table (float64 angles differed
    from vLLM's bf16 table in a share of entries; ``docs/vllm.md``). Looking positions up
    never reads them back to the host (no ``positions.max()``, which would sync a GPU): whoever
    knows the longest context (the runner, from Python ints) calls :meth:`reserve` first. A
    lookup past the table is an IndexError on the CPU and a device-side assert on a GPU.
    """

    MIN_LEN = 1024

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self._len = 0
        self._cpu: _RopeTables | None = None
        self._dev: dict[tuple[torch.device, torch.dtype], _RopeTables] = {}
        # Outgrown device tables stay alive: a CUDA graph captured over one still reads valid
        # values (a position's row never changes) until its runner recaptures.
        self._retired: list[_RopeTables] = []
        self._vllm: tuple[object, torch.Tensor | None] = (None, None)  # vllm_table's, with its key
        #: Bumped whenever the table grows, so runners know their graphs cover fewer positions.
        self.version = 0
        self._grow(self.MIN_LEN)

    def __len__(self) -> int:
        return self._len

    def _grow(self, n: int) -> None:
        self._len = max(self.MIN_LEN, 1 << (n - 1).bit_length())
        pos = torch.arange(self._len, dtype=self.inv_freq.dtype, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate_half pairs dim i with i + D/2
        cos, sin = emb.cos().float(), emb.sin().float()
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed exactly (negation is exact).
        self._cpu = (cos, _sign_first_half(sin))
        in_use = list(self._dev)
        self._retired.extend(self._dev.values())
        self._dev.clear()
        for device, dtype in in_use:  # rebuild where already used, so lookups stay copy-free
            self.table(device, dtype)
        self.version += 1

    def reserve(
        self,
        n_positions: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Make positions ``0 .. n_positions - 1`` valid (and the table resident on ``device``)."""
        if n_positions > self._len:
            self._grow(n_positions)
        if device is not None and dtype is not None:
            self.table(torch.device(device), dtype)

    def table(self, device: torch.device, dtype: torch.dtype) -> _RopeTables:
        """The whole ``cos, sin_signed [len, head_dim]`` on ``device`` (copied there once)."""
        key = (device, dtype)
        t = self._dev.get(key)
        if t is None:
            assert self._cpu is not None
            cos, signed = self._cpu
            t = self._dev[key] = (cos.to(device, dtype), signed.to(device, dtype))
        return t

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, head_dim]`` for ``positions [T]``, in ``dtype`` on positions' device."""
        cos, signed = self.lookup(positions, dtype)
        return cos, _sign_first_half(signed)

    def vllm_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The whole table in vLLM's form (:func:`~hawk.engine.vllm_cpu_ops.rotary_table`), made once per
        device, dtype and growth."""
        key = (device, dtype, self.version)
        if self._vllm[0] != key:
            self._vllm = (key, vllm_cpu_ops.rotary_table(*self.table(device, dtype)))
        assert self._vllm[1] is not None
        return self._vllm[1]

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin_signed [T, head_dim]``: the form :func:`rope_rolled` (the model) takes."""
        cos, signed = self.table(positions.device, dtype)
        return cos[positions], signed[positions]


_RopeTables = tuple[torch.Tensor, torch.Tensor]


def _sign_first_half(x: torch.Tensor) -> torch.Tensor:
    """Negate the first half of the last dim (its own inverse)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., :half], x[..., half:]], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos, sin [T, D]`` (Hugging Face's rotate_half convention)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` bit for bit in four ops instead of six: rotate_half's sign is folded
    into ``sin_signed`` (:meth:`RotaryTable.lookup`), so the half swap is a single roll."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * sin_signed[:, None, :]


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """The model's torch RoPE: in fp32 and rounded once on a CPU in bf16/fp16, as vLLM's CPU kernel
    rotates (:mod:`hawk.engine.cpu_numerics`); elsewhere :func:`rope_rolled`, which the fused Triton
    kernel reproduces."""
    return rope_widened(x, cos, sin_signed) if widens(x) else rope_rolled(x, cos, sin_signed)


class RopeArgs(NamedTuple):
    """What a layer needs to rotate q and k, in one of three forms.

    Torch path: ``cos, sin_signed [T, D]`` gathered once per forward, ``positions`` None. Fused
    path (:attr:`kernels`): the whole tables ``[L, D]`` and ``positions [T]``; the Triton kernel
    gathers the rows itself, so a step has no gather kernels and no host sync. vLLM's CPU op
    (:attr:`cos_sin` set): the whole tables, ``positions [T]`` and vLLM's own table
    (:func:`~hawk.engine.vllm_cpu_ops.rotary_table`), which the op reads; norms and SiLU stay torch's.
    """

    cos: torch.Tensor
    sin_signed: torch.Tensor
    positions: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None

    @property
    def kernels(self) -> bool:
        """True when this forward runs the fused Triton kernels (norms, RoPE, SiLU)."""
        return self.positions is not None and self.cos_sin is None


class _Fusable(nn.Module):
    """A module whose parallel projections (same input) can run as one matmul.

    The per-projection ``nn.Linear`` children stay (their names are what the loaders, the
    seeded init and ``state_dict`` use); fusing concatenates their weights into one buffer and
    makes each weight a row view of it, so fusing costs no memory and in-place weight edits
    reach the fused matmul. The outputs are split back, so every value is the same dot product.
    Moving or casting the module (``.to``) and loading a state dict rebuild the buffer and the
    views; ``state_dict`` hands out copies, because savers such as safetensors refuse tensors
    that share storage.
    """

    _FUSED: str
    _PARTS: tuple[str, ...]

    def _init_fusion(self) -> None:
        self.register_buffer(self._FUSED, None, persistent=False)
        self.register_load_state_dict_post_hook(_Fusable._after_load)
        self.register_state_dict_post_hook(_Fusable._copy_views)

    @property
    def fused(self) -> bool:
        return getattr(self, self._FUSED) is not None

    def fuse(self) -> None:
        """Concatenate the projections (idempotent)."""
        if not self.fused:
            self._refuse(force=True)

    def _refuse(self, force: bool = False) -> None:
        """(Re)build the fused buffer from the parts' weights and make them views of it."""
        if not (force or self.fused):
            return
        linears = [getattr(self, p) for p in self._PARTS]
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([lin.weight.detach() for lin in linears])
            setattr(self, self._FUSED, fused)
            row = 0
            for lin in linears:
                n = lin.weight.shape[0]
                lin.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
                row += n

    @staticmethod
    def _after_load(mod: nn.Module, _incompatible: object) -> None:
        assert isinstance(mod, _Fusable)
        mod._refuse()

    @staticmethod
    def _copy_views(mod: nn.Module, state: dict, prefix: str, _meta: object) -> None:
        assert isinstance(mod, _Fusable)
        if mod.fused:
            for p in mod._PARTS:
                key = f"{prefix}{p}.weight"
                if key in state:
                    state[key] = state[key].clone()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        out = super()._apply(fn, recurse)
        self._refuse()  # .to() converted the buffer and the views separately: re-alias
        return out


class Attention(_Fusable):
    _FUSED, _PARTS = "wqkv", ("wq", "wk", "wv")

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard = Shard()) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Under tensor parallelism this rank's heads only: q/k/v column-parallel, wo row-parallel.
        self.n_heads, self.n_kv_heads = cfg.num_heads // shard.size, cfg.num_kv_heads // shard.size
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.n_heads * cfg.head_dim, self.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, q_size, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.wo = nn.Linear(q_size, cfg.hidden_size, bias=False)
        #: Sums the row-parallel partial outputs over the ranks (None: one rank, nothing to sum).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.wqkv: torch.Tensor | None
        self._init_fusion()

    def forward(self, x: torch.Tensor, rope: RopeArgs, attn: AttentionBackend) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        if rope.kernels:
            assert self.wqkv is not None and rope.positions is not None
            fuses = getattr(attn, "fuses_rope", None)  # attention.RotatingBackend
            if fuses is not None and fuses(hq, x.dtype, x.device):  # the backend's launch rotates them
                qkv = linear(x, self.wqkv)
                q, k, v = qkv.view(t, hq + 2 * hkv, d).split((hq, hkv, hkv), dim=1)
                o = attn.attend_unrotated(self.layer_idx, q, k, v, rope.positions, rope.cos, rope.sin_signed)
                return self.output(o)
        return self.output(attn(self.layer_idx, *self.qkv(x, rope)))

    def qkv(self, x: torch.Tensor, rope: RopeArgs, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE'd ``q [t, Hq, D]``, ``k, v [t, Hkv, D]`` of ``x``, contiguous. ``out``: a flat buffer of at
        least ``t * (Hq + 2 Hkv) * D`` elements that holds them back to back (q, k, v), so a piecewise
        CUDA graph leaves them at the same addresses on every replay (see piecewise.py)."""
        t, hq, hkv, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin_signed = rope.cos, rope.sin_signed
        if rope.kernels:  # one kernel: RoPE on q and k, and q/k/v out as contiguous tensors
            assert self.wqkv is not None and rope.positions is not None
            return triton_ops.qkv_rope(linear(x, self.wqkv), rope.positions, cos, sin_signed, hq, hkv, out=out)
        if self.wqkv is not None and rope.cos_sin is not None:  # vLLM's op rotates q and k in place
            assert rope.positions is not None
            qkv = linear(x, self.wqkv)
            vllm_cpu_ops.rotate_qk(rope.positions, qkv, hq, hkv, d, rope.cos_sin)
            qkv = qkv.view(t, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq].contiguous(), qkv[:, hq : hq + hkv].contiguous(), qkv[:, hq + hkv :].contiguous()
        elif self.wqkv is not None:
            qkv = linear(x, self.wqkv).view(t, hq + 2 * hkv, d)
            qk = rope_torch(qkv[:, : hq + hkv], cos, sin_signed)  # q and k heads in one pass
            # Contiguous, as the unfused path gives them (free for a single token).
            q, k = qk[:, :hq].contiguous(), qk[:, hq:].contiguous()
            v = qkv[:, hq + hkv :].contiguous()
        else:
            q = rope_torch(linear(x, self.wq.weight).view(t, hq, d), cos, sin_signed)
            k = rope_torch(linear(x, self.wk.weight).view(t, hkv, d), cos, sin_signed)
            v = linear(x, self.wv.weight).view(t, hkv, d)
        return (q, k, v) if out is None else _into(out, t, (q, k, v))

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of attention's ``o [t, Hq, D]`` (summed over the ranks under TP)."""
        out = linear(o.reshape(o.shape[0], self.n_heads * self.head_dim), self.wo.weight)
        return out if self.reduce is None else self.reduce(out)


def _into(flat: torch.Tensor, t: int, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``parts`` (each ``[t, ...]``) copied back to back into the front of ``flat``; the copies' views."""
    views, at = [], 0
    for p in parts:
        n = p.numel()
        view = flat[at : at + n].view(p.shape)
        view.copy_(p)
        views.append(view)
        at += n
    return tuple(views)


class MLP(_Fusable):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    _FUSED, _PARTS = "w_gate_up", ("gate", "up")

    def __init__(self, cfg: ModelConfig, shard: Shard = Shard()) -> None:
        super().__init__()
        inter = cfg.intermediate_size // shard.size  # gate/up column-parallel, down row-parallel
        self.gate = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.w_gate_up: torch.Tensor | None
        self._init_fusion()

    def forward(self, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        if self.w_gate_up is not None:
            gate_up = linear(x, self.w_gate_up)
            act = triton_ops.silu_mul(gate_up) if kernels else silu_mul_ref(gate_up)
        else:
            act = F.silu(linear(x, self.gate.weight)) * linear(x, self.up.weight)
        out = linear(act, self.down.weight)
        return out if self.reduce is None else self.reduce(out)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard = Shard()) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx, shard)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, shard)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeArgs, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous sublayer's output, not yet added to ``residual`` (the stream; None
        before the first layer). The adds happen inside the norms (one kernel each when fused);
        returns this block's MLP output and the residual stream, for the next norm to add."""
        h, residual = self.attn_norm.add_norm(x, residual, rope.kernels)
        return self.finish(self.attn(h, rope, attn), residual, rope)

    # A piecewise forward (piecewise.py) runs a block as qkv, then attention outside the piece, then finish.

    def qkv(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeArgs, out: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention sublayer up to attention: ``(q, k, v, residual)`` (see :meth:`Attention.qkv`)."""
        h, residual = self.attn_norm.add_norm(x, residual, rope.kernels)
        return (*self.attn.qkv(h, rope, out), residual)

    def finish(self, a: torch.Tensor, residual: torch.Tensor, rope: RopeArgs) -> tuple[torch.Tensor, torch.Tensor]:
        """The block after attention's output projection ``a``: the MLP sublayer; ``(mlp out, residual)``."""
        h, residual = self.mlp_norm.add_norm(a, residual, rope.kernels)
        return self.mlp(h, rope.kernels), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = Shard()) -> None:
        """``shard``: this rank's part under tensor parallelism (its heads and MLP columns; the
        embedding, norms and LM head are whole). ``config`` stays the whole model's."""
        super().__init__()
        if shard.parallel:
            shard.check(cfg.num_kv_heads, cfg.intermediate_size)
        self.config, self.shard = cfg, shard
        #: Called with ``(input_ids, positions)`` before each forward: how rank 0 of a
        #: tensor-parallel instance tells the other ranks which step to run (None: nobody to tell).
        self.step_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryTable(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float32))
        #: Fused Triton kernels for norms / RoPE / SiLU: None = on CUDA when Triton is installed;
        #: True forces them (e.g. on CPU under ``TRITON_INTERPRET=1``), False forbids them.
        self.use_triton: bool | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config says so (redo after materialising)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def fuse_projections(self) -> LlamaModel:
        """Run q/k/v as one matmul and gate/up as one, in every layer (idempotent; returns self).

        Call it after the weights are final (seeded init and loaders hash / map the separate
        parameter names, which keep existing as views). A model on the meta device is left as is.
        """
        if self.device.type != "meta":
            for layer in self.layers:
                layer.attn.fuse()
                layer.mlp.fuse()
        return self

    def set_group(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> LlamaModel:
        """Sum the row-parallel outputs (``wo``, ``down``) with ``reduce`` (a group's all-reduce)."""
        for layer in self.layers:
            layer.attn.reduce = layer.mlp.reduce = reduce
        return self

    @property
    def fused(self) -> bool:
        return all(layer.attn.fused and layer.mlp.fused for layer in self.layers)

    def uses_kernels(self) -> bool:
        """Whether a forward runs the fused Triton kernels (they need the fused projections).

        The CPU keeps the torch ops: the kernels only pay off where launches cost (a GPU).
        """
        if self.use_triton is False or not triton_ops.AVAILABLE or not self.fused:
            return False
        return bool(self.use_triton) or self.device.type == "cuda"

    def reserve_positions(self, n_positions: int) -> None:
        """Make RoPE valid for positions below ``n_positions`` on this model's device (no sync later)."""
        self.rope.reserve(n_positions, self.device, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` of a flattened batch of new tokens."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if self.step_hook is not None:
            self.step_hook(input_ids, positions)
        x = self.embed(input_ids)
        rope = self.rope_args(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
        return self.norm.add_norm(x, residual, rope.kernels)[0]

    def rope_args(self, positions: torch.Tensor) -> RopeArgs:
        """What every layer of a forward over ``positions [T]`` rotates q and k with (no host sync)."""
        if self.uses_kernels():
            return RopeArgs(*self.rope.table(positions.device, self.dtype), positions=positions.contiguous())
        if self.fused and widens(self.embed.weight) and vllm_cpu_ops.has_rotary():  # vLLM's bits, its op
            return RopeArgs(*self.rope.table(positions.device, self.dtype), positions=positions.contiguous(),
                            cos_sin=self.rope.vllm_table(positions.device, self.dtype))
        return RopeArgs(*self.rope.lookup(positions, self.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` in fp32, so sampling is the same whatever the weights' dtype.

        Separate from forward so an engine can project only each sequence's last token.
        """
        return linear(hidden, self.lm_head.weight).float()

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        std: float = 0.02,
        fuse: bool = True,
        shard: Shard = Shard(),
    ) -> LlamaModel:
        """A model with seeded random weights, identical on every device for a given seed.

        Weights come from an integer hash of (seed, parameter name, element index) rather than
        a torch Generator, whose streams differ between CPU and CUDA: a prefill instance on a
        GPU and a decode instance elsewhere must hold the same "random" model. Built on the
        meta device first, so a 70B-shaped shard never exists twice in memory. ``fuse`` fuses
        the projections after the init (which hashes the unfused parameter names). ``shard``: build
        only this rank's slices, each element hashed at its index in the whole tensor, so the
        ranks of a tensor-parallel instance together hold exactly the single-rank model.
        """
        with torch.device("meta"):
            whole = {n: tuple(p.shape) for n, p in cls(cfg).named_parameters()} if shard.parallel else {}
            model = cls(cfg, shard)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        if model.device.type == "meta":  # shapes only (e.g. to size a KV cache): nothing to fill
            return model.requires_grad_(False).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif shard.parallel:
                    _fill_hash_uniform_slice(p, seed, name, std, whole[name], shard)
                else:
                    _fill_hash_uniform(p, seed, name, std)
        model.requires_grad_(False).eval()
        return model.fuse_projections() if fuse else model


_MASK31 = (1 << 31) - 1
_CHUNK = 1 << 24


def _fill_hash_uniform(p: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``p`` with values uniform in [-a, a), std ``std``, from a counter-based hash.

    Integer arithmetic is exact on every device: values stay below 2**31 and constants below
    2**31, so no int64 product overflows.
    """
    key = zlib.crc32(f"{seed}:{name}".encode()) & _MASK31
    flat = p.view(-1)
    if flat.numel() > _MASK31:
        raise ValueError(f"parameter {name} too large for the init hash")
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        x = torch.arange(start, start + n, device=p.device, dtype=torch.int64)
        flat[start : start + n] = _hash_uniform(x, key, std).to(p.dtype)


def _hash_uniform(index: torch.Tensor, key: int, std: float) -> torch.Tensor:
    """The init value of each element ``index`` (int64) of the tensor hashed under ``key``."""
    x = (index * 0x2545F491 + key) & _MASK31
    x = ((x >> 15) ^ x) * 0x5BD1E995 & _MASK31
    x = ((x >> 13) ^ x) * 0x27D4EB2F & _MASK31
    x = (x >> 16) ^ x
    u = x.to(torch.float32) * (2.0 ** -30) - 1.0  # [-1, 1), both steps exact or IEEE-rounded
    return u * (std * math.sqrt(3.0))


def _fill_hash_uniform_slice(p: torch.Tensor, seed: int, name: str, std: float, whole: tuple[int, ...], shard: Shard) -> None:
    """Fill a rank's slice ``p`` of the 2-D parameter ``name`` (whole shape ``whole``) with the
    values :func:`_fill_hash_uniform` gives those elements of the whole tensor."""
    key = zlib.crc32(f"{seed}:{name}".encode()) & _MASK31
    dim, part = shard_slice(name, whole, shard)
    if dim is None:
        _fill_hash_uniform(p, seed, name, std)
        return
    cols = whole[1]
    rows_per_chunk = max(1, _CHUNK // cols)
    for r0 in range(0, p.shape[0], rows_per_chunk):
        r = torch.arange(r0, min(p.shape[0], r0 + rows_per_chunk), device=p.device, dtype=torch.int64)
        if dim == 0:  # this rank's rows, whole
            c = torch.arange(cols, device=p.device, dtype=torch.int64)
            r = r + part.start
        else:  # every row, this rank's columns
            c = torch.arange(part.start, part.stop, device=p.device, dtype=torch.int64)
        index = (r[:, None] * cols + c[None, :]).reshape(-1)
        p[r0 : r0 + len(r)] = _hash_uniform(index, key, std).view(len(r), -1).to(p.dtype)


@torch.inference_mode()
def greedy_generate(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
) -> list[int]:
    """The oracle: greedy decoding over the contiguous reference cache, one sequence.

    Returns the new token ids; an end token, if hit, is the last one returned.
    """
    if not prompt_ids:
        raise ValueError("greedy_generate needs a non-empty prompt")
    attn = ContiguousKVAttention(model.config.num_layers)
    model.reserve_positions(len(prompt_ids) + max_new_tokens)
    device = model.device
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        attn.begin([0], [ids.numel()])
        hidden = model(ids, positions, attn)
        tok = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(tok)
        if tok in eos_ids:
            break
        ids = torch.tensor([tok], dtype=torch.long, device=device)
        positions = positions[-1:] + 1
    return out
