"""Testbeds as data: the devices, links and transfer paths a simulated cluster runs on.

Two testbeds:

* ``here`` — this project's own calibration (``defaults.py``): KV-transfer curves **measured** on
  2x H200 (NPU emulated), compute models assumed. What ``hawk sim`` used before testbeds existed.
* ``paper`` — the evaluation setup of *HAWK: Heterogeneity-Aware KV Cache Transfer for Efficient
  GPU-NPU Phase-Disaggregated LLM Inference* (§5.1): Llama-3.1-70B, TP4 on four A100 PCIe for
  prefill and four Tenstorrent p150a for decode, 200 Gb/s HDR InfiniBand between the nodes, host
  staging over PCIe Gen4. Every number is derived from a cited fact (:class:`PaperFacts`) plus
  the assumptions listed in :class:`PaperAssumptions` — the only place where this testbed takes
  a number nobody published. Nothing is fitted to the paper's serving figures (Figs. 10–13,
  Tables 8–9): those are what ``--reproduce-paper`` checks the testbed against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hawk.devices.timing import P150A, npu_kv_bytes_per_token, p150a_step_model
from hawk.sim.calibration import MiB, TransferCurve
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.decode import VLLM_DECODE_FLOW
from hawk.sim.host import HostStaging
from hawk.sim.defaults import (
    DECODE_MODELS,
    KV_BYTES_PER_TOKEN_PER_RANK,
    PREFILL_MODELS,
    PRESETS,
    Preset,
    default_transfer_curves,
)


@dataclass(frozen=True)
class PaperFacts:
    """Published numbers the ``paper`` testbed is built from, each with its source."""

    # --- the paper, §5.2 (Fig. 9): ratios at 10 MB and 1280 MB
    fig9_sizes_mb: tuple[float, float] = (10.0, 1280.0)
    gn_host_over_gg_host: tuple[float, float] = (8.91, 3.79)
    gg_direct_over_gg_host: tuple[float, float] = (0.6630, 0.1477)
    #: "GN-HAWK latency decreases from 77.25 % to 14.69 %". The text says "of GN-Host"; we read it
    #: as "of GG-Host" because only that reading agrees with the paper's other claims (GN-HAWK
    #: within 0.65 % of GG-Direct, up to 27.69x faster than GN-Host); see docs/reproduce.md.
    gn_hawk_over_gg_host: tuple[float, float] = (0.7725, 0.1469)
    max_gn_host_over_gn_hawk: float = 27.69  # §1
    gn_hawk_vs_gg_direct_1280: float = 0.0065  # §1: "latency difference of only 0.65 %"
    #: §5.2: "10 MB ... corresponds to only 64 input tokens in our setup" -> bytes per token moved
    tokens_per_10mb: int = 64
    # --- the paper, Table 1 (512 in / 128 out, batch 32): A100 vs p150a
    a100_over_p150a_prefill: float = 2.52
    a100_over_p150a_decode: float = 1.16
    p150a_decode_power_eff_gain: float = 1.39  # NPU perf/W over GPU perf/W, decode, ASIC power
    p150a_decode_cost_eff_gain: float = 5.88  # NPU perf/$ over GPU perf/$, decode
    # --- Tenstorrent (tt-metal model tables): Llama-3.1-8B on one p150a, tokens/s/user
    p150a_8b_tok_s_user_b1: float = 33.6
    p150a_8b_tok_s_user_b32: float = 29.0
    #: cross-check only: Tenstorrent's QuietBox-2 (4x Blackhole) Llama-3.1-70B, 476.5 tok/s total (batch 32 assumed)
    p150a_x4_70b_tok_s_total: float = 476.5
    p150a_price_usd: float = 1399.0  # Tenstorrent list price (the paper uses the vendor's price)
    p150a_gddr6_gb_s: float = 512.0  # Blackhole p150a spec sheet
    # --- public specs
    a100_bf16_tflops: float = 312.0  # NVIDIA A100 datasheet, dense bf16
    a100_hbm_tb_s: float = 1.935  # A100 PCIe 80 GB
    h100_pcie_hbm_tb_s: float = 2.0  # H100 PCIe 80 GB
    ib_hdr_gbit_s: float = 200.0  # HDR InfiniBand, ConnectX-6 (§5.1.1)
    pcie_gen4_x16_gb_s: float = 25.0  # effective of 32 GB/s raw, one direction
    # --- Llama-3.1-70B shape
    params: float = 70.6e9
    layers: int = 80
    hidden: int = 8192
    kv_heads: int = 8
    head_dim: int = 128
    llama_8b_params: float = 8.03e9


@dataclass(frozen=True)
class PaperAssumptions:
    """Every number the ``paper`` testbed needs that no source gives. Change them here only."""

    prefill_launch_s: float = 0.015  # per-batch floor: launches, sampling, scheduler
    #: ring all-reduce over PCIe Gen4 (A100 PCIe pairs have NVLink bridges, the pairs meet over PCIe)
    allreduce_gb_s: float = 25.0
    direct_fixed_s: float = 0.001  # decode request -> first RDMA byte (control round trip)
    direct_link_efficiency: float = 1.0  # RDMA pulls at the IB line rate (the paper: GG-Direct ~ NIXL)
    a100_power_w: float = 300.0  # A100 PCIe TDP; only ratios matter (ASIC power is not published)
    #: what a serving framework adds to each NPU decode step (the vLLM plugin); none published, and
    #: values up to 110 ms do not produce the paper's Summarization gap (docs/reproduce.md), so it stays 0
    npu_framework_step_s: float = 0.0
    h100_price_usd: float = 25_000.0  # H100 PCIe market price (the paper's is not published)
    max_batch_gpu: int = 256  # vLLM max_num_seqs default
    max_batch_npu: int = 32  # tt-transformers' Llama-70B decode batch


@dataclass(frozen=True)
class MeasuredHere:
    """Numbers measured on this project's machines that the ``paper`` testbed uses."""

    #: the NPU-side layout fix-up of a host-staged KV (tilize to bfloat8_b tiles, the NPU's KV dtype)
    #: on a CPU: the torch transform on the 70B-TP4 KV shape, median over sizes
    cpu_tilize_gb_s: float = 0.0
    cpu_tilize_source: str = ""


@dataclass(frozen=True)
class PaperCalibration:
    """The parameters that no source gives and that the paper's serving results set: one number
    each, by the declared protocol (``calibrate`` in ``paper.py``; docs/reproduce.md). The rows
    that set them are ``role: input`` in ``--reproduce-paper``; every other row is a prediction."""

    #: effective A100 GEMM efficiency of the vLLM prefill instance, end to end
    prefill_mfu: float = 0.5
    #: the rate at which a serving worker issues host-staging copies (device <-> host), per node
    host_copy_gb_s: float = 25.0
    #: the H100 decode instance's power per device ("the H100 GPUs consume less power during
    #: decoding in our evaluation", §5.4.3; the number is not published)
    h100_power_w: float = 350.0


@dataclass(frozen=True)
class DevicePower:
    """Power and price used for the efficiency tables (§5.4), with where they came from."""

    power_w: float
    price_usd: float
    source: str


@dataclass(frozen=True)
class Testbed:
    """Everything :func:`hawk.sim.cluster.make_config` needs, plus power/price for efficiency."""

    name: str
    prefill_models: dict[str, PrefillModel]
    decode_models: dict[str, DecodeModel]
    curves: dict[str, TransferCurve]
    presets: dict[str, Preset]
    bytes_per_token: int
    devices: dict[str, DevicePower] = field(default_factory=dict)
    note: str = ""
    #: host staging as worker time, by transfer path (``host.py``); paths not listed only delay the KV
    host: dict[str, HostStaging] = field(default_factory=dict)
    #: the serving framework whose request flow the instances follow (``decode.VLLM_DECODE_FLOW``):
    #: ``vllm`` for the paper's testbed (§5.1.2), ``hawk`` for this project's engine
    serving_framework: str = "hawk"

    def decode_flow(self) -> dict[str, bool]:
        """The ``SimConfig`` fields of the serving framework's decode request flow (``VLLM_DECODE_FLOW``
        for vLLM; none for HAWK's engine, whose testbed keeps the fields' defaults)."""
        return dict(VLLM_DECODE_FLOW) if self.serving_framework == "vllm" else {}


# ============================================================================ the paper's testbed


def kv_bytes_per_token(f: PaperFacts = PaperFacts()) -> int:
    """Bytes one prompt token's KV adds to a transfer, as the paper sizes Fig. 9 (10 MiB = 64 tokens)."""
    return int(10 * MiB / f.tokens_per_10mb)


def paper_transfer_curves(f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions()) -> dict[str, TransferCurve]:
    """Fig. 9 as curves. GG-Direct is derived from the link: a fixed control cost plus bytes at the
    HDR line rate (one ConnectX-6 per node carries the whole request). The other paths are GG-Direct
    divided / multiplied by the paper's measured ratios at 10 and 1280 MB, linear in between."""
    sizes = tuple(s * MiB for s in f.fig9_sizes_mb)
    bw = f.ib_hdr_gbit_s / 8 * 1e9 * a.direct_link_efficiency
    direct = tuple(a.direct_fixed_s + s / bw for s in sizes)
    gg_host = tuple(d / r for d, r in zip(direct, f.gg_direct_over_gg_host))
    gn_host = tuple(h * r for h, r in zip(gg_host, f.gn_host_over_gg_host))
    gn_hawk = tuple(h * r for h, r in zip(gg_host, f.gn_hawk_over_gg_host))
    src = "derived: the paper's Fig. 9 ratio x GG-Direct at 10/1280 MB"
    return {
        "gg-direct": TransferCurve("gg-direct", sizes, direct, f"derived: {a.direct_fixed_s * 1e3:g} ms + bytes at 200 Gb/s HDR IB"),
        "gg-host": TransferCurve("gg-host", sizes, gg_host, src),
        "gn-host": TransferCurve("gn-host", sizes, gn_host, src),
        "gn-hawk": TransferCurve("gn-hawk", sizes, gn_hawk, src),
    }


def a100_prefill(f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions(), mfu: float = 0.5) -> PrefillModel:
    """4x A100 PCIe at TP4: GEMMs at ``mfu`` of peak plus two ring all-reduces per layer over
    PCIe, not overlapped (vLLM runs them in the layer's critical path)."""
    flops_s = 4 * f.a100_bf16_tflops * 1e12 * mfu
    gemm_s = 2 * f.params / flops_s
    allreduce_bytes = 2 * f.layers * f.hidden * 2 * 2 * (4 - 1) / 4  # 2 per layer, bf16, ring 2(n-1)/n
    comm_s = allreduce_bytes / (a.allreduce_gb_s * 1e9)
    attn_s = 2 * f.layers * f.hidden / flops_s  # causal QK^T + PV: 2*2*layers*hidden*L^2/2 FLOPs
    return PrefillModel(
        base_s=a.prefill_launch_s, per_token_s=gemm_s + comm_s, per_token_sq_s=attn_s, max_batch_tokens=8192,
        kv_capacity_tokens=450_000,
        source=(
            f"derived: 2x{f.params:.3g} FLOP/token / (4x{f.a100_bf16_tflops:g} TFLOP/s x MFU {mfu:.3g}) = {gemm_s * 1e3:.3f} ms "
            f"+ all-reduce {allreduce_bytes / 1e6:.2f} MB/token at {a.allreduce_gb_s:g} GB/s = {comm_s * 1e3:.3f} ms; "
            f"+{a.prefill_launch_s * 1e3:g} ms per batch"
        ),
    )


def p150a_decode(f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions(), overhead_s: float = 0.0) -> DecodeModel:
    """4x p150a at TP4, from Tenstorrent's Llama-3.1-8B single-p150a figures: decode is weight-read
    bound, so the 70B step is the 8B step times the ratio of weights each device reads
    (70.6B/4 over 8.03B = 2.2x); interpolated linearly in batch between batch 1 and 32. Context
    cost: bfloat8_b KV per token per device read at the GDDR6 rate. The all-reduces over Ethernet
    are taken as folded into that ratio (QuietBox-2's 476.5 tok/s at batch 32 is a cross-check).
    ``overhead_s``: what each step costs on top when a serving framework drives the NPU."""
    k = (f.params / 4) / f.llama_8b_params
    facts = replace(P150A, llama_8b_tok_s_user_b1=f.p150a_8b_tok_s_user_b1, llama_8b_tok_s_user_b32=f.p150a_8b_tok_s_user_b32,
                    llama_8b_params=f.llama_8b_params, gddr6_gb_s=f.p150a_gddr6_gb_s)
    kv_bytes = npu_kv_bytes_per_token(f.layers, f.kv_heads // 4, f.head_dim, "bfp8_b")
    m = p150a_step_model(f.params / 4, kv_bytes, facts)  # the same model --npu-timing p150a paces a real run to
    s1, s32 = m.step_time(1, 0), m.step_time(32, 0)
    return DecodeModel(
        base_s=m.base_s + overhead_s, per_seq_s=m.per_seq_s, per_ctx_token_s=m.per_ctx_token_s,
        max_batch=a.max_batch_npu, kv_capacity_tokens=262_144,
        source=(
            f"derived: Tenstorrent Llama-3.1-8B on p150a {f.p150a_8b_tok_s_user_b1:g}/{f.p150a_8b_tok_s_user_b32:g} tok/s/user "
            f"(batch 1/32) x {k:.2f} (70B TP4 weights per device / 8B) -> {s1 * 1e3:.1f}/{s32 * 1e3:.1f} ms per step"
            + (f" + {overhead_s * 1e3:.1f} ms serving-framework overhead (calibrated)" if overhead_s else "")
        ),
    )


def _scaled_decode(m: DecodeModel, factor: float, max_batch: int, source: str) -> DecodeModel:
    return DecodeModel(
        base_s=m.base_s * factor, per_seq_s=m.per_seq_s * factor, per_ctx_token_s=m.per_ctx_token_s * factor,
        max_batch=max_batch, kv_capacity_tokens=450_000, source=source,
    )


def paper_devices(f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions(), h100_power_w: float = 350.0) -> dict[str, DevicePower]:
    """Power and price. The p150a/A100 ratios follow from Table 1: perf/W 1.39x at 1/1.16 the
    speed -> the p150a draws 1/(1.16x1.39) of the A100's decode power; perf/$ 5.88x -> the A100
    costs 5.88x1.16 p150a list prices."""
    npu_w = a.a100_power_w / (f.a100_over_p150a_decode * f.p150a_decode_power_eff_gain)
    a100_usd = f.p150a_price_usd * f.p150a_decode_cost_eff_gain * f.a100_over_p150a_decode
    return {
        "a100-tp4": DevicePower(a.a100_power_w, a100_usd, "power: TDP (unit); price: Table 1's 5.88x cost-eff. x 1.16x speed x p150a list"),
        "p150a-tp4": DevicePower(npu_w, f.p150a_price_usd, "power: Table 1 (1.39x perf/W at 1/1.16 speed); price: Tenstorrent list"),
        "h100-tp4": DevicePower(h100_power_w, a.h100_price_usd, "power: calibrated (Table 9); price: assumption, H100 PCIe market price"),
    }


def paper_host_staging(c: PaperCalibration, m: MeasuredHere) -> dict[str, HostStaging]:
    """The worker time of the two host-staged paths (``host.py``): both nodes' workers copy every
    byte once at the calibrated rate; ``gn-host``'s decode host also tilizes it on its CPU first,
    at the rate measured on this project's CPU (the paper's NPU node's CPU is not described)."""
    src = f"calibrated: worker copies at {c.host_copy_gb_s:.3g} GB/s on each node"
    return {
        "gg-host": HostStaging.from_rates(c.host_copy_gb_s, None, src),
        "gn-host": HostStaging.from_rates(c.host_copy_gb_s, m.cpu_tilize_gb_s or None,
                                          f"{src}; + CPU tilize at {m.cpu_tilize_gb_s:.3g} GB/s ({m.cpu_tilize_source})"),
    }


def paper_testbed(f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions(), c: PaperCalibration | None = None,
                  m: MeasuredHere | None = None) -> Testbed:
    """The paper's §5.1 setup, derived as documented on each function above, with the calibrated
    parameters ``c`` (default: :data:`PAPER_CALIBRATION`)."""
    c = PAPER_CALIBRATION if c is None else c
    m = MEASURED_HERE if m is None else m
    a100_p = a100_prefill(f, a, c.prefill_mfu)
    npu_d = p150a_decode(f, a, a.npu_framework_step_s)
    a100_d = _scaled_decode(
        npu_d, 1 / f.a100_over_p150a_decode, a.max_batch_gpu, "derived: p150a-tp4 / 1.16 (Table 1 decode ratio, batch 32)",
    )
    h100_d = _scaled_decode(
        a100_d, f.a100_hbm_tb_s / f.h100_pcie_hbm_tb_s, a.max_batch_gpu, "derived: a100-tp4 x HBM bandwidth ratio (A100 PCIe / H100 PCIe)",
    )
    npu_p = PrefillModel(
        base_s=a100_p.base_s, per_token_s=a100_p.per_token_s * f.a100_over_p150a_prefill,
        per_token_sq_s=a100_p.per_token_sq_s * f.a100_over_p150a_prefill, max_batch_tokens=8192, kv_capacity_tokens=262_144,
        source="derived: a100-tp4 x 2.52 (Table 1 prefill ratio)",
    )
    presets = {
        "gg-host": Preset("a100-tp4", "a100-tp4", "gg-host", note="A100 prefill + decode, host staging"),
        "gn-host": Preset("a100-tp4", "p150a-tp4", "gn-host", note="A100 prefill, p150a decode, host staging + layout fix-up"),
        "gg-direct": Preset("a100-tp4", "a100-tp4", "gg-direct", note="A100 prefill + decode, RDMA"),
        "gn-hawk": Preset("a100-tp4", "p150a-tp4", "gn-hawk", note="A100 prefill, p150a decode, HAWK"),
        "ggh-direct": Preset("a100-tp4", "h100-tp4", "gg-direct", note="A100 prefill, H100 decode, RDMA (Table 9)"),
    }
    return Testbed(
        "paper", {"a100-tp4": a100_p, "p150a-tp4": npu_p}, {"a100-tp4": a100_d, "p150a-tp4": npu_d, "h100-tp4": h100_d},
        paper_transfer_curves(f, a), presets, kv_bytes_per_token(f), paper_devices(f, a, c.h100_power_w),
        "the paper's §5.1 testbed, derived from its Fig. 9 / Table 1 and public specs, with three calibrated parameters",
        paper_host_staging(c, m), serving_framework="vllm",
    )


#: measured on the H200 box's host CPU (benchmarks/results/transform_cpu_h200host.json; PACED_TILIZE=1 bash scripts/gpu_suite.sh paced)
MEASURED_HERE = MeasuredHere(0.211, "benchmarks/results/transform_cpu_h200host.json: the torch transform to bfloat8_b tiles on the H200 box's 16-core host CPU, 30 MiB of 70B-TP4 KV in 149 ms")
#: solved by ``python -m hawk sim --calibrate-paper`` (1000 requests, seed 0) from the three input rows (docs/reproduce.md)
PAPER_CALIBRATION = PaperCalibration(prefill_mfu=0.1727, host_copy_gb_s=2.036, h100_power_w=225.1)


def here_testbed() -> Testbed:
    """This project's calibration: measured transfer curves (H200x2, NPU emulated), assumed compute."""
    return Testbed(
        "here", dict(PREFILL_MODELS), dict(DECODE_MODELS), default_transfer_curves(), dict(PRESETS),
        KV_BYTES_PER_TOKEN_PER_RANK, note="measured: benchmarks/results/raw/transfer_h200x2_2026-11-29.json; compute assumed (defaults.py)",
    )


TESTBEDS = {"paper": paper_testbed, "here": here_testbed}


def get_testbed(name: str) -> Testbed:
    try:
        return TESTBEDS[name]()
    except KeyError:
        raise ValueError(f"unknown testbed {name!r}; known: {', '.join(TESTBEDS)}") from None
