"""The bfloat8_b register kernel compiled for sm_90 on a machine without a GPU: registers, spills, SASS size.

Why: at batch 1 each of the kernel's one-warp programs is a chain of dependent instructions (Nsight
Compute: ~4 cycles per issued instruction, no dominant stall), so its length is the kernel's time; this
says how long the chain's code is for a launch shape without spending device time. Needs Triton >= 3.5
(Gluon) and the ptxas / cuobjdump Triton ships; the shapes are the 8B model's (GQA group 4, p150a's 8
banks, 64-token NPU blocks).

    python benchmarks/regs_kernel_sass_probe.py --tokens 16,32 [--merge]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from hawk.engine import gluon_npu_attention as gk

POINTERS = {"q": "*bf16", "out": "*bf16", "part_out": "*fp32", "part_lse": "*fp32", "mem": "*u8", "meta": "*i32",
            "k_new": "*bf16", "v_new": "*bf16", "counters": "*i32"}
WIDE = ("k_base", "v_base", "bank_stride", "page_stride")


def compile_ptx(tokens: int, merge: bool, splits: int = 32) -> str:
    """PTX of the kernel as a batch-1 decode launches it (fused row write, early loads, prefetch)."""
    fn = gk._decode_bfp8_regs_kernel
    lay = gk.layouts(tokens)
    const = dict(NB=8, SHARD=1, G=4, BS=64, TOKN=tokens, KW=lay["kw"], VW=lay["vw"], VT=lay["vt"], MMA=lay["mma"],
                 RL=lay["rl"], DIRECT=False, PREFETCH=True, FUSED=True, EARLY=True, MERGE=merge, SP=splits if merge else 1)
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else POINTERS.get(n) or ("fp32" if n == "qk_scale" else "i64" if n in WIDE else "i32")
           for n in names}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]


def sass_stats(ptx: str) -> dict[str, int]:
    """ptxas -v's registers and spill bytes, and the SASS instruction count, for sm_90a."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.o")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", src, "-o", obj],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", obj], capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"Used (\d+) registers", info).group(1)),
            "spill_stores": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            "spill_loads": int(re.search(r"(\d+) bytes spill loads", info).group(1)),
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="32", help="tokens per iteration (16, 32)")
    p.add_argument("--merge", action="store_true", help="with the in-launch merge of 32 splits")
    a = p.parse_args()
    for t in (int(x) for x in a.tokens.split(",")):
        print(f"TOKN={t} merge={a.merge}: {sass_stats(compile_ptx(t, a.merge))}")


if __name__ == "__main__":
    main()
