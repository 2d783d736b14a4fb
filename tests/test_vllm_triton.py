"""The fused Triton transform reads vLLM 0.32's GPU caches as vLLM lays them out, byte-exact with the reference.

Caches are built from ``tests/data/vllm_kv_layouts.json`` (the views vLLM's own
``create_kv_cache_views`` made, per KVCacheLayout: shapes, strides, each layer's offset in one
buffer), so the GPU box needs no vLLM. Each case checks the Triton bytes against the torch reference
on the same views, and the reference against HAWK's NHD cache holding the same K/V (read the way
vLLM's backends read it: ``cache.transpose(1, 2).split(head_dim, -1)``). On CPU a subset runs under
Triton's interpreter in a subprocess (``python -m tests.test_vllm_triton``); ``pytest -m gpu`` runs
every fixture layout on every kernel natively.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hawk.layouts import vllm as V
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.kv_plan import plan_kv_transfer
from hawk.transform.reference import transform_reference
from tests.interpreter import emit, run_interpreted

FIXTURE = Path(__file__).parent / "data" / "vllm_kv_layouts.json"
CASES = json.loads(FIXTURE.read_text())["cases"]
KERNELS = ("v1", "v2", "v2e")
NDTYPES = ("bf16", "bfp8_b")
#: Under the interpreter: the small shape's six layouts, bf16 and bfloat8_b, one kernel each in turn.
INTERPRETED = [(c, n, KERNELS[(i * 2 + j) % 3]) for i, c in enumerate(x for x in CASES if x["shape"] == "smollm2")
               for j, n in enumerate(NDTYPES)]


def _name(case: dict, ndtype: str, kernel: str) -> str:
    return f"{case['shape']}-{case['kv_layout']}-{ndtype}@{kernel}"


def fixture_caches(case: dict, device: str, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The case's per-layer views over one random bf16 buffer, exactly as recorded, and the buffer."""
    total = case["layers"] * case["blocks"] * case["heads"] * case["block_size"] * 2 * case["head_dim"]
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(total, generator=g) * 4).to(torch.bfloat16).to(device)
    return [buf.as_strided(v["shape"], v["stride"], v["offset"]) for v in case["views"]], buf


def run_case(case: dict, ndtype: str, kernel: str, device: str, tokens: int = 100) -> None:
    """Triton == reference on the vLLM views, and reference == reference on an NHD copy of the same K/V."""
    from hawk.transform.triton_kernel import transform_triton

    views, _ = fixture_caches(case, device)
    lay = V.from_registered({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(views)}, "FLASH_ATTN", None,
                            case["head_dim"], kv_layout=case["kv_layout"])
    L, B, H, N, D = case["layers"], case["blocks"], case["heads"], case["block_size"], case["head_dim"]
    tokens = min(tokens, B * N - 3)
    rng = np.random.default_rng(1)
    dst = NpuKVLayout(get_arch("blackhole-p150a", bank_capacity=8 << 20), L, -(-tokens // 32) + 1, H, 32, D, ndtype)
    gids = rng.permutation(B)[: -(-tokens // N)]
    nids = rng.permutation(dst.max_num_blocks)[: -(-tokens // 32)]
    bases = [t * (dst.tensor_buffer(0).bytes_per_bank + 4096) for t in range(dst.num_tensors)]
    plan = plan_kv_transfer(tokens, gids, nids, lay, dst, bases)
    ref = transform_reference(views, plan)
    out = torch.full((plan.total_bytes,), 0xAB, dtype=torch.uint8, device=device)
    for _ in range(2):  # the second call takes the direct launch path
        got = transform_triton(views, plan, out, kernel=kernel)
        if not torch.equal(got, ref):
            raise AssertionError(f"Triton bytes differ from the reference at {int((got != ref).sum())} of {ref.numel()}")
    nhd = GpuKVLayout(L, B, N, H, D)
    caches = nhd.allocate(device)
    for layer, c in enumerate(views):
        k, v = c.transpose(1, 2).split(D, dim=-1)
        caches[layer][0].copy_(k)
        caches[layer][1].copy_(v)
    want = transform_reference(caches, plan_kv_transfer(tokens, gids, nids, nhd, dst, bases))
    if not torch.equal(ref, want):
        raise AssertionError("the reference reads the vLLM views differently from HAWK's NHD copy of them")


def _run_all_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"
    np.seterr(all="ignore")
    for case, ndtype, kernel in INTERPRETED:
        name = _name(case, ndtype, kernel)
        try:
            run_case(case, ndtype, kernel, "cpu", tokens=40)
            emit({"name": name, "ok": True})
        except Exception as e:  # noqa: BLE001 - report every failure to the parent
            emit({"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"})


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_interpreted("tests.test_vllm_triton", timeout_s=800)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [_name(*x) for x in INTERPRETED])
def test_triton_reads_vllm_layouts_interpreted(interpreted: dict[str, dict], name: str) -> None:
    r = interpreted.get(name)
    assert r is not None, f"case {name} did not run (subprocess crashed?)"
    assert r["ok"], r.get("error")


#: On a GPU: every fixture layout with each dtype's default kernel (v1 for bf16, v2 for bfloat8_b), and
#: every kernel on vLLM's default FlashAttention layout at the 8B shape (each layout compiles its own kernels).
GPU_RUNS = [(c, n, "auto") for c in CASES for n in NDTYPES] + [
    (c, n, k) for c in CASES if c["shape"] == "llama8b" and c["kv_layout"] == V.DEFAULT_GPU_LAYOUT for n in NDTYPES for k in KERNELS]


@pytest.mark.gpu
@pytest.mark.parametrize("run", GPU_RUNS, ids=[_name(*r) for r in GPU_RUNS])
def test_triton_reads_vllm_layouts_cuda(run: tuple) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case, ndtype, kernel = run
    run_case(case, ndtype, kernel, "cuda", tokens=1000)


def test_triton_refuses_an_interleaved_layout() -> None:
    """CPU_ATTN's orders are not plain strides: the fused kernel says so before any launch."""
    pytest.importorskip("triton")
    from hawk.layouts.paged import NotStridedError
    from hawk.transform.triton_kernel import transform_triton

    lay = V.cpu_layout("vec", 1, 2, 32, 1, 32)
    dst = NpuKVLayout(get_arch("blackhole-p150a", bank_capacity=8 << 20), 1, 2, 1, 32, 32, "bf16")
    plan = plan_kv_transfer(40, [1, 0], [0, 1], lay, dst, [t * (dst.tensor_buffer(0).bytes_per_bank + 4096) for t in range(dst.num_tensors)])
    with pytest.raises(NotStridedError):
        transform_triton(lay.allocate(), plan)


if __name__ == "__main__":
    _run_all_interpreted()
