"""Transfer-plan invariants on random inputs, checked against an independent model of NPU memory."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import ARCHS, NpuKVLayout, get_arch
from hawk.layouts.tt import tilize, untilize
from hawk.plan.kv_plan import plan_kv_transfer
from hawk.transform import untransform
from hawk.transform.reference import transform_reference
from tests.npu_sim import ChannelMemory


@st.composite
def cases(draw):
    arch = get_arch(draw(st.sampled_from(sorted(ARCHS))), bank_capacity=8 << 20)
    layers = draw(st.integers(1, 3))
    head_dim = 32 * draw(st.integers(1, 3))
    gpu_heads = draw(st.integers(1, 4))
    gpu_start = draw(st.integers(0, 2))
    npu_start = draw(st.integers(max(0, gpu_start - 2), gpu_start + gpu_heads - 1))
    npu_heads = draw(st.integers(max(1, gpu_start - npu_start + 1), 4))
    gbs = draw(st.sampled_from([1, 8, 16, 32]))
    nbs = draw(st.sampled_from([32, 64]))
    tokens = draw(st.integers(1, 200))
    order = draw(st.sampled_from(["NHD", "HND"]))
    gdtype = draw(st.sampled_from(["bf16", "fp32", "fp16"]))
    ndtype = draw(st.sampled_from(["bf16", "bfp8_b"]))
    g_needed, n_needed = -(-tokens // gbs), -(-tokens // nbs)
    g_total = g_needed + draw(st.integers(0, 4))
    n_total = n_needed + draw(st.integers(0, 4))
    gids = draw(st.permutations(range(g_total)))[:g_needed]
    nids = draw(st.permutations(range(n_total)))[:n_needed]
    src = GpuKVLayout(layers, g_total, gbs, gpu_heads, head_dim, gdtype, order, gpu_start)
    shard = draw(st.sampled_from([1, 1, 2, 3, 8]))  # 1 = tt-metal interleaved; more = block-cyclic (sharded)
    dst = NpuKVLayout(arch, layers, n_total, npu_heads, nbs, head_dim, ndtype, npu_start, shard)
    gap = draw(st.sampled_from([0, 64, 4096]))
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    bases = [t * (per_bank + gap) for t in range(2 * layers)]
    return tokens, gids, nids, src, dst, bases, draw(st.integers(0, 2**31 - 1))


def _expected_npu_tensor(cache_layers, plan, mem_before, t):
    """What NPU tensor t must hold: the request's rows in its blocks, zero padding, the rest untouched."""
    src, dst = plan.src, plan.dst
    layer, kv = divmod(t, 2)
    out = mem_before.clone()
    for tok_block, nb in enumerate(plan.npu_block_ids):
        out[nb, [h - dst.head_start for h in plan.heads]] = 0.0
        for r in range(dst.block_size):
            tok = tok_block * dst.block_size + r
            if tok >= plan.num_tokens:
                break
            gb, slot = plan.gpu_block_ids[tok // src.block_size], tok % src.block_size
            for h in plan.heads:
                row = cache_layers[layer][kv, gb, slot, h - src.head_start] if src.order == "NHD" else cache_layers[layer][kv, gb, h - src.head_start, slot]
                out[nb, h - dst.head_start, r] = row.float()
    return out


def _apply(mem, send, requests, copies):
    for r in requests:
        mem.write(r.dst_region, r.dst_offset, send[r.src_offset : r.src_offset + r.length])
    for c in copies:
        data = mem.read(c.src_region, c.src_offset, c.length).copy()
        mem.write(c.dst_region, c.dst_offset, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plan_places_every_source_element_exactly_once(case):
    tokens, gids, nids, src, dst, bases, seed = case
    plan = plan_kv_transfer(tokens, gids, nids, src, dst, bases)
    pb = dst.page_size

    # Every tile of every tensor has its own page-sized slot in the send buffer.
    offs = np.sort(plan.send_offsets().ravel())
    assert np.array_equal(offs, np.arange(0, plan.total_bytes, pb))
    # Each channel's bytes are one contiguous extent, and tiles sit in their channel's extent.
    ext = plan.channel_extents
    assert [o for _, o, _ in ext] == list(np.cumsum([0] + [n for *_, n in ext])[:-1])
    assert sum(n for *_, n in ext) == plan.total_bytes
    so = plan.send_offsets()
    for c, o, n in ext:
        mine = so[:, plan.channel == c]
        assert mine.min() >= o and mine.max() + pb <= o + n
    # Staging: one request per channel that receives data.
    assert len(plan.staging_requests({c: 0 for c, _, _ in ext})) == len(ext) == len(set(plan.channel.tolist()))

    g = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(src.layer_shape, generator=g) * 3).to(src.torch_dtype) for _ in range(src.num_layers)]
    send = transform_reference(caches, plan).numpy()

    # The three modes land the same bytes; decoding the pages gives exactly the source rows.
    results = []
    for mode in ("direct", "staging", "single"):
        mem = ChannelMemory(dst, bases)
        junk = torch.Generator().manual_seed(seed + 1)
        for t in range(dst.num_tensors):  # old contents that must survive outside the request's pages
            mem.write_tensor(t, torch.randn(dst.tensor_shape, generator=junk))
        before = [mem.read_tensor(t) for t in range(dst.num_tensors)]
        top = mem.bank_capacity - plan.total_bytes - 64  # buffers at the top of each channel's first bank
        assert top > max(bases) + dst.tensor_buffer(0).bytes_per_bank
        stage = {c: top - top % 64 for c, _, _ in ext}
        if mode == "direct":
            _apply(mem, send, plan.direct_requests(), [])
        elif mode == "staging":
            reqs, copies = plan.staging_requests(stage), plan.staging_copies(stage)
            assert all(not c.cross_region for c in copies)
            _apply(mem, send, reqs, copies)
        else:
            _apply(mem, send, plan.single_requests(0, stage[ext[0][0]]), plan.single_copies(0, stage[ext[0][0]]))
        got = [mem.read_tensor(t) for t in range(dst.num_tensors)]
        results.append(got)
        for t in range(dst.num_tensors):
            want = _expected_npu_tensor(caches, plan, before[t], t)
            want = untilize(tilize(want, dst.dtype), want.shape, dst.dtype)  # the dtype's own rounding
            assert torch.equal(got[t], want), f"mode {mode} tensor {t}"
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)

    # Reverse direction: gathering the pages back per channel reproduces each channel's extent of the
    # send buffer, and untiling that buffer gives back the request's rows (exactly, for bf16).
    back = {c: top - top % 64 for c, _, _ in ext}
    mem.mem = {c: m.copy() for c, m in mem.mem.items()}
    runs = plan.gather_copy_runs(back)
    for sr, so, dr, do, n in runs:
        assert sr == dr  # intra-channel only
        mem.write(dr, do, mem.read(sr, so, n).copy())
    for c, o, n in ext:
        assert np.array_equal(mem.read(c, back[c], n), send[o : o + n])
    restored = [torch.zeros_like(x) for x in caches]
    untransform(torch.from_numpy(send.copy()), plan, restored)
    expect = [torch.zeros_like(x) for x in caches]
    dst_rows = expect  # the request's rows, through the NPU dtype, and nothing else
    for layer in range(src.num_layers):
        for tok in range(tokens):
            gb, slot = gids[tok // src.block_size], tok % src.block_size
            for h in plan.heads:
                idx = (slice(None), gb, slot, h - src.head_start) if src.order == "NHD" else (slice(None), gb, h - src.head_start, slot)
                row = caches[layer][idx].float()
                dst_rows[layer][idx] = untilize(tilize(row.reshape(2, 1, -1).expand(2, 32, -1).contiguous(), dst.dtype), (2, 32, row.shape[-1]), dst.dtype)[:, 0].to(src.torch_dtype)
    for a, b in zip(restored, expect):
        assert torch.equal(a, b)


def test_request_counts_for_70b_rank():
    """Llama-3.1-70B TP4 rank on a p150a: 8 staging requests, direct one per (bank, tensor) when blocks are contiguous."""
    arch = get_arch("blackhole-p150a")
    src = GpuKVLayout(80, 512, 16, 2, 128)
    dst = NpuKVLayout(arch, 80, 128, 2, 64, 128, "bf16")
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    plan = plan_kv_transfer(2048, range(128), range(32), src, dst, [t * per_bank for t in range(160)])
    assert plan.total_bytes == 2048 * 80 * 2 * 2 * 128 * 2
    assert len(plan.staging_requests({c: 0 for c in range(8)})) == 8
    assert len(plan.direct_requests()) == 8 * 160
    assert len(plan.staging_copies({c: 0 for c in range(8)})) == 8 * 160


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=0), "num_tokens"),
        (dict(gpu_block_ids=[0, 99]), "gpu_block_ids holds block id 99"),
        (dict(npu_block_ids=[5]), "npu_block_ids holds block id 5"),
        (dict(npu_block_ids=[]), "npu_block_ids has 0 blocks"),
        (dict(dst_bases=[0]), "dst_bases has 1"),
    ],
)
def test_bad_input_names_the_value(kwargs, match):
    arch = get_arch("wormhole-n150", bank_capacity=1 << 20)
    src = GpuKVLayout(1, 4, 16, 2, 64)
    dst = NpuKVLayout(arch, 1, 2, 2, 32, 64)
    args = dict(num_tokens=20, gpu_block_ids=[0, 1], npu_block_ids=[1], src=src, dst=dst, dst_bases=[0, 4096])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_kv_transfer(**args)


def test_layout_errors_name_the_value():
    arch = get_arch("blackhole-p150a")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        NpuKVLayout(arch, 1, 2, 2, 32, 48)
    with pytest.raises(ValueError, match="block_size must be a multiple"):
        NpuKVLayout(arch, 1, 2, 2, 48, 64)
    with pytest.raises(ValueError, match="'int8'"):
        NpuKVLayout(arch, 1, 2, 2, 32, 64, "int8")
    with pytest.raises(ValueError, match="order"):
        GpuKVLayout(1, 2, 16, 2, 64, order="XYZ")
    with pytest.raises(ValueError, match="no shared KV heads"):
        plan_kv_transfer(1, [0], [0], GpuKVLayout(1, 2, 16, 2, 64, head_start=0), NpuKVLayout(arch, 1, 2, 2, 32, 64, head_start=4), [0, 4096])
    with pytest.raises(ValueError, match="unknown NPU arch 'tpu'"):
        get_arch("tpu")


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 96), st.integers(0, 2**31 - 1), st.sampled_from(["NHD", "HND"]))
def test_block_plan_moves_whole_blocks(tokens, seed, order):
    """gg-*: direct requests and gather-then-scatter both put every request block where it belongs."""
    from hawk.devices.batched_copy import copy_regions
    from hawk.plan.block_plan import plan_block_copy

    rng = np.random.default_rng(seed)
    src = GpuKVLayout(2, 12, 8, 2, 32, "bf16", order)
    dst = GpuKVLayout(2, 20, 8, 2, 32, "bf16", order)
    n = -(-tokens // 8)
    sids, dids = rng.permutation(12)[:n], rng.permutation(20)[:n]
    if rng.random() < 0.5:  # often contiguous, to exercise merging
        sids, dids = np.arange(n) + rng.integers(0, 12 - n + 1), np.arange(n) + rng.integers(0, 20 - n + 1)
    caches = [torch.randn(src.layer_shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) for _ in range(2)]
    plan = plan_block_copy(tokens, sids.tolist(), src)
    direct = dst.allocate()
    for r in plan.direct_requests(dst, dids.tolist()):
        s = caches[r.src_region].reshape(-1).view(torch.uint8)
        d = direct[r.dst_region].reshape(-1).view(torch.uint8)
        d[r.dst_offset : r.dst_offset + r.length] = s[r.src_offset : r.src_offset + r.length]
    compact = torch.empty(plan.total_bytes, dtype=torch.uint8)
    copy_regions(plan.gather_copies(), {-1: compact, 0: caches[0], 1: caches[1]})
    staged = dst.allocate()
    copy_regions(plan.scatter_copies(dst, dids.tolist()), {-1: compact, 0: staged[0], 1: staged[1]})
    for layer in range(2):
        want = dst.allocate()[layer]
        want[:, dids] = caches[layer][:, sids]
        assert torch.equal(direct[layer], want) and torch.equal(staged[layer], want)
    assert len(plan.direct_requests(dst, dids.tolist())) <= 2 * 2 * n


def test_cost_model_picks_the_cheaper_landing():
    from hawk.plan.cost_model import CostModel, cost_model_for

    arch = get_arch("blackhole-p150a")
    src = GpuKVLayout(80, 512, 16, 2, 128)
    dst = NpuKVLayout(arch, 80, 128, 2, 64, 128, "bf16")
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    plan = plan_kv_transfer(2048, range(128), range(32), src, dst, [t * per_bank for t in range(160)])
    # Costly requests (RDMA NIC, NVLink engines): 8 requests + an on-device copy beat 1280 requests.
    assert cost_model_for("nixl", "cuda").choose(plan) == "staging"
    # Free requests and a slow device copy: write straight into the pages.
    assert CostModel(0.0, 10e9, 1e9).choose(plan) == "direct"
    m = CostModel(1e-5, 1e10, 1e11)
    assert m.staging_time(plan) == pytest.approx(8e-5 + plan.total_bytes / 1e10 + 2 * plan.total_bytes / 1e11)
    with pytest.raises(ValueError, match="no cost figures"):
        cost_model_for("carrier-pigeon", "cpu")


def test_same_device_figures_stage_small_requests_and_place_large_ones_directly():
    """Copies inside one GPU: a small request scattered over many runs is staged (the intra-channel
    copy costs less than submitting a thousand runs), a large one goes straight into the pages (a
    second pass over its bytes costs more); the copy step's fixed cost counts only where something
    is copied."""
    from hawk.plan.cost_model import SAME_DEVICE, CostModel

    arch = get_arch("blackhole-p150a")
    src = GpuKVLayout(32, 4096, 16, 8, 128)
    dst = NpuKVLayout(arch, 32, 1024, 8, 64, 128, "bf16")
    per_bank = dst.tensor_buffer(0).bytes_per_bank
    bases = [t * per_bank for t in range(64)]
    small = plan_kv_transfer(80, range(6), [7, 3], src, dst, bases)  # 10 MiB of 8B-shaped KV, blocks apart
    large = plan_kv_transfer(10240, range(640), range(160), src, dst, bases)  # 1280 MiB
    assert len(small.direct_runs()) >= 1000
    assert SAME_DEVICE.choose(small) == "staging" and SAME_DEVICE.choose(large) == "direct"
    m = CostModel(1e-6, 1e12, 2e12, copy_overhead_s=1e-4)
    assert m.time(3, 1000, 0) == pytest.approx(3e-6 + 1e-9)
    assert m.time(3, 1000, 1000) == pytest.approx(3e-6 + 1e-9 + 1e-9 + 1e-4)


def test_sharded_placement_needs_fewer_direct_requests():
    """Describing another page map is all it takes: block-cyclic shards of 8 pages cut direct requests 8x."""
    arch = get_arch("blackhole-p150a")
    src = GpuKVLayout(4, 64, 16, 2, 128)
    for shard in (1, 8):
        dst = NpuKVLayout(arch, 4, 16, 2, 64, 128, "bf16", shard_pages=shard)
        per_bank = dst.tensor_buffer(0).bytes_per_bank
        plan = plan_kv_transfer(1024, range(64), range(16), src, dst, [t * per_bank for t in range(8)])
        # The whole cache, tensors back to back: each bank is one run across all 8 tensors.
        assert len(plan.direct_requests()) == 8
        assert len(plan.staging_requests({c: 0 for c in range(8)})) == 8
    scattered = [0, 9, 3, 12]
    counts = {}
    for shard in (1, 8):
        dst = NpuKVLayout(arch, 4, 16, 2, 64, 128, "bf16", shard_pages=shard)
        per_bank = dst.tensor_buffer(0).bytes_per_bank
        plan = plan_kv_transfer(256, range(16), scattered, src, dst, [t * per_bank for t in range(8)])
        counts[shard] = len(plan.direct_requests())
    assert counts[8] * 4 <= counts[1]  # scattered blocks: whole shards stay together
