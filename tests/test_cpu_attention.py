"""The batched CPU decode attention (hawk/engine/cpu_attention.py) against the per-row reference.

The reference is :func:`~hawk.engine.cpu_numerics.attend_widened` over each row's own context, which
the torch path ran per row before. A lone row must give its bits exactly; a padded batch the same up to
fp32 summation order (a bf16 output at most one ulp off, and rarely).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine.cpu_attention import DecodeWorkspace, KeptBuffers, decode_groups, decode_plan
from hawk.engine.cpu_numerics import attend_widened

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _setup(seed: int, ctx: list[int], bs: int, hkv: int, g: int, d: int, order: str, kv: str, qd: str):
    """A shuffled paged cache holding random K/V, each row's block table, and its queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctx]
    nb = sum(need) + 3
    kv_dt = DTYPES[kv]
    cache = torch.randn((2, nb, bs, hkv, d), generator=gen).to(kv_dt)
    if order == "HND":
        cache = cache.transpose(2, 3).contiguous()
    perm = torch.randperm(nb, generator=gen).numpy()
    table = np.zeros((len(ctx), max(need) + 2), dtype=np.int64)
    off = 0
    for i, k in enumerate(need):
        table[i, :k] = perm[off : off + k]
        off += k
    q = torch.randn((len(ctx), hkv * g, d), generator=gen).to(DTYPES[qd])
    return cache, table, q


def _reference(cache: torch.Tensor, table: np.ndarray, ctx: list[int], q: torch.Tensor, order: str) -> torch.Tensor:
    nhd = cache if order == "NHD" else cache.transpose(2, 3)  # [2, blocks, bs, H, D]
    outs = []
    for i, c in enumerate(ctx):
        blocks = torch.from_numpy(table[i, : -(-c // nhd.shape[2])])
        k, v = (nhd[s][blocks].reshape(-1, *nhd.shape[3:])[:c] for s in (0, 1))
        outs.append(attend_widened(q[i : i + 1], k, v, None))
    return torch.cat(outs)


@settings(max_examples=40, deadline=None)
@given(
    ctx=st.lists(st.integers(1, 90), min_size=1, max_size=8),
    bs=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(1, 1), (2, 3), (3, 3), (1, 8)]),
    d=st.sampled_from([16, 64]),
    order=st.sampled_from(["NHD", "HND"]),
    dtypes=st.sampled_from([("bf16", "bf16"), ("bf16", "fp16"), ("fp16", "fp16")]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_per_row_reference(ctx: list[int], bs: int, heads: tuple[int, int], d: int, order: str,
                                   dtypes: tuple[str, str], seed: int) -> None:
    hkv, g = heads
    cache, table, q = _setup(seed, ctx, bs, hkv, g, d, order, *dtypes)
    want = _reference(cache, table, ctx, q, order)
    got = DecodeWorkspace().attend_groups(q, cache, decode_groups(table, np.array(ctx), bs), order == "NHD")
    assert got.dtype == q.dtype and got.shape == q.shape
    if len(ctx) == 1:
        assert torch.equal(got, want), "a lone row attends exactly its context: the per-row form's bits"
    else:
        ulp = torch.finfo(q.dtype).eps * want.float().abs().clamp_min(torch.finfo(q.dtype).tiny)
        assert ((got.float() - want.float()).abs() <= ulp).all(), "more than one ulp off the per-row form"


def test_padded_batch_rarely_differs() -> None:
    """At SmolLM2's shape (3 KV heads of 3 queries, D 64), batch 32 of mixed contexts: padding changes
    only fp32 summation order, so nearly every bf16 output keeps the per-row form's bits."""
    ctx = [int(c) for c in np.random.default_rng(0).integers(1, 400, 32)]
    cache, table, q = _setup(1, ctx, 16, 3, 3, 64, "NHD", "bf16", "bf16")
    want = _reference(cache, table, ctx, q, "NHD")
    ws = DecodeWorkspace()
    plan = decode_plan(table, np.array(ctx), 16)
    got = ws.attend(q, cache, plan, True)
    assert (got != want).sum().item() <= got.numel() // 2000
    assert torch.equal(ws.attend(q, cache, plan, True), got), "kept buffers: a second call gives the same"


def test_plan_pads_with_the_rows_own_block() -> None:
    table = np.array([[5, 6, 7], [9, 0, 0]])
    plan = decode_plan(table, np.array([9, 3]), 4)  # 3 blocks and 1 block
    assert plan.blocks.tolist() == [5, 6, 7, 9, 9, 9]
    assert plan.keys == 12 and plan.pad is not None
    assert plan.pad[0, 0].tolist() == [False] * 9 + [True] * 3
    assert plan.pad[1, 0].tolist() == [False] * 3 + [True] * 9
    lone = decode_plan(table[:1], np.array([9]), 4)
    assert lone.keys == 9 and lone.pad is None


@settings(max_examples=60, deadline=None)
@given(ctx=st.lists(st.integers(1, 2000), min_size=1, max_size=40), max_groups=st.integers(1, 5))
def test_groups_cover_every_row_once_and_bound_padding(ctx: list[int], max_groups: int) -> None:
    bs = 16
    need = [-(-c // bs) for c in ctx]
    table = np.arange(len(ctx) * max(need)).reshape(len(ctx), max(need))
    plans = decode_groups(table, np.array(ctx), bs, max_groups)
    assert 1 <= len(plans) <= max_groups
    rows = [i for p in plans for i in (range(len(ctx)) if p.index is None else p.index.tolist())]
    assert sorted(rows) == list(range(len(ctx)))
    for p in plans[:-1] if len(plans) == max_groups else plans:  # the last of a capped split takes the rest
        members = range(len(ctx)) if p.index is None else p.index.tolist()
        assert all(2 * need[i] > p.width for i in members), "a row padded to more than twice its blocks"


def test_mixed_lengths_split_into_groups() -> None:
    plans = decode_groups(np.arange(64 * 4).reshape(4, 64), np.array([1000, 30, 900, 40]), 16)
    assert [p.index.tolist() for p in plans if p.index is not None] == [[0, 2], [1, 3]]
    assert [p.width for p in plans] == [63, 3]


def test_a_kept_buffer_made_under_inference_mode_takes_writes_outside_it():
    """Engine threads run under inference mode and the tests under no_grad: a buffer kept across both
    must be a normal tensor (one made as an inference tensor refuses in-place writes later)."""
    kept = KeptBuffers(zeroed=True)
    with torch.inference_mode():
        kept.get("k", 8, torch.float32).copy_(torch.ones(8))
    with torch.no_grad():
        kept.get("k", 8, torch.float32).add_(1)
    assert kept.get("k", 8, torch.float32).tolist() == [2.0] * 8
