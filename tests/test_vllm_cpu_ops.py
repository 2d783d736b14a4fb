"""vLLM's CPU GEMM and RoPE as HAWK's CPU step calls them (hawk/engine/vllm_cpu_ops.py): the bits of
HAWK's own torch forms, through the model and on their own."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine import model as model_mod
from hawk.engine import vllm_cpu_ops
from hawk.engine.attention import ContiguousKVAttention
from hawk.engine.loader import load_model
from hawk.engine.model import RopeArgs

pytestmark = pytest.mark.skipif(not vllm_cpu_ops.loaded(), reason="vLLM's CPU library is not loadable here (no vllm-cpu)")


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 257])
def test_prepacked_gemm_gives_f_linear_bits_on_rows_apart(rows: int) -> None:
    """Rows with a stride of their own (a view of wider rows) too; every row count is model.linear's test
    (tests/test_model.py), which takes this GEMM where vLLM loads."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=g) * 0.05).to(torch.bfloat16)
    gemm = vllm_cpu_ops.prepacked_gemm(w)
    assert gemm is not None
    wide = torch.randn(rows, 2 * 576, generator=g).to(torch.bfloat16)[:, :576]
    assert torch.equal(gemm(wide), F.linear(wide, w)) and torch.equal(gemm(wide.contiguous()), F.linear(wide, w))


def test_linear_takes_vllms_gemm_for_bf16_only_and_frees_its_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[vllm_cpu_ops.PrepackedGemm] = []
    real = vllm_cpu_ops.prepacked_gemm
    monkeypatch.setattr(vllm_cpu_ops, "prepacked_gemm", lambda w: made.append(real(w)) or made[-1])
    x = torch.randn(3, 40)
    for _ in range(3):
        w = torch.randn(16, 40).to(torch.bfloat16)  # K not whole AMX tiles: oneDNN's GEMM on every CPU, as in vLLM
        with torch.inference_mode():
            assert torch.equal(model_mod.linear(x.to(torch.bfloat16), w), F.linear(x.to(torch.bfloat16), w))
        model_mod.linear(x, w.float())  # fp32: not vLLM's
    assert len(made) == 3 and all(isinstance(m, vllm_cpu_ops.PrepackedGemm) for m in made)
    released = []
    monkeypatch.setattr(torch.ops._C, "release_dnnl_matmul_handler", released.append, raising=False)
    ptrs = [m._ptr for m in made]
    made.clear()
    del w
    gc.collect()
    assert set(ptrs) <= set(released) and len(set(released)) == len(released)  # each weight gone: released once


def test_small_weights_take_vllms_small_gemm_on_amx_only() -> None:
    """vLLM 0.32's rule (``check_cpu_sgl_kernel``): bf16 weights of at most 1 MiB, whole tiles or fewer than
    16 rows, on a CPU with AMX tiles; the rest (and every weight elsewhere) oneDNN's GEMM."""
    amx = torch.cpu._is_amx_tile_supported()
    assert vllm_cpu_ops.takes_small_gemm(576, 576, torch.bfloat16) == amx  # SmolLM2's o_proj: 648 KiB
    assert vllm_cpu_ops.takes_small_gemm(8, 40, torch.bfloat16) == amx  # fewer than 16 rows: any K
    assert not vllm_cpu_ops.takes_small_gemm(960, 576, torch.bfloat16)  # its qkv_proj: 1.05 MiB
    assert not vllm_cpu_ops.takes_small_gemm(16, 40, torch.bfloat16)  # K not a multiple of 32
    assert not vllm_cpu_ops.takes_small_gemm(576, 576, torch.float16)
    w = torch.randn(576, 576).to(torch.bfloat16)
    gemm = vllm_cpu_ops.prepacked_gemm(w)
    assert isinstance(gemm, vllm_cpu_ops.SmallPackedGemm if amx else vllm_cpu_ops.PrepackedGemm)
    x = torch.randn(5, 576).to(torch.bfloat16)
    want = F.linear(x.float(), w.float())
    assert ((gemm(x).float() - want).abs() <= 0.02 * want.abs() + 0.05).all()  # a GEMM, in bf16


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 300), start=st.integers(0, 1500), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_vllm_rope_gives_the_torch_forms_q_k_v(t: int, start: int, dtype: torch.dtype, seed: int) -> None:
    model = _tiny(dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, model.config.hidden_size, generator=g).to(dtype)
    pos = torch.randperm(start + t, generator=g)[:t]  # any order, as a batch of rows has them
    model.reserve_positions(start + t)
    ours = model.rope_args(pos)
    assert ours.cos_sin is not None and not ours.kernels
    attn = model.layers[1].attn
    with torch.inference_mode():
        got = attn.qkv(x, ours)
        want = attn.qkv(x, RopeArgs(*model.rope.lookup(pos, dtype)))
    for a, b in zip(got, want):
        assert a.is_contiguous() and torch.equal(a, b)


def test_the_model_gives_the_same_logits_without_vllms_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole forward (SmolLM2-shaped tiny layers, bf16) with vLLM's GEMM and RoPE against HAWK's torch forms."""
    model = _tiny(torch.bfloat16)
    ids, pos = torch.randint(0, model.config.vocab_size, (37,)), torch.arange(37)
    with torch.inference_mode():
        want = model.compute_logits(model(ids, pos, _attention(model)))
        monkeypatch.setattr(vllm_cpu_ops, "has_rotary", lambda: False)
        monkeypatch.setattr(vllm_cpu_ops, "prepacked_gemm", lambda w: None)
        model_mod._PACKED.clear()
        assert model.rope_args(pos).cos_sin is None
        got = model.compute_logits(model(ids, pos, _attention(model)))
    model_mod._PACKED.clear()
    assert torch.equal(got, want)


def _tiny(dtype: torch.dtype) -> model_mod.LlamaModel:
    return load_model("tiny", "cpu", dtype, 0).model


def _attention(model: model_mod.LlamaModel) -> ContiguousKVAttention:
    attn = ContiguousKVAttention(model.config.num_layers)
    attn.begin([0], [37])
    return attn
