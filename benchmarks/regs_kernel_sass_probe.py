"""The bfloat8_b register kernel compiled for sm_90 on a machine without a GPU: registers, spills, SASS size.

Why: at batch 1 each of the kernel's one-warp programs is a chain of dependent instructions (Nsight
Compute: ~4 cycles per issued instruction, no dominant stall), so its length is the kernel's time; this
says how long the chain's code is for a launch shape without spending device time. Needs Triton >= 3.5
(Gluon) and the ptxas / cuobjdump Triton ships; the shapes are the 8B model's (GQA group 4, p150a's 8
banks, 64-token NPU blocks).

    python benchmarks/regs_kernel_sass_probe.py --tokens 16,32 [--merge] [--rope] [--program kernel|split|new-row]

``--program split`` / ``new-row``: the code of one program kind of the new-row-program form (NEWP), each
compiled alone behind a kernel of the same arguments (the whole kernel holds both kinds' code, and a
program runs one); ``--rope``: q and the new k rotated in the launch.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from hawk.engine import gluon_npu_attention as gk

POINTERS = {"q": "*bf16", "out": "*bf16", "part_out": "*fp32", "part_lse": "*fp32", "mem": "*u8", "meta": "*i32",
            "k_new": "*bf16", "v_new": "*bf16", "counters": "*i32", "positions": "*i64", "cos": "*bf16", "sin": "*bf16"}
WIDE = ("k_base", "v_base", "bank_stride", "page_stride")


@gluon.jit
def _one_part(
    q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse,
    mem, k_base, v_base, meta, meta_s0, meta_w, qk_scale, num_splits,
    bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1, counters, positions, cos, sin,
    NB: gl.constexpr, SHARD: gl.constexpr, G: gl.constexpr, BS: gl.constexpr, TOKN: gl.constexpr,
    KW: gl.constexpr, VW: gl.constexpr, VT: gl.constexpr, MMA: gl.constexpr, RL: gl.constexpr,
    DIRECT: gl.constexpr, PREFETCH: gl.constexpr, FUSED: gl.constexpr, EARLY: gl.constexpr,
    MERGE: gl.constexpr, SP: gl.constexpr, NEWP: gl.constexpr, ROPE: gl.constexpr, PART: gl.constexpr,
):
    """One program kind of the kernel's NEWP form alone (the kernel's arguments, its prologue): a split
    over the rows before the new one (PART "split"), or the new row's program ("new-row")."""
    row = gl.program_id(0).to(gl.int64)
    mrow = meta + row * meta_s0
    n = gl.load(mrow)
    pos = 0
    if ROPE:
        pos = gl.load(positions + row).to(gl.int64)
    if PART == "split":
        gk._split_program(q, q_s0, q_s1, out, o_s0, o_s1, part_out, part_lse, mem, k_base, v_base, mrow, meta_w,
                          qk_scale, num_splits, num_splits + 1, row, gl.program_id(1), gl.program_id(2), n - 1, pos,
                          cos, sin, bank_stride, page_stride, s0, s1, s2, k_new, kn_s0, kn_s1, v_new, vn_s0, vn_s1,
                          NB, SHARD, G, BS, TOKN, KW, VW, VT, MMA, RL, False, PREFETCH, False, EARLY, ROPE)
    else:
        gk._new_row_program(q, q_s0, q_s1, part_out, part_lse, mem, k_base, v_base, mrow, qk_scale, num_splits + 1,
                            row, gl.program_id(1), n, pos, cos, sin, bank_stride, page_stride, s0, s1, s2, k_new, kn_s0,
                            kn_s1, v_new, vn_s0, vn_s1, NB, SHARD, G, BS, RL, ROPE)


def compile_ptx(tokens: int, merge: bool, splits: int = 32, rope: bool = False, program: str = "kernel") -> str:
    """PTX of the kernel as a batch-1 decode launches it (fused row write, early loads, prefetch; with
    ``program`` "split" or "new-row", that program kind of the new-row-program form alone)."""
    fn = gk._decode_bfp8_regs_kernel if program == "kernel" else _one_part
    lay = gk.layouts(tokens)
    const = dict(NB=8, SHARD=1, G=4, BS=64, TOKN=tokens, KW=lay["kw"], VW=lay["vw"], VT=lay["vt"], MMA=lay["mma"],
                 RL=lay["rl"], DIRECT=False, PREFETCH=True, FUSED=program == "kernel", EARLY=True, MERGE=merge,
                 SP=splits if merge else 1, NEWP=program != "kernel", ROPE=rope)
    if program != "kernel":
        const["PART"] = program
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
    p.add_argument("--rope", action="store_true", help="q and the new k rotated in the launch")
    p.add_argument("--program", default="kernel", choices=["kernel", "split", "new-row"],
                   help="the whole kernel (the split holding the new row packs it), or one program kind of the "
                        "new-row-program form alone")
    a = p.parse_args()
    for t in (int(x) for x in a.tokens.split(",")):
        stats = sass_stats(compile_ptx(t, a.merge and a.program == "kernel", rope=a.rope, program=a.program))
        print(f"TOKN={t} program={a.program} merge={a.merge} rope={a.rope}: {stats}")


if __name__ == "__main__":
    main()
