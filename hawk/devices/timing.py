"""Timing emulation: how long a real Tenstorrent p150a (and a real link) would take.

The emulated NPU (``emulated.py``) is faithful in *where bytes live*, not in *how long things take*:
its decode step runs at the speed of whatever holds its memory (a CPU, an H200). ``--npu-timing
p150a`` and ``--link-gbps N`` make a real serving run take the p150a's and the link's time instead,
by sleeping until the modelled time when the emulation finished early. They can only slow things
down: where the emulation is already slower than the model (a tiny model on a CPU) the measured
time stands. Every number that comes out of a paced run is therefore an **emulation** of p150a /
link timing, not a measurement of either, and is labelled so (:func:`timing_label`).

This module sits in the device layer so that the engine (decode step), the emulated device (DRAM
copies), the transport (link) and the simulator (``hawk.sim.testbeds``) all read the *same* model:
the simulator's p150a decode model is built by :func:`p150a_step_model` too.

Sources (:class:`P150aFacts`):

* decode step: Tenstorrent's published Llama-3.1-8B figures on one p150a (tt-metal model tables),
  33.6 tokens/s/user at batch 1 and 29.0 at batch 32. Decode is weight-read bound, so a model with
  ``P`` parameters per device takes ``P / 8.03e9`` times as long per step (the same scaling the
  simulator's ``paper`` testbed uses for the 70B at TP4), linear in batch between 1 and 32; each
  context token adds its KV bytes read at the GDDR6 rate. Assumption: nothing else scales, so a
  tiny model's modelled step is tiny (a real device would add per-op dispatch floors nobody
  published for such models).
* DRAM copies: the p150a's 512 GB/s GDDR6 (Blackhole p150a spec sheet) over its 8 DRAM channels
  (``hawk.layouts.npu``), i.e. 64 GB/s per channel; a copy batch takes as long as its busiest
  channel's read + write bytes.
* link: ``bytes x 8 / N`` seconds for a link of ``N`` Gb/s (line rate, no protocol overhead).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: ``--npu-timing`` values (the models this module can build).
NPU_TIMINGS: tuple[str, ...] = ("p150a",)

#: Bytes one KV element takes on the NPU per dtype (bfloat8_b: 1 byte + a shared exponent per 16).
NPU_KV_ELEM_BYTES: dict[str, float] = {"bf16": 2.0, "bfp8_b": 1.0625}


@dataclass(frozen=True)
class P150aFacts:
    """Published p150a numbers the timing models are built from, each with its source."""

    #: Tenstorrent tt-metal model tables: Llama-3.1-8B on one p150a, tokens/s/user at batch 1 / 32
    llama_8b_tok_s_user_b1: float = 33.6
    llama_8b_tok_s_user_b32: float = 29.0
    llama_8b_params: float = 8.03e9  # Llama-3.1-8B parameter count (Meta's model card)
    batch_hi: int = 32  # the batch of the second figure
    gddr6_gb_s: float = 512.0  # Blackhole p150a spec sheet: 32 GB GDDR6 at 512 GB/s
    dram_channels: int = 8  # Blackhole: 8 GDDR6 channels (hawk.layouts.npu's p150a preset)


P150A = P150aFacts()


@dataclass(frozen=True)
class StepModel:
    """Modelled decode step: ``base_s + per_seq_s x batch + per_ctx_token_s x context tokens``."""

    base_s: float
    per_seq_s: float
    per_ctx_token_s: float
    source: str = ""

    def step_time(self, batch: int, context_tokens: int) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens


def p150a_step_model(params_per_device: float, kv_bytes_per_token: float, f: P150aFacts = P150A) -> StepModel:
    """The p150a's decode step for a model with ``params_per_device`` weights on each device and
    ``kv_bytes_per_token`` KV bytes per context token on each device (see the module docstring)."""
    k = params_per_device / f.llama_8b_params
    s1, s_hi = k / f.llama_8b_tok_s_user_b1, k / f.llama_8b_tok_s_user_b32
    per_seq = (s_hi - s1) / (f.batch_hi - 1)
    return StepModel(
        base_s=s1 - per_seq, per_seq_s=per_seq, per_ctx_token_s=kv_bytes_per_token / (f.gddr6_gb_s * 1e9),
        source=(
            f"p150a timing model: Tenstorrent Llama-3.1-8B {f.llama_8b_tok_s_user_b1:g}/{f.llama_8b_tok_s_user_b32:g} tok/s/user "
            f"(batch 1/{f.batch_hi}) x {k:.4g} (weights per device / 8.03B) -> {s1 * 1e3:.3g}/{s_hi * 1e3:.3g} ms per step; "
            f"KV {kv_bytes_per_token:.0f} B/token at {f.gddr6_gb_s:g} GB/s"
        ),
    )


def npu_kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> float:
    """KV bytes one context token occupies on the NPU (K and V of every layer)."""
    return layers * 2 * kv_heads * head_dim * NPU_KV_ELEM_BYTES[kv_dtype]


def engine_step_model(npu_timing: str, params: float, layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> StepModel:
    """The step model a decode engine of this shape paces to (one device: the emulated NPU)."""
    if npu_timing != "p150a":
        raise ValueError(f"unknown NPU timing model {npu_timing!r}; known: {', '.join(NPU_TIMINGS)}")
    return p150a_step_model(params, npu_kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype))


@dataclass(frozen=True)
class DramCopyModel:
    """Device-side copies: ``gb_s`` shared evenly by ``channels``; a batch of copies takes as long
    as the channel that reads + writes the most bytes (channels work in parallel)."""

    gb_s: float
    channels: int

    @property
    def channel_bytes_per_s(self) -> float:
        return self.gb_s * 1e9 / self.channels

    def copy_time(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> float:
        """Seconds for copies given as parallel arrays (source channel, destination channel, bytes)."""
        if len(length) == 0:
            return 0.0
        n = max(self.channels, int(src.max()) + 1, int(dst.max()) + 1)
        w = length.astype(np.float64)
        traffic = np.bincount(src, weights=w, minlength=n) + np.bincount(dst, weights=w, minlength=n)
        return float(traffic.max()) / self.channel_bytes_per_s


def p150a_copy_model(f: P150aFacts = P150A) -> DramCopyModel:
    return DramCopyModel(f.gddr6_gb_s, f.dram_channels)


def copy_model_for(npu_timing: str | None) -> DramCopyModel | None:
    """The DRAM copy model ``--npu-timing`` names, or None (no pacing)."""
    if npu_timing is None:
        return None
    if npu_timing != "p150a":
        raise ValueError(f"unknown NPU timing model {npu_timing!r}; known: {', '.join(NPU_TIMINGS)}")
    return p150a_copy_model()


def copy_arrays(copies: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src channel, dst channel, bytes) of a ``Runs`` (arrays) or a sequence of ``Copy``."""
    if hasattr(copies, "src_region") and isinstance(copies.src_region, np.ndarray):
        return copies.src_region.astype(np.int64), copies.dst_region.astype(np.int64), copies.length.astype(np.int64)
    cs: Sequence[Any] = list(copies)
    return (
        np.fromiter((c.src_region for c in cs), np.int64, len(cs)),
        np.fromiter((c.dst_region for c in cs), np.int64, len(cs)),
        np.fromiter((c.length for c in cs), np.int64, len(cs)),
    )


def link_time_s(nbytes: float, gbps: float) -> float:
    """Seconds ``nbytes`` take on a link of ``gbps`` Gb/s at line rate."""
    return nbytes * 8.0 / (gbps * 1e9)


def pace_until(start: float, modelled_s: float, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep) -> float:
    """Sleep until ``start + modelled_s`` on ``clock``; the seconds slept (0 when already late).
    Why a loop: ``time.sleep`` may wake early on some platforms; pacing must never be short."""
    slept = 0.0
    while True:
        left = start + modelled_s - clock()
        if left <= 0:
            return slept
        sleep(left)
        slept += left


def timing_label(npu_timing: str | None, link_gbps: float | None) -> str | None:
    """How a paced run names itself (logs, /internal/info, responses, bench records); None when off."""
    parts = []
    if npu_timing:
        parts.append(f"NPU timing emulated: {npu_timing} model")
    if link_gbps:
        parts.append(f"link emulated: {link_gbps:g} Gb/s")
    return "; ".join(parts) or None
