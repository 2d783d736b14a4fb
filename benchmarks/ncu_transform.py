"""A driver for Nsight Compute: the fused transform's kernels at one size, three calls each.

Why: ``hawk.bench.transform`` times the kernels against a copy; this runs them (v2 and v1, bfloat8_b and
bf16 output, the 70B rank shape, contiguous blocks) so that ``ncu`` can say where their time goes.

    ncu --clock-control none -k regex:'_rows_kernel|_transform_kernel' --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \\
        python3 benchmarks/ncu_transform.py 1280 > ncu.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hawk.bench import transform as bench  # noqa: E402
from hawk.transform.triton_kernel import transform_triton  # noqa: E402

shp = bench.SHAPES["llama70b-tp4"]
size = int(sys.argv[1]) if len(sys.argv) > 1 else 1280
tokens = bench.tokens_for_size(size, shp)
for dtype in ("bfp8_b", "bf16"):
    prob = bench.build_problem(tokens, shp["layers"], shp["heads"], shp["head_dim"], shp["gbs"], shp["nbs"], dtype, False,
                               torch.device("cuda"))
    out = torch.empty(prob.plan.total_bytes, dtype=torch.uint8, device="cuda")
    for kernel in ("v2", "v1"):
        for _ in range(3):
            transform_triton(prob.caches, prob.plan, out, kernel=kernel)
        torch.cuda.synchronize()
print("done")
