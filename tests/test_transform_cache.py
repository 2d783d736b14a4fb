"""The Triton transform's launch state is reused across plan objects of the same request (content-keyed),
and rebuilt for new block ids: the bytes stay the reference's either way (Triton's interpreter on CPU)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.plan.kv_plan import plan_kv_transfer


def test_pow2_divisor_and_tables_match_a_naive_build():
    pytest.importorskip("triton")
    import torch

    from hawk.transform.triton_kernel import _build_tables, _pow2_divisor

    for v, want in (([0, 0], 16), ([16, 32], 16), ([8, -8, 24], 8), ([3], 1), ([-4, 12], 4), ([], 16)):
        assert _pow2_divisor(np.asarray(v, dtype=np.int64), 16) == want
    rng = np.random.default_rng(3)
    arch = get_arch("blackhole-p150a", 1 << 30)
    for ntok, gbs, order in ((70, 16, "NHD"), (1000, 32, "HND"), (961, 16, "NHD"), (64, 64, "NHD")):
        g = GpuKVLayout(2, -(-ntok // gbs) + 3, gbs, 4, 64, "bf16", order)
        n = NpuKVLayout(arch, 2, -(-ntok // 64) + 2, 4, 64, 64, "bf16")
        plan = plan_kv_transfer(ntok, rng.permutation(g.num_blocks).tolist(), rng.permutation(n.max_num_blocks).tolist(), g, n,
                                [i << 22 for i in range(4)])  # fmt: skip
        strides = tuple(torch.empty(g.layer_shape, dtype=torch.bfloat16, device="meta").stride())
        t = _build_tables(plan, strides)
        names = ("kv", "block", "slot", "head", "dim") if order == "NHD" else ("kv", "block", "head", "slot", "dim")
        s = dict(zip(names, strides))
        # Naive: every (token_start, gpu_head) group in sorted order, row by row.
        keys = sorted(set(zip(plan.token_start.tolist(), plan.gpu_head.tolist())))
        assert t.groups == len(keys)
        row_off = t.host[: t.groups * 32].reshape(-1, 32)
        row_valid = t.host[t.groups * 32 : t.groups * 33]
        for gi, (ts, gh) in enumerate(keys):
            for r in range(32):
                tok = ts + r
                want = 0 if tok >= ntok else int(plan.gpu_block_ids[tok // gbs]) * s["block"] + (tok % gbs) * s["slot"] + gh * s["head"]
                assert row_off[gi, r] == want
            assert row_valid[gi] == max(0, min(32, ntok - ts))


def test_launch_state_reused_across_plan_objects_interpreted():
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import numpy as np, torch
        from hawk.layouts.gpu import GpuKVLayout
        from hawk.layouts.npu import NpuKVLayout, get_arch
        from hawk.plan.plan_cache import PlanCache
        from hawk.transform.reference import transform_reference
        import hawk.transform.triton_kernel as tk
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
            got1 = tk.transform_triton(caches, p1, kernel=kernel)
            assert torch.equal(got1, transform_reference(caches, p1))
            launch1, _ = tk._prepare(p1, caches)
            for c in caches:
                c.copy_(torch.randn(g.layer_shape).to(torch.bfloat16))  # same memory, new values
            got2 = tk.transform_triton(caches, p2, kernel=kernel)
            assert tk._prepare(p2, caches)[0] is launch1  # same request: the launch state is reused
            assert torch.equal(got2, transform_reference(caches, p2))
            p3 = cache.kv_plan(100, [0, 7, 8, 10, 11, 2, 6], [2, 0], g, n, bases)  # new GPU blocks, same placement
            got3 = tk.transform_triton(caches, p3, kernel=kernel)
            assert tk._prepare(p3, caches)[0] is not launch1
            assert torch.equal(got3, transform_reference(caches, p3))
            # One-layer lists (a layer-wise push): every layer's cache shares one launch state.
            g1, n1 = GpuKVLayout(1, 12, 16, 2, 64, "bf16"), NpuKVLayout(arch, 1, 6, 2, 64, 64, ndtype)
            p4 = cache.kv_plan(100, [3, 1, 4, 5, 9, 2, 6], [2, 0], g1, n1, bases[:2])
            layers = [torch.randn(g1.layer_shape).to(torch.bfloat16) for _ in range(3)]
            states = set()
            for layer in layers:
                got = tk.transform_triton([layer], p4, kernel=kernel)
                assert torch.equal(got, transform_reference([layer], p4))
                states.add(id(tk._prepare(p4, [layer])[0]))
            assert len(states) == 1
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240,
                       cwd=os.path.dirname(os.path.dirname(__file__)))  # fmt: skip
    assert r.stdout.strip().endswith("ok"), r.stderr[-3000:]
