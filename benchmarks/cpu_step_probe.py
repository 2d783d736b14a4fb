"""What HAWK's CPU step costs: decode at a few batch sizes and a mixed step, as the colocated engine runs them.

Why: issue 31's CPU acceptance compares HAWK's serving throughput with vLLM's on the CPU box, and the
serving run only says the decode step is slow, not which part. This probe builds the colocated engine's
pieces (the model in its serving dtype, the paged cache that engine keeps: ``--cache engine``, on a CPU
where vLLM's kernel loads the kernel's own order read in place, see
:func:`~hawk.engine.vllm_cpu_kernel.in_place_layout`; ``--cache nhd``: HAWK's NHD cache of 16-token
blocks, copied into the kernel's order per layer, the way before it; the torch path of
:class:`~hawk.engine.paged_attention.PagedAttention`, :class:`~hawk.engine.runner.ModelRunner`) and times
whole steps (metadata, forward, LM head) at a fixed context, median of ``--reps`` after a warm-up:

* ``decode``: ``batch`` sequences, one new token each, every one at ``--context`` tokens;
* ``mixed``: the same decode rows plus one prompt chunk of ``--chunk`` tokens (a fresh prompt), one forward.

``--profile`` adds a torch.profiler table (self CPU time per op) of a few steps of each point.
``--ops both`` times each point with vLLM's CPU GEMM and RoPE (:mod:`hawk.engine.vllm_cpu_ops`, the
default where vLLM is installed) and with HAWK's torch forms instead, rep by rep in turn, so the
shared box's drift falls on both alike; ``ms`` is then vLLM's ops', ``ms_torch_ops`` the other's.

    PYTHONPATH=. python benchmarks/cpu_step_probe.py --batches 1,8,32 --context 300 --chunk 256 --reps 5

One JSON line per point: ``{kind, batch, context, chunk, ms, ms_all}``; the first line says which cache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hawk.engine import model as model_mod
from hawk.engine import vllm_cpu_ops
from hawk.engine.attention import SeqSlice
from hawk.engine.loader import load_model
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.runner import ModelRunner
from hawk.engine.vllm_cpu_kernel import in_place_layout
from hawk.layouts.gpu import GpuKVLayout

#: HAWK's serving block size (``--gpu-block-size``'s default), before the engine picks its cache.
BLOCK = 16
Batch = tuple[list[list[int]], list[SeqSlice]]


@dataclass
class Case:
    """``top`` decode rows at ``context`` tokens each and one fresh prompt chunk, over a paged cache
    sized for exactly them, in the layout the colocated engine keeps (or HAWK's NHD one)."""

    layout: GpuKVLayout
    caches: list[torch.Tensor]
    context: int
    chunk: int

    @classmethod
    def build(cls, cfg: Any, dtype: torch.dtype, top: int, context: int, chunk: int, cache: str) -> Case:
        tokens = top * (context + 2) + chunk + 1
        nhd = GpuKVLayout(cfg.num_layers, -(-tokens // BLOCK), BLOCK, cfg.num_kv_heads, cfg.head_dim, "bf16" if dtype == torch.bfloat16 else "fp32")
        layout = in_place_layout(nhd, "cpu", dtype) if cache == "engine" else nhd
        per_seq, chunk_blocks = -(-(context + 2) // layout.block_size), -(-(chunk + 1) // layout.block_size)
        layout = dataclasses.replace(layout, num_blocks=top * per_seq + chunk_blocks)
        return cls(layout, layout.allocate("cpu"), context, chunk)

    @property
    def per_seq(self) -> int:
        """Blocks a decode row holds."""
        return -(-(self.context + 2) // self.layout.block_size)

    def decode(self, b: int) -> Batch:
        """The first ``b`` rows' tokens and slices: one new token each, after ``context``."""
        n = self.per_seq
        return [[1]] * b, [SeqSlice(list(range(i * n, (i + 1) * n)), self.context, 1) for i in range(b)]

    def prefill(self) -> Batch:
        """The chunk's tokens and slice, in the blocks after every row's."""
        first = self.layout.num_blocks - -(-(self.chunk + 1) // self.layout.block_size)
        return [list(range(1, self.chunk + 1))], [SeqSlice(list(range(first, self.layout.num_blocks)), 0, self.chunk)]


def _times(fn: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    """Wall ms of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """HAWK's torch GEMM (oneDNN on weights torch packed) and RoPE instead of vLLM's ops, for a while."""
    saved = (vllm_cpu_ops.prepacked_gemm, vllm_cpu_ops.has_rotary)
    vllm_cpu_ops.prepacked_gemm, vllm_cpu_ops.has_rotary = (lambda w: None), (lambda: False)
    model_mod._PACKED.clear()
    try:
        yield
    finally:
        vllm_cpu_ops.prepacked_gemm, vllm_cpu_ops.has_rotary = saved
        model_mod._PACKED.clear()


def _paired(fn: Callable[[], object], reps: int) -> tuple[list[float], list[float]]:
    """Wall ms of ``fn`` with vLLM's ops and with the torch forms, alternating (each warmed up per turn:
    the first call after a switch repacks the weights)."""
    ours, theirs = [], []
    for _ in range(reps):
        ours += _times(fn, 1, warmup=1)
        with torch_ops():
            theirs += _times(fn, 1, warmup=1)
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=300, help="tokens each decode row already has")
    ap.add_argument("--chunk", type=int, default=256, help="the mixed step's prompt chunk (0: no mixed point)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ops", default="default", choices=("default", "both"),
                    help="both: also time HAWK's torch GEMM and RoPE in place of vLLM's, alternating")
    ap.add_argument("--cache", default="engine", choices=("engine", "nhd"),
                    help="engine: the cache the colocated engine keeps (vLLM's kernel order where it reads it in place); "
                         "nhd: HAWK's NHD cache of 16-token blocks, copied into the kernel's order per layer")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    batches = [int(x) for x in a.batches.split(",")]
    top = max(batches)
    loaded = load_model(a.model, torch.device("cpu"), dtype, 0)
    case = Case.build(loaded.config, dtype, top, a.context, a.chunk, a.cache)
    g = torch.Generator().manual_seed(0)
    for c in case.caches:  # a context of random K/V (what is in it does not change the cost)
        c.copy_(torch.randn(c.shape, generator=g, dtype=torch.float32).to(c.dtype))
    attn = PagedAttention(case.layout, case.caches, max_batch=top + 2, max_model_len=a.context + a.chunk + 8)
    runner = ModelRunner(loaded.model, attn, max_batch=top, graphs=False)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": a.dtype, "model": a.model,
                      "cache": {"order": case.layout.order, "block_size": case.layout.block_size}}), flush=True)
    ptok, pre = case.prefill()
    for b in batches:
        dtok, dec = case.decode(b)
        points = {"decode": (dtok, dec)}
        if a.chunk:
            points["mixed"] = (dtok + ptok, dec + pre)
        for kind, (toks, slices) in points.items():
            def step() -> object:
                return runner.step(toks, slices)

            rec: dict[str, Any] = {"kind": kind, "batch": b, "context": a.context, "chunk": a.chunk if kind == "mixed" else 0}
            if a.ops == "both":
                ms, other = _paired(step, a.reps)
                rec |= {"ms_torch_ops": round(statistics.median(other), 2), "ms_torch_ops_all": [round(x, 1) for x in other]}
            else:
                ms = _times(step, a.reps)
            print(json.dumps({**rec, "ms": round(statistics.median(ms), 2), "ms_all": [round(x, 1) for x in ms]}), flush=True)
            if a.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(2):
                        runner.step(toks, slices)
                print(f"# {kind} batch {b}: self CPU time of 2 steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


if __name__ == "__main__":
    main()
