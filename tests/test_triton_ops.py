"""The fused Triton ops (hawk.engine.triton_ops) equal their torch references, alone and in the model.

On CPU the kernels run under Triton's interpreter, which must be switched on before triton is
imported: those cases run in one subprocess (``python -m tests.test_triton_ops``) printing a JSON
verdict per case. ``gpu``-marked tests run the compiled kernels, and the whole fused CUDA model
against the torch path.
"""

from __future__ import annotations

import os

import pytest
import torch

from hawk.engine.attention import ContiguousKVAttention
from hawk.engine.config import preset
from hawk.engine.model import LlamaModel, greedy_generate
from hawk.engine.triton_ops import add_rms_norm_ref, qkv_rope_ref, silu_mul_ref
from tests.interpreter import emit, run_interpreted

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Max error against the reference, relative to max(|want|, 1); fp32 differs by summation order
#: and FMA contraction only. bf16: a few ulps (2**-8), since Triton's interpreter casts fp32 to bf16
#: by truncation where torch and the GPU round to nearest even.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-5}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs() / want.abs().clamp_min(1.0)).max().item()

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

# (name, op, dtype, shape parameters)
OP_CASES = [
    ("norm-576-fp32-first", "norm", "fp32", dict(rows=3, n=576, residual=False)),
    ("norm-576-bf16", "norm", "bf16", dict(rows=3, n=576, residual=True)),
    ("norm-4096-bf16-first", "norm", "bf16", dict(rows=2, n=4096, residual=False)),
    ("norm-4096-fp32", "norm", "fp32", dict(rows=2, n=4096, residual=True)),
    ("norm-100-fp32", "norm", "fp32", dict(rows=1, n=100, residual=True)),
    ("rope-smol-fp32", "rope", "fp32", dict(t=3, hq=9, hkv=3, d=64)),
    ("rope-8b-bf16", "rope", "bf16", dict(t=2, hq=32, hkv=8, d=128)),
    ("rope-mha-fp32", "rope", "fp32", dict(t=1, hq=2, hkv=2, d=32)),
    ("silu-1536-fp32", "silu", "fp32", dict(t=3, inter=1536)),
    ("silu-1536-bf16", "silu", "bf16", dict(t=2, inter=1536)),
    ("silu-100-fp32", "silu", "fp32", dict(t=2, inter=100)),
]
# (name, preset, dtype, prompt, steps): the fused model against the torch path.
MODEL_CASES = [
    ("tiny-fp32", "tiny", "fp32", [256, 72, 105, 33], 6),
    ("tiny-bf16", "tiny", "bf16", [256, 72, 105, 33], 6),
]
#: The piecewise forward over the Triton kernels (run_piecewise_case), per dtype.
PIECEWISE_DTYPES = ["fp32", "bf16"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_op_case(op: str, dt: torch.dtype, p: dict, device: str) -> float:
    """Run one kernel against its reference; returns the max abs error (asserts exact side effects)."""
    from hawk.engine import triton_ops

    g = _gen(len(op) + sum(int(v) for v in p.values()))
    if op == "norm":
        x = torch.randn(p["rows"], p["n"], generator=g).to(dt).to(device)
        r = torch.randn(p["rows"], p["n"], generator=g).to(dt).to(device) if p["residual"] else None
        w = (1 + 0.1 * torch.randn(p["n"], generator=g)).to(dt).to(device)
        want, want_res = add_rms_norm_ref(x.clone(), None if r is None else r.clone(), w, 1e-5)
        got, got_res = triton_ops.add_rms_norm(x, r, w, 1e-5)
        assert got.dtype == dt and got.shape == x.shape
        # The residual stream is the torch add, in place when there is one (exact, but for the
        # interpreter's truncating bf16 casts).
        assert got_res is (x if r is None else r)
        res_err = _err(got_res, want_res)
        assert res_err == 0 or (INTERPRETED and dt == torch.bfloat16 and res_err < ATOL[dt]), res_err
        return _err(got, want)
    if op == "rope":
        t, hq, hkv, d = p["t"], p["hq"], p["hkv"], p["d"]
        from hawk.engine.model import RotaryTable, rope_inv_freq

        table = RotaryTable(rope_inv_freq(d, 10000.0, None))
        cos, sin_signed = table.table(torch.device(device), dt)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dt).to(device)
        pos = torch.randint(0, len(table), (t,), generator=g).to(device)
        want = qkv_rope_ref(qkv, pos, cos, sin_signed, hq, hkv)
        got = triton_ops.qkv_rope(qkv, pos, cos, sin_signed, hq, hkv)
        err = 0.0
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.is_contiguous() and a.dtype == dt
            err = max(err, _err(a, b))
        assert torch.equal(got[2], want[2])  # v is copied untouched
        buf = torch.full(((hq + 2 * hkv) * d * t + 7,), float("nan"), dtype=dt, device=device)  # a larger static buffer
        into = triton_ops.qkv_rope(qkv, pos, cos, sin_signed, hq, hkv, out=buf)
        for a, b in zip(into, got):  # the same values, back to back at the buffer's front
            assert torch.equal(a, b) and a.is_contiguous()
        assert [x.data_ptr() for x in into] == [buf.data_ptr() + i * t * d * buf.element_size() for i in (0, hq, hq + hkv)]
        with pytest.raises(ValueError, match="flat"):
            triton_ops.qkv_rope(qkv, pos, cos, sin_signed, hq, hkv, out=buf[:5])
        return err
    if op == "silu":
        gu = torch.randn(p["t"], 2 * p["inter"], generator=g).to(dt).to(device) * 3
        want, got = silu_mul_ref(gu), triton_ops.silu_mul(gu)
        assert got.shape == want.shape and got.dtype == dt
        return _err(got, want)
    raise ValueError(op)


def _logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    attn = ContiguousKVAttention(model.config.num_layers)
    attn.begin([0], [len(prompt)])
    ids = torch.tensor(prompt, device=model.device)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(prompt), device=model.device), attn))


def run_model_case(name: str, dt: torch.dtype, prompt: list[int], steps: int, device: str) -> dict:
    """Greedy tokens and prompt logits of the fused path against the torch path (same weights)."""
    model = LlamaModel.from_config(preset(name), seed=0, dtype=dt, device=device)
    model.use_triton = False
    want_toks, want_logits = greedy_generate(model, prompt, steps), _logits(model, prompt)
    model.use_triton = True
    assert model.uses_kernels()
    got_toks, got_logits = greedy_generate(model, prompt, steps), _logits(model, prompt)
    return {"same_tokens": got_toks == want_toks, "tokens": got_toks, "want": want_toks,
            "logit_err": (got_logits - want_logits).abs().max().item()}


def run_piecewise_case(dt: torch.dtype, device: str) -> dict:
    """Batches past the prefill graphs' sequences (five prompts, then five decode rows beside two
    prompts) through the runner's graph pieces, with the fused ops and the Triton paged attention (a
    mixed layer's decode rows by the decode kernel), against the eager forward over the same kernels:
    the greatest logit and cache differences. On a CPU the pieces are called, not replayed."""
    from hawk.engine.attention import SeqSlice
    from hawk.engine.paged_attention import PagedAttention
    from hawk.engine.runner import ModelRunner, StepPath
    from hawk.layouts.gpu import GpuKVLayout

    class PieceRunner(ModelRunner):
        def _why_no_graphs(self) -> None:  # the graph-free parts of the graph paths, on a CPU
            return None

    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=dt, device=device)
    model.use_triton = True
    cfg = model.config

    def paged() -> PagedAttention:
        lay = GpuKVLayout(cfg.num_layers, 40, 16, cfg.num_kv_heads, cfg.head_dim, "fp32" if dt == torch.float32 else "bf16")
        return PagedAttention(lay, lay.allocate(device), max_batch=16, use_triton=True)

    eager = ModelRunner(model, paged(), max_batch=8, graphs=False)
    pieces = PieceRunner(model, paged(), max_batch=8, graphs=False, prefill_graph_tokens=64, prefill_graph_seqs=2, piecewise_graphs=True)
    g, blocks = _gen(1), [[2 * i, 2 * i + 1] for i in range(5)]
    steps = [[(b, 0, 4 + i) for i, b in enumerate(blocks)],
             [(b, 4 + i, 1) for i, b in enumerate(blocks)] + [([10, 11], 0, 9), ([12, 13], 0, 20)]]
    logit_err, same_greedy, paths = 0.0, True, []
    for batch in steps:
        toks = [torch.randint(0, cfg.vocab_size, (q,), generator=g).tolist() for _, _, q in batch]
        slices = [SeqSlice(b, start, q) for b, start, q in batch]
        want, got = eager.step(toks, slices), pieces.step(toks, slices)
        paths.append(got.path.name)
        logit_err = max(logit_err, (want.logits - got.logits).abs().max().item())
        same_greedy &= got.greedy is not None and torch.equal(got.greedy, want.logits.argmax(-1))
    cache_err = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager.attn.caches, pieces.attn.caches))
    return {"paths": paths, "logit_err": logit_err, "cache_err": cache_err, "same_greedy": same_greedy,
            "pieces_path": paths == [StepPath.PIECEWISE.name] * 2}


# ---- under the interpreter (CPU) ------------------------------------------------------------


def _run_all_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"
    torch.set_num_threads(1)
    for name, op, dt, p in OP_CASES:
        try:
            res = {"err": run_op_case(op, DTYPES[dt], p, "cpu")}
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            res = {"error": f"{type(e).__name__}: {e}"}
        emit({"name": name, **res})
    for name, pre, dt, prompt, steps in MODEL_CASES:
        try:
            res = run_model_case(pre, DTYPES[dt], prompt, steps, "cpu")
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"}
        emit({"name": name, **res})
    for dt in PIECEWISE_DTYPES:
        try:
            res = run_piecewise_case(DTYPES[dt], "cpu")
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"}
        emit({"name": f"piecewise-{dt}", **res})


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    return run_interpreted("tests.test_triton_ops")


@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_matches_reference_interpreted(interpreted: dict[str, dict], case: tuple) -> None:
    name, _op, dt, _p = case
    r = interpreted.get(name)
    assert r is not None, f"case {name} did not run (subprocess crashed?)"
    assert "error" not in r, r["error"]
    assert r["err"] <= ATOL[DTYPES[dt]], f"{name}: max err {r['err']:.3g}"


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_fused_model_generates_what_torch_does_interpreted(interpreted: dict[str, dict], case: tuple) -> None:
    r = interpreted.get(case[0])
    assert r is not None and "error" not in r, r
    assert r["same_tokens"], r
    assert r["logit_err"] < (1e-4 if case[2] == "fp32" else 5e-2), r


@pytest.mark.parametrize("dt", PIECEWISE_DTYPES)
def test_piecewise_forward_over_the_triton_kernels_is_the_eager_one_interpreted(interpreted: dict[str, dict], dt: str) -> None:
    """The same kernels in the same order (bit for bit where the CPU's GEMMs give the padded bucket's
    rows the bits of the unpadded batch's, as they did here)."""
    r = interpreted.get(f"piecewise-{dt}")
    assert r is not None and "error" not in r, r
    assert r["pieces_path"] and r["same_greedy"], r
    assert r["logit_err"] <= ATOL[DTYPES[dt]] and r["cache_err"] <= ATOL[DTYPES[dt]], r


def test_cpu_model_keeps_the_torch_path() -> None:
    """On CPU (no interpreter forced) the model never launches a kernel, Triton or not."""
    m = LlamaModel.from_config(preset("tiny"), seed=0)
    assert not m.uses_kernels()
    m.use_triton = True
    assert m.uses_kernels() == HAVE_TRITON
    assert not LlamaModel.from_config(preset("tiny"), seed=0, fuse=False).uses_kernels()


def test_references_are_the_old_torch_code() -> None:
    """The references keep today's numerics: norm(x + r) in fp32, rotate_half RoPE, silu * up."""
    from hawk.engine.model import RMSNorm, RotaryTable, apply_rope, rope_inv_freq

    g = _gen(0)
    x, r = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    norm = RMSNorm(64, 1e-6)
    out, res = add_rms_norm_ref(x, r.clone(), norm.weight, 1e-6)
    assert torch.equal(res, r + x) and torch.equal(out, norm(r + x))
    table = RotaryTable(rope_inv_freq(32, 10000.0, None))
    qkv = torch.randn(3, 4 * 32, generator=g)
    pos = torch.tensor([0, 5, 900])
    q, k, v = qkv_rope_ref(qkv, pos, *table.table(torch.device("cpu"), torch.float32), 2, 1)
    cos, sin = table(pos, torch.float32)
    heads = qkv.view(3, 4, 32)
    assert torch.allclose(q, apply_rope(heads[:, :2], cos, sin), atol=1e-6)
    assert torch.allclose(k, apply_rope(heads[:, 2:3], cos, sin), atol=1e-6)
    assert torch.equal(v, heads[:, 3:])
    gu = torch.randn(2, 20, generator=g)
    assert torch.equal(silu_mul_ref(gu), torch.nn.functional.silu(gu[:, :10]) * gu[:, 10:])


# ---- on the GPU -----------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_matches_reference_cuda(case: tuple) -> None:
    name, op, dt, p = case
    assert run_op_case(op, DTYPES[dt], p, "cuda") <= ATOL[DTYPES[dt]], name


@gpu
@needs_cuda
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_fused_cuda_model_generates_what_torch_does(case: tuple) -> None:
    name, pre, dt, prompt, steps = case
    model = LlamaModel.from_config(preset(pre), seed=0, dtype=DTYPES[dt], device="cuda")
    assert model.uses_kernels()  # the default on CUDA
    r = run_model_case(pre, DTYPES[dt], prompt, steps, "cuda")
    assert r["same_tokens"], r
    assert r["logit_err"] < (1e-3 if dt == "fp32" else 5e-2), r


@gpu
@needs_cuda
def test_fused_ops_capture_in_a_cuda_graph() -> None:
    """All three kernels replay from a graph with new inputs (no sync, no allocation per replay)."""
    from hawk.engine import triton_ops
    from hawk.engine.model import RotaryTable, rope_inv_freq

    dev, dt = torch.device("cuda"), torch.bfloat16
    table = RotaryTable(rope_inv_freq(128, 500000.0, None))
    cos, sin_signed = table.table(dev, dt)
    x = torch.randn(4, 4096, device=dev, dtype=dt)
    res = torch.randn(4, 4096, device=dev, dtype=dt)
    w = torch.ones(4096, device=dev, dtype=dt)
    qkv = torch.randn(4, 48 * 128, device=dev, dtype=dt)
    pos = torch.tensor([0, 1, 2, 3], device=dev)
    gu = torch.randn(4, 2 * 14336, device=dev, dtype=dt)

    def body() -> tuple[torch.Tensor, ...]:
        n, r2 = triton_ops.add_rms_norm(x, res, w, 1e-5)
        return (n, *triton_ops.qkv_rope(qkv, pos, cos, sin_signed, 32, 8), triton_ops.silu_mul(gu))

    body()
    torch.cuda.synchronize()
    res.copy_(torch.randn_like(res))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = body()
    for _ in range(2):
        r0 = res.clone()
        x.copy_(torch.randn_like(x))
        qkv.copy_(torch.randn_like(qkv))
        pos.copy_(torch.randint(0, 1000, (4,), device=dev))
        graph.replay()
        torch.cuda.synchronize()
        want_n, want_r = add_rms_norm_ref(x, r0, w, 1e-5)
        assert torch.equal(res, want_r)
        assert _err(outs[0], want_n) < ATOL[dt]
        for a, b in zip(outs[1:4], qkv_rope_ref(qkv, pos, cos, sin_signed, 32, 8)):
            assert _err(a, b) < ATOL[dt]
        assert _err(outs[4], silu_mul_ref(gu)) < ATOL[dt]


if __name__ == "__main__":
    _run_all_interpreted()
