"""Loading specs: the embedded SmolLM2 GGUF, GGUF files, HF directories, presets, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hawk.engine.attention import ContiguousKVAttention
from hawk.engine.config import preset
from hawk.engine.loader import (
    LoadedModel,
    _unpermute_rope,
    load_gguf,
    load_hf_dir,
    load_model,
    save_hf_dir,
)
from hawk.engine.model import LlamaModel, greedy_generate, rope_inv_freq
from hawk.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model("smollm2-135m")


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    attn = ContiguousKVAttention(model.config.num_layers)
    attn.begin([0], [len(ids)])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))


# ---- the embedded default -------------------------------------------------------------------


def test_smollm2_answers_the_capital_of_france(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs)
    out = greedy_generate(smol.model, tok.encode(prompt), 12, smol.config.eos_token_ids)
    assert "Paris" in tok.decode(out)


def test_smollm2_shape(smol: LoadedModel) -> None:
    ref = preset("smollm2-135m")
    cfg = smol.config
    assert smol.name == "smollm2-135m"
    assert cfg.replace(rms_norm_eps=ref.rms_norm_eps) == ref  # GGUF stores eps as float32
    assert smol.model.lm_head.weight is smol.model.embed.weight  # no output.weight: tied
    assert smol.model.dtype == torch.float32
    assert not any(p.requires_grad for p in smol.model.parameters())


def _llamacpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (from its convert_hf_to_gguf.py)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, w.shape[1])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = torch.randn(3 * 64, 40)
    assert torch.equal(_unpermute_rope(_llamacpp_permute(w, 3), 3), w)


# ---- GGUF files -----------------------------------------------------------------------------


def _write_gguf(model: LlamaModel, tok: Tokenizer, path: Path, rope_freqs: bool = False) -> None:
    """A GGUF file the way llama.cpp's converter writes a Llama (F32, q/k permuted)."""
    cfg = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"<unused_{i}>") for i in range(cfg.vocab_size)]
    specials = set(tok.tok.get_added_tokens_decoder().keys())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(cfg.vocab_size)])
    w.add_token_merges([])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_chat_template(tok.chat_template)
    names = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer = {"attn_norm": "attn_norm", "attn.wq": "attn_q", "attn.wk": "attn_k",
             "attn.wv": "attn_v", "attn.wo": "attn_output", "mlp_norm": "ffn_norm",
             "mlp.gate": "ffn_gate", "mlp.up": "ffn_up", "mlp.down": "ffn_down"}
    for n, p in model.state_dict().items():
        parts = n.removesuffix(".weight").split(".", 2)
        if parts[0] == "layers":
            gname = f"blk.{parts[1]}.{layer[parts[2]]}.weight"
        else:
            gname = f"{names[parts[0]]}.weight"
        t = p.detach().float()
        if gname.endswith("attn_q.weight"):
            t = _llamacpp_permute(t, cfg.num_heads)
        elif gname.endswith("attn_k.weight"):
            t = _llamacpp_permute(t, cfg.num_kv_heads)
        w.add_tensor(gname, t.numpy().copy())
    if rope_freqs:
        # llama.cpp stores Llama-3 scaling as per-frequency divisors
        plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
        scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        w.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("scaled", [False, True])
def test_gguf_round_trip(tmp_path: Path, scaled: bool) -> None:
    cfg = preset("tiny")
    if scaled:
        cfg = cfg.replace(rope_scaling=preset("llama-3.1-8b").rope_scaling)
    src = LlamaModel.from_config(cfg, seed=3)
    tok = Tokenizer.byte_level(cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(src, tok, path, rope_freqs=scaled)
    loaded = load_model(str(path))
    assert loaded.name == "tiny"
    assert loaded.config.rope_scaling == cfg.rope_scaling
    assert loaded.config.vocab_size == cfg.vocab_size
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "héllo 42"}]))
    assert loaded.tokenizer.encode("héllo 42") == tok.encode("héllo 42")
    assert torch.allclose(_logits(loaded.model, ids), _logits(src, ids), atol=1e-5)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_tensor("x.weight", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="mamba"):
        load_gguf(tmp_path / "x.gguf")


def test_damaged_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(bad))


# ---- Hugging Face directories ---------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_hf_dir_round_trip(tmp_path: Path, tied: bool) -> None:
    cfg = preset("tiny").replace(tie_word_embeddings=tied)
    src = LoadedModel(LlamaModel.from_config(cfg, seed=7), Tokenizer.byte_level(cfg), cfg, "t")
    save_hf_dir(src, tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    loaded = load_model(str(tmp_path))
    assert loaded.config == cfg
    assert loaded.name == tmp_path.name
    ids = [256, *b"The quick brown fox", 258]
    assert torch.equal(_logits(loaded.model, ids), _logits(src.model, ids))
    tok = loaded.tokenizer
    assert tok.encode("héllo <|im_end|>") == src.tokenizer.encode("héllo <|im_end|>")
    assert tok.eos_token_ids == src.tokenizer.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == src.tokenizer.apply_chat_template(msgs)


def test_hf_dir_sharded_with_index(tmp_path: Path) -> None:
    cfg = preset("tiny")
    src = LoadedModel(LlamaModel.from_config(cfg, seed=1), Tokenizer.byte_level(cfg), cfg, "t")
    save_hf_dir(src, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        save_file({k: state[k] for k in ks}, str(tmp_path / fname))
    weight_map = {k: f for f, ks in shards.items() for k in ks}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "stray.safetensors").write_bytes(b"ignored: not in the index")
    loaded = load_hf_dir(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    ids = [1, 2, 3]
    assert (_logits(loaded.model, ids) - _logits(src.model, ids)).abs().max() < 0.1
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        load_model(str(tmp_path))


def _tiny_dir(tmp_path: Path) -> Path:
    cfg = preset("tiny")
    save_hf_dir(LoadedModel(LlamaModel.from_config(cfg), Tokenizer.byte_level(cfg), cfg, "t"),
                tmp_path)
    return tmp_path


def test_hf_dir_bad_config(tmp_path: Path) -> None:
    d = _tiny_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="num_kv_heads"):
        load_model(str(d))
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="intermediate_size"):
        load_model(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_model(str(d))


def test_hf_dir_weights_must_match_the_config(tmp_path: Path) -> None:
    d = _tiny_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing weights \['layers\.2\."):
        load_model(str(d))
    (d / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 300}))
    with pytest.raises(ValueError, match="mlp.down.weight has shape"):
        load_model(str(d))


# ---- presets and bad specs ------------------------------------------------------------------


def test_tiny_preset() -> None:
    lm = load_model("tiny", seed=5)
    assert lm.name == "tiny" and lm.config == preset("tiny")
    assert lm.tokenizer.vocab_size <= lm.config.vocab_size
    again = load_model("tiny", seed=5)
    assert torch.equal(_logits(lm.model, [1, 2]), _logits(again.model, [1, 2]))


@pytest.mark.parametrize(("name", "params"), [("llama-3.1-8b", 8.03e9),
                                              ("llama-3.1-70b-tp4", 19.21e9)])
def test_big_presets_build_on_the_meta_device(name: str, params: float) -> None:
    lm = load_model(name, device="meta", dtype=torch.bfloat16)
    n = sum(p.numel() for p in lm.model.parameters())
    assert abs(n - params) / params < 0.01
    assert lm.tokenizer.bos_token_id == lm.config.bos_token_id == 128000


@pytest.mark.parametrize(
    ("spec", "match"),
    [("llama-9000", "unknown model 'llama-9000'.*tiny"),
     ("/nonexistent/model.gguf", "unknown model"),
     ("", "unknown model")],
)
def test_bad_specs(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_model(spec)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))
