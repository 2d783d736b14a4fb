"""Cached plans are the uncached plans: same arrays, same requests and copies, same transformed bytes."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hawk.plan.kv_plan import plan_kv_transfer
from hawk.plan.plan_cache import LRU, PlanCache
from hawk.transform.reference import transform_reference
from tests.test_plan import cases

ARRAYS = ("gpu_block_ids", "npu_block_ids", "page", "bank", "channel", "addr", "rank", "token_start", "gpu_head", "col_tile", "bank_pages", "bank_offset")


def _runs(r):
    return [np.asarray(a).tolist() for a in (r.src_region, r.src_offset, r.dst_region, r.dst_offset, r.length)]


def _same(a, b, caches):
    for name in ARRAYS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.channel_extents == b.channel_extents and a.dst_bases == b.dst_bases and a.heads == b.heads
    assert _runs(a.direct_runs()) == _runs(b.direct_runs())
    addr = {c: 1 << 20 | c * 4096 for c, _, _ in a.channel_extents}
    assert _runs(a.staging_copy_runs(addr)) == _runs(b.staging_copy_runs(addr))
    assert a.staging_requests(addr) == b.staging_requests(addr)
    assert torch.equal(transform_reference(caches, a), transform_reference(caches, b))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_cached_plans_transfer_the_same_bytes(case, data):
    tokens, gids, nids, src, dst, bases, seed = case
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(src.layer_shape, generator=g).to(src.torch_dtype) for _ in range(src.num_layers)]
    cache = PlanCache(grids=2, placements=2)  # small: evictions happen inside the test
    # The same shape with other block ids, then the first ids again (a hit after other entries).
    other_n = list(data.draw(st.permutations(range(dst.max_num_blocks))))[: len(nids)]
    other_g = list(data.draw(st.permutations(range(src.num_blocks))))[: len(gids)]
    for gi, ni in ((gids, nids), (other_g, other_n), (gids, other_n), (gids, nids)):
        cached = cache.kv_plan(tokens, gi, ni, src, dst, bases)
        _same(cached, plan_kv_transfer(tokens, gi, ni, src, dst, bases), caches)
    assert cache.grids.hits >= 3 and cache.placements.hits >= 1


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_warming_before_d2_changes_nothing(case):
    tokens, gids, nids, src, dst, bases, seed = case
    cache = PlanCache()
    cache.warm(tokens, nids, src, dst, bases)  # the decode side, before it knows the GPU block ids
    assert cache.placements.misses == 1
    plan = cache.kv_plan(tokens, gids, nids, src, dst, bases)
    assert cache.placements.hits == 1
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(src.layer_shape, generator=g).to(src.torch_dtype) for _ in range(src.num_layers)]
    _same(plan, plan_kv_transfer(tokens, gids, nids, src, dst, bases), caches)


def test_cached_plans_still_refuse_bad_requests():
    from tests.test_plan import GpuKVLayout, NpuKVLayout, get_arch

    src = GpuKVLayout(2, 8, 16, 2, 64, "bf16")
    dst = NpuKVLayout(get_arch("blackhole-p150a", bank_capacity=8 << 20), 2, 4, 2, 64, 64, "bf16")
    bases = [t * (1 << 20) for t in range(4)]
    cache = PlanCache()
    cache.kv_plan(100, range(7), [0, 1], src, dst, bases)
    for bad in ([0, 0], [0, 9], [3]):
        try:
            cache.kv_plan(100, range(7), bad, src, dst, bases)
        except ValueError:
            continue
        raise AssertionError(f"npu ids {bad} accepted")
    cache.warm(100, [0, 0], src, dst, bases)  # a bad hint is ignored, never cached
    assert len(cache.placements) == 1


def test_lru_evicts_the_least_recently_used():
    lru: LRU[int] = LRU(2)
    assert lru.get_or_build("a", lambda: 1) == 1
    lru.get_or_build("b", lambda: 2)
    lru.get_or_build("a", lambda: 0)  # hit: "a" is now the newest
    lru.get_or_build("c", lambda: 3)  # evicts "b"
    assert lru.get_or_build("b", lambda: 20) == 20 and lru.get_or_build("a", lambda: 0) in (0, 1)
    assert len(lru) == 2


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_repeated_npu_ids_are_refused_cached_or_not(case):
    """The cache checks the NPU ids' uniqueness only when it places ids it has not placed before; the
    ids a hit stands for were checked then, so a repeat is refused exactly as without the cache."""
    import pytest

    tokens, gids, nids, src, dst, bases, _ = case
    if len(nids) < 2:
        return
    bad = list(nids)
    bad[-1] = bad[0]
    cache = PlanCache()
    cache.kv_plan(tokens, gids, nids, src, dst, bases)  # the good ids, placed
    for _ in range(2):  # a miss each time: a refused placement is not kept
        with pytest.raises(ValueError, match="repeats a block"):
            cache.kv_plan(tokens, gids, bad, src, dst, bases)
    with pytest.raises(ValueError, match="repeats a block"):
        plan_kv_transfer(tokens, gids, bad, src, dst, bases)
    assert cache.placements.hits == 0 and len(cache.placements) == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.data())
def test_the_senders_whole_plans_are_never_reused_for_another_request(case, data):
    """gn-hawk's sender keeps whole plans (``NpuTiles.plan``): a repeat is the very plan object, and
    other block ids (either side), another token count, another receiver (an equal layout object of its
    own, or other bases) each get their own plan, equal to an uncached one; bad ids are refused every time."""
    import dataclasses

    import pytest

    from hawk.connector.formats import NpuTiles
    from hawk.memory.buffers import StagingBuffer

    tokens, gids, nids, src, dst, bases, seed = case
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(src.layer_shape, generator=g).to(src.torch_dtype) for _ in range(src.num_layers)]
    fmt = NpuTiles(caches, src, StagingBuffer(1 << 16, "cpu"), impl="torch")
    peer = {"layout": dst, "bases": tuple(bases)}
    twin = {"layout": dataclasses.replace(dst), "bases": tuple(bases)}  # another receiver of the same shape
    moved = {"layout": dst, "bases": tuple(b + 4096 for b in bases)}
    other_g = list(data.draw(st.permutations(range(src.num_blocks))))[: len(gids)]
    other_n = list(data.draw(st.permutations(range(dst.max_num_blocks))))[: len(nids)]
    fewer = max(1, tokens - data.draw(st.integers(0, 40)))  # may need fewer blocks: the ids are a prefix then
    seen: dict[tuple, object] = {}  # request -> its plan
    for t, gi, ni, p in ((tokens, gids, nids, peer), (tokens, other_g, nids, peer), (tokens, gids, other_n, peer),
                         (fewer, gids, nids, peer), (tokens, gids, nids, twin), (tokens, gids, nids, moved)):
        plan = fmt.plan(t, np.asarray(gi, dtype=np.int64), p, list(ni))  # as the handler passes them
        assert plan.dst is p["layout"] and plan.dst_bases == p["bases"] and plan.num_tokens == t
        _same(plan, plan_kv_transfer(t, gi, ni, src, p["layout"], p["bases"]), caches)
        request = (t, tuple(gi), tuple(ni), id(p["layout"]), p["bases"])  # a draw may repeat one
        assert plan is seen[request] if request in seen else all(plan is not q for q in seen.values())
        seen[request] = plan
    first = seen[(tokens, tuple(gids), tuple(nids), id(dst), peer["bases"])]
    assert fmt.plan(tokens, np.asarray(gids, dtype=np.int64), peer, list(nids)) is first
    with pytest.raises(ValueError, match="positive int"):
        fmt.plan(float(tokens), gids, peer, nids)  # equal to a cached key's token count, but not an int
    if len(nids) == 1:  # the same bytes as a planned request, as a 2-D array
        with pytest.raises(ValueError, match="1-D"):
            fmt.plan(tokens, gids, peer, np.asarray(nids).reshape(1, 1))
    if len(nids) > 1:
        with pytest.raises(ValueError, match="repeats a block"):
            fmt.plan(tokens, gids, peer, [nids[0]] * len(nids))


def test_memory_dest_is_found_by_the_bases_and_uneven_bases_are_refused_every_time():
    """``memory_dest`` is looked up by the plan's bases before they are checked: every plan on a
    placement gets the one destination its first check built, and bases that are not evenly spaced
    raise on every call (nothing refused is kept)."""
    import pytest

    from tests.test_plan import GpuKVLayout, NpuKVLayout, get_arch

    src = GpuKVLayout(2, 8, 16, 2, 64, "bf16")
    dst = NpuKVLayout(get_arch("blackhole-p150a", bank_capacity=8 << 20), 2, 4, 2, 64, 64, "bf16")
    cache = PlanCache()
    even = tuple(t * (1 << 20) for t in range(4))
    a, b = cache.kv_plan(100, range(7), [0, 1], src, dst, even), cache.kv_plan(100, [6, 5, 4, 3, 2, 1, 0], [0, 1], src, dst, even)
    dest = a.memory_dest(8 << 20)
    assert b.memory_dest(8 << 20) is dest and dest.key == ("memory", 8 << 20, 0, 1 << 20)
    assert a.memory_dest(16 << 20) is not dest  # another channel size: another destination
    uneven = cache.kv_plan(100, range(7), [0, 1], src, dst, (0, 1 << 20, 3 << 20, 4 << 20))
    for _ in range(2):
        with pytest.raises(ValueError, match="not evenly spaced"):
            uneven.memory_dest(8 << 20)


@st.composite
def block_requests(draw):
    """A gg-direct pull: a paged layout on both sides, tokens, both sides' block ids, and other ids / fewer tokens."""
    from hawk.layouts.gpu import GpuKVLayout

    layers, bs, heads = draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 16])), draw(st.integers(1, 2))
    tokens = draw(st.integers(1, 120))
    n = -(-tokens // bs)
    total = n + draw(st.integers(0, 4))
    layout = GpuKVLayout(layers, total, bs, heads, 32, "bf16")
    gids, dids = (draw(st.permutations(range(total)))[:n] for _ in range(2))
    other_g, other_d = (draw(st.permutations(range(total)))[:n] for _ in range(2))
    fewer = max(1, tokens - draw(st.integers(1, 3 * bs)))  # may need fewer blocks: the ids are a prefix then
    return layout, tokens, gids, dids, other_g, other_d, fewer


def _cache_rows(cache: torch.Tensor, ids: list[int], tokens: int, bs: int) -> torch.Tensor:
    """The request's token rows of one layer's cache ``[2, blocks, bs, ...]``, in token order."""
    return torch.stack([cache[:, ids[t // bs], t % bs] for t in range(tokens)], 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_requests())
def test_gg_direct_whole_plans_and_landings_are_never_reused_for_another_request(req):
    """gg-direct's sender keeps whole plans (``InPlace.plan``) and, on each, its landing copies per receiver:
    a repeat is the very plan object; other block ids (either side), another token count or another
    receiver (an equal layout object of its own) each get their own plan, equal to an uncached one; each
    landing writes the current rows of its own request into its own receiver; a bad destination id is
    refused every time (nothing refused is kept)."""
    import dataclasses

    import pytest

    from hawk.connector.formats import InPlace
    from hawk.plan.block_plan import plan_block_copy
    from hawk.transport.base import byte_view

    layout, tokens, gids, dids, other_g, other_d, fewer = req
    caches = [torch.randn(layout.layer_shape).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    fmt = InPlace(caches, layout)
    peer, twin = {"layout": layout}, {"layout": dataclasses.replace(layout)}
    receivers = {id(p["layout"]): [torch.zeros(layout.layer_shape, dtype=layout.torch_dtype) for _ in caches] for p in (peer, twin)}
    as_bytes = {k: [byte_view(d) for d in v] for k, v in receivers.items()}  # as the transport gives a peer's regions
    seen: dict[tuple, object] = {}
    for t, gi, di, p in ((tokens, gids, dids, peer), (tokens, other_g, dids, peer), (tokens, gids, other_d, peer),
                         (fewer, gids, dids, peer), (tokens, gids, dids, twin), (tokens, gids, dids, peer)):
        plan = fmt.plan(t, np.asarray(gi, dtype=np.int64), p, np.asarray(di, dtype=np.int64))  # as the handler passes them
        fresh = plan_block_copy(t, gi, layout)
        assert plan.dst is p["layout"] and plan.blocks.num_tokens == t
        assert np.array_equal(plan.blocks.src_block_ids, fresh.src_block_ids) and plan.dst_block_ids.tolist() == list(di)
        request = (t, tuple(gi), tuple(di), id(p["layout"]))  # a draw may repeat one
        assert plan is seen[request] if request in seen else all(plan is not q for q in seen.values())
        seen[request] = plan
        for c in caches:  # new contents: a kept landing copies what the cache holds now
            c.copy_(torch.randn(c.shape).to(c.dtype))
        dests = as_bytes[id(p["layout"])]
        assert fmt.land(plan, dests) is not None
        for c, d in zip(caches, receivers[id(p["layout"])]):
            assert torch.equal(_cache_rows(d, list(di), t, layout.block_size), _cache_rows(c, list(gi), t, layout.block_size))
        assert len(plan.landings) == 1 and next(iter(plan.landings.values()))[0] is dests
    first, elsewhere = seen[(tokens, tuple(gids), tuple(dids), id(layout))], receivers[id(twin["layout"])]
    for d in elsewhere:  # the same plan into other memory (a receiver that mapped its caches again): copies of its own
        d.zero_()
    assert fmt.land(first, as_bytes[id(twin["layout"])]) is not None and len(first.landings) == 2
    for c, d in zip(caches, elsewhere):
        assert torch.equal(_cache_rows(d, list(dids), tokens, layout.block_size), _cache_rows(c, list(gids), tokens, layout.block_size))
    with pytest.raises(ValueError, match="positive int"):
        fmt.plan(float(tokens), gids, peer, dids)  # equal to a cached key's token count, but not an int
    bad = fmt.plan(tokens, gids, peer, [layout.num_blocks] + list(dids[1:]))
    for _ in range(2):
        with pytest.raises(ValueError, match="outside"):
            fmt.land(bad, as_bytes[id(layout)])
    assert not bad.landings
