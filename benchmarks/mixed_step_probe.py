"""What a mixed step costs on a GPU against its parts: a decode batch, a prefill chunk, and both in
one forward (as the colocated engine's mixed steps run them), each timed on the device (CUDA events)
and on the host (the launch: the call until it returns, before any sync).

    python benchmarks/mixed_step_probe.py --model llama-3.1-8b --batches 16,48,64,128,256 --context 850 --chunk 512
    python benchmarks/mixed_step_probe.py --batches 48 --chunk 32,64,128,192,256,512   # a step's cost against its chunk
    python benchmarks/mixed_step_probe.py --mixed-graphs --batches 48 --chunk 128,512 --kernels   # where a chunk's time goes
    python benchmarks/mixed_step_probe.py --mixed-graphs --batches 48 --chunk 64,128,144 --step-token-target 192 --kernels
    python benchmarks/mixed_step_probe.py --mixed-graphs --batches 48 --chunk 224 --chunk-offsets 0,256,512   # a later chunk of its prompt
    python benchmarks/mixed_step_probe.py --mixed-graphs --batches 16,48 --chunk 192 --longest 0,2000,4000 [--decode-split-tokens 512]
        # one long row among 850-token ones, the decode kernel's splits by rows (or by the rows' lengths)

One JSON line per point: ``{kind, batch, chunk, offset, longest, decode_split_tokens, gpu_ms, host_ms, path}``
(``offset``: the prompt tokens before the chunk, already in the cache, which the chunk attends to as a
served prompt's later chunks do; ``longest``: the first decode row's context, 0 when it has ``--context``
as every other); kind is ``decode`` (the batch
alone, as the engine runs it: its decode graph), ``prefill`` (the chunk alone: its prefill graph),
``split`` (both parts back to back in one timed call: the former path of a mixed batch past 16
sequences, two graph replays), ``mixed`` (both in one forward, the runner's choice of path where the
batch has more than 16 sequences: PIECEWISE, graph pieces with attention between them, or with
``--mixed-graphs`` GRAPH, the decode rows padded to their bucket in one mixed graph), ``eager``
(``--eager``: the one-forward step launched eagerly) and ``sum`` (decode + prefill, with the ratios
mixed / split and mixed / decode: issue 31 wants the TPOT of a step carrying a chunk near the decode
step). With ``--kernels``, a ``kernels`` line per point: GPU µs per step by kernel name in the decode
step and in the mixed step (a profiler trace of 5 of each), the kernels the chunk adds most to first:
whether a chunk's cost is its GEMMs' extra rows (compute past the weight reads) or the rest. A first ``capture`` line: the piece (or mixed) graphs captured, the seconds and GPU memory it took. The
pieces run a bucket of tokens (multiples of 128 past 128): 48 rows + 512 tokens run as 640, where the
engine's steps that carry a chunk fill their token budget (640 by default) and pad nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hawk.engine.attention import SeqSlice
from hawk.engine.loader import load_model
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.runner import ModelRunner
from hawk.layouts.gpu import GpuKVLayout

BLOCK = 16


@dataclass
class StepCase:
    """``top`` decode rows at ``context`` tokens each and one prompt chunk after up to ``offset`` cached
    tokens of its prompt, over a paged cache sized for exactly them (the CPU step probe builds the same case)."""

    loaded: Any
    layout: GpuKVLayout
    caches: list[torch.Tensor]
    context: int
    chunk: int
    per_seq: int  # blocks a decode row holds
    offset: int = 0  # the most prompt tokens a chunk follows
    longest: int = 0  # the most context the first row may have (--longest), in blocks of its own

    @classmethod
    def build(cls, model: str, device: torch.device, dtype: torch.dtype, top: int, context: int, chunk: int,
              offset: int = 0, longest: int = 0) -> StepCase:
        loaded = load_model(model, device, dtype, 0)
        cfg = loaded.config
        per_seq = -(-(context + 2) // BLOCK)
        long_blocks = -(-(longest + 2) // BLOCK) if longest else 0
        chunk_blocks = -(-(offset + chunk + 1) // BLOCK)
        layout = GpuKVLayout(cfg.num_layers, top * per_seq + long_blocks + chunk_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, "bf16")
        return cls(loaded, layout, layout.allocate(device), context, chunk, per_seq, offset, longest)

    def decode(self, b: int, longest: int = 0) -> tuple[list[list[int]], list[SeqSlice]]:
        """The first ``b`` rows' tokens and slices: one new token each, after ``context``; with
        ``longest`` (at most the case's), the first row after that many (a served batch's long prompt)."""
        rows = [SeqSlice(list(range(i * self.per_seq, (i + 1) * self.per_seq)), self.context, 1) for i in range(b)]
        if longest and b:
            first = self._long_first()
            rows[0] = SeqSlice(list(range(first, first + -(-(self.longest + 2) // BLOCK))), min(longest, self.longest), 1)
        return [[1]] * b, rows

    def _long_first(self) -> int:
        """The first of the long row's blocks: after every row's, before the chunk's."""
        return self.layout.num_blocks - (-(-(self.offset + self.chunk + 1) // BLOCK)) - (-(-(self.longest + 2) // BLOCK))

    def prefill(self, chunk: int | None = None, offset: int = 0) -> tuple[list[list[int]], list[SeqSlice]]:
        """A prompt chunk of ``chunk`` tokens (at most the case's) after ``offset`` cached ones (at most
        the case's), its tokens and slice, in the blocks after every row's."""
        n = self.chunk if chunk is None else min(chunk, self.chunk)
        first = self.layout.num_blocks - (-(-(self.offset + self.chunk + 1) // BLOCK))
        return [list(range(1, n + 1))], [SeqSlice(list(range(first, self.layout.num_blocks)), min(offset, self.offset), n)]


def _time(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """Median device ms (events around the launch and the work) and median host launch ms."""
    gpu, host = [], []
    for i in range(reps + 2):
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        torch.cuda.synchronize(device)
        if i >= 2:
            gpu.append(a.elapsed_time(b))
            host.append(1e3 * (t1 - t0))
    return statistics.median(gpu), statistics.median(host)


Batch = tuple[list[list[int]], list[SeqSlice]]


def _steps(runner: ModelRunner, eager: ModelRunner | None, dec: Batch, pre: Batch, path: list[str]) -> dict[str, Any]:
    """The timed calls of one batch size, each appending the path(s) its steps took to ``path``."""
    (dtok, dslices), (ptok, pslices) = dec, pre

    def run(r: ModelRunner, toks: list[list[int]], slices: list[SeqSlice]) -> str:
        return r.step(toks, slices).path.name

    steps = {
        "decode": lambda: path.append(run(runner, dtok, dslices)),
        "prefill": lambda: path.append(run(runner, ptok, pslices)),
        "split": lambda: path.append(run(runner, dtok, dslices) + "+" + run(runner, ptok, pslices)),
        "mixed": lambda: path.append(run(runner, dtok + ptok, dslices + pslices)),
    }
    if eager is not None:
        steps["eager"] = lambda: path.append(run(eager, dtok + ptok, dslices + pslices))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="16,48,64,128,256")
    ap.add_argument("--context", type=int, default=850)
    ap.add_argument("--chunk", default="512", help="prompt tokens beside the decode rows; a comma list times each")
    ap.add_argument("--chunk-offsets", default="0",
                    help="prompt tokens already cached before the chunk (a served prompt's later chunks); a comma list times each")
    ap.add_argument("--prefill-graph-tokens", type=int, default=0,
                    help="the runner's prefill graph / graph piece token limit (0: the largest batch plus the chunk)")
    ap.add_argument("--prefill-graph-seqs", type=int, default=16,
                    help="sequences a prefill graph holds (the decode engine's MIXED_PREFILL_SEQS); a mixed step of more runs as graph pieces")
    ap.add_argument("--mixed-graphs", action="store_true",
                    help="the mixed step past the prefill graphs' sequences as one mixed graph (the engine's default), not graph pieces")
    ap.add_argument("--eager", action="store_true", help="also time the mixed step as one eager forward")
    ap.add_argument("--step-token-target", type=int, default=0,
                    help="a token bucket of its own (hawk serve --step-token-target): e.g. 192, so 48 rows + 128 tokens pad to 192, not 256")
    ap.add_argument("--kernels", action="store_true", help="also GPU time per kernel name, decode step against mixed step")
    ap.add_argument("--longest", default="0",
                    help="the first decode row's context instead of --context (a served batch's long prompt among short ones); "
                         "a comma list times each, 0 = every row at --context")
    ap.add_argument("--decode-split-tokens", type=int, default=0,
                    help="hawk serve --decode-split-tokens: each row's decode attention in programs of at most this many tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda:0")
    a = ap.parse_args()
    device = torch.device(a.device)
    batches = [int(x) for x in a.batches.split(",")]
    chunks = [int(x) for x in a.chunk.split(",")]
    offsets = [int(x) for x in a.chunk_offsets.split(",")]
    longests = [int(x) for x in a.longest.split(",")]
    top, most = max(batches), max(chunks)
    case = StepCase.build(a.model, device, torch.bfloat16, top, a.context, most, max(offsets), max(longests))
    max_len = max(a.context, max(offsets) + most, max(longests)) + 8
    attn = PagedAttention(case.layout, case.caches, max_batch=top + 17, max_model_len=max_len, decode_split_tokens=a.decode_split_tokens)
    runner = ModelRunner(case.loaded.model, attn, max_batch=top, prefill_graph_tokens=a.prefill_graph_tokens or top + most,
                         prefill_graph_seqs=a.prefill_graph_seqs, piecewise_graphs=True, mixed_graphs=a.mixed_graphs,
                         extra_token_buckets=(a.step_token_target,) if a.step_token_target else ())
    runner.warmup()
    torch.cuda.synchronize(device)
    alloc, reserved, t0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), time.perf_counter()
    buckets = runner.warmup_mixed() if a.mixed_graphs else runner.warmup_piecewise()
    torch.cuda.synchronize(device)
    graphs = len(buckets) if a.mixed_graphs else (case.loaded.config.num_layers + 1) * len(buckets)
    print(json.dumps({"kind": "capture", "buckets": buckets, "graphs": graphs,
                      "seconds": round(time.perf_counter() - t0, 2), "allocated_mib": round((torch.cuda.memory_allocated(device) - alloc) / 2**20, 1),
                      "reserved_mib": round((torch.cuda.memory_reserved(device) - reserved) / 2**20, 1)}), flush=True)
    eager = ModelRunner(case.loaded.model, PagedAttention(case.layout, case.caches, max_batch=top + 17, max_model_len=max_len),
                        max_batch=top, graphs=False) if a.eager else None
    for longest in longests:
        for offset in offsets:
            for chunk in chunks:
                for b in batches:
                    _point(runner, eager, case, b, chunk, device, a.reps, a.kernels, offset, longest, a.decode_split_tokens)


def _point(runner: ModelRunner, eager: ModelRunner | None, case: StepCase, b: int, chunk: int, device: torch.device, reps: int,
           kernels: bool = False, offset: int = 0, longest: int = 0, split_tokens: int = 0) -> None:
    """One JSON line per kind of step at ``b`` decode rows (the first at ``longest`` tokens of context,
    if given) beside a ``chunk``-token prompt chunk after ``offset`` cached tokens of it, then the sums."""
    path: list[str] = []
    steps = _steps(runner, eager, case.decode(b, longest), case.prefill(chunk, offset), path)
    rows = {}
    point = {"batch": b, "chunk": chunk, "offset": offset, "longest": longest, "decode_split_tokens": split_tokens}
    for kind, fn in steps.items():
        gpu, host = _time(fn, device, reps)
        rows[kind] = gpu
        print(json.dumps({"kind": kind, **point, "context": case.context, "gpu_ms": round(gpu, 3),
                          "host_ms": round(host, 3), "path": path[-1]}), flush=True)
    parts = rows["decode"] + rows["prefill"]
    print(json.dumps({"kind": "sum", **point, "gpu_ms": round(parts, 3),
                      "mixed_over_sum": round(rows["mixed"] / parts, 3), "mixed_over_split": round(rows["mixed"] / rows["split"], 3),
                      "mixed_over_decode": round(rows["mixed"] / rows["decode"], 3)}), flush=True)
    if kernels:
        from decode_step_probe import kernel_times  # benchmarks/ is sys.path[0] when run as a script

        dec = kernel_times({"step": steps["decode"]}, 5)
        mix = kernel_times({"step": steps["mixed"]}, 5)
        added = sorted(set(dec) | set(mix), key=lambda k: dec.get(k, 0.0) - mix.get(k, 0.0))
        print(json.dumps({"kind": "kernels", **point, "decode_us": round(sum(dec.values()), 1),
                          "mixed_us": round(sum(mix.values()), 1),
                          "added_us": {k: [round(dec.get(k, 0.0), 1), round(mix.get(k, 0.0), 1)] for k in added[:14]}}), flush=True)


if __name__ == "__main__":
    main()
