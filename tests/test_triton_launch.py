"""``hawk.triton_launch``: a kernel launched through :func:`launch` gives what Triton's dispatcher gives,
for every specialization it could be given (dtype, pointer alignment, ints equal to 1 or multiples of
16, constexprs), takes the direct path from the second launch of a specialization on, falls back to
the dispatcher while a launch hook is installed, and is captured in a CUDA graph like any launch.
The direct path needs a GPU (``-m gpu``); the facts the key is made of are checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from hawk import triton_launch as tl_launch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _axpy(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m).to(tl.float32)
    y = tl.load(y_ptr + i, mask=m).to(tl.float32)
    r = a * x + y
    if SQUARE:
        r = r * r
    tl.store(out_ptr + i, r.to(out_ptr.dtype.element_ty), mask=m)


def _expected(x: torch.Tensor, y: torch.Tensor, a: float, square: bool) -> torch.Tensor:
    r = a * x.float() + y.float()
    return (r * r if square else r).to(x.dtype)


def test_key_facts_are_what_triton_specializes_on():
    """Two arguments Triton would compile apart never share a key; the key does not hold a pointer's value."""
    t = torch.zeros(64, dtype=torch.float32)
    assert tl_launch._fact(t) == tl_launch._fact(torch.zeros(64, dtype=torch.float32))  # address aside
    assert tl_launch._fact(t) != tl_launch._fact(t[1:])  # 4 bytes off: not 16-byte aligned
    assert tl_launch._fact(t) != tl_launch._fact(t.to(torch.bfloat16))
    assert tl_launch._fact(t[4:]) == tl_launch._fact(t)  # 16 bytes off: aligned
    assert len({tl_launch._fact(v) for v in (1, 2, 3, 16, 32)}) == 3  # 1; not a multiple of 16; multiple of 16
    assert tl_launch._fact(2**31) != tl_launch._fact(2**4 * 2**27 - 16)  # 64-bit against 32-bit
    assert tl_launch._fact(True) != tl_launch._fact(1)
    assert tl_launch._fact(0.5) == tl_launch._fact(2.0)  # floats: fp32, not by value


def test_launch_hooks_idle_follows_triton_hooks(monkeypatch):
    """The direct launch is taken only while no launch hook is installed, whatever form Triton gives
    an empty hook (None up to 3.4, an empty HookChain from 3.5: there the test of ``is None`` alone
    sent every launch through the dispatcher)."""
    pytest.importorskip("triton")
    from triton import knobs

    assert tl_launch.launch_hooks_idle()
    hook = knobs.runtime.launch_enter_hook
    if hook is None:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    else:
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    assert not tl_launch.launch_hooks_idle()


gpu = pytest.mark.skipif(not torch.cuda.is_available() or not tl_launch.DIRECT, reason="needs a GPU (the direct path)")


@pytest.mark.gpu
@gpu
def test_every_specialization_matches_the_dispatcher():
    dev = torch.device("cuda")
    tl_launch._compiled.pop(_axpy, None)
    cases = []
    for dtype in (torch.float32, torch.float16):
        for off in (0, 1, 4):  # aligned, misaligned, aligned again by 16 bytes (fp32) / 8 bytes (fp16)
            for n in (1, 16, 37):
                for square in (False, True):
                    cases.append((dtype, off, n, square))
    for dtype, off, n, square in cases * 2:  # the second pass runs direct
        x = torch.randn(n + 8, device=dev).to(dtype)[off:off + n]
        y = torch.randn(n + 8, device=dev).to(dtype)[off:off + n]
        out = torch.empty(n + 8, device=dev, dtype=dtype)[off:off + n]
        tl_launch.launch(_axpy, (triton.cdiv(n, 16),), x, y, out, n, 0.75, BLOCK=16, SQUARE=square, num_warps=1)
        torch.testing.assert_close(out, _expected(x, y, 0.75, square))
    table = tl_launch._compiled[_axpy]
    assert all(c is not None for c in table.values())
    # 2 dtypes x 2 alignments (fp32: 0 and 4 aligned, 1 not; fp16: only 0) x 3 int classes x 2 constexprs
    assert len(table) == 24


@pytest.mark.gpu
@gpu
def test_second_launch_skips_the_dispatcher_unless_a_hook_is_installed(monkeypatch):
    from triton import knobs

    dev = torch.device("cuda")
    x, y, out = (torch.randn(32, device=dev) for _ in range(3))
    tl_launch.launch(_axpy, (2,), x, y, out, 32, 2.0, BLOCK=16, SQUARE=False, num_warps=1)
    calls = []
    real = type(_axpy).run

    def counting(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(type(_axpy), "run", counting)
    tl_launch.launch(_axpy, (2,), x, y, out, 32, 3.0, BLOCK=16, SQUARE=False, num_warps=1)
    assert calls == []
    torch.testing.assert_close(out, 3.0 * x + y)
    seen = []
    hook = knobs.runtime.launch_enter_hook
    if hook is None:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: seen.append(1))
    else:
        monkeypatch.setattr(hook, "calls", [lambda *a: seen.append(1)])
    assert not tl_launch.launch_hooks_idle()
    tl_launch.launch(_axpy, (2,), x, y, out, 32, 4.0, BLOCK=16, SQUARE=False, num_warps=1)
    assert calls == [1] and seen  # the dispatcher ran, and the hook with it
    torch.testing.assert_close(out, 4.0 * x + y)


@pytest.mark.gpu
@gpu
def test_direct_launches_are_captured_in_a_graph():
    dev = torch.device("cuda")
    x, y, out = (torch.randn(64, device=dev) for _ in range(3))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):  # the second is direct
            tl_launch.launch(_axpy, (4,), x, y, out, 64, 1.5, BLOCK=16, SQUARE=True, num_warps=1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tl_launch.launch(_axpy, (4,), x, y, out, 64, 1.5, BLOCK=16, SQUARE=True, num_warps=1)
    x.copy_(torch.randn(64, device=dev))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, _expected(x, y, 1.5, True))
