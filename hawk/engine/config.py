"""The shape of a Llama-architecture model, and the named shapes HAWK runs.

One frozen dataclass, validated on construction, so a bad checkpoint or a typo in a preset
fails here with the field's name instead of as a shape error deep inside a matmul.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

# The NPU's tiled KV layout packs head_dim into 32-wide tile columns.
HEAD_DIM_MULTIPLE = 32


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style RoPE frequency scaling ("rope_type": "llama3" in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to build its modules; nothing about serving."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        if self.bos_token_id is not None and not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(
                f"ModelConfig.bos_token_id {self.bos_token_id} is outside the vocabulary "
                f"(vocab_size={self.vocab_size})"
            )
        # Accept a list from JSON but store a tuple, so the config stays hashable.
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        for i in self.eos_token_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"ModelConfig.eos_token_ids contains {i}, outside the vocabulary "
                    f"(vocab_size={self.vocab_size})"
                )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache footprint of one token over all layers (K and V)."""
        return self.num_layers * 2 * self.kv_size * bytes_per_element

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` of a Llama-architecture model."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type not in (None, "llama", "mistral") and not any("Llama" in a for a in archs):
            raise ValueError(
                f"config.json: model_type {model_type!r} is not a Llama-architecture model"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json is missing required field {key!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("config.json: attention_bias / mlp_bias are not supported")
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // num_heads
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling_from_hf(d.get("rope_scaling")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The inverse of ``from_hf_dict``: a ``config.json`` transformers would also accept."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        return d


def _rope_scaling_from_hf(rs: dict[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(
            f"config.json: rope_scaling type {kind!r} is not supported (only 'llama3')"
        )
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json: rope_scaling is missing field {e.args[0]!r}") from None


_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3_SPECIAL = dict(bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))

PRESETS: dict[str, ModelConfig] = {
    # Fast enough for unit tests; token ids follow the byte-level test tokenizer
    # (0-255 bytes, 256 bos, 257 end-of-text, 258 end-of-turn).
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=256, eos_token_ids=(257, 258),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, **_LLAMA3_SPECIAL,
    ),
    # Llama-3.1-70B as ONE rank of tensor parallelism 4 sees it: 64/4 query heads, 8/4 KV heads,
    # 28672/4 FFN columns, full hidden size. It runs as a single-process model (o_proj maps
    # 16*128 -> 8192), so its per-rank compute and KV bytes are right for timing; it has no
    # all-reduce and its text is meaningless.
    "llama-3.1-70b-tp4": ModelConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672 // 4, num_layers=80,
        num_heads=64 // 4, num_kv_heads=8 // 4, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, **_LLAMA3_SPECIAL,
    ),
    # The embedded default's shape, for reference (the loader reads the real one from its GGUF).
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2, 0),
    ),
}


def preset(name: str) -> ModelConfig:
    """A named shape; the error lists the names so a typo is easy to fix."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
