"""The decoder: config validation, RoPE, attention, ragged batches, deterministic init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine.attention import AttentionBackend, ContiguousKVAttention, RotatingBackend, attend
from hawk.engine.config import HEAD_DIM_MULTIPLE, PRESETS, ModelConfig, RopeScaling, preset
from hawk.engine.model import (
    LlamaModel,
    RopeArgs,
    RotaryTable,
    apply_rope,
    greedy_generate,
    rope_inv_freq,
    rope_rolled,
)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return LlamaModel.from_config(preset("tiny"), seed=0)


# ---- config ---------------------------------------------------------------------------------


def test_presets_have_the_documented_shapes() -> None:
    p8 = preset("llama-3.1-8b")
    assert (p8.num_layers, p8.hidden_size, p8.num_heads, p8.num_kv_heads, p8.head_dim) == (
        32, 4096, 32, 8, 128,
    )
    assert (p8.intermediate_size, p8.vocab_size, p8.rope_theta) == (14336, 128256, 500000.0)
    assert p8.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    p70 = preset("llama-3.1-70b-tp4")
    assert (p70.num_layers, p70.hidden_size, p70.num_heads, p70.num_kv_heads) == (80, 8192, 16, 2)
    assert p70.intermediate_size == 7168
    for cfg in PRESETS.values():
        assert cfg.head_dim % HEAD_DIM_MULTIPLE == 0  # the NPU tile format needs it
    assert preset("smollm2-135m").kv_bytes_per_token(2) == 30 * 2 * 3 * 64 * 2


def test_70b_tp4_shard_is_a_consistent_model() -> None:
    with torch.device("meta"):
        m = LlamaModel(preset("llama-3.1-70b-tp4"))
    assert m.layers[0].attn.wq.weight.shape == (16 * 128, 8192)
    assert m.layers[0].attn.wk.weight.shape == (2 * 128, 8192)
    assert m.layers[0].attn.wo.weight.shape == (8192, 16 * 128)
    assert m.layers[0].mlp.down.weight.shape == (8192, 7168)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="tiny"):
        preset("llama-9")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 33}, "head_dim"),
        ({"vocab_size": 1.5}, "vocab_size"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"eos_token_ids": (9999,)}, "eos_token_ids"),
        ({"bos_token_id": 512}, "bos_token_id"),
        ({"rope_scaling": {"factor": 8}}, "rope_scaling"),
    ],
)
def test_bad_config_names_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        preset("tiny").replace(**change)


def test_bad_rope_scaling() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 8192)


def test_hf_dict_round_trip() -> None:
    for name in ("tiny", "llama-3.1-8b"):
        cfg = preset(name)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_from_hf_dict_errors() -> None:
    d = preset("tiny").to_hf_dict()
    del d["num_attention_heads"]
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig.from_hf_dict(d)
    d = preset("tiny").to_hf_dict() | {"rope_scaling": {"rope_type": "yarn", "factor": 4}}
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict(d)
    d = preset("tiny").to_hf_dict() | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_hf_dict([1, 2])  # type: ignore[arg-type]
    # head_dim defaults to hidden / heads, KV heads to heads, one eos id becomes a tuple
    d = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 2, "eos_token_id": 5}
    cfg = ModelConfig.from_hf_dict(d)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.eos_token_ids) == (32, 2, (5,))


# ---- RoPE -----------------------------------------------------------------------------------


def _llama3_closed_form(i: int, dim: int, theta: float, s: RopeScaling) -> float:
    """Meta's published rule, one frequency at a time."""
    f = 1.0 / theta ** (2 * i / dim)
    wavelen = 2 * math.pi / f
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    if wavelen < high_wavelen:
        return f
    if wavelen > low_wavelen:
        return f / s.factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    return (1 - smooth) * f / s.factor + smooth * f


def test_llama3_rope_scaling_matches_closed_form() -> None:
    cfg = preset("llama-3.1-8b")
    assert cfg.rope_scaling is not None
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    want = [_llama3_closed_form(i, 128, cfg.rope_theta, cfg.rope_scaling) for i in range(64)]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12)
    plain = rope_inv_freq(128, cfg.rope_theta, None)
    assert got[0] == plain[0]  # highest frequency untouched
    assert torch.isclose(got[-1], plain[-1] / 8)  # lowest divided by the factor
    medium = (got != plain) & ~torch.isclose(got, plain / 8)
    assert medium.any()  # and a blended band in between


def test_rope_is_a_rotation_of_half_split_pairs(tiny: LlamaModel) -> None:
    d = 32
    x = torch.randn(3, 2, d)
    pos = torch.tensor([0, 5, 1000])
    cos, sin = tiny.rope(pos, torch.float32)
    y = apply_rope(x, cos, sin)
    inv = rope_inv_freq(d, 10000.0, None, torch.float32)  # the model's table: float32 angles, as vLLM's
    for t, p in enumerate(pos.tolist()):
        ang = (p * inv).double()
        z = torch.complex(x[t, :, : d // 2].double(), x[t, :, d // 2 :].double())
        z = z * torch.polar(torch.ones_like(ang), ang)
        assert torch.allclose(y[t, :, : d // 2].double(), z.real, atol=1e-5)
        assert torch.allclose(y[t, :, d // 2 :].double(), z.imag, atol=1e-5)


@pytest.mark.parametrize("seed", range(5))
def test_rope_scores_depend_only_on_distance(tiny: LlamaModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def score(m: int, n: int) -> float:
        cq, sq = tiny.rope(torch.tensor([m]), torch.float32)
        ck, sk = tiny.rope(torch.tensor([n]), torch.float32)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    # The table's angles are float32, as vLLM's: near position 1000 an angle carries up to ~6e-5 rad
    # of rounding (half an ulp of 1007 is 3e-5, plus the frequency's), so the two scores may differ
    # by ~1e-4 of |q||k| per pair; a wrong rotation moves them by order |q||k|.
    tol = 2e-4 * float(q.norm() * k.norm())
    assert score(7, 3) == pytest.approx(score(1007, 1003), abs=tol)
    assert abs(score(7, 3) - score(7, 5)) > tol  # the distance does matter


# ---- attention ------------------------------------------------------------------------------


def _naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int
) -> torch.Tensor:
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(tq):
            s = (kh[: offset + i + 1] @ q[i, h]) / math.sqrt(d)
            out[i, h] = torch.softmax(s, 0) @ vh[: offset + i + 1]
    return out


@pytest.mark.parametrize(
    ("tq", "tk", "offset"),
    [(5, 5, None), (3, 9, None), (1, 7, None), (4, 9, 2), (4, 4, 1), (1, 7, 3)],
)
def test_attend_equals_naive_per_head_gqa(tq: int, tk: int, offset: int | None) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(tq, 8, 32, generator=g, dtype=torch.float64)
    k = torch.randn(tk, 2, 32, generator=g, dtype=torch.float64)
    v = torch.randn(tk, 2, 32, generator=g, dtype=torch.float64)
    want = _naive_attention(q, k, v, tk - tq if offset is None else offset)
    assert torch.allclose(attend(q, k, v, offset), want, atol=1e-10)


def test_attend_rejects_impossible_offset() -> None:
    with pytest.raises(ValueError, match="causal_offset"):
        attend(torch.randn(4, 2, 32), torch.randn(2, 1, 32), torch.randn(2, 1, 32))


def test_contiguous_backend_is_an_attention_backend() -> None:
    assert isinstance(ContiguousKVAttention(2), AttentionBackend)
    b = ContiguousKVAttention(2)
    with pytest.raises(ValueError, match="twice"):
        b.begin([1, 1], [2, 2])
    with pytest.raises(ValueError, match="> 0"):
        b.begin([1], [0])
    b.begin([1], [3])
    with pytest.raises(ValueError, match="declared 3"):
        b(0, torch.randn(4, 4, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32))


# ---- the model ------------------------------------------------------------------------------


def _run(model: LlamaModel, attn: ContiguousKVAttention, seqs: dict[int, list[int]],
         starts: dict[int, int]) -> torch.Tensor:
    """One forward of a ragged batch: ``seqs[s]`` new tokens at positions from ``starts[s]``."""
    attn.begin(list(seqs), [len(t) for t in seqs.values()])
    ids = torch.tensor([t for toks in seqs.values() for t in toks])
    pos = torch.cat([torch.arange(starts[s], starts[s] + len(t)) for s, t in seqs.items()])
    return model(ids, pos, attn)


def test_ragged_batch_equals_separate_runs(tiny: LlamaModel) -> None:
    a, b = [5, 17, 300, 42, 7], [256, 99, 98, 97, 12, 13, 14]
    sep_a, sep_b = ContiguousKVAttention(2), ContiguousKVAttention(2)
    ha = _run(tiny, sep_a, {0: a}, {0: 0})
    hb = _run(tiny, sep_b, {1: b}, {1: 0})
    batch = ContiguousKVAttention(2)
    hab = _run(tiny, batch, {0: a, 1: b}, {0: 0, 1: 0})
    assert torch.allclose(hab, torch.cat([ha, hb]), atol=1e-5)
    # then a mixed step: a decodes one token while b brings a chunk of three
    ha2 = _run(tiny, sep_a, {0: [1]}, {0: 5})
    hb2 = _run(tiny, sep_b, {1: [2, 3, 4]}, {1: 7})
    hab2 = _run(tiny, batch, {1: [2, 3, 4], 0: [1]}, {0: 5, 1: 7})
    assert torch.allclose(hab2, torch.cat([hb2, ha2]), atol=1e-5)
    assert batch.seq_len(0) == 6 and batch.seq_len(1) == 10
    k_sep, _ = sep_b.kv(1, 1)
    k_bat, _ = batch.kv(1, 1)
    assert torch.allclose(k_sep, k_bat, atol=1e-5)


class _RotatingContiguous(ContiguousKVAttention):
    """The reference cache behind the rotate-in-the-backend contract (``RotatingBackend``)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.unrotated_calls: list[int] = []

    def fuses_rope(self, num_heads: int, dtype: torch.dtype, device: torch.device) -> bool:
        return True

    def attend_unrotated(self, layer_idx, q, k, v, positions, cos, sin_signed):  # noqa: ANN001, ANN201
        self.unrotated_calls.append(layer_idx)
        c, s = cos[positions], sin_signed[positions]
        return self(layer_idx, rope_rolled(q, c, s), rope_rolled(k, c, s), v)


def test_a_backend_that_rotates_gets_q_and_k_before_rope() -> None:
    """With the fused projections and the kernels' RoPE form (whole tables + positions), a layer whose
    backend says ``fuses_rope`` hands it q and k un-rotated with the tables and positions, and skips
    its own RoPE: same output and same cached K as the layer rotating them itself."""
    model = LlamaModel.from_config(preset("tiny"), seed=0).fuse_projections()
    layer = model.layers[1].attn
    assert isinstance(_RotatingContiguous(2), RotatingBackend)
    assert not isinstance(ContiguousKVAttention(2), RotatingBackend)
    pos = torch.tensor([3, 4, 5, 9])
    x = torch.randn(4, preset("tiny").hidden_size, generator=torch.Generator().manual_seed(1))
    ref_attn, rot_attn = ContiguousKVAttention(2), _RotatingContiguous(2)
    ref_attn.begin([0, 1], [3, 1])
    rot_attn.begin([0, 1], [3, 1])
    want = layer(x, RopeArgs(*model.rope.lookup(pos, x.dtype)), ref_attn)
    got = layer(x, RopeArgs(*model.rope.table(x.device, x.dtype), positions=pos), rot_attn)
    assert rot_attn.unrotated_calls == [1]
    assert torch.equal(got, want)
    assert torch.equal(rot_attn.kv(1, 1)[0], ref_attn.kv(1, 1)[0])


def test_chunked_prefill_equals_one_shot(tiny: LlamaModel) -> None:
    toks = list(range(40, 52))
    whole = _run(tiny, ContiguousKVAttention(2), {0: toks}, {0: 0})
    attn = ContiguousKVAttention(2)
    first = _run(tiny, attn, {0: toks[:5]}, {0: 0})
    rest = _run(tiny, attn, {0: toks[5:]}, {0: 5})
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-5)


def test_greedy_generate_matches_full_recompute(tiny: LlamaModel) -> None:
    prompt = [256, 72, 105, 33]
    out = greedy_generate(tiny, prompt, 8)
    assert len(out) == 8
    # Recomputing the whole sequence without a cache picks the same tokens.
    seq = list(prompt)
    for _ in range(8):
        h = _run(tiny, ContiguousKVAttention(2), {0: seq}, {0: 0})
        seq.append(int(tiny.compute_logits(h[-1:]).argmax()))
    assert seq[len(prompt):] == out


def test_greedy_generate_stops_at_eos(tiny: LlamaModel) -> None:
    out = greedy_generate(tiny, [256, 1, 2], 6)
    stop = greedy_generate(tiny, [256, 1, 2], 6, eos_ids=[out[2]])
    assert stop == out[: out.index(out[2]) + 1]
    with pytest.raises(ValueError, match="non-empty"):
        greedy_generate(tiny, [], 3)


def test_random_init_is_seeded_and_sane() -> None:
    cfg = preset("tiny")
    m0, m0b, m1 = (LlamaModel.from_config(cfg, seed=s) for s in (0, 0, 1))
    for (n, p), p2, p3 in zip(m0.named_parameters(), m0b.parameters(), m1.parameters()):
        assert torch.equal(p, p2), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p, p3), n
            assert abs(float(p.std()) - 0.02) < 0.002, n
    logits = m0.compute_logits(_run(m0, ContiguousKVAttention(2), {0: [1, 2, 3]}, {0: 0}))
    assert logits.dtype == torch.float32 and logits.shape == (3, 512)
    assert torch.isfinite(logits).all() and logits.abs().max() < 20


def test_bf16_model_tracks_fp32() -> None:
    cfg = preset("tiny")
    m32 = LlamaModel.from_config(cfg, seed=0)
    m16 = LlamaModel.from_config(cfg, seed=0, dtype=torch.bfloat16)
    assert m16.dtype == torch.bfloat16
    l32 = m32.compute_logits(_run(m32, ContiguousKVAttention(2), {0: [5, 6, 7]}, {0: 0}))
    l16 = m16.compute_logits(_run(m16, ContiguousKVAttention(2), {0: [5, 6, 7]}, {0: 0}))
    assert (l32 - l16).abs().max() < 0.1


def test_tied_embeddings_share_storage() -> None:
    m = LlamaModel.from_config(preset("tiny").replace(tie_word_embeddings=True), seed=0)
    assert m.lm_head.weight is m.embed.weight
    untied = LlamaModel.from_config(preset("tiny"), seed=0)
    assert len(list(m.parameters())) == len(list(untied.parameters())) - 1


def test_forward_rejects_bad_shapes(tiny: LlamaModel) -> None:
    attn = ContiguousKVAttention(2)
    attn.begin([0], [2])
    with pytest.raises(ValueError, match=r"\[T\]"):
        tiny(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), attn)


# ---- sync-free RoPE and fused projections ----------------------------------------------------


def _old_rope_table(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table as it was built before reserve(): float64 on the CPU, grown to cover max(positions)."""
    n = max(1024, 1 << int(positions.max()).bit_length())
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float()[positions], emb.sin().float()[positions]


def test_rope_lookup_equals_the_old_table_and_never_reads_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = preset("llama-3.1-8b")
    model_rope = RotaryTable(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    pos = torch.tensor([0, 1, 5, 1023, 1024, 3000, 5000])
    model_rope.reserve(5001)
    want_cos, want_sin = _old_rope_table(model_rope.inv_freq, pos)

    def no_reads(*_a: object, **_k: object) -> None:
        raise AssertionError("the lookup read positions back")

    for name in ("max", "item", "tolist", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, no_reads)
    cos, sin = model_rope(pos, torch.float32)
    cos2, signed = model_rope.lookup(pos, torch.float32)
    monkeypatch.undo()
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin) and torch.equal(cos2, want_cos)
    x = torch.randn(len(pos), 4, 128)
    assert torch.equal(rope_rolled(x, cos2, signed), apply_rope(x, want_cos, want_sin))


def test_rope_past_the_reserved_table_is_an_error_on_cpu(tiny: LlamaModel) -> None:
    n = len(tiny.rope)
    with pytest.raises(IndexError):
        tiny.rope(torch.tensor([n]), torch.float32)
    version = tiny.rope.version
    tiny.rope.reserve(n + 1)
    assert len(tiny.rope) == 2 * n and tiny.rope.version == version + 1
    tiny.rope(torch.tensor([n]), torch.float32)


def _unfused_copy(model: LlamaModel) -> LlamaModel:
    with torch.device("meta"):
        plain = LlamaModel(model.config)
    plain.load_state_dict(model.state_dict(), assign=True, strict=False)
    plain.tie_weights()
    return plain.requires_grad_(False).eval()


def _same_generation(fused: LlamaModel, plain: LlamaModel, prompt: list[int], steps: int) -> None:
    assert fused.fused and not plain.fused
    assert greedy_generate(fused, prompt, steps) == greedy_generate(plain, prompt, steps)
    lf = fused.compute_logits(_run(fused, ContiguousKVAttention(fused.config.num_layers), {0: prompt}, {0: 0}))
    lp = plain.compute_logits(_run(plain, ContiguousKVAttention(plain.config.num_layers), {0: prompt}, {0: 0}))
    assert torch.allclose(lf, lp, atol=1e-4)


def test_fused_projections_generate_what_unfused_ones_do(tiny: LlamaModel) -> None:
    assert tiny.fused  # from_config fuses after the seeded init
    _same_generation(tiny, LlamaModel.from_config(preset("tiny"), seed=0, fuse=False), [256, 72, 105, 33], 10)
    # the parameters keep their names and values: only their storage is shared
    plain = LlamaModel.from_config(preset("tiny"), seed=0, fuse=False)
    for (n, p), (n2, p2) in zip(tiny.named_parameters(), plain.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    attn = tiny.layers[0].attn
    assert attn.wk.weight.data_ptr() == attn.wqkv[attn.wq.weight.shape[0]:].data_ptr()


def test_fused_smollm2_generates_what_unfused_does() -> None:
    from hawk.engine.loader import load_model

    smol = load_model("smollm2-135m")
    _same_generation(smol.model, _unfused_copy(smol.model), [1, 504, 3458, 282, 4649, 314, 2986, 30], 3)


def test_fusion_survives_moves_loads_and_saves() -> None:
    m = LlamaModel.from_config(preset("tiny"), seed=0)
    sd = m.state_dict()
    assert sd["layers.0.attn.wq.weight"].data_ptr() != m.layers[0].attn.wq.weight.data_ptr()  # copies
    half = m.to(torch.bfloat16)
    mlp = half.layers[1].mlp
    assert mlp.w_gate_up.dtype == torch.bfloat16 and mlp.gate.weight.data_ptr() == mlp.w_gate_up.data_ptr()
    other = LlamaModel.from_config(preset("tiny"), seed=1)
    other.load_state_dict(sd, assign=True)  # new parameters: the fused buffer is rebuilt
    ids = [3, 1, 4, 1, 5]
    assert greedy_generate(other, ids, 5) == greedy_generate(LlamaModel.from_config(preset("tiny"), seed=0), ids, 5)
    with torch.no_grad():  # in-place edits reach the fused matmul
        other.layers[0].attn.wv.weight.zero_()
    assert other.layers[0].attn.wqkv[-other.config.kv_size :].abs().sum() == 0


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 40])
def test_linear_is_x_times_w_transposed_by_whichever_route(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from hawk.engine import model as model_mod

    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g)
    want = x.double() @ w.double().t()
    got = model_mod.linear(x, w)
    assert got.shape == (rows, 200) and got.is_contiguous() and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-4)
    detour = rows <= model_mod.CPU_FEW_ROWS
    calls: list[int] = []
    monkeypatch.setattr(model_mod.F, "linear", lambda a, b: calls.append(1) or a @ b.t())
    model_mod.linear(x, w)
    model_mod.linear(x.to(torch.float16), w.to(torch.float16))  # other dtypes: torch's own
    model_mod.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))  # bf16: oneDNN's on packed weights
    assert len(calls) == (1 if detour else 2)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 300), shape=st.sampled_from([(200, 96), (64, 576), (960, 576), (576, 1536)]),
       seed=st.integers(0, 2**31 - 1))
def test_packed_bf16_linear_gives_f_linear_bits(rows: int, shape: tuple[int, int], seed: int) -> None:
    """The packed bf16 GEMM is oneDNN's, as F.linear's: the same bits at every row count."""
    from hawk.engine import model as model_mod

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, shape[1], generator=g).to(torch.bfloat16)
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(model_mod.linear(x, w), F.linear(x, w))


def test_packed_bf16_weight_is_repacked_after_an_in_place_edit() -> None:
    from hawk.engine import model as model_mod

    x, w = torch.randn(3, 32).to(torch.bfloat16), torch.randn(16, 32).to(torch.bfloat16)
    with torch.inference_mode():
        first = model_mod.linear(x, w)
    with torch.no_grad():
        w.mul_(2)
    with torch.inference_mode():
        assert torch.equal(model_mod.linear(x, w), F.linear(x, w)) and not torch.equal(first, F.linear(x, w))
    p = torch.nn.Parameter(w.clone())  # tracked by autograd: torch's own F.linear
    assert model_mod.linear(x, p).requires_grad
