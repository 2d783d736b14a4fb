"""The batched device copy (NPU finish, same-GPU transport batches) against one plain device copy of
the same bytes, in one run: kernel block size, warps and 16-byte alignment hints.

    python benchmarks/copy_probe.py --json /tmp/copy_probe.json     # cuda:0, a few seconds

Cases: the staging finish of a 1280 MiB (bf16) and a 10 MiB gn-hawk transfer on the emulated p150a (runs
of whole per-bank extents), and many 2 KiB page runs (a direct-placement layer). Ratios are copy time /
kernel time (1.0 = as fast as ``torch.Tensor.copy_``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hawk.devices import batched_copy as bc  # noqa: E402
from benchmarks.attention_probe import cuda_ms  # noqa: E402
from hawk.devices._copy_kernel import copy_words  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda:0")
    cases = {"finish-1280MiB": (512, 4 << 20), "finish-10MiB": (8, 10 << 20 >> 3), "pages-2KiB": (4096, 2048)}
    out = []
    for name, (n, run) in cases.items():
        total = n * run
        mem = torch.randint(0, 255, (2 * total + (1 << 20),), dtype=torch.uint8, device=dev)
        words = mem.view(torch.int64)
        rng = np.random.default_rng(0)
        src = (np.arange(n, dtype=np.int64) * run) // 8
        dst = (total + rng.permutation(n).astype(np.int64) * run) // 8
        lens = np.full(n, run // 8, dtype=np.int64)
        t = bc.upload_int64(np.stack([src, dst, lens]), dev)
        plain = cuda_ms(lambda: mem[total : 2 * total].copy_(mem[:total]), a.repeats)
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                for align in (1, 2):
                    ms = cuda_ms(lambda: copy_words(words, t[0], t[1], t[2], int(lens.max()), block, align, warps), a.repeats)
                    out.append({"case": name, "bytes": total, "block": block, "num_warps": warps, "align": align,
                                "ms": ms, "copy_ms": plain, "x_copy": ms / plain})
        best = min((r for r in out if r["case"] == name), key=lambda r: r["ms"])
        print(f"{name}: plain copy {plain:.3f} ms; best block {best['block']} warps {best['num_warps']} align {best['align']}: "
              f"{best['ms']:.3f} ms ({best['x_copy']:.2f}x copy)")
        for r in out:
            if r["case"] == name and r["block"] == bc._BLOCK and r["num_warps"] == 4:
                print(f"   default block, align {r['align']}: {r['ms']:.3f} ms ({r['x_copy']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "records": out}, f, indent=1)


if __name__ == "__main__":
    main()
