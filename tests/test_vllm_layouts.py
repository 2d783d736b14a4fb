"""vLLM 0.32's KV layouts as data: offsets, the registered tensors, the transform and block copies read them.

The K/V written into a vLLM-laid-out cache here is written the way vLLM's kernels address it (GPU
backends: ``cache.transpose(1, 2).split(head_dim, -1)``; CPU_ATTN: the ISA formulas worked out by
hand), never through the layout under test, and compared against HAWK's own NHD cache holding the
same values.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.connector.messages import ProtocolError, layout_from_wire, layout_to_wire
from hawk.layouts import vllm as V
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.layouts.paged import LayoutError, NotStridedError, PagedKVLayout
from hawk.plan.block_plan import plan_block_copy
from hawk.plan.kv_plan import plan_kv_transfer
from hawk.transform.reference import transform_reference, untransform_reference

FIXTURE = Path(__file__).parent / "data" / "vllm_kv_layouts.json"
GPU_ORDERS = tuple(V.STRIDE_ORDERS)
CPU_ISAS = ("vec", "vec16", "amx")


# -- hand-written offsets: what vLLM's kernels address, written out ------------------------------


def cpu_hand_offset(isa: str, kv: int, n: int, d: int, block_size: int, head_dim: int) -> int:
    """Offset inside one (block, head) region of CPU_ATTN's cache, from the formulas of issue 30."""
    N, D = block_size, head_dim
    if isa in ("vec", "vec16"):
        return d * N + n if kv == 0 else N * D + n * D + d
    if kv == 0:
        return (n // 16) * 16 * D + (d // 2) * 32 + (n % 16) * 2 + d % 2
    return N * D + (d // 16) * 16 * N + (n // 2) * 32 + (d % 16) * 2 + n % 2


def fill_vllm_gpu(caches: list[torch.Tensor], vals: torch.Tensor) -> None:
    """``vals[l, kv, b, n, h, d]`` into vLLM GPU-backend caches, as the backends split them."""
    d = vals.shape[-1]
    for layer, c in enumerate(caches):
        k, v = c.transpose(1, 2).split(d, dim=-1)  # [B, N, H, D] each, views of the cache
        k.copy_(vals[layer, 0])
        v.copy_(vals[layer, 1])


def fill_vllm_cpu(caches: list[torch.Tensor], vals: torch.Tensor, isa: str) -> None:
    """``vals`` into CPU_ATTN caches by the hand formulas: each (block, head) region flat."""
    _, _, nb, n, h, d = vals.shape
    idx = torch.tensor([[[cpu_hand_offset(isa, kv, i, j, n, d) for j in range(d)] for i in range(n)] for kv in range(2)])
    for layer, c in enumerate(caches):
        region = c.reshape(nb, h, -1)  # LBHNC: a (block, head) region is N * 2D contiguous elements
        for kv in range(2):
            region[:, :, idx[kv].reshape(-1)] = vals[layer, kv].permute(0, 2, 1, 3).reshape(nb, h, -1)


def fill_nhd(layout: GpuKVLayout, vals: torch.Tensor) -> list[torch.Tensor]:
    caches = layout.allocate()
    for layer, c in enumerate(caches):
        c.copy_(vals[layer])
    return caches


def random_vals(layers: int, blocks: int, n: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, 2, blocks, n, h, d, generator=g) * 3).to(dtype)


def vllm_cpu_caches(layout: PagedKVLayout) -> list[torch.Tensor]:
    """One buffer, layer views ``B * H * N * 2D`` apart, as CPU_ATTN's registered tensors are."""
    per = layout.num_blocks * layout.tensor_strides[0]
    buf = torch.zeros(layout.num_layers * per, dtype=layout.torch_dtype)
    return [buf.as_strided(layout.tensor_shape, layout.tensor_strides, i * per) for i in range(layout.num_layers)]


def registered_vec_cache(L: int, B: int, N: int, H: int, D: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], PagedKVLayout]:
    """Random K/V written into CPU_ATTN (vec) caches by the hand formulas, and the layout
    ``from_registered`` reads from those views."""
    vals = random_vals(L, B, N, H, D, torch.bfloat16, seed=seed)
    caches = vllm_cpu_caches(V.cpu_layout("vec", L, B, N, H, D))
    fill_vllm_cpu(caches, vals, "vec")
    return vals, caches, V.from_registered({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)}, "CPU_ATTN", "vec", D)


def layouts_of(layers: int, blocks: int, n: int, h: int, d: int, dtype: str = "bf16") -> list[tuple[str, PagedKVLayout, list[torch.Tensor]]]:
    """Every vLLM form HAWK describes at these dims (CPU forms where the ISA allows them), with caches."""
    out = []
    for o in GPU_ORDERS:
        lay = V.gpu_layout("FLASH_ATTN", o, layers, blocks, n, h, d, dtype)
        out.append((o, lay, V.allocate(lay, o)))
    for isa in CPU_ISAS:
        if isa == "amx" and (n % 16 or d % 16):
            continue
        lay = V.cpu_layout(isa, layers, blocks, n, h, d, dtype)
        out.append((isa, lay, vllm_cpu_caches(lay)))
    return out


# -- offsets ------------------------------------------------------------------------------------


def all_offsets(lay: PagedKVLayout, caches: list[torch.Tensor]) -> np.ndarray:
    """Every element's offset from the first layer's first element, all layers."""
    kv, b, n, h, d = np.meshgrid(*(np.arange(x) for x in (2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)), indexing="ij")
    per = lay.element_offsets(kv, b, n, h, d).reshape(-1)
    base = np.array([c.storage_offset() - caches[0].storage_offset() for c in caches])
    return (base[:, None] + per[None, :]).reshape(-1)


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 3), blocks=st.integers(1, 4), n=st.sampled_from([16, 32]), h=st.integers(1, 3), d=st.sampled_from([16, 32, 48]))
def test_every_layout_is_a_bijection_onto_its_buffer(layers: int, blocks: int, n: int, h: int, d: int) -> None:
    """Every element of every layer lands on its own offset, and together they fill the buffer exactly."""
    for name, lay, caches in layouts_of(layers, blocks, n, h, d):
        offs = all_offsets(lay, caches)
        total = layers * blocks * n * h * 2 * d
        assert np.array_equal(np.sort(offs), np.arange(total)), name
    for order in ("NHD", "HND"):
        g = GpuKVLayout(layers, blocks, n, h, d, order=order).paged()
        assert np.array_equal(np.sort(all_offsets(g, g.allocate()[:1])), np.arange(2 * blocks * n * h * d)), order


def _amx_writable() -> bool:
    from hawk.engine import vllm_cpu_kernel, vllm_cpu_ops

    return torch.cpu._is_amx_tile_supported() and vllm_cpu_ops.loaded() and vllm_cpu_kernel.amx_ready()


@pytest.mark.skipif(not _amx_writable(), reason="vLLM's 'amx' cache writer needs vllm-cpu and a CPU with AMX tiles")
@pytest.mark.parametrize("nb,n,h,d", [(3, 32, 2, 64), (2, 64, 3, 32), (2, 32, 1, 128)])
def test_amx_is_where_vllms_own_op_writes_each_element(nb: int, n: int, h: int, d: int) -> None:
    """The "amx" form as HAWK describes it, against vLLM's ``cpu_attn_reshape_and_cache`` writing its
    CPU cache (``[blocks, H, 2 * N, D]``, K then V in each (block, head)) on a CPU with AMX tiles."""
    flat = torch.zeros(nb * h * 2 * n * d, dtype=torch.bfloat16)
    k_cache, v_cache = flat.view(nb, h, 2 * n, d).chunk(2, dim=2)
    vals = torch.randn(2, nb * n, h, d).bfloat16()
    torch.ops._C.cpu_attn_reshape_and_cache(vals[0], vals[1], k_cache, v_cache, torch.arange(nb * n), "amx", 1.0, 1.0, "auto")
    kv, b, s, hh, dd = np.meshgrid(*(np.arange(x) for x in (2, nb, n, h, d)), indexing="ij")
    offsets = V.cpu_layout("amx", 1, nb, n, h, d).element_offsets(kv, b, s, hh, dd)
    assert torch.equal(flat[torch.from_numpy(offsets.astype(np.int64))], vals[kv, b * n + s, hh, dd])


def test_cpu_forms_match_the_hand_formulas() -> None:
    """vec, vec16 and amx: every (kv, slot, dim) of a region, plus the block and head strides."""
    n, d, h, b = 32, 64, 3, 2
    for isa in CPU_ISAS:
        lay = V.cpu_layout(isa, 1, b, n, h, d)
        for kv, blk, slot, head, dim in itertools.product(range(2), range(b), range(n), range(h), range(d)):
            want = blk * h * n * 2 * d + head * n * 2 * d + cpu_hand_offset(isa, kv, slot, dim, n, d)
            assert lay.offset(kv, blk, slot, head, dim) == want, (isa, kv, blk, slot, head, dim)
    with pytest.raises(NotStridedError):
        V.cpu_layout("amx", 1, 2, 32, 1, 32).strides()
    with pytest.raises(V.UnsupportedVllmLayout, match="neon"):
        V.cpu_layout("neon", 1, 2, 32, 1, 32)
    with pytest.raises(LayoutError, match="multiples of 16"):
        V.cpu_layout("amx", 1, 2, 40, 1, 32)


def test_hawk_orders_in_hierarchical_form_read_the_same_offsets() -> None:
    for order in ("NHD", "HND"):
        g = GpuKVLayout(2, 3, 16, 2, 32, order=order)
        p = g.paged()
        for c in itertools.product(range(2), range(3), range(0, 16, 5), range(2), range(0, 32, 7)):
            assert p.offset(*c) == g.offset(*c)
        assert p.strides() == g.strides()


def test_gpu_layouts_match_vllms_own_views() -> None:
    """The committed record of vLLM 0.32's create_kv_cache_views: shape, strides, each layer's offset."""
    rec = json.loads(FIXTURE.read_text())
    assert rec["vllm"].startswith("0.32")
    assert rec["backends"]["FLASH_ATTN"]["default"] == V.DEFAULT_GPU_LAYOUT == rec["backends"]["TRITON_ATTN"]["default"]
    for case in rec["cases"]:
        lay = V.gpu_layout("FLASH_ATTN", case["kv_layout"], case["layers"], case["blocks"], case["block_size"], case["heads"], case["head_dim"])
        caches = V.allocate(lay, case["kv_layout"])
        got = [{"shape": list(c.shape), "stride": list(c.stride()), "offset": c.storage_offset(), "dtype": "bfloat16"} for c in caches]
        assert got == case["views"], case["kv_layout"]
        buf = torch.zeros(case["layers"] * case["blocks"] * case["heads"] * case["block_size"] * 2 * case["head_dim"], dtype=torch.bfloat16)
        built = [buf.as_strided(v["shape"], v["stride"], v["offset"]) for v in case["views"]]
        assert V.from_registered({str(i): c for i, c in enumerate(built)}, "FLASH_ATTN", None, case["head_dim"], kv_layout=case["kv_layout"]) == lay


def test_fixture_is_what_installed_vllm_produces() -> None:
    pytest.importorskip("vllm")
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_kv_layouts", Path(__file__).parents[1] / "scripts" / "vllm_kv_layouts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    assert mod.generate()["cases"] == json.loads(FIXTURE.read_text())["cases"]


def test_from_registered_reads_vllm_cpu_registration() -> None:
    """The tensors vLLM 0.32's CPU backend registered for SmolLM2 (30 layers, 67 blocks of 128): the
    same shapes and strides at a few layers, one buffer, layer k at k * 3293184 elements."""
    buf = torch.zeros(3 * 3293184, dtype=torch.bfloat16)
    reg = {f"model.layers.{i}.self_attn.attn": buf.as_strided((67, 3, 128, 128), (49152, 16384, 128, 1), i * 3293184) for i in range(3)}
    lay = V.from_registered(reg, "CPU_ATTN", "vec", 64)
    assert lay == V.cpu_layout("vec", 3, 67, 128, 3, 64)
    assert lay.offset(1, 2, 5, 1, 7) == 2 * 49152 + 16384 + 128 * 64 + 5 * 64 + 7
    with pytest.raises(LayoutError, match="isa"):
        V.from_registered(reg, "CPU_ATTN", None, 64)
    with pytest.raises(V.UnsupportedVllmLayout):
        V.from_registered(reg, "CPU_ATTN", "vsx", 64)
    with pytest.raises(LayoutError, match="2\\*head_dim"):
        V.from_registered(reg, "CPU_ATTN", "vec", 128)
    with pytest.raises(LayoutError, match="bf16|fp16"):
        V.from_registered(reg, "CPU_ATTN", "vec", 64, dtype="fp16")
    odd = dict(reg)
    odd["model.layers.1.self_attn.attn"] = buf.as_strided((67, 3, 128, 128), (49152, 128, 384, 1), 3293184)
    with pytest.raises(LayoutError, match="layer"):
        V.from_registered(odd, "CPU_ATTN", "vec", 64)


def test_from_registered_checks_the_gpu_order() -> None:
    lay = V.gpu_layout("FLASH_ATTN", "LBNHC", 2, 5, 16, 2, 64)
    caches = {str(i): c for i, c in enumerate(V.allocate(lay, "LBNHC"))}
    assert V.from_registered(caches, "FLASH_ATTN", None, 64) == lay
    assert V.from_registered(caches, "FLASH_ATTN", None, 64).name == "vllm FLASH_ATTN LBNHC"
    with pytest.raises(LayoutError, match="LBHNC"):
        V.from_registered(caches, "FLASH_ATTN", None, 64, kv_layout="LBHNC")
    with pytest.raises(V.UnsupportedVllmLayout, match="backend"):
        V.from_registered(caches, "XFORMERS", None, 64)
    lhb = V.gpu_layout("FLASH_ATTN", "LHBNC", 2, 5, 16, 2, 64)
    with pytest.raises(V.UnsupportedVllmLayout, match="FLASHINFER"):
        V.from_registered({str(i): c for i, c in enumerate(V.allocate(lhb, "LHBNC"))}, "FLASHINFER", None, 64, kv_layout="LHBNC")


# -- the transform reads them ------------------------------------------------------------------


def _plans(src_layouts: list[PagedKVLayout | GpuKVLayout], tokens: int, ndtype: str, seed: int):
    rng = np.random.default_rng(seed)
    s0 = src_layouts[0]
    nbs = 32
    dst = NpuKVLayout(get_arch("blackhole-p150a", bank_capacity=4 << 20), s0.num_layers, -(-tokens // nbs) + 1, s0.num_kv_heads, nbs, s0.head_dim, ndtype)
    gids = rng.permutation(s0.num_blocks)[: -(-tokens // s0.block_size)]
    nids = rng.permutation(dst.max_num_blocks)[: -(-tokens // nbs)]
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    bases = [t * (per_bank + 4096) for t in range(dst.num_tensors)]
    return [plan_kv_transfer(tokens, gids, nids, s, dst, bases) for s in src_layouts]


@pytest.mark.parametrize("ndtype", ["bf16", "bfp8_b"])
def test_transform_of_vllm_caches_equals_transform_of_nhd(ndtype: str) -> None:
    """Every vLLM form: the same K/V give the same tile bytes as HAWK's NHD cache, and the tiles
    untransform back into a zeroed cache of that form exactly (the request's rows)."""
    L, B, N, H, D, tokens = 2, 6, 32, 2, 64, 150
    vals = random_vals(L, B, N, H, D, torch.bfloat16, seed=7)
    nhd = GpuKVLayout(L, B, N, H, D)
    forms = layouts_of(L, B, N, H, D)
    plans = _plans([nhd] + [lay for _, lay, _ in forms], tokens, ndtype, seed=1)
    want = transform_reference(fill_nhd(nhd, vals), plans[0])
    for (name, lay, caches), plan in zip(forms, plans[1:]):
        if name in CPU_ISAS:
            fill_vllm_cpu(caches, vals, name)
        else:
            fill_vllm_gpu(caches, vals)
        got = transform_reference(caches, plan)
        assert torch.equal(got, want), name
        back = V.allocate(lay, name) if name in GPU_ORDERS else vllm_cpu_caches(lay)
        untransform_reference(got, plan, back)
        if ndtype == "bf16":  # bfloat8_b is lossy: the round trip is checked on bf16 tiles
            assert torch.equal(transform_reference(back, plan), want), name


def test_transform_refuses_caches_that_are_not_the_layout() -> None:
    lay = V.gpu_layout("FLASH_ATTN", "LBNHC", 1, 4, 16, 1, 32)
    (plan,) = _plans([lay], 20, "bf16", seed=0)
    with pytest.raises(LayoutError, match="strides"):
        transform_reference(V.allocate(V.gpu_layout("FLASH_ATTN", "LBHNC", 1, 4, 16, 1, 32), "LBHNC"), plan)


# -- whole blocks: compact staging and in-place copies ---------------------------------------------


def _form(name: str, L: int, N: int, H: int, D: int):
    """(blocks -> layout, layout -> caches) of a vLLM form or of HAWK's NHD / HND."""
    if name in GPU_ORDERS:
        return (lambda b: V.gpu_layout("FLASH_ATTN", name, L, b, N, H, D)), (lambda lay: V.allocate(lay, name))
    if name in CPU_ISAS:
        return (lambda b: V.cpu_layout(name, L, b, N, H, D)), vllm_cpu_caches
    return (lambda b: GpuKVLayout(L, b, N, H, D, order=name)), (lambda lay: lay.allocate())


@pytest.mark.parametrize("name", GPU_ORDERS + CPU_ISAS + ("NHD", "HND"))
def test_block_copies_move_exactly_the_requests_blocks(name: str) -> None:
    """Gather (compact) then scatter, and direct runs, between two caches of one form: the
    destination blocks equal the source blocks, and nothing else changes."""
    L, B, N, H, D = 2, 6, 32, 2, 32
    make, alloc = _form(name, L, N, H, D)
    src, dst = make(B), make(B + 2)
    scaches = alloc(src)
    for c in scaches:
        c.copy_(torch.randn(c.shape))
    sids, dids = [4, 1, 2], [0, 6, 7]
    plan = plan_block_copy(70, sids, src)
    # gather + scatter through a compact buffer (the host-staged path)
    from hawk.connector.formats import gather_compact
    from hawk.devices.batched_copy import copy_regions

    compact = gather_compact(scaches, plan)
    assert compact.numel() == plan.total_bytes == L * 3 * 2 * N * H * D * 2
    via_copies = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    copy_regions(plan.gather_copies(), {-1: via_copies, **{i: src.layer_bytes_view(c) for i, c in enumerate(scaches)}})
    assert torch.equal(compact, via_copies)
    dcaches = alloc(dst)
    copy_regions(plan.scatter_copies(dst, dids), {-1: compact, **{i: dst.layer_bytes_view(c) for i, c in enumerate(dcaches)}})
    direct = alloc(dst)
    for sr, so, dr, do, n in plan.direct_runs(dst, dids):
        dst.layer_bytes_view(direct[dr])[do : do + n].copy_(src.layer_bytes_view(scaches[sr])[so : so + n])
    for out in (dcaches, direct):
        for layer, kv, (s, d) in itertools.product(range(L), range(2), zip(sids, dids)):
            for slot, head, dim in itertools.product(range(0, N, 7), range(H), (0, 5, D - 1)):
                assert src.layer_flat(scaches[layer])[src.offset(kv, s, slot, head, dim)] == dst.layer_flat(out[layer])[dst.offset(kv, d, slot, head, dim)]
        untouched = [b for b in range(B + 2) if b not in dids]
        assert all(float(dst.layer_flat(out[0])[dst.offset(0, b, 0, 0, 0)]) == 0 for b in untouched)
    # compact form: the gathered bytes read as the compact layout give the same elements
    comp = src.compact(3).layer_views(compact)
    clay = src.compact(3)
    for layer, kv, j in itertools.product(range(L), range(2), range(3)):
        assert clay.layer_flat(comp[layer])[clay.offset(kv, j, 3, 1, 9)] == src.layer_flat(scaches[layer])[src.offset(kv, sids[j], 3, 1, 9)]


def test_layer_major_blocks_copy_as_one_span_per_layer_and_block_run() -> None:
    """LBHNC (CPU_ATTN's, and vLLM's layer-major GPU orders): a block's K and V of all heads are one
    region, so in-place copies are per (layer, run of blocks), not per (layer, kv, block)."""
    for lay in (V.cpu_layout("vec", 3, 8, 32, 2, 32), V.gpu_layout("FLASH_ATTN", "LBHNC", 3, 8, 16, 2, 32)):
        plan = plan_block_copy(4 * lay.block_size, [2, 3, 6, 0], lay)
        runs = plan.direct_runs(lay, [5, 6, 1, 3])
        assert len(runs) == 3 * 3  # per layer: [2,3]->[5,6] one span, 6->1, 0->3
        block = lay.block_size * 2 * (2 * 32) * 2  # heads x (K | V) x bf16 bytes
        assert sorted(runs.length.tolist()) == [block] * 6 + [2 * block] * 3
    with pytest.raises(ValueError, match="matching layouts"):
        plan_block_copy(20, [1], V.cpu_layout("vec", 1, 4, 32, 2, 32)).direct_runs(V.gpu_layout("FLASH_ATTN", "LBHNC", 1, 4, 32, 2, 32), [0])


# -- the wire ------------------------------------------------------------------------------------


def test_paged_layouts_cross_the_wire() -> None:
    for lay in (V.cpu_layout("amx", 2, 4, 32, 2, 32, head_start=2), V.gpu_layout("FLASHINFER", "BLHNC", 3, 5, 16, 2, 64)):
        w = msgpack.unpackb(msgpack.packb(layout_to_wire(lay)))
        back = layout_from_wire(w)
        assert back == lay and back.name == lay.name
    good = msgpack.unpackb(msgpack.packb(layout_to_wire(V.cpu_layout("vec", 1, 2, 32, 1, 32))))
    bad = [
        {**good, "version": 2},
        {**good, "modes": good["modes"][:1]},
        {**good, "modes": [[[[32, 1]], [[32, 1]], [[1, 0]], [[31, 32]]]] * 2},  # a dim mode of 31 for head_dim 32
        {**good, "kv_base": [0, -1]},
        {**good, "kv_base": [0, 10**9]},  # past the tensor
        {**good, "tensor_shape": [2, 1, 32, "64"]},
        {**good, "num_blocks": True},
        {k: v for k, v in good.items() if k != "modes"},
    ]
    for d in bad:
        with pytest.raises(ProtocolError):
            layout_from_wire(d)


# -- the send formats take the per-layer views vLLM registers ---------------------------------------


def test_send_formats_read_vllm_registered_views() -> None:
    """NpuTiles stages the NHD cache's tile bytes from CPU_ATTN caches; CompactBlocks stages the
    request's blocks; InPlace lands them into another vLLM cache through its registered regions."""
    from hawk.connector.formats import CompactBlocks, InPlace, NpuTiles, gather_compact
    from hawk.memory.buffers import StagingBuffer

    L, B, N, H, D, tokens = 2, 5, 32, 2, 64, 90
    vals, caches, reg = registered_vec_cache(L, B, N, H, D, seed=3)
    nhd = GpuKVLayout(L, B, N, H, D)
    ref_plan, plan = _plans([nhd, reg], tokens, "bfp8_b", seed=5)
    tiles = NpuTiles(caches, reg, StagingBuffer(1 << 20), impl="torch")
    peer = {"layout": plan.dst, "bases": plan.dst_bases}
    p = tiles.plan(tokens, plan.gpu_block_ids, peer, plan.npu_block_ids)
    staged = tiles.stage(p, "r1", 5.0)
    got = tiles.staging.tensor[staged.offset : staged.offset + p.total_bytes]
    assert torch.equal(got, transform_reference(fill_nhd(nhd, vals), ref_plan))

    compact = CompactBlocks(caches, reg, StagingBuffer(1 << 20))
    cp = compact.plan(tokens, [3, 0, 4], {}, [])
    st = compact.stage(cp, "r2", 5.0)
    assert torch.equal(compact.staging.tensor[st.offset : st.offset + cp.total_bytes], gather_compact(caches, cp))

    dst = V.cpu_layout("vec", L, B + 3, N, H, D)
    dcaches = vllm_cpu_caches(dst)
    sender, receiver = InPlace(caches, reg), InPlace(dcaches, dst)
    assert [r.numel() for r in sender.regions().values()] == [reg.layer_bytes] * L
    ip = sender.plan(tokens, [3, 0, 4], {"layout": dst}, [7, 1, 2])
    assert sender.land(ip, list(receiver.regions().values())) is not None
    n, h, d = torch.meshgrid(torch.arange(N), torch.arange(H), torch.arange(D), indexing="ij")
    for layer, kv in itertools.product(range(L), range(2)):
        for sb, db in zip([3, 0, 4], [7, 1, 2]):
            landed = dst.layer_flat(dcaches[layer])[dst.element_offsets(kv, db, n, h, d)]
            assert torch.equal(landed, vals[layer, kv, sb])  # [N, H, D]: what was written by the hand formulas


# -- Algorithm 1 end to end, vLLM's registered views on the prefill side (and on a GPU decode) ---------


@pytest.mark.parametrize("config", ["gg-direct", "gg-host", "gn-hawk", "gn-host", "gn-direct-single"])
@pytest.mark.parametrize("post", ["pull", "push"])
@pytest.mark.parametrize("direct", ["1", "0"])
def test_every_gpu_prefill_configuration_lands_kv_from_vllm_views(config: str, post: str, direct: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU_ATTN's cache (LBHNC, vec order) on the prefill side, written by the hand formulas; a GPU decode
    holds the same vLLM form. Whatever the configuration, with the sender landing a pull itself or not
    (``HAWK_DIRECT_WRITE``), the decode ends up with exactly the request's K/V."""
    monkeypatch.setenv("HAWK_DIRECT_WRITE", direct)
    from hawk.connector.configs import GpuSide, NpuSide, get_config, make_receiver, make_sender
    from hawk.devices.emulated import open_npu
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory
    from hawk.plan.cost_model import cost_model_for
    from hawk.transport.local import LocalTransport

    L, B, N, H, D, NBS = 2, 6, 32, 2, 64, 64
    vals, caches, src = registered_vec_cache(L, B, N, H, D, seed=11)
    tp, td = LocalTransport(), LocalTransport()
    freed: list[str] = []
    sender = make_sender(config, tp, caches, src, 1 << 20, ttl_s=30.0, reap_every_s=0.02)
    on_npu = get_config(config).decode_on == "npu"
    if on_npu:
        npu = open_npu("npu-emu:cpu", "blackhole-p150a", bank_capacity=4 << 20)
        kv = NpuKVCacheMemory(npu, NpuKVLayout(npu.arch, L, 8, H, NBS, D))
        side = NpuSide(npu, kv, 1 << 20, cost_model_for("local", "cpu"))
    else:
        dst = V.cpu_layout("vec", L, B + 2, N, H, D)
        dcaches = vllm_cpu_caches(dst)
        side = GpuSide(dcaches, dst, 1 << 20)
    receiver = make_receiver(config, td, side, post=post, timeout_s=5.0)
    try:
        for i, (tokens, gblocks) in enumerate([(100, [5, 1, 3, 0]), (1, [2]), (64, [4, 0])]):
            sender.add(f"r{i}", tokens, gblocks, lambda rid=f"r{i}": freed.append(rid))
            size = NBS if on_npu else N
            dblocks = list(range(1, 1 + -(-tokens // size)))
            res = receiver.pull(sender.address, f"r{i}", dblocks)
            assert res.num_tokens == tokens
            want = torch.stack([vals[:, :, gblocks[t // N], t % N] for t in range(tokens)], dim=2)  # [L, 2, tokens, H, D]
            for layer, k in itertools.product(range(L), range(2)):
                if on_npu:
                    got = kv.read_blocks(2 * layer + k, torch.tensor(dblocks)).permute(0, 2, 1, 3).reshape(-1, H, D)[:tokens]
                else:
                    t = torch.arange(tokens)
                    blk = torch.tensor(dblocks)[t // N][:, None, None]
                    hh, dd = torch.arange(H)[None, :, None], torch.arange(D)[None, None, :]
                    got = dst.layer_flat(dcaches[layer])[dst.element_offsets(k, blk, (t % N)[:, None, None], hh, dd)]
                assert torch.equal(got.float(), want[layer, k].float()), (config, i, layer, k)
        deadline = time.monotonic() + 3
        while sorted(freed) != ["r0", "r1", "r2"] and time.monotonic() < deadline:
            sender.reap()
            time.sleep(0.02)
        assert sorted(freed) == ["r0", "r1", "r2"]  # every prefill's blocks went back exactly once
    finally:
        receiver.close()
        sender.close()
        td.close()
        tp.close()
