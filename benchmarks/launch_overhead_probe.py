"""Host time of one Triton kernel launch, by how much of Triton's dispatcher it goes through.

A 1k-token prefill launches about 190 Triton kernels from Python; when their host time approaches
the GPU's, the forward's thread stops running ahead and a layer-wise push is no longer hidden. This
times, per launch of the engine's ``add_rms_norm`` kernel on one row (so the GPU never holds the host
back): ``jit`` (``kernel[grid](...)``, Triton's dispatcher), ``binder`` (the kernel's own binder and
cache key, then the compiled kernel's launcher, no launch metadata or hooks), ``keyed`` (a key the
caller computes from its arguments, then the launcher with pointers as ints), ``launcher`` (the
compiled kernel's launcher alone, arguments prepared once), and ``torch`` (one ``torch.add``).

    python benchmarks/launch_overhead_probe.py --launches 20000
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime.jit import compute_cache_key

from hawk.engine import triton_ops as ops


def per_launch_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--launches", type=int, default=20000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    k = ops._add_rms_norm_kernel
    args = (x, res, w, out, 4096, 1e-5)
    consts = {"HAS_RES": True, "BLOCK": 4096}
    compiled = k[(1,)](*args, **consts, num_warps=16)
    stream = torch._C._cuda_getCurrentRawStream(0)
    kcache, kkey_cache, _target, _backend, binder = k.device_caches[0]

    def jit() -> None:
        k[(1,)](*args, **consts, num_warps=16)

    def binder_path() -> None:
        bound, spec, opts = binder(*args, **consts, num_warps=16, debug=k.debug or knobs.runtime.debug,
                                   instrumentation_mode=knobs.compilation.instrumentation_mode)
        c = kcache[compute_cache_key(kkey_cache, spec, opts)]
        c.run(1, 1, 1, torch._C._cuda_getCurrentRawStream(0), c.function, c.packed_metadata, None, None, None, *bound.values())

    table = {}

    def keyed() -> None:
        key = (x.dtype, x.data_ptr() % 16 == 0, res.data_ptr() % 16 == 0, w.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, 4096)
        c = table.get(key)
        if c is None:
            c = table[key] = compiled
        c.run(1, 1, 1, torch._C._cuda_getCurrentRawStream(0), c.function, c.packed_metadata, None, None, None,
              x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), 4096, 1e-5, True, 4096)

    ptrs = (x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), 4096, 1e-5, True, 4096)

    def launcher() -> None:
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *ptrs)

    def torch_add() -> None:
        torch.add(x, res, out=out)

    def wrapper() -> None:
        ops.add_rms_norm(x, res, w, 1e-5)

    rows = {name: per_launch_us(fn, a.launches) for name, fn in
            [("jit", jit), ("binder", binder_path), ("keyed", keyed), ("launcher", launcher), ("torch", torch_add),
             ("add_rms_norm", wrapper)]}
    for name, us in rows.items():
        print(f"{name:14s} {us:6.2f} us per launch")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
