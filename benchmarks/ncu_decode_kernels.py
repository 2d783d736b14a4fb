"""A driver for Nsight Compute: one layer's decode attention at one point, each path called a few times.

Why: ``bfp8_kernel_probe.py`` times the bfloat8_b tile decode against the paged one; this runs the same
kernels (paged bf16, NPU bf16 tiles, the named bfloat8_b variants) on the same caches, each call after a
256 MiB read that flushes L2, so ``ncu`` can say where their time goes (instructions, issue rate,
occupancy, DRAM throughput). The fourth call of each is the one to read (three warm it up).

    ncu --clock-control none -k regex:'_decode|_write_rows' --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section InstructionStats --csv --page details \
        python3 benchmarks/ncu_decode_kernels.py 64x1024 tok-pipe2-r128-fw,words-pipe2-r128 > ncu.csv
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.bfp8_kernel_probe as P  # noqa: E402
from hawk.engine import triton_npu_attention as tk  # noqa: E402
from hawk.engine.npu_attention import NpuTileAttention  # noqa: E402
from hawk.engine.paged_attention import PagedAttention  # noqa: E402
from hawk.layouts.gpu import GpuKVLayout  # noqa: E402

b, c = (int(x) for x in sys.argv[1].split("x"))
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else [tk.DEFAULT_BFP8_VARIANT]
torch.manual_seed(0)
q = torch.randn(b, P.HQ, P.D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, P.HKV, P.D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
flush = torch.ones(256 << 17, dtype=torch.int64, device="cuda")
slices, per = P._batch(b, c, 16)
lay = GpuKVLayout(1, b * per, 16, P.HKV, P.D, "bf16")
caches = lay.allocate(torch.device("cuda"))
caches[0].normal_()
pa = PagedAttention(lay, caches, max_batch=max(b, 8), max_model_len=c + 64, use_triton=True)
pa.begin(slices, pad_to=b)
for _ in range(4):
    flush.sum()
    pa(0, q, k, v)
torch.cuda.synchronize()
for dt in ("bf16", "bfp8_b"):
    npu, mem, sl, kv = P.npu_cache(b, c, dt)
    a = NpuTileAttention(mem, max_batch=max(b, 8), max_model_len=c + 64, backend="triton")
    a.begin(sl, pad_to=b)
    for name in (variants if dt == "bfp8_b" else ["bf16"]):
        if dt == "bfp8_b":
            a.decode_config = tk.BFP8_VARIANTS[name]
        for _ in range(4):
            flush.sum()
            a(0, q, k, v)
        torch.cuda.synchronize()
    mem.close()
print("done")
