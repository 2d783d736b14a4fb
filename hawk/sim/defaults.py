"""The simulator's default calibration, each entry with where it came from.

Two kinds of numbers live here, and they must not be confused:

* **Measured** — the KV-transfer curves: medians from ``hawk bench transfer`` on 2× H200 (NV18),
  NIXL 1.5.1 pulls, decode-side memory = HAWK's *emulated* Blackhole p150a on GPU1 for ``gn-*``,
  bf16 KV in the Llama-3.1-70B TP4 rank shape, median of 5 after one warm-up
  (``benchmarks/results/raw/transfer_h200x2_2026-11-29.json``, the run of 2026-11-29; docs/benchmarks.md
  has the later 10-repeat run, which the simulator is not re-calibrated to). These are GPU-memory
  transfer times, not Tenstorrent hardware or InfiniBand numbers.
* **Assumptions** — every compute-time and memory model below. They are first-order roofline
  estimates for Llama-3.1-70B at TP4 (stated per entry), plus the paper's Table 1 ratio for the
  p150a's decode speed. Nothing here was measured on an A100, H100 or p150a. Override them with a
  JSON file (``load_calibration``) when you have measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hawk.sim.calibration import MiB, TransferCurve, load_transfer_curves
from hawk.sim.compute import DecodeModel, PrefillModel

# ============================================================================ KV transfer (measured)

TRANSFER_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "raw" / "transfer_h200x2_2026-11-29.json"
TRANSFER_SOURCE = (
    "measured: benchmarks/results/raw/transfer_h200x2_2026-11-29.json (hawk bench transfer, 2x H200 NV18, NIXL 1.5.1 pull, "
    "gn-* decode memory = emulated p150a on GPU1, bf16 KV, Llama-3.1-70B TP4 rank shape, median of 5)"
)
TRANSFER_SIZES_MB: tuple[int, ...] = (10, 20, 40, 80, 160, 320, 640, 1280)
#: median_ms per configuration at TRANSFER_SIZES_MB, copied from TRANSFER_FILE so an installed
#: package without the repository still has them (tests check the two agree).
TRANSFER_MEDIANS_MS: dict[str, tuple[float, ...]] = {
    "gg-host": (10.260571, 12.538654, 19.3361, 31.307862, 51.578637, 95.299418, 184.846836, 399.534504),
    "gn-host": (31.062533, 31.276782, 38.836717, 49.381026, 74.830979, 114.86954, 233.987455, 418.856693),
    "gg-direct": (10.673037, 9.783534, 7.168636, 7.053648, 9.035794, 10.561716, 12.915388, 18.441843),
    "gn-direct-single": (5.771263, 4.802973, 5.198366, 5.550768, 5.468953, 7.274482, 9.884574, 15.227437),
    "gn-hawk": (6.332333, 6.13246, 6.600626, 6.192069, 6.806871, 8.985342, 10.1083, 14.973728),
    "gn-hawk@staging": (4.564896, 4.310029, 4.208566, 4.654212, 5.213269, 5.900837, 9.210003, 13.672057),
    "gn-hawk@direct": (16.941236, 17.1402, 23.663185, 24.850832, 25.570909, 26.977667, 27.570351, 24.872939),
}

#: KV bytes per token of one TP rank — the unit the transfer curves were measured in:
#: Llama-3.1-70B at TP4 = 80 layers x 2 (K, V) x 2 KV heads x 128 head_dim x 2 B (bf16). With
#: TP4 the four ranks move their shares in parallel, each on its own path, so one request's
#: transfer takes the time of one rank's share.
KV_BYTES_PER_TOKEN_PER_RANK = 80 * 2 * 2 * 128 * 2


def default_transfer_curves(prefer_file: bool = True) -> dict[str, TransferCurve]:
    """The measured curves: from the results file when the repository is here, else the copy above."""
    if prefer_file and TRANSFER_FILE.exists():
        return load_transfer_curves(TRANSFER_FILE)
    sizes = tuple(s * MiB for s in TRANSFER_SIZES_MB)
    return {c: TransferCurve(c, sizes, tuple(t / 1e3 for t in ms), TRANSFER_SOURCE, measured=True) for c, ms in TRANSFER_MEDIANS_MS.items()}


# ============================================================================ compute (assumptions)

# Llama-3.1-70B, one instance = 4 devices at TP4. Shared arithmetic:
#   prefill FLOPs ~ 2 x 70.6e9 per token; attention adds ~ 2 x 80 layers x 8192 x L^2 FLOPs (causal)
#   decode reads all weights once per step (141 GB bf16 / 4 = 35 GB per device) plus each context
#   token's KV (327,680 B/token for the whole model in bf16 = 81,920 B per rank)
PREFILL_MODELS: dict[str, PrefillModel] = {
    "a100-tp4": PrefillModel(
        base_s=0.015, per_token_s=2.3e-4, per_token_sq_s=2.1e-9, max_batch_tokens=8192, kv_capacity_tokens=450_000,
        source=(
            "assumption: 4x A100 (312 TFLOP/s bf16 each) at 50% MFU -> 6.2e14 FLOP/s -> 2.3e-4 s/token, "
            "attention 1.3e6 FLOP/L^2 -> 2.1e-9 s; 15 ms launch/all-reduce floor; KV room = 320 GB - 141 GB weights "
            "- ~30 GB activations = ~150 GB / 327,680 B/token = ~450k tokens"
        ),
    ),
    "h100-tp4": PrefillModel(
        base_s=0.010, per_token_s=7.3e-5, per_token_sq_s=6.6e-10, max_batch_tokens=8192, kv_capacity_tokens=450_000,
        source="assumption: 4x H100 SXM (989 TFLOP/s bf16 dense) at 50% MFU; KV room as for A100 80 GB",
    ),
}

DECODE_MODELS: dict[str, DecodeModel] = {
    "a100-tp4": DecodeModel(
        base_s=0.025, per_seq_s=2.0e-4, per_ctx_token_s=5.1e-8, max_batch=256, kv_capacity_tokens=450_000,
        source=(
            "assumption: 35 GB weights per A100 at 1.6 TB/s effective (80% of 2.0 TB/s) = 22 ms + 3 ms all-reduce; "
            "81,920 B KV per token per rank at 1.6 TB/s = 5.1e-8 s; 0.2 ms per sequence (sampling, small GEMM growth); "
            "max 256 sequences (vLLM's max_num_seqs default); KV room ~450k tokens as for prefill"
        ),
    ),
    "p150a-tp4": DecodeModel(
        base_s=0.029, per_seq_s=2.3e-4, per_ctx_token_s=5.9e-8, max_batch=32, kv_capacity_tokens=262_144,
        source=(
            "assumption: the A100 model x 1.16 (the paper's Table 1: GPU decode 1.16x faster than the p150a at batch 32); "
            "max 32 sequences (tt-transformers' Llama-70B decode batch); KV room: 4x 32 GB - ~75 GB bfloat8_b weights "
            "= ~45 GB / ~174 KB per token (bfloat8_b) = ~262k tokens"
        ),
    ),
    "h100-tp4": DecodeModel(
        base_s=0.015, per_seq_s=1.2e-4, per_ctx_token_s=3.1e-8, max_batch=256, kv_capacity_tokens=450_000,
        source="assumption: the A100 model x 0.6 (HBM3 3.35 TB/s vs HBM2e 2.0 TB/s); KV room as for 80 GB",
    ),
}


# ============================================================================ cluster configurations


@dataclass(frozen=True)
class Preset:
    """A configuration of the paper (§5.1.3): which devices prefill and decode, which transfer."""

    prefill: str  # key of PREFILL_MODELS
    decode: str  # key of DECODE_MODELS
    transfer: str  # key of the transfer curves
    decode_slowdown: float = 1.0  # TPOT multiplier (the paper blames host intervention for host-staged TPOT; 1.0 = not modelled)
    note: str = ""


PRESETS: dict[str, Preset] = {
    "gg-host": Preset("a100-tp4", "a100-tp4", "gg-host", note="GPU prefill, GPU decode, host-staged transfer"),
    "gn-host": Preset("a100-tp4", "p150a-tp4", "gn-host", note="GPU prefill, NPU decode, host staging + NPU-side layout fix-up"),
    "gg-direct": Preset("a100-tp4", "a100-tp4", "gg-direct", note="GPU prefill, GPU decode, direct RDMA"),
    "gn-hawk": Preset("a100-tp4", "p150a-tp4", "gn-hawk", note="GPU prefill, NPU decode, HAWK"),
    "gn-direct-single": Preset("a100-tp4", "p150a-tp4", "gn-direct-single", note="single NPU buffer; its channel-imbalance OOM is not modelled"),
    "ggh-direct": Preset("a100-tp4", "h100-tp4", "gg-direct", note="A100 prefill, H100 decode (the paper's GGH-Direct), direct transfer"),
}


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Overrides from a JSON file: ``{"prefill_models": {name: {...}}, "decode_models": {...},
    "presets": {name: {...}}, "transfer_file": "..."}`` — each model dict takes PrefillModel /
    DecodeModel fields (and should carry a ``source``). Returns the merged tables."""
    data = json.loads(Path(path).read_text())
    prefill = dict(PREFILL_MODELS)
    decode = dict(DECODE_MODELS)
    presets = dict(PRESETS)
    for k, v in data.get("prefill_models", {}).items():
        prefill[k] = replace(prefill[k], **v) if k in prefill else PrefillModel(**v)
    for k, v in data.get("decode_models", {}).items():
        decode[k] = replace(decode[k], **v) if k in decode else DecodeModel(**v)
    for k, v in data.get("presets", {}).items():
        presets[k] = replace(presets[k], **v) if k in presets else Preset(**v)
    curves = load_transfer_curves(data["transfer_file"]) if "transfer_file" in data else default_transfer_curves()
    return {"prefill_models": prefill, "decode_models": decode, "presets": presets, "transfer_curves": curves}
