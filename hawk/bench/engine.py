"""Model-level benchmark: decode step and prefill times, beside ceilings measured in the same run.

Why measure the ceilings here: a step time alone says nothing about how far from the hardware the
engine is. The same process therefore first measures what the device can do at best,

* ``read_gbps``: stream-read bandwidth, a reduction over a large tensor (4 GiB on a GPU, 256 MiB on
  a CPU), best of several;
* ``gemm_tflops``: dense matmul throughput in the model's dtype (8192³ on a GPU, 1024³ on a CPU),
  best of several;

and then times the model against them. A decode step is memory-bound, so its floor is the bytes
it must read divided by ``read_gbps`` (:func:`decode_floor_bytes` says which bytes); ``ratio =
ms / floor_ms`` (1.0 is perfect, 2.0 is half the achievable speed). A prefill is compute-bound, so
its ceiling is ``gemm_tflops``; ``ratio`` is the achieved fraction of it (1.0 is perfect).

Paths: ``gpu-paged`` (PagedAttention over a vLLM-layout paged cache, kv bf16) and ``npu-tile``
(NpuTileAttention over NpuKVCacheMemory on an emulated NPU whose memory is on the same device as
the model; kv bf16 or bfp8_b). On an emulated NPU the numbers are GPU (or host) memory numbers.

    python -m hawk.bench.engine --device cuda --json engine.json        # llama-3.1-8b, bf16
    python -m hawk.bench.engine --json engine_cpu.json                  # SmolLM2 on the CPU, ~1 min

The JSON is a list of records; see :func:`decode_record` and :func:`prefill_record` for the fields.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hawk.engine import sampler as sampler_mod
from hawk.engine.attention import SeqSlice
from hawk.engine.config import ModelConfig
from hawk.engine.model import LlamaModel
from hawk.engine.runner import ModelRunner
from hawk.layouts.dtypes import GPU_DTYPES, NPU_DTYPES
from hawk.layouts.tt import TILE, page_bytes

GiB, MiB = 1 << 30, 1 << 20
PATHS = ("gpu-paged", "npu-tile")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GPU_BLOCK, NPU_BLOCK = 16, 64  # tokens per block: vLLM's default, the NPU's (two tile rows)
ARCH = "blackhole-p150a"


# ---- options ---------------------------------------------------------------------------------


@dataclass
class EngineBenchSpec:
    """What to measure; ``None`` fields take the device's default (see :func:`resolve`)."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    batches: tuple[int, ...] | None = None
    contexts: tuple[int, ...] | None = None
    prefill_tokens: tuple[int, ...] | None = None
    paths: tuple[str, ...] = PATHS
    kv_dtypes: tuple[str, ...] = ("bf16", "bfp8_b")
    steps: int | None = None
    warmup: int | None = None
    point_budget_s: float | None = None
    time_budget_s: float | None = None
    hf_baseline: str = "auto"  # auto | on | off
    hf_prompt_tokens: int = 128
    hf_new_tokens: int = 32
    seed: int = 0
    threads: int | None = None  # torch CPU threads (default: torch's choice)
    replicas: int = 1  # builds of each decode point compared in rounds (run_decode_group)
    ceilings: dict[str, float] = field(default_factory=dict)  # preset ceilings (tests): skip measuring


def resolve(spec: EngineBenchSpec) -> EngineBenchSpec:
    """Fill the device defaults: the 8B preset in bf16 on a GPU, SmolLM2 in fp32 on a CPU with
    sizes small enough for about a minute on two cores."""
    dev = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = dev.type == "cuda"
    out = replace(
        spec,
        device=str(dev),
        model=spec.model or ("llama-3.1-8b" if gpu else "smollm2-135m"),
        dtype=spec.dtype or ("bf16" if gpu else "fp32"),
        batches=spec.batches or ((1, 8, 32, 64) if gpu else (1, 4)),
        contexts=spec.contexts or ((1024, 8192) if gpu else (128, 512)),
        prefill_tokens=spec.prefill_tokens if spec.prefill_tokens is not None else ((512, 2048, 8192) if gpu else (128, 512)),
        steps=spec.steps or (30 if gpu else 5),
        warmup=spec.warmup if spec.warmup is not None else (2 if gpu else 1),
        point_budget_s=spec.point_budget_s or (10.0 if gpu else 2.0),
    )
    if out.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {out.dtype!r}; expected one of {list(DTYPES)}")
    for p in out.paths:
        if p not in PATHS:
            raise ValueError(f"unknown path {p!r}; expected one of {list(PATHS)}")
    for k in out.kv_dtypes:
        if k not in GPU_DTYPES and k not in NPU_DTYPES:
            raise ValueError(f"unknown kv dtype {k!r}; expected bf16, fp16, fp32 or bfp8_b")
    if out.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {out.replicas}")
    if out.hf_baseline not in ("auto", "on", "off"):
        raise ValueError(f"--hf-baseline must be auto, on or off, got {out.hf_baseline!r}")
    return out


def kv_dtypes_for(path: str, kv_dtypes: Sequence[str]) -> list[str]:
    """The requested KV dtypes a path can hold: the paged cache takes torch dtypes, the tiles bf16/bfp8_b."""
    ok = GPU_DTYPES if path == "gpu-paged" else NPU_DTYPES
    return [k for k in kv_dtypes if k in ok]


# ---- the ceilings --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up: CUDA events on a GPU (kernel time, no host
    gaps), synchronize + perf_counter elsewhere. Best, not median: a ceiling is what the device
    can do, and slower runs measure interference."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure_read_gbps(device: torch.device, nbytes: int | None = None, repeats: int = 8) -> float:
    """Stream-read bandwidth (GB/s, 1e9): ``x.sum()`` over ``nbytes`` of fp32, which reads every
    byte once and writes one scalar. 4 GiB on a GPU (far past any cache), 256 MiB on a CPU."""
    nbytes = nbytes or (4 * GiB if device.type == "cuda" else 256 * MiB)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    ms = _best_ms(lambda: x.sum(), device, repeats)
    del x
    _free(device)
    return nbytes / (ms * 1e-3) / 1e9


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 8) -> float:
    """Dense ``n x n @ n x n`` matmul throughput (TFLOP/s) in the model's dtype: 8192 on a GPU, 1024 on a CPU."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = _best_ms(lambda: a @ b, device, repeats)
    del a, b
    _free(device)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---- bytes and flops ---------------------------------------------------------------------------------


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: q, k, v, o and the SwiGLU gate, up, down."""
    h = cfg.hidden_size
    return h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size


def decode_weight_bytes(cfg: ModelConfig, elem_bytes: int) -> int:
    """Weight bytes one decode step must read: every layer's matmul and norm weights, the final
    norm, and the LM head in full (``vocab x hidden``; with tied embeddings that is the embedding
    table, counted once). The embedding *lookup* is excluded: it reads only one row per sequence,
    a few KiB, not the table."""
    h = cfg.hidden_size
    per_layer = layer_matmul_params(cfg) + 2 * h  # + attention and MLP RMSNorm weights
    return (cfg.num_layers * per_layer + h + cfg.vocab_size * h) * elem_bytes


def kv_read_bytes(cfg: ModelConfig, path: str, kv_dtype: str, batch: int, context: int) -> int:
    """KV bytes one decode step must read: K and V of all layers for the ``context`` cached tokens of
    each of ``batch`` sequences, in the cache's encoding.

    ``gpu-paged``: ``context`` rows of ``kv_heads x head_dim`` elements of the cache dtype.
    ``npu-tile``: whole 32x32 tiles (the NPU reads tiles, so a partly filled tile row counts in
    full): ``ceil(context / 32) x head_dim / 32`` tiles per head, each ``page_bytes(kv_dtype)``
    (2048 B for bf16, 1088 B for bfp8_b: 1024 values + 64 shared exponents).
    The new token's own K/V is not counted: a fused kernel has it in registers.
    """
    if path == "npu-tile":
        tiles = -(-context // TILE) * (cfg.head_dim // TILE)
        return batch * cfg.num_layers * 2 * cfg.num_kv_heads * tiles * page_bytes(kv_dtype)
    elem = torch.empty((), dtype=GPU_DTYPES[kv_dtype]).element_size()
    return batch * context * cfg.num_layers * 2 * cfg.kv_size * elem


def decode_floor_bytes(cfg: ModelConfig, elem_bytes: int, path: str, kv_dtype: str, batch: int, context: int) -> int:
    """All bytes a decode step must read: weights once (:func:`decode_weight_bytes`) + the batch's KV
    (:func:`kv_read_bytes`). Activations, logits and the sampled tokens are ignored (KiB to MiB)."""
    return decode_weight_bytes(cfg, elem_bytes) + kv_read_bytes(cfg, path, kv_dtype, batch, context)


def prefill_flops(cfg: ModelConfig, tokens: int) -> int:
    """Flops of one prefill of ``tokens`` (one sequence, start 0).

    ``2 x layer matmul params x tokens`` for the projections; the LM head runs on the last token
    only (the runner projects each sequence's last hidden state), ``2 x hidden x vocab``; causal
    attention does ``QK^T`` and ``PV`` over ``T(T+1)/2`` query-key pairs per query head, ``2 x
    head_dim`` flops each: ``2 x layers x q_heads x head_dim x T(T+1)`` in all.
    """
    mm = 2 * cfg.num_layers * layer_matmul_params(cfg) * tokens + 2 * cfg.hidden_size * cfg.vocab_size
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1)
    return mm + attn


# ---- building a point --------------------------------------------------------------------------------


@dataclass
class Cache:
    """One point's attention backend, each sequence's block ids, and what to release afterwards."""

    attn: Any
    blocks: list[list[int]]
    nbytes: int
    close: Callable[[], None] = lambda: None


def per_seq_blocks(block_size: int, batch: int, tokens: int) -> list[list[int]]:
    """Distinct, contiguous block ids per sequence, as the engines' BlockManager hands them to a
    fresh batch (lowest ids first): sequence i owns ``[i*n, (i+1)*n)``."""
    n = -(-tokens // block_size)
    return [list(range(i * n, (i + 1) * n)) for i in range(batch)]


def _sizing(backend: type, batch: int, tokens: int) -> dict[str, int]:
    """``max_batch`` / ``max_model_len`` for a backend constructor that takes them (metadata
    buffers sized to the point, as an instance sizes them to its limits)."""
    params = inspect.signature(backend).parameters
    sizes = {"max_batch": batch, "max_model_len": tokens}
    return {k: v for k, v in sizes.items() if k in params}


def paged_cache_bytes(cfg: ModelConfig, kv_dtype: str, batch: int, tokens: int) -> int:
    blocks = batch * -(-tokens // GPU_BLOCK)
    elem = torch.empty((), dtype=GPU_DTYPES[kv_dtype]).element_size()
    return blocks * GPU_BLOCK * cfg.num_layers * 2 * cfg.kv_size * elem


def build_paged(cfg: ModelConfig, kv_dtype: str, batch: int, tokens: int, device: torch.device) -> Cache:
    """A zeroed vLLM-layout cache holding exactly the batch's blocks (zeros are valid KV)."""
    from hawk.engine.paged_attention import PagedAttention
    from hawk.layouts.gpu import GpuKVLayout

    blocks = per_seq_blocks(GPU_BLOCK, batch, tokens)
    layout = GpuKVLayout(cfg.num_layers, batch * len(blocks[0]), GPU_BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
    caches = layout.allocate(device)
    attn = PagedAttention(layout, caches, **_sizing(PagedAttention, batch, tokens))
    return Cache(attn, blocks, layout.layer_bytes * cfg.num_layers)


def _npu_layout(cfg: ModelConfig, kv_dtype: str, num_blocks: int, bank_capacity: int | None = None):
    from hawk.layouts.npu import NpuKVLayout, get_arch

    return NpuKVLayout(get_arch(ARCH, bank_capacity), cfg.num_layers, num_blocks, cfg.num_kv_heads, NPU_BLOCK, cfg.head_dim, kv_dtype)


def npu_bank_bytes(cfg: ModelConfig, kv_dtype: str, batch: int, tokens: int) -> int:
    """Bank size of an emulated NPU that holds the batch's tiled cache (+ slack), whole MiB."""
    lay = _npu_layout(cfg, kv_dtype, batch * -(-tokens // NPU_BLOCK))
    need = lay.num_tensors * (lay.tensor_buffer(0).bytes_per_bank + lay.arch.alignment) + 4 * MiB
    return -(-need // MiB) * MiB


def build_npu(cfg: ModelConfig, kv_dtype: str, batch: int, tokens: int, device: torch.device) -> Cache:
    """An emulated p150a whose DRAM is a zeroed tensor on ``device`` (zero bytes decode to 0.0 in
    bf16 and bfp8_b), sized to the batch, with the tiled KV cache interleaved over its banks."""
    from hawk.devices.emulated import open_npu
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory

    blocks = per_seq_blocks(NPU_BLOCK, batch, tokens)
    bank = npu_bank_bytes(cfg, kv_dtype, batch, tokens)
    npu = open_npu(f"npu-emu:{device}", ARCH, bank_capacity=bank)
    kv = NpuKVCacheMemory(npu, _npu_layout(cfg, kv_dtype, batch * len(blocks[0]), bank))
    attn = NpuTileAttention(kv, **_sizing(NpuTileAttention, batch, tokens))
    return Cache(attn, blocks, bank * npu.arch.num_banks, kv.close)


def cache_bytes(cfg: ModelConfig, path: str, kv_dtype: str, batch: int, tokens: int) -> int:
    if path == "npu-tile":
        return npu_bank_bytes(cfg, kv_dtype, batch, tokens) * 8  # p150a: 8 banks
    return paged_cache_bytes(cfg, kv_dtype, batch, tokens)


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can still take on ``device``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def fits(need: int, device: torch.device) -> tuple[bool, str]:
    """Whether ``need`` bytes of cache fit, leaving room for activations and the allocator's slack."""
    spare = 2 * GiB if device.type == "cuda" else 512 * MiB
    avail = free_bytes(device)
    if need + spare > avail:
        return False, f"skipped: needs {need / GiB:.1f} GiB of cache, {avail / GiB:.1f} GiB free on {device}"
    return True, ""


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e).lower() or "can't allocate memory" in str(e).lower())


# ---- the runner, graphs and sampling (whatever the engine offers now) ---------------------------------


def make_runner(model: LlamaModel, attn: Any, batch: int, device: torch.device) -> tuple[Any, bool, str]:
    """``ModelRunner(model, attn[, max_batch, graphs])``, with CUDA graphs asked for on a GPU when
    this runner takes them; if it refuses (backend not graph-safe), eager, with the reason.
    Returns the runner, whether it replays graphs, and a note."""
    params = inspect.signature(ModelRunner).parameters
    kwargs: dict[str, Any] = {"max_batch": batch} if "max_batch" in params else {}
    if device.type == "cuda" and "graphs" in params:
        try:
            runner = ModelRunner(model, attn, **kwargs, graphs=True)
            return runner, bool(getattr(runner, "use_graphs", True)), ""
        except Exception as e:  # noqa: BLE001 - GraphsUnavailable and the like: time eagerly, say why
            runner = ModelRunner(model, attn, **kwargs, graphs=False)
            return runner, False, f"eager: {type(e).__name__}: {e}"
    runner = ModelRunner(model, attn, **kwargs)
    return runner, bool(getattr(runner, "use_graphs", False)), ""


def warm_runner(runner: Any, batch: int) -> str:
    """Capture graphs for this batch bucket first, when the runner can (``warmup(buckets)``)."""
    warm = getattr(runner, "warmup", None)
    if warm is None:
        return ""
    try:
        warm([batch])
    except Exception as e:  # noqa: BLE001 - say so in the record and time the eager path
        return f"warmup([{batch}]) failed: {type(e).__name__}: {e}"
    return ""


Step = Callable[[Sequence[Sequence[int]], Sequence[SeqSlice]], list[int]]


def make_step(runner: Any, n: int) -> tuple[str, Step]:
    """A decode or prefill step as an engine runs it: the runner's forward, sampling of the
    ``n`` sequences on the device, and one host sync that fetches the tokens.

    Uses ``runner.step`` (forward without the logits copy, plus the greedy tokens a graph already
    computed) when the runner has it, else ``runner.forward``; samples with
    ``hawk.engine.sampler.sample_batch`` (greedy parameters) when it exists, else a device
    ``argmax``. Returns the sampler's name and the step.
    """
    from hawk.engine.sequence import SamplingParams

    fn = getattr(sampler_mod, "sample_batch", None)
    names = inspect.signature(fn).parameters if fn is not None else {}
    params, gens = [SamplingParams()] * n, [None] * n
    has_step = callable(getattr(runner, "step", None))

    def forward(tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice]) -> tuple[torch.Tensor, Any]:
        if has_step:
            out = runner.step(tokens, slices)
            return out.logits, getattr(out, "greedy", None)
        return runner.forward(tokens, slices), None

    def sample(logits: torch.Tensor, greedy: Any) -> list[int]:
        if fn is None:
            return (greedy if greedy is not None else logits.argmax(-1)).tolist()
        kw: dict[str, Any] = {}
        if "generators" in names:
            kw["generators"] = gens
        if "greedy" in names:
            kw["greedy"] = greedy
        out = fn(logits, params, **kw)
        return out.tolist() if isinstance(out, torch.Tensor) else [int(t) for t in out]

    def step(tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice]) -> list[int]:
        return sample(*forward(tokens, slices))

    return ("sample_batch" if fn is not None else "argmax"), step


#: Steps per timed run of the overlapped loop: the first step of a run cannot hide its host work
#: (nothing is in flight yet), so a run is long enough for that to stay under a percent.
OVERLAP_RUN = 16


def make_overlapped_steps(runner: ModelRunner, n: int, k: int = OVERLAP_RUN) -> Step:
    """``k`` decode steps as the decode engine runs them on a GPU (async scheduling,
    hawk/engine/token_fetch.py): each step after the first launched on the previous step's
    tokens on the device, before the host reads those, so the host's work for the next step
    overlaps the GPU's for this one. Returns the last step's tokens."""
    from hawk.engine.sequence import SamplingParams
    from hawk.engine.token_fetch import TokenFetcher

    fetcher = TokenFetcher(runner.device, n)
    params, gens = [SamplingParams()] * n, [None] * n

    def launch(tokens: Sequence[Sequence[int]] | None, slices: Sequence[SeqSlice], ids: torch.Tensor | None) -> Any:
        out = runner.step(tokens, slices, ids=ids)
        return fetcher.start(sampler_mod.sample_tokens(out.logits, params, gens, out.greedy))

    def run(tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice]) -> list[int]:
        prev = launch(tokens, slices, None)
        for _ in range(k - 1):
            nxt = launch(None, slices, prev.device)
            prev.result()
            prev = nxt
        return prev.result()

    return run


def time_steps(step: Callable[[], object], device: torch.device, warmup: int, steps: int, budget_s: float) -> tuple[float, int]:
    """Median ms of ``step`` after ``warmup`` calls, synchronized on both sides of each call: one step
    timed in rounds (:func:`time_rounds`). Stops early once ``budget_s`` is spent (after at least 3
    steps), so a slow point cannot eat the run. Returns ``(median ms, steps timed)``.
    """
    return time_rounds([step], device, warmup, steps, budget_s)[0]


def time_rounds(steps: Sequence[Callable[[], object]], device: torch.device, warmup: int, rounds: int,
                budget_s: float) -> list[tuple[float, int]]:
    """Median ms of each of ``steps`` and how many calls were timed (:func:`round_times`)."""
    return [(statistics.median(t), len(t)) for t in round_times(steps, device, warmup, rounds, budget_s)]


def round_times(steps: Sequence[Callable[[], object]], device: torch.device, warmup: int, rounds: int,
                budget_s: float) -> list[list[float]]:
    """Each of ``steps``' times (ms, one per round), timed in rounds: one call of each per round, the
    round's first step rotating (round r starts at step r mod n), each call synchronized on both sides.

    Why rounds: on an H200 the same CUDA graph replayed ~5 % slower minutes into a process than at
    its start (benchmarks/graph_order_probe.py), as large as the differences the paths are compared
    on; timed back to back in rounds, every path sees the same drift (and :func:`paired_ratio` can
    compare them round by round). Stops early once ``budget_s`` is spent (after at least 3 rounds).
    """
    for step in steps:
        for _ in range(warmup):
            step()
    _sync(device)
    times: list[list[float]] = [[] for _ in steps]
    n, t_start = len(steps), time.perf_counter()
    for r in range(rounds):
        for i in [(r + j) % n for j in range(n)]:
            _sync(device)
            t0 = time.perf_counter()
            steps[i]()
            _sync(device)
            times[i].append((time.perf_counter() - t0) * 1e3)
        if r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return times


def paired_ratio(times: Sequence[float], base: Sequence[float]) -> dict[str, float | int]:
    """``times[r] / base[r]`` for each round ``r`` of :func:`round_times`: median and quartiles.

    Why paired: a ratio of two medians still carries whatever moved between the two medians' rounds;
    a ratio taken within each round (the two calls back to back) cancels the drift both saw, so its
    spread is the compared steps' own (on an H200 the GEMMs' clock drift moved whole-step medians by
    0.5-2 % between points timed apart, more than the bfloat8_b and paged steps differ at batch 1).
    """
    if len(times) != len(base) or not times:
        raise ValueError(f"paired times need equal, non-zero lengths, got {len(times)} and {len(base)}")
    r = sorted(t / b for t, b in zip(times, base))
    q25, q75 = (statistics.quantiles(r, n=4)[0::2] if len(r) > 1 else (r[0], r[0]))
    return {"median": round(statistics.median(r), 4), "q25": round(q25, 4), "q75": round(q75, 4), "rounds": len(r)}


# ---- the points ------------------------------------------------------------------------------------


@dataclass
class Context:
    """What every point shares: the model, the device, the ceilings and the record's constant fields."""

    model: LlamaModel
    cfg: ModelConfig
    device: torch.device
    spec: EngineBenchSpec
    read_gbps: float
    gemm_tflops: float
    base: dict[str, Any]
    deadline: float

    @property
    def elem_bytes(self) -> int:
        return self.model.dtype.itemsize


def _note(path: str, device: torch.device) -> str:
    return f"emulated NPU: memory on {device}" if path == "npu-tile" else ""


def decode_record(ctx: Context, path: str, kv_dtype: str, batch: int, context: int, ms: float | None, **extra: Any) -> dict[str, Any]:
    """A decode record: ``ms`` per step, and its floor ``floor_ms = floor_bytes / read_gbps``."""
    nbytes = decode_floor_bytes(ctx.cfg, ctx.elem_bytes, path, kv_dtype, batch, context)
    floor_ms = nbytes / (ctx.read_gbps * 1e9) * 1e3
    rec = {
        "kind": "decode", "path": path, "kv_dtype": kv_dtype, "batch": batch, "context": context,
        "ms": None if ms is None else round(ms, 4), "floor_ms": round(floor_ms, 4), "floor_bytes": nbytes,
        "weight_bytes": decode_weight_bytes(ctx.cfg, ctx.elem_bytes),
        "kv_bytes": kv_read_bytes(ctx.cfg, path, kv_dtype, batch, context),
        "ratio": None if ms is None else round(ms / floor_ms, 4),
        "tokens_per_s": None if ms is None else round(batch / (ms * 1e-3), 2),
        **ctx.base, "note": _note(path, ctx.device),
    }
    rec.update(extra)
    return rec


def prefill_record(ctx: Context, path: str, kv_dtype: str, tokens: int, ms: float | None, **extra: Any) -> dict[str, Any]:
    """A prefill record: ``ms``, its ``flops`` and the achieved fraction of ``gemm_tflops`` as ``ratio``."""
    flops = prefill_flops(ctx.cfg, tokens)
    achieved = None if ms is None else flops / (ms * 1e-3) / 1e12
    rec = {
        "kind": "prefill", "path": path, "kv_dtype": kv_dtype, "batch": 1, "tokens": tokens,
        "ms": None if ms is None else round(ms, 4), "flops": flops,
        "tflops": None if achieved is None else round(achieved, 3),
        "ratio": None if achieved is None else round(achieved / ctx.gemm_tflops, 4),
        **ctx.base, "note": _note(path, ctx.device),
    }
    rec.update(extra)
    return rec


def _skip_reason(ctx: Context, need: int) -> str:
    if time.monotonic() > ctx.deadline:
        return "skipped: time budget spent"
    ok, why = fits(need, ctx.device)
    return "" if ok else why


def _guarded(ctx: Context, measure: Callable[[], dict[str, Any]], skipped: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """Run one point; an out-of-memory error skips it with a note (anything else is a bug and
    propagates). The point's cache is built and dropped inside ``measure``, so once it returns
    nothing references it and the memory can go back before the next point."""
    try:
        rec = measure()
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        rec = skipped(f"skipped: out of memory ({str(e)[:120]})")
    _free(ctx.device)
    return rec


def run_decode_point(ctx: Context, path: str, kv_dtype: str, batch: int, context: int) -> dict[str, Any]:
    """One decode point: ``batch`` sequences with ``context`` tokens cached each add one token.

    A step is ``runner.forward`` + sampling + the host fetch of the tokens; the sampled tokens are
    fed back, and every step writes and reads at position ``context`` (the context stays fixed).
    """
    def skipped(why: str) -> dict[str, Any]:
        return decode_record(ctx, path, kv_dtype, batch, context, None, skipped=True, note=why)

    why = _skip_reason(ctx, cache_bytes(ctx.cfg, path, kv_dtype, batch, context + 1))
    if why:
        return skipped(why)
    return _guarded(ctx, lambda: _measure_decode(ctx, path, kv_dtype, batch, context), skipped)


@dataclass
class _Prepared:
    """One decode point ready to time: its cache, a step that feeds its sampled tokens back, and
    what its record says about how it ran."""

    cache: Cache
    step: Callable[[], None]
    graphs: bool
    sampler: str
    note: str
    #: :data:`OVERLAP_RUN` steps overlapped as the engine runs them on a GPU (None on a CPU, where
    #: the engine does not overlap: its steps are synchronous anyway).
    overlapped: Callable[[], None] | None = None

    def timed(self) -> list[Callable[[], None]]:
        return [self.step] + ([self.overlapped] if self.overlapped is not None else [])

    def record(self, ctx: Context, point: tuple[str, str, int, int], times: Sequence[tuple[float, int]], **extra: Any) -> dict[str, Any]:
        """The point's record from :meth:`timed`'s times: ``ms`` per step as the engine runs it
        (overlapped on a GPU; then ``sync_ms`` is the synchronous step: forward, sampling, fetch)."""
        (ms, steps), *rest = times
        if rest:
            extra = {"sync_ms": round(ms, 4), "overlap_run": OVERLAP_RUN, **extra}
            ms, steps = rest[0][0] / OVERLAP_RUN, rest[0][1] * OVERLAP_RUN
        return decode_record(ctx, *point, ms, steps=steps, graphs=self.graphs, sampler=self.sampler,
                             cache_bytes=self.cache.nbytes, note=self.note, overlap=bool(rest), **extra)


@dataclass
class DecodePoint:
    """One decode point as the benchmark builds it (also what the probes in ``benchmarks/`` time): its
    cache, its runner (CUDA graphs captured where it can) and ``step``, the engine's step on the point's
    sequences with each sampled token fed back as the next input. The caller closes ``cache``."""

    cache: Cache
    runner: Any
    graphs: bool
    sampler: str
    #: why there are no graphs, and the warm-up's warnings ("" when none)
    why: str
    step: Callable[[], None]
    feed: Callable[[Step], Callable[[], None]]


def build_decode_point(model: LlamaModel, path: str, kv_dtype: str, batch: int, context: int, device: torch.device,
                       decode_config: Any = None) -> DecodePoint:
    """Build a decode point: ``batch`` sequences of ``context`` cached tokens on ``path``'s cache;
    ``decode_config`` (npu-tile: a ``DecodeConfig``) is set before the graphs are captured."""
    build = build_npu if path == "npu-tile" else build_paged
    cache = build(model.config, kv_dtype, batch, context + 1, device)
    try:
        if decode_config is not None:
            cache.attn.decode_config = decode_config
        runner, graphs, why = make_runner(model, cache.attn, batch, device)
        warn = warm_runner(runner, batch)
        sname, run = make_step(runner, batch)
    except BaseException:
        cache.close()
        raise
    slices = [SeqSlice(b, context, 1) for b in cache.blocks]
    tokens = [[1] for _ in range(batch)]

    def feed(run: Step) -> Callable[[], None]:
        """``run`` on the point's slices, its sampled tokens fed back as the next call's."""
        def call() -> None:
            for row, t in zip(tokens, run(tokens, slices)):
                row[0] = t
        return call

    return DecodePoint(cache, runner, graphs, sname, "; ".join(x for x in (why, warn) if x), feed(run), feed)


def _prepare_decode(ctx: Context, path: str, kv_dtype: str, batch: int, context: int) -> _Prepared:
    """Build a point's cache and runner (graphs captured); the caller closes the cache."""
    pt = build_decode_point(ctx.model, path, kv_dtype, batch, context, ctx.device)
    overlapped = pt.feed(make_overlapped_steps(pt.runner, batch)) if ctx.device.type == "cuda" else None
    note = "; ".join(x for x in (_note(path, ctx.device), pt.why) if x)
    return _Prepared(pt.cache, pt.step, pt.graphs, pt.sampler, note, overlapped)


def _measure_decode(ctx: Context, path: str, kv_dtype: str, batch: int, context: int) -> dict[str, Any]:
    prep = _prepare_decode(ctx, path, kv_dtype, batch, context)
    try:
        times = time_rounds(prep.timed(), ctx.device, ctx.spec.warmup or 0, ctx.spec.steps or 10, ctx.spec.point_budget_s or 10.0)
    finally:
        prep.cache.close()
    return prep.record(ctx, (path, kv_dtype, batch, context), times)


def run_decode_group(ctx: Context, points: Sequence[tuple[str, str, int, int]]) -> list[dict[str, Any]]:
    """Several decode points (the paths at one batch and context), timed in rounds (:func:`round_times`)
    when their caches fit side by side, so their ratios are like for like; else one after another.

    With ``replicas`` > 1 each point is built that many times (its own cache, runner and graphs, so in
    other memory; built in turns, no path always first), all timed in the same rounds, and its times
    pooled. Why: on an H200 two builds of the same paged point in one process differed by up to 0.4 %
    (the same kernels, other addresses), as much as the bfloat8_b and paged steps differ at batch 1.

    Records timed so carry ``interleaved``: how many points shared their rounds (absent when timed alone),
    ``replicas``, and, beside a paged point, ``vs_paged``: their step over the paged step's, round by round,
    replica ``k`` against the paged replica ``k`` (:func:`paired_ratio` of the step ``ms`` reports: the
    overlapped one on a GPU; with replicas, ``by_replica``: each one's median).
    """
    if len(points) < 2:
        return [run_decode_point(ctx, *p) for p in points]
    reps = max(1, ctx.spec.replicas)
    need = reps * sum(cache_bytes(ctx.cfg, path, kv, b, c + 1) for path, kv, b, c in points)
    if _skip_reason(ctx, need):
        return [run_decode_point(ctx, *p) for p in points]
    preps: list[_Prepared] = []  # replica k of point i at k * len(points) + i
    try:
        for _ in range(reps):
            for p in points:
                preps.append(_prepare_decode(ctx, *p))
        spec = ctx.spec
        # temporaries and comprehensions only: no local may keep a runner (its graphs' memory) past the finally
        raw = iter(round_times([fn for x in preps for fn in x.timed()], ctx.device, spec.warmup or 0,
                               spec.steps or 10, (spec.point_budget_s or 10.0) * len(preps)))
        per_prep = [[next(raw) for _ in x.timed()] for x in preps]
        n, base = len(points), _paged_base(points)
        return [preps[i].record(ctx, p, _pooled([per_prep[k * n + i] for k in range(reps)]), interleaved=n, replicas=reps,
                                **({} if base is None or i == base else
                                   {"vs_paged": _paired_replicas([per_prep[k * n + i][-1] for k in range(reps)],
                                                                 [per_prep[k * n + base][-1] for k in range(reps)])}))
                for i, p in enumerate(points)]
    except Exception as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
    finally:
        while preps:  # the runners and their graphs go with them, before the next points (no loop variable keeps one)
            preps.pop().cache.close()
        _free(ctx.device)
    return [run_decode_point(ctx, *p) for p in points]  # out of memory side by side: one at a time


def _pooled(replicas: Sequence[Sequence[list[float]]]) -> list[tuple[float, int]]:
    """Per timed call of a point, its replicas' round times pooled: (median ms, calls timed)."""
    pooled = [[t for rep in replicas for t in rep[j]] for j in range(len(replicas[0]))]
    return [(statistics.median(t), len(t)) for t in pooled]


def _paired_replicas(times: Sequence[list[float]], base: Sequence[list[float]]) -> dict[str, Any]:
    """:func:`paired_ratio` over every replica's rounds (replica k against base replica k), and each
    replica's median where there are several."""
    out: dict[str, Any] = paired_ratio([t for rep in times for t in rep], [b for rep in base for b in rep])
    if len(times) > 1:
        out["by_replica"] = [paired_ratio(t, b)["median"] for t, b in zip(times, base)]
    return out


def _paged_base(points: Sequence[tuple[str, str, int, int]]) -> int | None:
    """Index of the point the others are paired with (:func:`paired_ratio`): the paged bf16 step,
    else the first paged one; None without one."""
    paged = [i for i, p in enumerate(points) if p[0] == "gpu-paged"]
    return next((i for i in paged if points[i][1] == "bf16"), paged[0] if paged else None)


def run_prefill_point(ctx: Context, tokens: int, kv_dtype: str = "bf16") -> dict[str, Any]:
    """One prefill of ``tokens`` (one sequence, start 0) over a fresh paged cache: forward +
    sampling of the first token + its host fetch. Median of up to 5 runs within the point budget
    (each run rewrites the same slots)."""
    path = "gpu-paged"

    def skipped(why: str) -> dict[str, Any]:
        return prefill_record(ctx, path, kv_dtype, tokens, None, skipped=True, note=why)

    # cache + the widest activations (gate and up outputs, fp32-sized to be safe)
    why = _skip_reason(ctx, paged_cache_bytes(ctx.cfg, kv_dtype, 1, tokens) + 8 * tokens * ctx.cfg.intermediate_size)
    if why:
        return skipped(why)
    return _guarded(ctx, lambda: _measure_prefill(ctx, tokens, kv_dtype), skipped)


def _measure_prefill(ctx: Context, tokens: int, kv_dtype: str) -> dict[str, Any]:
    cache = build_paged(ctx.cfg, kv_dtype, 1, tokens, ctx.device)
    runner, _, _ = make_runner(ctx.model, cache.attn, 1, ctx.device)
    _, run = make_step(runner, 1)
    ids = [[(7919 * i + 11) % ctx.cfg.vocab_size for i in range(tokens)]]
    slices = [SeqSlice(cache.blocks[0], 0, tokens)]
    ms, n = time_steps(lambda: run(ids, slices), ctx.device, 1, min(ctx.spec.steps or 5, 5),
                       ctx.spec.point_budget_s or 10.0)
    return prefill_record(ctx, "gpu-paged", kv_dtype, tokens, ms, steps=n)


# ---- transformers' generate, beside HAWK's colocated decode (CPU, SmolLM2) ------------------------------


def hawk_generate(model: LlamaModel, prompt: list[int], new_tokens: int, device: torch.device,
                  repeats: int = 2) -> tuple[float, list[int]]:
    """HAWK's colocated generation (paged bf16 cache, greedy, batch 1): ms per decode step after
    the prefill (best of ``repeats`` generations, as for transformers), and the tokens. Each step
    is forward + sampling + host fetch, as in the engines."""
    cache = build_paged(model.config, "bf16", 1, len(prompt) + new_tokens, device)
    runner, _, _ = make_runner(model, cache.attn, 1, device)
    warm_runner(runner, 1)
    _, run = make_step(runner, 1)
    blocks = cache.blocks[0]
    times: list[float] = []
    out: list[int] = []
    for _ in range(repeats + 1):  # the first generation is the warm-up
        out = run([prompt], [SeqSlice(blocks, 0, len(prompt))])
        _sync(device)
        t0 = time.perf_counter()
        for i in range(new_tokens - 1):
            out += run([[out[-1]]], [SeqSlice(blocks, len(prompt) + i, 1)])
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3 / max(1, new_tokens - 1))
    del cache, runner, run
    _free(device)
    return min(times[1:] or times), out


def transformers_generate(gguf_path: Path, prompt: list[int], new_tokens: int, dtype: torch.dtype, repeats: int = 2) -> tuple[float, list[int]]:
    """transformers' ``generate`` (greedy, batch 1) on the same GGUF, loaded by its GGUF loader:
    ms per decode token = (time for ``new_tokens`` - time for 1) / (``new_tokens`` - 1), best of
    ``repeats`` each, so its prefill and setup cancel out."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # keep the benchmark's output a table
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    m = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, **kw).eval()
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def gen(n: int) -> list[int]:
        with torch.inference_mode():
            out = m.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[0, len(prompt):].tolist()

    def best(n: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            gen(n)
            times.append(time.perf_counter() - t0)
        return min(times)

    gen(2)  # warm-up
    ms = (best(new_tokens) - best(1)) * 1e3 / max(1, new_tokens - 1)
    tokens = gen(new_tokens)
    del m
    gc.collect()
    return ms, tokens


def want_hf_baseline(spec: EngineBenchSpec) -> tuple[bool, str]:
    """Whether to run the transformers baseline, and if not, why (empty: nothing to say).

    ``auto`` runs it on a CPU with the embedded model when transformers is importable (an
    optional extra, never a CI dependency); ``on`` insists; ``off`` never runs it.
    """
    from hawk.engine.loader import EMBEDDED

    if spec.hf_baseline == "off":
        return False, ""
    have = importlib.util.find_spec("transformers") is not None
    if spec.hf_baseline == "on":
        if not (have and spec.model in EMBEDDED):
            raise ValueError("--hf-baseline on needs transformers importable and the embedded model (smollm2-135m)")
        return True, ""
    if str(spec.device) != "cpu" or spec.model not in EMBEDDED:
        return False, ""
    return have, "" if have else "transformers baseline skipped: transformers is not importable (pip install transformers)"


def run_hf_baseline(ctx: Context) -> dict[str, Any]:
    """The transformers record: its decode ms per token beside HAWK's colocated one, same model,
    prompt length and new tokens, measured the same way (decode steps only, greedy, batch 1)."""
    from hawk.engine.loader import embedded_path

    p, n = ctx.spec.hf_prompt_tokens, ctx.spec.hf_new_tokens
    prompt = [(7919 * i + 11) % ctx.cfg.vocab_size for i in range(p)]
    dtype_name = str(ctx.spec.dtype)
    kv = dtype_name if dtype_name in GPU_DTYPES else "fp32"
    hawk_ms, hawk_toks = hawk_generate(ctx.model, prompt, n, ctx.device)
    try:
        hf_ms, hf_toks = transformers_generate(embedded_path(str(ctx.spec.model)), prompt, n, ctx.model.dtype)
    except Exception as e:  # noqa: BLE001 - a missing extra (accelerate, gguf) must not cost the run its table
        return decode_record(ctx, "transformers", kv, 1, p, None, skipped=True, hawk_ms=round(hawk_ms, 4),
                             note=f"skipped: transformers baseline failed: {type(e).__name__}: {str(e)[:160]}")
    return decode_record(
        ctx, "transformers", kv, 1, p, hf_ms, new_tokens=n, hawk_ms=round(hawk_ms, 4),
        hawk_tokens_per_s=round(1e3 / hawk_ms, 2), hawk_no_slower=hawk_ms <= hf_ms,
        tokens_match=hawk_toks == hf_toks,
        note=f"transformers generate (GGUF loader) vs HAWK colocated paged decode, prompt {p}, {n} new tokens",
    )


# ---- the run -----------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_benchmark(spec: EngineBenchSpec, on_record: Callable[[dict[str, Any]], None] | None = None,
                  model: LlamaModel | None = None, verbose: bool = True) -> list[dict[str, Any]]:
    """Measure the ceilings, then every decode and prefill point, with one model built once.

    ``on_record`` sees each record as it is made (the command line rewrites the JSON file, so a
    run cut short by a time limit keeps what it measured).
    """
    spec = resolve(spec)
    dev = torch.device(str(spec.device))
    t_start = time.monotonic()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    if model is None:
        from hawk.engine.loader import load_model

        model = load_model(str(spec.model), dev, DTYPES[str(spec.dtype)], spec.seed).model
    log = print if verbose else (lambda *a, **k: None)
    log(f"model {spec.model} ({spec.dtype}) on {dev} ready in {time.monotonic() - t_start:.1f} s", flush=True)
    read = spec.ceilings.get("read_gbps") or measure_read_gbps(dev)
    gemm = spec.ceilings.get("gemm_tflops") or measure_gemm_tflops(dev, model.dtype)
    log(f"ceilings: read {read:.1f} GB/s, gemm {gemm:.2f} TFLOP/s ({spec.dtype})", flush=True)
    deadline = t_start + spec.time_budget_s if spec.time_budget_s else float("inf")
    base = {"device": device_name(dev), "model": spec.model, "dtype": spec.dtype,
            "read_gbps": round(read, 2), "gemm_tflops": round(gemm, 3)}
    ctx = Context(model, model.config, dev, spec, read, gemm, base, deadline)
    records: list[dict[str, Any]] = []

    def add(rec: dict[str, Any]) -> None:
        records.append(rec)
        if on_record:
            on_record(rec)
        log(_line(rec), flush=True)

    # Prefill first: three quick points a time budget should never be the one to drop.
    if "gpu-paged" in spec.paths:
        for tokens in spec.prefill_tokens or ():
            add(run_prefill_point(ctx, tokens))
    points = [(path, kv, batch, context) for context in spec.contexts or () for batch in spec.batches or ()
              for path in spec.paths for kv in kv_dtypes_for(path, spec.kv_dtypes)]
    if points and dev.type == "cuda":
        # A process's first decode point ran ~5 % faster than the same work later on an H200 (whichever path;
        # benchmarks/graph_order_probe.py): one point is run and dropped first, so none is measured in that state.
        warm = run_decode_point(ctx, *points[0])
        log(f"warm-up point (not kept): {_line(warm)}", flush=True)
    groups: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}
    for point in points:  # the paths compared at one batch and context are timed together, in rounds
        groups.setdefault(point[2:], []).append(point)
    for group in groups.values():
        for rec in run_decode_group(ctx, group):
            add(rec)
    run_hf, why = want_hf_baseline(spec)
    if run_hf:
        add(run_hf_baseline(ctx))
    elif why:
        log(why, flush=True)
    return records


def _line(r: dict[str, Any]) -> str:
    what = f"ctx {r['context']:>6}" if r["kind"] == "decode" else f"tok {r['tokens']:>6}"
    head = f"{r['kind']:7} {r['path']:12} {r['kv_dtype']:6} b {r['batch']:>3} {what}"
    if r.get("skipped"):
        return f"{head}  {r['note']}"
    if r["kind"] == "decode":
        pair = f"  / paged {r['vs_paged']['median']:.4f} (paired, {r['vs_paged']['rounds']} rounds)" if "vs_paged" in r else ""
        return f"{head}  {r['ms']:9.3f} ms  floor {r['floor_ms']:8.3f} ms  ratio {r['ratio']:6.2f}{pair}"
    return f"{head}  {r['ms']:9.3f} ms  {r['tflops']:8.2f} TFLOP/s  of gemm {r['ratio']:5.2f}"


def print_table(records: list[dict[str, Any]]) -> None:
    """One rich table: decode rows against their read floor, prefill rows against the GEMM ceiling."""
    from rich.console import Console
    from rich.table import Table

    if not records:
        return
    r0 = records[0]
    t = Table(title=f"HAWK engine on {r0['device']}: {r0['model']} {r0['dtype']}; ceilings measured in this run: "
                    f"read {r0['read_gbps']} GB/s, gemm {r0['gemm_tflops']} TFLOP/s")
    for c in ("kind", "path", "kv", "batch", "ctx / tokens", "ms", "floor ms", "TFLOP/s", "ratio", "tok/s", "note"):
        t.add_column(c, justify="left" if c in ("kind", "path", "kv", "note") else "right")
    for r in records:
        dec = r["kind"] == "decode"
        size = str(r["context"] if dec else r["tokens"])
        if r.get("skipped"):
            t.add_row(r["kind"], r["path"], r["kv_dtype"], str(r["batch"]), size, "-", "-", "-", "-", "-", r["note"])
            continue
        tok_s = r.get("tokens_per_s")
        note = r.get("note", "")
        if r["path"] == "transformers":
            note = f"HAWK {r['hawk_ms']:.2f} ms/tok ({r['hawk_tokens_per_s']:.1f} tok/s): " + \
                   ("no slower" if r["hawk_no_slower"] else "SLOWER") + f"; tokens match: {r['tokens_match']}"
        t.add_row(
            r["kind"], r["path"], r["kv_dtype"], str(r["batch"]), size, f"{r['ms']:.3f}",
            f"{r['floor_ms']:.3f}" if dec else "-", "-" if dec else f"{r['tflops']:.2f}",
            f"{r['ratio']:.2f}", f"{tok_s:.1f}" if tok_s else "-", note,
        )
    Console(width=max(140, Console().width)).print(t)
    print("decode ratio = ms / floor_ms (1.0 = reads only what it must, at stream bandwidth); "
          "prefill ratio = achieved TFLOP/s / gemm TFLOP/s (1.0 = dense-matmul speed)")


def save_json(records: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(records, indent=1) + "\n")


def run_and_report(spec: EngineBenchSpec, json_path: str | None = None) -> list[dict[str, Any]]:
    """Run, keep the JSON file current after every record, print the table."""
    records: list[dict[str, Any]] = []

    def keep(rec: dict[str, Any]) -> None:
        records.append(rec)
        if json_path:
            save_json(records, json_path)

    run_benchmark(spec, on_record=keep)
    print_table(records)
    if json_path:
        save_json(records, json_path)
        print(f"wrote {len(records)} records to {json_path}")
    return records


def _ints(s: str | None) -> tuple[int, ...] | None:
    return None if s is None else tuple(int(x) for x in s.split(",") if x.strip())


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hawk.bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model spec (default: smollm2-135m on CPU, llama-3.1-8b on GPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="compute dtype: fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--batches", default=None, help="decode batch sizes (default: 1,4 on CPU; 1,8,32,64 on GPU)")
    p.add_argument("--contexts", default=None, help="decode context lengths (default: 128,512 on CPU; 1024,8192 on GPU)")
    p.add_argument("--prefill-tokens", default=None, help="prefill lengths, '' for none (default: 128,512 on CPU; 512,2048,8192 on GPU)")
    p.add_argument("--paths", default=",".join(PATHS), help="gpu-paged,npu-tile")
    p.add_argument("--kv-dtypes", default="bf16,bfp8_b", help="KV dtypes; each path takes those it can hold (paged: bf16/fp16/fp32, npu-tile: bf16/bfp8_b)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point, at most (default: 5 on CPU, 30 on GPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per point, after graph capture (default: 1 on CPU, 2 on GPU)")
    p.add_argument("--point-budget-s", type=float, default=None, help="stop timing a point after this many seconds, once 3 steps are timed (default: 2 on CPU, 10 on GPU)")
    p.add_argument("--time-budget-s", type=float, default=None, help="skip the remaining points (with a note) once the run has taken this long")
    p.add_argument("--hf-baseline", default="auto", choices=("auto", "on", "off"),
                   help="transformers' generate on the same model (auto: on CPU with smollm2-135m when transformers is importable)")
    p.add_argument("--hf-prompt-tokens", type=int, default=128, help="baseline prompt length")
    p.add_argument("--hf-new-tokens", type=int, default=32, help="baseline new tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 on a shared box avoids spinning threads)")
    p.add_argument("--replicas", type=int, default=1,
                   help="build each decode point this many times (other memory each) and pool their rounds, "
                        "for ratios between paths finer than placement's effect (~0.4 %% on an H200)")
    p.add_argument("--json", default=None, help="write the records here (a JSON list)")
    return p


def spec_from_args(a: argparse.Namespace) -> EngineBenchSpec:
    return EngineBenchSpec(
        model=a.model, device=a.device, dtype=a.dtype, batches=_ints(a.batches), contexts=_ints(a.contexts),
        prefill_tokens=_ints(a.prefill_tokens), paths=_strs(a.paths), kv_dtypes=_strs(a.kv_dtypes), steps=a.steps,
        warmup=a.warmup, point_budget_s=a.point_budget_s, time_budget_s=a.time_budget_s, hf_baseline=a.hf_baseline,
        hf_prompt_tokens=a.hf_prompt_tokens, hf_new_tokens=a.hf_new_tokens, threads=a.threads, replicas=a.replicas,
    )


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    a = build_parser().parse_args(argv)
    return run_and_report(spec_from_args(a), a.json)


if __name__ == "__main__":
    main()
