"""The Triton transform's launch state is split by what each part depends on: the cache layout (strides,
layer offsets), the placement table (row groups and their send-buffer pages: NPU side and token count)
and the request's GPU block ids. A request with new GPU blocks on a known placement builds nothing and
uploads only its block table; the bytes stay the reference's (Triton's interpreter on CPU), and no
launch argument Triton specializes on depends on the request (no compilation on the serving path)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.kv_plan import plan_kv_transfer


def _records(plan, g) -> set:
    """Every (token start, gpu head, col tile, page_a, page_b) a placement table sends somewhere."""
    out = set()
    for rec in g.host.tolist():
        for c in range(g.ctp):
            if rec[4 + c] >= 0:
                out.add((rec[0], rec[2], c, rec[4 + c], rec[4 + g.ctp + c]))
    return out


def test_pow2_divisor_and_placement_tables_match_a_naive_build():
    pytest.importorskip("triton")
    import torch

    from hawk.transform.triton_kernel import _build_groups, _build_layout, _pow2_divisor

    for v, want in (([0, 0], 16), ([16, 32], 16), ([8, -8, 24], 8), ([3], 1), ([-4, 12], 4), ([], 16)):
        assert _pow2_divisor(np.asarray(v, dtype=np.int64), 16) == want
    rng = np.random.default_rng(3)
    arch = get_arch("blackhole-p150a", 1 << 30)
    shapes = ((70, 16, "NHD", 64), (1000, 32, "HND", 64), (961, 16, "NHD", 96), (64, 64, "NHD", 32), (33, 3, "HND", 128))
    for ntok, gbs, order, hd in shapes:
        g = GpuKVLayout(2, -(-ntok // gbs) + 3, gbs, 4, hd, "bf16", order)
        n = NpuKVLayout(arch, 2, -(-ntok // 64) + 2, 4, 64, hd, "bf16")
        plan = plan_kv_transfer(ntok, rng.permutation(g.num_blocks).tolist(), rng.permutation(n.max_num_blocks).tolist(), g, n,
                                [i << 22 for i in range(4)])  # fmt: skip
        t = _build_groups(plan)
        # Naive: every page of the plan, with its group's pages in page units.
        a, b = plan.offset_terms()
        pb = plan.page_bytes
        want = {(int(ts), int(gh), int(c), int(x) // pb, int(y) // pb)
                for ts, gh, c, x, y in zip(plan.token_start, plan.gpu_head, plan.col_tile, a, b)}  # fmt: skip
        assert _records(plan, t) == want and t.groups == len({(w[0], w[1]) for w in want})
        assert t.host.dtype == np.int32 and t.host.shape == (t.groups, 4 + 2 * t.ctp)
        assert np.array_equal(t.host[:, 1], np.clip(ntok - t.host[:, 0], 0, 32))
        # Pages in another order: grouped by np.unique instead of by runs, the same records.
        perm = rng.permutation(plan.num_pages)
        per_page = ("page", "bank", "channel", "addr", "rank", "token_start", "gpu_head", "col_tile")
        shuffled = dataclasses.replace(plan, **{k: getattr(plan, k)[perm] for k in per_page})
        assert _records(shuffled, _build_groups(shuffled)) == want
        # The kernel's row offsets (blk[t // bs] * s_block + (t % bs) * s_slot + head * s_head, the
        # strides read off the cache) against the layout's own offset function, row by row.
        cache = torch.empty(g.layer_shape, dtype=torch.bfloat16, device="meta")
        lay = _build_layout(plan, [cache, cache])
        gids = plan.gpu_block_ids
        for ts, nvalid, gh in t.host[:, :3].tolist():
            assert nvalid == max(0, min(32, ntok - ts))
            for r in range(nvalid):
                tok = ts + r
                got = int(gids[tok // lay.block_size]) * lay.s_block + (tok % lay.block_size) * lay.s_slot + gh * lay.s_head
                assert got == g.offset(0, int(gids[tok // gbs]), tok % gbs, gh)
        assert lay.vec == _pow2_divisor(np.asarray([lay.s_block, lay.s_slot, lay.s_head, lay.kv_stride]), 8)


_CHILD = textwrap.dedent(
    """
    import numpy as np, torch
    from hawk.layouts.gpu import GpuKVLayout
    from hawk.layouts.npu import NpuKVLayout, get_arch
    from hawk.plan.plan_cache import PlanCache
    from hawk.transform.reference import transform_reference
    import hawk.transform.triton_kernel as tk

    counts = {"uploads": [], "groups": 0, "layouts": 0}
    real_upload, real_groups, real_layout = tk.upload_int64, tk._build_groups, tk._build_layout
    def upload(arr, device):
        counts["uploads"].append(int(arr.size))
        return real_upload(arr, device)
    def groups(plan, dest=None):
        counts["groups"] += 1
        return real_groups(plan, dest)
    def layout(plan, used):
        counts["layouts"] += 1
        return real_layout(plan, used)
    tk.upload_int64, tk._build_groups, tk._build_layout = upload, groups, layout

    def run(caches, plan, kernel):
        counts["uploads"].clear()
        counts["groups"] = counts["layouts"] = 0
        got = tk.transform_triton(caches, plan, kernel=kernel)
        assert torch.equal(got, transform_reference(caches, plan))
        return list(counts["uploads"]), counts["groups"], counts["layouts"]

    arch = get_arch("blackhole-p150a", 1 << 30)
    g = GpuKVLayout(2, 12, 16, 2, 64, "bf16")
    for ndtype, kernel in (("bf16", "v1"), ("bfp8_b", "v2"), ("bf16", "v2")):
        n = NpuKVLayout(arch, 2, 6, 2, 64, 64, ndtype)
        cache = PlanCache()
        caches = [torch.randn(g.layer_shape).to(torch.bfloat16) for _ in range(2)]
        bases = [i << 22 for i in range(4)]
        p1 = cache.kv_plan(100, [3, 1, 4, 5, 9, 2, 6], [2, 0], g, n, bases)
        p2 = cache.kv_plan(100, [3, 1, 4, 5, 9, 2, 6], [2, 0], g, n, bases)
        assert p1 is not p2
        tk._BLOCKS.clear()  # (block tables are cached by content: the previous round's ids would hit)
        ups, built, lays = run(caches, p1, kernel)
        launch1, _ = tk._prepare(p1, caches)
        # Its block table (7 ids), its placement table, and the cache layout's unless known already.
        assert built == 1 and lays <= 1 and 7 in ups and len(ups) == 2 + lays, (ups, built, lays)
        for c in caches:
            c.copy_(torch.randn(g.layer_shape).to(torch.bfloat16))  # same memory, new values
        # Same request, a new plan object: nothing built, nothing uploaded.
        assert run(caches, p2, kernel) == ([], 0, 0)
        assert tk._prepare(p2, caches)[0].placed is launch1.placed
        # New GPU blocks on the same placement: only the block table (7 ids) goes up.
        for gids in ([0, 7, 8, 10, 11, 2, 6], [11, 10, 9, 8, 7, 6, 5]):
            p3 = cache.kv_plan(100, gids, [2, 0], g, n, bases)
            assert run(caches, p3, kernel) == ([7], 0, 0)
            l3 = tk._prepare(p3, caches)[0]
            assert l3.placed is launch1.placed and l3.layout is launch1.layout and l3.blocks is not launch1.blocks
        # New NPU blocks (a new placement): its placement table and block table, no new cache layout.
        p4 = cache.kv_plan(70, [4, 9, 1, 0, 3], [5, 1], g, n, bases)
        ups, built, lays = run(caches, p4, kernel)
        assert built == 1 and lays == 0 and sorted(ups) == sorted([5, tk._prepare(p4, caches)[0].placed.table.host.size // 2])
        # One-layer lists (a layer-wise push): every layer's cache shares one launch state.
        g1, n1 = GpuKVLayout(1, 12, 16, 2, 64, "bf16"), NpuKVLayout(arch, 1, 6, 2, 64, 64, ndtype)
        p5 = cache.kv_plan(100, [3, 1, 4, 5, 9, 2, 6], [2, 0], g1, n1, bases[:2])
        layers = [torch.randn(g1.layer_shape).to(torch.bfloat16) for _ in range(3)]
        states = set()
        for i, layer in enumerate(layers):
            ups, built, lays = run([layer], p5, kernel)
            assert i == 0 or (ups, built, lays) == ([], 0, 0)
            states.add(id(tk._prepare(p5, [layer])[0]))
        assert len(states) == 1
    print("ok")
    """
)


def test_fresh_block_ids_upload_only_the_block_table_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=240,
                       cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_launch_keys_do_not_depend_on_the_request(monkeypatch):
    """What Triton's dispatcher keys each launch on (constexprs, argument types, the 1 / multiple-of-16
    and pointer-alignment specializations), recorded on the CPU instead of launched, is one key per
    kernel configuration for requests of any size, block ids and placement, even when the per-request
    tables land at addresses of another alignment: a fresh request compiles nothing, and the compiled
    kernel the direct launch reuses is the right one."""
    pytest.importorskip("triton")
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    import hawk.transform.triton_kernel as tk

    class Recorder:
        def __init__(self, kernel):
            self.kernel, self.keys = kernel, []

        def __getitem__(self, grid):
            def launch(*args, **kw):
                key = []
                for p, a in zip(self.kernel.params, args):
                    if p.is_constexpr:
                        key.append((p.name, a))
                    else:
                        t, spec = native_specialize_impl(BaseBackend, a, p.is_const, not p.do_not_specialize,
                                                         not p.do_not_specialize_on_alignment)
                        key.append((p.name, t, spec))
                self.keys.append(tuple(key))

            return launch

    real_upload = tk.upload_int64
    count = [0]

    def upload(arr, device):  # every third table 8 bytes off a 16-byte boundary
        count[0] += 1
        t = real_upload(arr, device)
        if count[0] % 3:
            return t
        pad = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        if pad.data_ptr() % 16 == 0:
            pad = pad[1:]
        else:
            pad = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        pad.copy_(t)
        return pad

    rec = {"v1": Recorder(tk._transform_kernel), "v2": Recorder(tk._rows_kernel)}
    monkeypatch.setattr(tk, "_transform_kernel", rec["v1"])
    monkeypatch.setattr(tk, "_rows_kernel", rec["v2"])
    monkeypatch.setattr(tk, "upload_int64", upload)
    for name in ("groups", "blk"):
        for k in rec.values():
            assert next(p for p in k.kernel.params if p.name == name).do_not_specialize_on_alignment
    arch = get_arch("blackhole-p150a", 1 << 30)
    g = GpuKVLayout(4, 600, 16, 8, 128, "bf16")
    caches = [torch.zeros(g.layer_shape, dtype=torch.bfloat16) for _ in range(4)]
    rng = np.random.default_rng(0)
    for ndtype in ("bf16", "bfp8_b"):
        n = NpuKVLayout(arch, 4, 160, 8, 64, 128, ndtype)
        for kernel in ("v1", "v2"):
            rec[kernel].keys.clear()
            for ntok in (1, 17, 100, 1000, 4096, 9000, 33, 2048):
                gids = rng.permutation(g.num_blocks)[: -(-ntok // 16)]
                nids = rng.permutation(n.max_num_blocks)[: -(-ntok // 64)]
                plan = plan_kv_transfer(ntok, gids, nids, g, n, [i << 24 for i in range(8)])
                out = torch.empty(plan.total_bytes, dtype=torch.uint8)
                if out.data_ptr() % 16:
                    continue
                tk.transform_triton(caches, plan, out, kernel=kernel)
            keys = rec[kernel].keys
            assert len(keys) >= 6 and len(set(keys)) == 1, (kernel, ndtype, set(keys))


def _cuda_or_skip() -> str:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return "cuda"


def _layouts_and_caches(layers: int, gpu_blocks: int, npu_blocks: int, ndtype: str, seed: int, device: str):
    """A 70B-at-TP4 rank's KV shape (2 KV heads of 128; 16- and 64-token blocks) on a p150a, and four
    random bf16 layer caches of it (more than ``layers``: a layer-wise push reads one at a time)."""
    import torch

    arch = get_arch("blackhole-p150a", 1 << 30)
    g = GpuKVLayout(layers, gpu_blocks, 16, 2, 128, "bf16")
    n = NpuKVLayout(arch, layers, npu_blocks, 2, 64, 128, ndtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    return g, n, [torch.randn(g.layer_shape, device=device, generator=gen).to(torch.bfloat16) for _ in range(4)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["v1", "v2"])
@pytest.mark.parametrize("ndtype", ["bf16", "bfp8_b"])
def test_fresh_requests_cuda(kernel: str, ndtype: str) -> None:
    """Requests of other sizes, GPU blocks and placements on one cache layout, through the direct
    launch of the kernel compiled for the first, some on another stream than their tables' uploads:
    the reference's bytes every time."""
    import torch

    import hawk.transform.triton_kernel as tk
    from hawk.plan.plan_cache import PlanCache
    from hawk.transform.reference import transform_reference
    from tests.test_transform import assert_same_bytes

    g, n, caches = _layouts_and_caches(4, 300, 80, ndtype, seed=5, device=_cuda_or_skip())
    cache = PlanCache()
    rng = np.random.default_rng(11)
    side = torch.cuda.Stream()
    nids = rng.permutation(n.max_num_blocks)
    for i, ntok in enumerate((1000, 1000, 37, 2100, 1000, 64)):
        gids = rng.permutation(g.num_blocks)[: -(-ntok // 16)]
        plan = cache.kv_plan(ntok, gids, nids[: -(-ntok // 64)], g, n, [t << 24 for t in range(8)])  # 1000: one placement
        for stream in (torch.cuda.current_stream(), side):
            with torch.cuda.stream(stream):
                got = tk.transform_triton(caches, plan, kernel=kernel)
            torch.cuda.synchronize()
            assert_same_bytes(got, transform_reference(caches, plan), plan)
    layout = tk._prepare(plan, caches)[0].layout
    assert all(len(c.compiled) <= 1 for c in layout.calls.values())
    assert tk.launch_hooks_idle() and all(c.direct for c in layout.calls.values())  # no launch fell back to the dispatcher


@pytest.mark.gpu
@pytest.mark.parametrize("ndtype", ["bf16", "bfp8_b"])
def test_layer_calls_move_the_first_layers_launch_cuda(ndtype: str, monkeypatch) -> None:
    """A layer-wise push's per-layer transform (``bind_triton_layers``): every layer's bytes are the
    reference's, in its own place; a layer after the first is layer 0's compiled launch with two
    addresses moved (no transform from scratch), and a layer whose address that kernel does not fit (an
    odd shift) is transformed from scratch, into its place and nowhere else."""
    import torch

    import hawk.transform.triton_kernel as tk
    from hawk.plan.plan_cache import PlanCache
    from hawk.transform.reference import transform_reference
    from tests.test_transform import assert_same_bytes

    g, n, caches = _layouts_and_caches(1, 64, 20, ndtype, seed=3, device=_cuda_or_skip())
    rng = np.random.default_rng(4)
    plan = PlanCache().kv_plan(300, rng.permutation(g.num_blocks)[:19], rng.permutation(n.max_num_blocks)[:5], g, n, [0, 1 << 24])
    total = plan.total_bytes
    out = torch.full((4 * total + 64,), 0xCD, dtype=torch.uint8, device="cuda")
    shifts = [0, total, 2 * total, 3 * total + 1]
    fresh = []  # the layers transformed from scratch, by their cache's address
    real = tk.transform_triton
    monkeypatch.setattr(tk, "transform_triton", lambda *a, **k: fresh.append(a[0][0].data_ptr()) or real(*a, **k))
    run = tk.bind_triton_layers(caches, plan, out, shifts)
    assert bool((out == 0xCD).all()), "binding wrote"
    run(0)
    run(2, 1)  # a group, as a push posts them
    assert fresh == [], "a layer was transformed from scratch"
    run(1, 3)  # one that fits layer 0's kernel and one that does not, in one call
    assert set(fresh) == {caches[3].data_ptr()}, "the odd shift was not transformed from scratch (or layer 1 was)"
    torch.cuda.synchronize()
    for layer, s in enumerate(shifts):
        assert_same_bytes(out[s: s + total], transform_reference([caches[layer]], plan), plan)
    assert int(out[3 * total]) == 0xCD and bool((out[3 * total + 1 + total:] == 0xCD).all())
