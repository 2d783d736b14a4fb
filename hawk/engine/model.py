"""A Llama-architecture decoder, readable top to bottom (gpt-fast style).

Inputs are a flattened ragged batch: ``input_ids [T]`` and ``positions [T]`` hold the new
tokens of several sequences back to back. Attention storage is the caller's: each layer hands
its RoPE'd q/k/v to an ``AttentionBackend`` (see attention.py), which writes k/v to whatever
cache layout it keeps and returns the attention output.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hawk.engine.attention import AttentionBackend, ContiguousKVAttention
from hawk.engine.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even for bf16 weights: the mean of squares loses too much in bf16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (float64), Llama-3-scaled if asked.

    Llama-3 scaling keeps high frequencies (short wavelengths) as they are, divides low
    frequencies by ``factor``, and blends linearly in between, so long contexts stretch only
    the dimensions that encode long distances.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
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
    """cos/sin for positions, computed once on the CPU in float64 and cached per device.

    Building the table on the CPU makes it bit-identical on every device, so a prefill on a
    GPU and a decode elsewhere rotate the same position the same way.
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self._len = 0
        self._cpu: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dev: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _grow(self, n: int) -> None:
        self._len = max(1024, 1 << (n - 1).bit_length())
        pos = torch.arange(self._len, dtype=torch.float64, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate_half pairs dim i with i + D/2
        self._cpu = (emb.cos().float(), emb.sin().float())
        self._dev.clear()

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, head_dim]`` for ``positions [T]``, in ``dtype`` on positions' device."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        if need > self._len:
            self._grow(need)
        key = (positions.device, dtype)
        if key not in self._dev:
            assert self._cpu is not None
            cos, sin = self._cpu
            self._dev[key] = (cos.to(positions.device, dtype), sin.to(positions.device, dtype))
        cos, sin = self._dev[key]
        return cos[positions], sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos, sin [T, D]`` (Hugging Face's rotate_half convention)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.q_size, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.wv = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=False)
        self.wo = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(self.layer_idx, q, k, v)
        return self.wo(o.reshape(t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryTable(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config says so (redo after materialising)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

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
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` in fp32, so sampling is the same whatever the weights' dtype.

        Separate from forward so an engine can project only each sequence's last token.
        """
        return self.lm_head(hidden).float()

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        std: float = 0.02,
    ) -> LlamaModel:
        """A model with seeded random weights, identical on every device for a given seed.

        Weights come from an integer hash of (seed, parameter name, element index) rather than
        a torch Generator, whose streams differ between CPU and CUDA: a prefill instance on a
        GPU and a decode instance elsewhere must hold the same "random" model. Built on the
        meta device first, so a 70B-shaped shard never exists twice in memory.
        """
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        if model.device.type == "meta":  # shapes only (e.g. to size a KV cache): nothing to fill
            return model.requires_grad_(False).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    _fill_hash_uniform(p, seed, name, std)
        return model.requires_grad_(False).eval()


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
    a = std * math.sqrt(3.0)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        x = torch.arange(start, start + n, device=p.device, dtype=torch.int64)
        x = (x * 0x2545F491 + key) & _MASK31
        x = ((x >> 15) ^ x) * 0x5BD1E995 & _MASK31
        x = ((x >> 13) ^ x) * 0x27D4EB2F & _MASK31
        x = (x >> 16) ^ x
        u = x.to(torch.float32) * (2.0 ** -30) - 1.0  # [-1, 1), both steps exact or IEEE-rounded
        flat[start : start + n] = (u * a).to(p.dtype)


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
