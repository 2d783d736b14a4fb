"""Transform kernels write the bytes the torch reference writes; the reference is checked against a naive model.

The Triton kernel is checked on CPU through Triton's interpreter. ``TRITON_INTERPRET`` must be
set before triton is imported, so those cases run in one subprocess (``python -m
tests.test_transform``) that prints a JSON verdict per case; the pytest side parametrizes over
the same deterministic case list. The ``gpu``-marked twin runs the cases natively on CUDA.
"""

from __future__ import annotations

import json
import os
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.kv_plan import KVTransferPlan, plan_kv_transfer
from hawk.transform.reference import transform_reference
from tests.interpreter import emit, run_interpreted


# -- cases ------------------------------------------------------------------------------------


def _random_case(rng: np.random.Generator, name: str, **fixed) -> dict:
    """One case as plain data (so the subprocess rebuilds exactly the same one)."""
    c = {
        "name": name,
        "arch": str(rng.choice(["blackhole-p150a", "blackhole-p100a", "wormhole-n150"])),
        "layers": int(rng.integers(1, 3)),
        "head_dim": int(32 * rng.choice([1, 2, 3, 4])),
        "gpu_heads": int(rng.integers(1, 4)),
        "gpu_start": int(rng.integers(0, 2)),
        "gbs": int(rng.choice([1, 3, 16, 32, 64, 128])),
        "nbs": int(rng.choice([32, 64])),
        "tokens": int(rng.integers(1, 150)),
        "order": str(rng.choice(["NHD", "HND"])),
        "gdtype": str(rng.choice(["bf16", "fp16", "fp32"])),
        "ndtype": str(rng.choice(["bf16", "bfp8_b"])),
        "values": str(rng.choice(["mixed", "edges", "randn"])),
        "view": "plain",
        "seed": int(rng.integers(0, 2**31 - 1)),
    }
    c.update(fixed)
    # NPU heads overlap the GPU's by at least one.
    lo = max(0, c["gpu_start"] - 1)
    c.setdefault("npu_start", int(rng.integers(lo, c["gpu_start"] + c["gpu_heads"])))
    c.setdefault("npu_heads", int(rng.integers(max(1, c["gpu_start"] - c["npu_start"] + 1), 4)))
    return c


def all_cases() -> list[dict]:
    """Every (GPU dtype, NPU dtype, order) combination, then random ones and targeted ones."""
    rng = np.random.default_rng(20240607)
    cases = []
    for g in ("bf16", "fp16", "fp32"):
        for n in ("bf16", "bfp8_b"):
            for o in ("NHD", "HND"):
                cases.append(_random_case(rng, f"grid-{g}-{n}-{o}", gdtype=g, ndtype=n, order=o, values="edges"))
    for i in range(28):
        cases.append(_random_case(rng, f"random-{i}"))
    cases += [
        _random_case(rng, "exact-blocks", tokens=128, gbs=16, nbs=64, head_dim=128, ndtype="bfp8_b"),
        _random_case(rng, "one-token", tokens=1, gbs=16, nbs=32),
        _random_case(rng, "gbs-larger-than-nbs", tokens=140, gbs=128, nbs=32),
        _random_case(rng, "head-dim-96-bfp8", head_dim=96, ndtype="bfp8_b", values="edges"),
        _random_case(rng, "head-dim-160", head_dim=160, layers=1, gpu_heads=1, gpu_start=0, npu_start=0, npu_heads=1),
        _random_case(rng, "strided-view-nhd", view="strided", order="NHD"),
        _random_case(rng, "strided-view-hnd", view="strided", order="HND", ndtype="bfp8_b"),
        _random_case(rng, "head-subset", gpu_heads=3, gpu_start=0, npu_start=1, npu_heads=1),
        _random_case(rng, "mixed-strides", view="mixed", layers=3),
    ]
    return cases


CASES = all_cases()
#: Cases whose tiles are also written straight into an NPU's DRAM (``run_memory_dest``).
MEMORY_CASES = [c for c in CASES if c["name"].startswith("grid-bf16-")] + [
    c for c in CASES if c["name"] in ("head-subset", "head-dim-96-bfp8")]
#: Bound transforms (a landed pull's): bf16, bfloat8_b, and caches whose strides disagree (the kernel reads
#: copies of those, made per call: a bound call must not keep them).
BOUND_CASES = MEMORY_CASES[:1] + [c for c in CASES if c["name"] in ("head-dim-96-bfp8", "mixed-strides")]


def build_plan(c: dict) -> KVTransferPlan:
    """The plan of a case: permuted (non-contiguous) block ids on both sides, a few spare blocks."""
    rng = np.random.default_rng(c["seed"])
    arch = get_arch(c["arch"], bank_capacity=8 << 20)
    g_need, n_need = -(-c["tokens"] // c["gbs"]), -(-c["tokens"] // c["nbs"])
    g_total, n_total = g_need + int(rng.integers(0, 4)), n_need + int(rng.integers(0, 3))
    src = GpuKVLayout(c["layers"], g_total, c["gbs"], c["gpu_heads"], c["head_dim"], c["gdtype"], c["order"], c["gpu_start"])
    dst = NpuKVLayout(arch, c["layers"], n_total, c["npu_heads"], c["nbs"], c["head_dim"], c["ndtype"], c["npu_start"])
    gids = rng.permutation(g_total)[:g_need]
    nids = rng.permutation(n_total)[:n_need]
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    bases = [t * (per_bank + 4096) for t in range(dst.num_tensors)]
    return plan_kv_transfer(c["tokens"], gids, nids, src, dst, bases)


def _special_fp32() -> np.ndarray:
    """fp32 values that stress bfloat8_b and bf16 rounding."""
    f = np.float32
    return np.array(
        [0.0, -0.0, 1.0, -1.0, 1.9999999, -1.9999999, 1.99, 1.5, 1.0078125, 1.01171875,  # 1.99 -> 128 -> 127
         3.0e-39, -3.0e-39, 1.0e-45, 2.0**-126, 2.0**-24, 2.0**-7, 2.0**-8, -(2.0**-8), 2.0**-9,  # denormals, shift 24/25
         65504.0, 6.0e-8, 3.0e38, -3.0e38, np.inf, -np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 2.0**100, 2.0**-100],
        dtype=f,
    )


def make_values(c: dict, shape: tuple[int, ...], dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    """Cache contents: gaussian, per-row wildly different exponents, or special values (no NaNs)."""
    n = int(np.prod(shape))
    x = rng.standard_normal(n).astype(np.float32)
    if c["values"] in ("mixed", "edges"):
        # Rows of 16 whose scale jumps by up to 2^40 within and between rows.
        x *= np.exp2(rng.integers(-40, 40, size=n)).astype(np.float32) ** (rng.random(n) < 0.3)
        x *= np.exp2(np.repeat(rng.integers(-30, 30, size=-(-n // 16)), 16)[:n]).astype(np.float32)
    if c["values"] == "edges":
        spec = _special_fp32()
        pick = rng.random(n) < 0.35
        x[pick] = spec[rng.integers(0, len(spec), size=int(pick.sum()))]
        zero_rows = rng.random(-(-n // 16)) < 0.05  # whole face rows of zeros / -0
        x.reshape(-1)[np.repeat(zero_rows, 16)[:n]] = -0.0
    t = torch.from_numpy(x).reshape(shape)
    if dtype == torch.float16:
        t = t.clamp(-65504, 65504).where(t.abs() < np.inf, t)  # keep fp16 infs as infs
    return t.to(dtype)


def make_caches(c: dict, plan: KVTransferPlan, device: str) -> list[torch.Tensor]:
    """Layer caches; ``strided`` views them out of a wider buffer (head_dim padded), as some allocators
    do; ``mixed`` does so for odd layers only (strides disagree: the kernel must fall back to copies)."""
    rng = np.random.default_rng(c["seed"] + 1)
    src = plan.src
    out = []
    for layer in range(src.num_layers):
        if c["view"] == "strided" or (c["view"] == "mixed" and layer % 2):
            full = list(src.layer_shape)
            full[-1] += 32
            big = make_values(c, tuple(full), src.torch_dtype, rng).to(device)
            out.append(big[..., : src.head_dim])  # slice on the device: .to() would compact it
        else:
            out.append(make_values(c, src.layer_shape, src.torch_dtype, rng).to(device))
    return out


# -- comparing bytes --------------------------------------------------------------------------


def padding_bytes(plan: KVTransferPlan) -> tuple[np.ndarray, np.ndarray]:
    """Send-buffer byte indices of rows past the request: ``(exponent bytes, value bytes)``.

    A tile row r lies in face rows ``(r // 16, r % 16)`` of the left and right faces; bfloat8_b
    gives each face row its own exponent byte, so padding rows never share bytes with real rows.
    """
    r = np.arange(32)
    faces = (r // 16)[:, None] * 2 + np.array([0, 1])[None, :]  # [32, 2] face of each half row
    pad = (plan.token_start[:, None] + r[None, :]) >= plan.num_tokens  # [P, 32]
    q_idx, row_idx = np.nonzero(pad)
    offs = plan.send_offsets()[:, q_idx]  # [T, n] byte offsets of the tiles holding padding
    elem = faces[row_idx] * 256 + (row_idx % 16)[:, None] * 16  # [n, 2] first element of each face row
    elem = (elem[:, :, None] + np.arange(16)).reshape(len(q_idx), 32)
    if plan.dst.dtype == "bf16":
        vals = (2 * elem[:, :, None] + np.arange(2)).reshape(len(q_idx), 64)
        return np.zeros(0, dtype=np.int64), (offs[:, :, None] + vals[None]).reshape(-1)
    exps = faces[row_idx] * 16 + (row_idx % 16)[:, None]  # [n, 2]
    return (offs[:, :, None] + exps[None]).reshape(-1), (offs[:, :, None] + 64 + elem[None]).reshape(-1)


def assert_same_bytes(got: torch.Tensor, ref: torch.Tensor, plan: KVTransferPlan) -> None:
    """Byte equality outside padding rows; in them ``got`` must hold exact +0 encodings.

    Why the exception: the reference zeroes padding by multiplying the clamped last row by 0,
    which leaves -0 for negative values and NaN for infinities; the tile format pads with +0.
    """
    got, ref = got.cpu().clone(), ref.cpu().clone()
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.uint8
    exp_idx, val_idx = (torch.from_numpy(i) for i in padding_bytes(plan))
    pad = torch.cat([exp_idx, val_idx])
    assert bool((got[pad] == 0).all()), "padding rows must be +0"
    if plan.dst.dtype == "bf16":
        r16 = ref[val_idx].view(torch.int16).to(torch.int32) & 0x7FFF
        assert bool(((r16 == 0) | (r16 > 0x7F80)).all()), "reference padding is neither a zero nor NaN"
    else:
        assert bool(((ref[exp_idx] == 0) | (ref[exp_idx] == 255)).all()), "reference padding is neither a zero nor NaN"
    got[pad] = 0
    ref[pad] = 0
    diff = (got != ref).nonzero()
    if len(diff):
        i = int(diff[0])
        pb = plan.page_bytes
        raise AssertionError(
            f"{len(diff)} bytes differ; first at byte {i} (page {i // pb}, byte {i % pb} of the page): "
            f"got {int(got[i])}, reference {int(ref[i])}"
        )


#: The Triton kernels every case runs on (see hawk.transform.triton_kernel): v1 permutes slabs; v2
#: gathers face rows (bf16 sources as 32-bit words); v2e is v2 reading each element on its own.
KERNELS = ("v1", "v2", "v2e")


def run_case(c: dict, device: str, kernel: str | None = None) -> None:
    """Triton vs reference on one case, twice on the same plan (the second reuses its placement and
    block tables)."""
    from hawk.transform.triton_kernel import transform_triton

    plan = build_plan(c)
    caches = make_caches(c, plan, device)
    ref = transform_reference(caches, plan)
    got = transform_triton(caches, plan, kernel=kernel)
    assert_same_bytes(got, ref, plan)
    # Same plan, new contents and a caller-given buffer with a tail that must stay untouched.
    caches2 = [x.flip(0).contiguous() if c["view"] == "plain" else x for x in caches]
    out = torch.full((plan.total_bytes + 100,), 0xAB, dtype=torch.uint8, device=device)
    ref2 = transform_reference(caches2, plan, out.clone())
    got2 = transform_triton(caches2, plan, out, kernel=kernel)
    assert got2 is out
    assert_same_bytes(got2, ref2, plan)
    # The placement and block tables were built once for the plan and reused with the new caches
    # (which only need their own cache-layout state).
    from hawk.transform.triton_kernel import _prepare

    first, second = _prepare(plan, caches, plan.send_dest())[0], _prepare(plan, caches2, plan.send_dest())[0]
    assert first.placed is second.placed and first.blocks is second.blocks


def _dram(plan: KVTransferPlan) -> tuple[int, int]:
    """``(channel bytes, channels)`` of the NPU whose DRAM a case's plan addresses (banks tile channels)."""
    arch = plan.dst.arch
    return arch.channel_capacity(0), arch.num_channels


def run_memory_dest(c: dict, device: str, kernel: str | None = None) -> None:
    """Tiles written straight into the NPU's DRAM (``memory_dest``): the bytes the send buffer holds,
    at the addresses the direct requests would have copied them to, and nothing else touched; the
    Triton kernel and the reference agree."""
    from hawk.transform.triton_kernel import transform_triton

    plan = build_plan(c)
    caches = make_caches(c, plan, device)
    cb, nch = _dram(plan)
    dest = plan.memory_dest(cb)
    assert dest is plan.memory_dest(cb), "memory_dest is cached with the placement"
    send = transform_reference(caches, plan)
    via_copies = torch.full((nch * cb,), 0x5A, dtype=torch.uint8, device=device)
    r = plan.direct_runs()
    for so, ch, do, n in zip(r.src_offset, r.dst_region, r.dst_offset, r.length):
        via_copies[int(ch) * cb + int(do): int(ch) * cb + int(do) + int(n)] = send[int(so): int(so) + int(n)]
    # tile by tile back into send-buffer order (the same map for both writers)
    a, b = plan.send_dest().a, plan.send_dest().b
    idx = torch.zeros(plan.total_bytes, dtype=torch.int64)
    within = torch.arange(plan.page_bytes)
    for t in range(plan.num_tensors):
        src = torch.from_numpy(dest.a + t * dest.b)[:, None] + within
        dst = torch.from_numpy(a + t * b)[:, None] + within
        idx[dst.reshape(-1)] = src.reshape(-1)
    assert _untouched(via_copies, idx), "direct requests cover exactly the tiles"
    for name, write in (("reference", lambda m: transform_reference(caches, plan, m, dest)),
                        ("triton", lambda m: transform_triton(caches, plan, m, kernel=kernel, dest=dest))):
        mem = torch.full((nch * cb,), 0x5A, dtype=torch.uint8, device=device)
        assert write(mem) is mem, name
        # equal to the send buffer (padding as assert_same_bytes allows)
        assert_same_bytes(mem[idx.to(device)], send, plan)
        assert _untouched(mem, idx), f"{name} wrote outside the tiles"


def _untouched(mem: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether every byte of ``mem`` outside ``idx`` still holds the 0x5A fill. Compared 8 bytes at a time on
    a copy whose ``idx`` bytes are set to the fill: a boolean mask over the whole DRAM (~100 MB) takes
    seconds on the CPU, and the memory cases run many times under the interpreter."""
    rest = mem.cpu().clone()
    rest[idx] = 0x5A
    return bool((rest.view(torch.int64) == 0x5A5A5A5A5A5A5A5A).all())


def run_bound(c: dict, device: str, kernel: str | None = None) -> None:
    """A transform bound to the NPU's DRAM (``bind_triton``: what a landed pull keeps) writes nothing when
    bound, and at each call the tiles of what the caches hold then: the bytes of a fresh transform, before
    and after the caches change in place."""
    from hawk.transform.triton_kernel import bind_triton, transform_triton

    plan = build_plan(c)
    caches = make_caches(c, plan, device)
    cb, nch = _dram(plan)
    dest = plan.memory_dest(cb)
    mem = torch.full((nch * cb,), 0x5A, dtype=torch.uint8, device=device)
    run = bind_triton(caches, plan, mem, dest, kernel=kernel)
    assert bool((mem == 0x5A).all()), "binding wrote"
    for step in range(2):
        if step:
            for x in caches:
                x.copy_(x.flip(0))  # new contents, same tensors
        run()
        want = torch.full_like(mem, 0x5A)
        transform_triton(caches, plan, want, kernel=kernel, dest=dest)
        assert torch.equal(mem, want), f"call {step}"


def run_odd_buffer(device: str, kernel: str) -> None:
    """Send buffers at an odd address (bfloat8_b: byte stores only; bf16: written aside and copied)
    and at 2 mod 16 (no 16-byte vectors), several tensors per program with a partial last program."""
    from hawk.transform.triton_kernel import transform_triton

    for ndtype, shift, tpp in (("bfp8_b", 1, None), ("bf16", 1, 4), ("bfp8_b", 2, 4), ("bf16", 2, None)):
        c = _random_case(np.random.default_rng(7), f"odd-{ndtype}", layers=3, tokens=70, gbs=16, nbs=32,
                         head_dim=64, gdtype="bf16", ndtype=ndtype, values="edges", order="NHD")
        plan = build_plan(c)
        caches = make_caches(c, plan, device)
        big = torch.full((plan.total_bytes + 64,), 0xCD, dtype=torch.uint8, device=device)
        out = big[shift: shift + plan.total_bytes]
        got = transform_triton(caches, plan, out, kernel=kernel, tpp=tpp)
        assert got is out
        assert_same_bytes(out, transform_reference(caches, plan), plan)
        assert bool((big[:shift] == 0xCD).all()) and bool((big[shift + plan.total_bytes:] == 0xCD).all())


def run_edges(device: str, kernel: str, gdtype: str, ndtype: str) -> None:
    """Every bf16/fp16 bit pattern (fp32: ties) at every distance from its face row's max: bytes equal."""
    from hawk.bench.transform import check_edges

    recs = check_edges([kernel], device, gdtypes=[gdtype], ndtypes=[ndtype], verbose=False)
    bad = [r for r in recs if not r["match"]]
    assert not bad, f"bytes differ: {bad}"


EDGE_COMBOS = [(g, n) for g in ("bf16", "fp16", "fp32") for n in ("bfp8_b", "bf16")]


def interpreted_kernels(c: dict, cases: list[dict] | None = None, full: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The kernels a case runs on under the interpreter (CI's slowest part; on a GPU every case runs on every
    kernel): every kernel for the cases named in ``full`` (or, without ``cases``, every non-random case of
    ``CASES``), one each in turn for the rest of ``cases``."""
    if cases is None:
        if not c["name"].startswith("random-"):
            return KERNELS
        i = int(c["name"].split("-")[1])
    else:
        if c["name"] in full:
            return KERNELS
        i = next(j for j, x in enumerate(cases) if x is c)
    return (KERNELS[i % len(KERNELS)],)


#: Memory-destination and bound cases that run on every kernel under the interpreter (bf16 and bfloat8_b).
_FULL_MEMORY = ("grid-bf16-bf16-NHD", "grid-bf16-bfp8_b-NHD")


def interpreted_names() -> list[str]:
    names = [f"{c['name']}@{k}" for c in CASES for k in interpreted_kernels(c)]
    names += [f"odd-buffer@{k}" for k in KERNELS]
    names += [f"{c['name']}@memory@{k}" for c in MEMORY_CASES for k in interpreted_kernels(c, MEMORY_CASES, _FULL_MEMORY)]
    names += [f"{c['name']}@bound@{k}" for c in BOUND_CASES for k in interpreted_kernels(c, BOUND_CASES, _FULL_MEMORY)]
    names += [f"edges-{g}-{n}@{k}" for g, n in EDGE_COMBOS for k in KERNELS]
    return names + ["bench-triton"]


# -- the interpreter subprocess ---------------------------------------------------------------


def _attempt(name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        fn(*args)
        res = {"name": name, "ok": True}
    except Exception as e:  # noqa: BLE001 - report every failure to the parent
        res = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
    res["s"] = round(time.perf_counter() - t0, 3)
    emit(res)


def _run_all_interpreted() -> None:
    """Subprocess entry: run every case on CPU under TRITON_INTERPRET=1, one JSON line each."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"
    # The interpreter evaluates float ops on whatever bits reach them (NaN payloads of lanes a kernel
    # then discards): numpy's warnings about those are noise here.
    np.seterr(all="ignore")
    for c in CASES:
        for k in interpreted_kernels(c):
            _attempt(f"{c['name']}@{k}", run_case, c, "cpu", k)
    for k in KERNELS:
        _attempt(f"odd-buffer@{k}", run_odd_buffer, "cpu", k)
    for c in MEMORY_CASES:
        for k in interpreted_kernels(c, MEMORY_CASES, _FULL_MEMORY):
            _attempt(f"{c['name']}@memory@{k}", run_memory_dest, c, "cpu", k)
    for c in BOUND_CASES:
        for k in interpreted_kernels(c, BOUND_CASES, _FULL_MEMORY):
            _attempt(f"{c['name']}@bound@{k}", run_bound, c, "cpu", k)
    for g, n in EDGE_COMBOS:
        _edges_interpreted(g, n)
    _bench_smoke_interpreted()


def _edges_interpreted(gdtype: str, ndtype: str) -> None:
    """``run_edges`` for every kernel in one ``check_edges`` call, a verdict per kernel: the edge problem
    (every bit pattern) and its reference are built once for the three kernels, not once each."""
    from hawk.bench.transform import check_edges

    names = {k: f"edges-{gdtype}-{ndtype}@{k}" for k in KERNELS}
    try:
        recs = {r["kernel"]: r for r in check_edges(list(KERNELS), "cpu", gdtypes=[gdtype], ndtypes=[ndtype], verbose=False)}
    except Exception as e:  # noqa: BLE001 - report every failure to the parent
        for name in names.values():
            emit({"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    for k, name in names.items():
        r = recs.get(k)
        ok = r is not None and r["match"]
        emit({"name": name, "ok": ok, "error": "" if ok else f"bytes differ: {r}"})


def _bench_smoke_interpreted() -> None:
    """The benchmark's Triton path on a tiny cache (it checks bytes itself), every kernel."""
    from hawk.bench.transform import run_benchmark

    try:
        recs = run_benchmark(sizes_mb=[0.125], dtypes=["bf16", "bfp8_b"], impls=["triton"], device="cpu",
                             repeats=1, warmup=0, shape="tiny", verbose=False, kernels=[None, *KERNELS])
        ok = all(r["match"] for r in recs) and len(recs) == 16 and recs[0]["kernel"] == "v1"  # auto: v1 for bf16
        res = {"name": "bench-triton", "ok": ok, "error": "" if ok else json.dumps(recs)}
    except Exception as e:  # noqa: BLE001
        res = {"name": "bench-triton", "ok": False, "error": f"{type(e).__name__}: {e}"}
    emit(res)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_interpreted("tests.test_transform", timeout_s=800)


@pytest.mark.timeout(900)  # the first case waits for the whole interpreter run (~2-5 min on 2 busy cores)
@pytest.mark.parametrize("name", interpreted_names())
def test_triton_matches_reference_interpreted(interpreted: dict[str, dict], name: str) -> None:
    r = interpreted.get(name)
    assert r is not None, f"case {name} did not run (subprocess crashed?)"
    assert r["ok"], r.get("error")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_triton_matches_reference_cuda(case: dict, kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_case(case, "cuda", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c["name"] for c in MEMORY_CASES])
def test_triton_memory_dest_cuda(case: dict, kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_memory_dest(case, "cuda", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", BOUND_CASES, ids=[c["name"] for c in BOUND_CASES])
def test_triton_bound_cuda(case: dict, kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_bound(case, "cuda", kernel)


def test_bound_reference_transform_reads_the_caches_at_each_call() -> None:
    """``hawk.transform.bind`` with the torch reference: nothing written when bound, and each call writes
    the tiles of the caches' contents at that moment (into a send buffer and into the NPU's DRAM)."""
    from hawk.transform import bind

    c = MEMORY_CASES[0]
    plan = build_plan(c)
    caches = make_caches(c, plan, "cpu")
    cb, nch = _dram(plan)
    for dest, size in ((None, plan.total_bytes), (plan.memory_dest(cb), nch * cb)):
        out = torch.full((size,), 0x5A, dtype=torch.uint8)
        run = bind(caches, plan, out, "torch", dest)
        assert bool((out == 0x5A).all())
        for step in range(2):
            if step:
                for x in caches:
                    x.copy_(x.flip(0))
            run()
            assert torch.equal(out, transform_reference(caches, plan, torch.full_like(out, 0x5A), dest)), step


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_odd_buffer_cuda(kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_odd_buffer("cuda", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("combo", EDGE_COMBOS, ids=[f"{g}-{n}" for g, n in EDGE_COMBOS])
def test_triton_edges_cuda(combo: tuple[str, str], kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_edges("cuda", kernel, *combo)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("ndtype", ["bf16", "bfp8_b"])
@pytest.mark.parametrize("blocks", ["contiguous", "shuffled"])
def test_triton_matches_reference_cuda_70b_shape(ndtype: str, blocks: str, kernel: str) -> None:
    """The benchmark's rank shape (2 KV heads, head_dim 128, GPU block 16, NPU block 64), 8 layers,
    1000 tokens (a padded last NPU block), wide vectorized loads and stores on real hardware;
    three calls, so v2's direct launches (after the first) are checked too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hawk.bench.transform import build_problem
    from hawk.transform.triton_kernel import transform_triton

    prob = build_problem(tokens=1000, layers=8, ndtype=ndtype, shuffled=blocks == "shuffled", device="cuda", seed=3)
    ref = transform_reference(prob.caches, prob.plan)
    out = torch.empty(prob.plan.total_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        out.fill_(0xAB)
        got = transform_triton(prob.caches, prob.plan, out, kernel=kernel)
        assert_same_bytes(got, ref, prob.plan)


def test_triton_rejects_bad_input() -> None:
    """Errors are raised before any launch, so this runs without a GPU or the interpreter."""
    pytest.importorskip("triton")
    from hawk.transform.triton_kernel import transform_triton

    c = CASES[0]
    plan = build_plan(c)
    caches = make_caches(c, plan, "cpu")
    with pytest.raises(ValueError, match="layer tensors"):
        transform_triton(caches[:-1] if len(caches) > 1 else caches * 2, plan)
    with pytest.raises(ValueError, match="shape"):
        transform_triton([x[:, :1] for x in caches], plan)
    with pytest.raises(ValueError, match="send buffer"):
        transform_triton(caches, plan, torch.empty(plan.total_bytes, dtype=torch.int16))
    with pytest.raises(ValueError, match="send buffer"):
        transform_triton(caches, plan, torch.empty(plan.total_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kernel"):
        transform_triton(caches, plan, kernel="v9")


def test_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: v2 for bfloat8_b, v1 for bf16; the environment variable picks otherwise; head_dim % 16 != 0 -> v1."""
    pytest.importorskip("triton")
    from hawk.transform.triton_kernel import ENV_KERNEL, default_tpp, resolve_kernel

    monkeypatch.delenv(ENV_KERNEL, raising=False)
    assert resolve_kernel(None, 128) == "v2" and resolve_kernel("auto", 128) == "v2"
    assert resolve_kernel(None, 128, "bf16") == "v1" and resolve_kernel("v2", 128, "bf16") == "v2"
    assert resolve_kernel("v1", 128) == "v1" and resolve_kernel("v2e", 128) == "v2e"
    assert resolve_kernel(None, 72) == "v1" and resolve_kernel("v2", 72) == "v1"
    monkeypatch.setenv(ENV_KERNEL, "v1")
    assert resolve_kernel(None, 128) == "v1" and resolve_kernel("v2", 128) == "v2"
    assert default_tpp(128, 2, 160) == 1 and default_tpp(128, 4, 160) == 1 and default_tpp(32, 2, 6) == 4


# -- the reference against a naive per-element model ------------------------------------------


def _naive_bf16(bits: int) -> int:
    """fp32 bits -> bf16 bits, nearest even, written as a decision on the discarded half-word."""
    hi, lo = bits >> 16, bits & 0xFFFF
    if lo > 0x8000 or (lo == 0x8000 and hi & 1):
        hi += 1
    return hi & 0xFFFF


def _naive_bfp8_row(bits: list[int]) -> tuple[int, list[int]]:
    """One face row: exact rational rounding (Python's round is half-to-even on Fractions)."""
    exps = [(b >> 23) & 0xFF for b in bits]
    shared = max(exps)
    vals = []
    for b, e in zip(bits, exps):
        if e == 0:
            vals.append(0)
            continue
        mant = (b & 0x7FFFFF) | 0x800000
        q = min(round(Fraction(mant, 2 ** (17 + shared - e))), 127)
        vals.append(q | (0x80 if (b >> 31) and q else 0))
    return shared, vals


def naive_transform(caches: list[torch.Tensor], plan: KVTransferPlan) -> bytes:
    """Element by element: where each value comes from, how it is encoded, where its page goes."""
    src, dst = plan.src, plan.dst
    out = bytearray(plan.total_bytes)
    offs = plan.send_offsets()
    f32 = [c.float() for c in caches]
    for t in range(dst.num_tensors):
        layer, kv = divmod(t, 2)
        for q in range(plan.num_pages):
            tile = np.zeros((32, 32), dtype=np.uint32)
            for r in range(32):
                tok = int(plan.token_start[q]) + r
                if tok >= plan.num_tokens:
                    continue
                blk, slot = int(plan.gpu_block_ids[tok // src.block_size]), tok % src.block_size
                h, d0 = int(plan.gpu_head[q]), 32 * int(plan.col_tile[q])
                x = f32[layer][kv, blk, slot, h] if src.order == "NHD" else f32[layer][kv, blk, h, slot]
                tile[r] = x[d0 : d0 + 32].numpy().view(np.uint32)
            faces = [tile[fr * 16 : fr * 16 + 16, fc * 16 : fc * 16 + 16] for fr in (0, 1) for fc in (0, 1)]
            page = bytearray()
            if dst.dtype == "bf16":
                for f in faces:
                    for v in f.reshape(-1):
                        page += _naive_bf16(int(v)).to_bytes(2, "little")
            else:
                rows = [_naive_bfp8_row([int(v) for v in f[i]]) for f in faces for i in range(16)]
                page += bytes(e for e, _ in rows) + bytes(v for _, vs in rows for v in vs)
            o = int(offs[t, q])
            out[o : o + len(page)] = page
    return bytes(out)


@pytest.mark.parametrize(
    "case",
    [
        _random_case(np.random.default_rng(1), "naive-bf16", layers=1, tokens=40, gbs=16, nbs=32, head_dim=64,
                     gpu_heads=2, gpu_start=0, npu_start=1, npu_heads=1, gdtype="fp32", ndtype="bf16", values="edges"),
        _random_case(np.random.default_rng(2), "naive-bfp8", layers=1, tokens=70, gbs=3, nbs=64, head_dim=32,
                     gpu_heads=1, gpu_start=0, npu_start=0, npu_heads=1, gdtype="bf16", ndtype="bfp8_b", order="HND",
                     values="edges"),
        _random_case(np.random.default_rng(3), "naive-bfp8-fp32", layers=1, tokens=33, gbs=16, nbs=32, head_dim=32,
                     gpu_heads=1, gpu_start=0, npu_start=0, npu_heads=1, gdtype="fp32", ndtype="bfp8_b", values="edges"),
    ],
    ids=lambda c: c["name"],
)
def test_reference_matches_naive(case: dict) -> None:
    plan = build_plan(case)
    caches = make_caches(case, plan, "cpu")
    want = torch.frombuffer(bytearray(naive_transform(caches, plan)), dtype=torch.uint8)
    assert_same_bytes(want, transform_reference(caches, plan), plan)


def _model_bfp8_rows(b32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bfloat8_b of fp32 bit rows ``[n, 16]`` in float64: ``rint`` is round-half-even, and scaling a
    24-bit mantissa by ``2^-(17 + E - e)`` (at most 2^-271) is exact in float64."""
    b = b32.astype(np.int64)
    e = (b >> 23) & 0xFF
    shared = e.max(axis=1, keepdims=True)
    mant = ((b & 0x7FFFFF) | 0x800000).astype(np.float64)
    q = np.minimum(np.rint(np.ldexp(mant, -(17 + shared - e))), 127).astype(np.int64)
    q[e == 0] = 0
    sign = ((b >> 31) & 1) * (q != 0)
    return shared[:, 0].astype(np.uint8), (q | (sign << 7)).astype(np.uint8)


@pytest.mark.parametrize("gdtype", ["bf16", "fp16", "fp32"])
def test_oracle_matches_model_on_edge_rows(gdtype: str) -> None:
    """The oracle (``pack_bfp8_rows``, and torch's fp32 -> bf16) against independent models on the
    edge rows the kernels are checked with: every bf16/fp16 pattern at every distance, fp32 ties."""
    from hawk.bench.transform import edge_rows, fp32_bits_of
    from hawk.layouts.tt import pack_bfp8_rows

    rows = edge_rows(gdtype)
    b32 = fp32_bits_of(rows, gdtype)
    exps, vals = pack_bfp8_rows(torch.from_numpy(b32.view(np.int32)))
    want_e, want_v = _model_bfp8_rows(b32)
    assert np.array_equal(exps.numpy(), want_e)
    assert np.array_equal(vals.numpy(), want_v)
    # bf16 (NaNs aside: torch makes them canonical), the rounding the kernels' bf16 pages use.
    flat = b32.reshape(-1)
    finite = ((flat >> 23) & 0xFF) != 0xFF
    flat = flat[finite | ((flat & 0x7FFFFF) == 0)]
    hi, lo = (flat >> 16).astype(np.int64), (flat & 0xFFFF).astype(np.int64)
    want = (hi + ((lo > 0x8000) | ((lo == 0x8000) & (hi & 1) == 1))) & 0xFFFF
    got = torch.from_numpy(flat.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    assert np.array_equal(got, want)


# -- the benchmark, smoke-tested on CPU -------------------------------------------------------


def test_bench_smoke_cpu(tmp_path: Path) -> None:
    from hawk.bench import transform as bench

    recs = bench.run_benchmark(sizes_mb=[0.125], dtypes=["bf16", "bfp8_b"], impls=["torch"], device="cpu",
                               repeats=2, warmup=1, shape="tiny", verbose=False, kernels=["v1", "v2"])
    assert len(recs) == 4  # kernels only multiply Triton runs
    for r in recs:
        for k in ("size_mb", "dtype", "impl", "gbps", "copy_gbps", "ratio", "ms", "device", "blocks"):
            assert k in r
        assert r["gbps"] > 0 and r["copy_gbps"] > 0 and r["match"]
    path = tmp_path / "t.json"
    bench.main(["--sizes-mb", "0.125", "--dtypes", "bf16", "--impls", "torch", "--device", "cpu", "--shape", "tiny",
                "--repeats", "1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert isinstance(data, list) and data[0]["impl"] == "torch" and data[0]["dtype"] == "bf16"


if __name__ == "__main__":
    _run_all_interpreted()
