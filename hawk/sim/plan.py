"""``hawk sim --plan``: which deployment serves a workload most cheaply, per dollar and per watt.

The paper evaluates one deployment (§5.1: four A100 for prefill, four p150a for decode, TP4) and
argues from its efficiency (§5.4). The planner asks the question the other way round: over
prefill and decode device types, TP degrees and prefill:decode instance ratios, which deployment
has the most *goodput* — the highest request rate still meeting the SLOs for ≥ 90 % of requests,
found by bisection over seeded simulator runs exactly as ``paper.py`` finds Fig. 12's rates —
per dollar of hardware and per watt? And where does the paper's setup land, and what limits it?

Everything is derived from the ``paper`` testbed (``testbeds.py``) at TP4. Other TP degrees and
the H100 prefill need a few more numbers; they are in :class:`PlanAssumptions`, each with its
source, and are the planner's only additions:

* a model at TP *t* reads 4/*t* of the TP4 weights and KV per device, so decode step terms and
  prefill GEMM / attention terms scale by 4/*t*; the prefill all-reduce term scales with the ring's
  2(*t*−1)/*t*; decode-side communication is not modelled beyond what TP4 folds in (TP8 is
  optimistic);
* KV room at TP *t* = the testbed's TP4 room + (*t* − 4) devices' memory (weights are fixed), and
  a deployment that cannot hold :attr:`PlanAssumptions.min_kv_tokens` is infeasible (the 70B at
  TP2 on 80 GB GPUs or on 32 GB p150a cards);
* both sides use one TP degree (HAWK maps KV rank to rank; re-sharding is not modelled); KV moves
  by GG-Direct to a GPU and by GN-HAWK to a p150a, on the testbed's Fig. 9 curves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hawk.sim.cluster import SimConfig, simulate
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.paper import TARGET, crossing
from hawk.sim.testbeds import PAPER_CALIBRATION, PaperAssumptions, PaperFacts, Testbed, a100_prefill, paper_testbed
from hawk.sim.workload import RequestSource, Workload, get_workload

TESTBED_KEY = {"a100": "a100-tp4", "h100": "h100-tp4", "p150a": "p150a-tp4"}
GPUS = ("a100", "h100")
PAPER_SETUP = ("a100", "p150a", 4, 1, 1)  # §5.1: 4x A100 prefill, 4x p150a decode, TP4, one instance each


@dataclass(frozen=True)
class PlanAssumptions:
    """The numbers the planner adds to the ``paper`` testbed (public specs unless noted)."""

    memory_gb: dict[str, float] = field(default_factory=lambda: {"a100": 80.0, "h100": 80.0, "p150a": 32.0})  # A100/H100 PCIe 80 GB; p150a 32 GB GDDR6
    #: an H100 prefill's power: its PCIe TDP (the testbed's H100 power is the paper's decode power, set by Table 9)
    h100_prefill_power_w: float = 350.0
    h100_bf16_tflops: float = 756.0  # H100 PCIe datasheet, dense bf16
    gpu_kv_bytes_per_token: int = 327_680  # Llama-3.1-70B bf16: 80 x 2 x 8 x 128 x 2 B
    npu_kv_bytes_per_token: int = 174_080  # bfloat8_b: 1 B + a shared exponent per 16 (1.0625 B)
    min_kv_tokens: int = 16_384  # assumption: an instance must hold at least this much KV to be worth running


@dataclass(frozen=True)
class PlanSpace:
    """What to search: device types per side, TP degrees, prefill:decode instance counts."""

    prefill: tuple[str, ...] = ("a100", "h100")
    decode: tuple[str, ...] = ("a100", "h100", "p150a")
    tp: tuple[int, ...] = (4, 8)
    pd: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1))

    def candidates(self) -> list[tuple[str, str, int, int, int]]:
        """Every (prefill, decode, tp, #prefill, #decode), the paper's setup always among them."""
        out = [(p, d, t, np_, nd) for p in self.prefill for d in self.decode for t in self.tp for np_, nd in self.pd]
        return out if PAPER_SETUP in out else [PAPER_SETUP, *out]


@dataclass
class Candidate:
    """One deployment and what the search found for it."""

    prefill: str
    decode: str
    tp: int
    num_prefill: int
    num_decode: int
    devices: int
    price_usd: float
    power_w: float
    transfer: str
    feasible: bool = True
    why_infeasible: str = ""
    rate90: float | None = None  # req/s at >= 90 % SLO attainment; inf: beyond the search cap
    throughput: float | None = None  # output tokens/s at rate90
    tok_s_per_kusd: float = 0.0
    tok_s_per_kw: float = 0.0
    binds: str = ""
    rank_cost: int = 0
    rank_power: int = 0

    @property
    def label(self) -> str:
        return f"{self.num_prefill}x {_name(self.prefill)}-TP{self.tp} : {self.num_decode}x {_name(self.decode)}-TP{self.tp}"

    @property
    def is_paper(self) -> bool:
        return (self.prefill, self.decode, self.tp, self.num_prefill, self.num_decode) == PAPER_SETUP


def _name(dev: str) -> str:
    return dev if dev == "p150a" else dev.upper()


# ============================================================================ models at other TP degrees


def _gemm_fraction(tflops: float, f: PaperFacts, a: PaperAssumptions) -> tuple[float, float]:
    """(GEMM, all-reduce) seconds per prompt token at TP4, as ``testbeds.a100_prefill`` derives them."""
    mfu = PAPER_CALIBRATION.prefill_mfu
    m = a100_prefill(replace(f, a100_bf16_tflops=tflops), a, mfu)
    gemm = 2 * f.params / (4 * tflops * 1e12 * mfu)
    return gemm, m.per_token_s - gemm


def prefill_model(tb: Testbed, dev: str, tp: int, pa: PlanAssumptions = PlanAssumptions(),
                  f: PaperFacts = PaperFacts(), a: PaperAssumptions = PaperAssumptions()) -> PrefillModel:
    """A prefill instance of ``dev`` at TP ``tp`` (see the module docstring for the scaling)."""
    if dev == "h100":
        base = a100_prefill(replace(f, a100_bf16_tflops=pa.h100_bf16_tflops), a, PAPER_CALIBRATION.prefill_mfu)
        gemm, comm = _gemm_fraction(pa.h100_bf16_tflops, f, a)
        src = f"planner: A100 derivation at {pa.h100_bf16_tflops:g} TFLOP/s (H100 PCIe dense bf16)"
    else:
        base = tb.prefill_models[TESTBED_KEY[dev]]
        g, c = _gemm_fraction(f.a100_bf16_tflops, f, a)
        gemm, comm = base.per_token_s * g / (g + c), base.per_token_s * c / (g + c)  # p150a: the same split, x2.52
        src = base.source
    ring = (2 * (tp - 1) / tp) / (2 * 3 / 4)
    return replace(
        base, per_token_s=gemm * 4 / tp + comm * ring, per_token_sq_s=base.per_token_sq_s * 4 / tp,
        kv_capacity_tokens=kv_room(base.kv_capacity_tokens, dev, tp, pa), source=f"{src}; at TP{tp}" if tp != 4 else src,
    )


def decode_model(tb: Testbed, dev: str, tp: int, pa: PlanAssumptions = PlanAssumptions()) -> DecodeModel:
    """A decode instance of ``dev`` at TP ``tp``: step terms x 4/tp, KV room from the devices added."""
    base = tb.decode_models[TESTBED_KEY[dev]]
    k = 4 / tp
    return replace(
        base, base_s=base.base_s * k, per_seq_s=base.per_seq_s * k, per_ctx_token_s=base.per_ctx_token_s * k,
        kv_capacity_tokens=kv_room(base.kv_capacity_tokens, dev, tp, pa), source=f"{base.source}; at TP{tp}" if tp != 4 else base.source,
    )


def kv_room(tp4_tokens: int, dev: str, tp: int, pa: PlanAssumptions) -> int:
    """KV tokens an instance holds: the TP4 room plus (or minus) whole devices' memory."""
    per_token = pa.gpu_kv_bytes_per_token if dev in GPUS else pa.npu_kv_bytes_per_token
    return int(tp4_tokens + (tp - 4) * pa.memory_gb[dev] * 1e9 / per_token)


def build(tb: Testbed, cand: tuple[str, str, int, int, int], pa: PlanAssumptions = PlanAssumptions()) -> tuple[Candidate, SimConfig | None]:
    """The candidate's bookkeeping (price, power, feasibility) and its simulator configuration."""
    p, d, tp, np_, nd = cand
    for dev in (p, d):
        if dev not in TESTBED_KEY:
            raise ValueError(f"unknown device {dev!r}; the planner knows {', '.join(TESTBED_KEY)}")
    if tp < 1:
        raise ValueError(f"TP degree must be positive, got {tp}")
    dp, dd = tb.devices[TESTBED_KEY[p]], tb.devices[TESTBED_KEY[d]]
    transfer = "gg-direct" if d in GPUS else "gn-hawk"
    prefill_w = pa.h100_prefill_power_w if p == "h100" else dp.power_w
    c = Candidate(p, d, tp, np_, nd, (np_ + nd) * tp, tp * (np_ * dp.price_usd + nd * dd.price_usd),
                  tp * (np_ * prefill_w + nd * dd.power_w), transfer)
    pm, dm = prefill_model(tb, p, tp, pa), decode_model(tb, d, tp, pa)
    short = list(dict.fromkeys((dev, m.kv_capacity_tokens) for dev, m in ((p, pm), (d, dm)) if m.kv_capacity_tokens < pa.min_kv_tokens))
    if short:
        c.feasible = False
        c.why_infeasible = "; ".join(f"{dev} TP{tp}: the 70B's weights leave {max(0, n)} KV tokens (< {pa.min_kv_tokens})" for dev, n in short)
        return c, None
    cfg = SimConfig(
        name=c.label, transfer=tb.curves[transfer], prefill=pm, decode=dm, num_prefill=np_, num_decode=nd,
        bytes_per_token=tb.bytes_per_token, prefill_profile=f"{p}-tp{tp}", decode_profile=f"{d}-tp{tp}", **tb.decode_flow(),
    )
    return c, cfg


# ============================================================================ search


def binding_constraint(rec: dict[str, Any]) -> str:
    """Why a run just above the goodput rate misses: which SLO, and where its time went."""
    ttft_miss = 1 - (rec.get("ttft_attainment") or 0.0)
    tpot_miss = 1 - (rec.get("tpot_attainment") or 0.0)
    if tpot_miss > ttft_miss:
        return f"TPOT: decode step too slow at batch {max(rec.get('decode_batch_peak') or [0])} (P90 {rec.get('tpot_p90_ms') or 0:.0f} ms)"
    stages = {k: rec.get(f"{k}_p90_ms") or 0.0 for k in ("prefill_queue", "prefill", "decode_admit_wait", "kv_transfer", "join_wait")}
    worst = max(stages, key=lambda k: stages[k])
    if worst in ("prefill_queue", "prefill"):
        util = max(rec.get("prefill_utilization") or [0.0])
        return f"TTFT: prefill compute (busy {util:.0%}, P90 queue {stages['prefill_queue']:.0f} ms)"
    if worst == "decode_admit_wait":
        batch, cap = max(rec.get("decode_batch_peak") or [0]), rec.get("decode_max_batch")
        kv, room = max(rec.get("decode_kv_peak_tokens") or [0]), rec.get("decode_kv_capacity_tokens") or 0
        if cap and batch >= cap:
            return f"TTFT: decode batch slots full ({cap} sequences), requests wait to be admitted"
        if room and kv >= 0.9 * room:
            return f"TTFT: decode KV memory full ({room} tokens)"
        return "TTFT: waiting for decode admission"
    if worst == "kv_transfer":
        return f"TTFT: KV transfer (P90 {stages['kv_transfer']:.0f} ms)"
    return f"TTFT: joining the decode batch (P90 {stages['join_wait']:.0f} ms)"


@dataclass
class Planner:
    """Seeded simulations of each candidate, cached by rate (the bisection revisits rates)."""

    workload: Workload | RequestSource
    num_requests: int = 300
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    steps: int = 7

    def runs(self, cfg: SimConfig) -> tuple[float | None, dict[float, dict[str, Any]]]:
        cache: dict[float, dict[str, Any]] = {}

        def run(rate: float) -> dict[str, Any]:
            if rate not in cache:
                cache[rate] = simulate(cfg, rate, self.workload, self.num_requests, self.seed,
                                       slo_ttft_ms=self.slo_ttft_ms, slo_tpot_ms=self.slo_tpot_ms)
            return cache[rate]

        rate = crossing(lambda r: run(r)["slo_attainment"] >= TARGET, steps=self.steps)
        return rate, cache

    def evaluate(self, c: Candidate, cfg: SimConfig) -> Candidate:
        rate, cache = self.runs(cfg)
        c.rate90 = rate
        if rate is None:
            c.binds = binding_constraint(cache[min(cache)])
            return c
        top = max(cache) if math.isinf(rate) else rate
        c.throughput = cache[top]["output_throughput_tok_s"] or 0.0
        c.tok_s_per_kusd = c.throughput / (c.price_usd / 1e3)
        c.tok_s_per_kw = c.throughput / (c.power_w / 1e3)
        fails = [r for r in cache if r > top and cache[r]["slo_attainment"] < TARGET]
        c.binds = binding_constraint(cache[min(fails)]) if fails else "none below the search cap (40 req/s)"
        return c


def plan(space: PlanSpace, workload: str | Workload | RequestSource = "chatbot", num_requests: int = 300, seed: int = 0, *,
         slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, tb: Testbed | None = None,
         assumptions: PlanAssumptions = PlanAssumptions()) -> list[Candidate]:
    """Every candidate, evaluated and ranked (1 = best) by goodput per $ and per W."""
    tb = tb or paper_testbed()
    pl = Planner(get_workload(workload), num_requests, seed, slo_ttft_ms, slo_tpot_ms)
    out = []
    for cand in space.candidates():
        c, cfg = build(tb, cand, assumptions)
        out.append(pl.evaluate(c, cfg) if cfg is not None else c)
    for key, attr in (("tok_s_per_kusd", "rank_cost"), ("tok_s_per_kw", "rank_power")):
        for i, c in enumerate(sorted(out, key=lambda c: (-getattr(c, key), c.devices)), start=1):
            setattr(c, attr, i)
    return sorted(out, key=lambda c: c.rank_cost)


def verdict(cands: Sequence[Candidate]) -> str:
    """Where the paper's setup ranks and why, in one paragraph."""
    paper = next(c for c in cands if c.is_paper)
    feasible = [c for c in cands if c.feasible]
    best_cost = min(feasible, key=lambda c: c.rank_cost)
    best_power = min(feasible, key=lambda c: c.rank_power)
    n = len(feasible)
    lines = [
        f"The paper's GN-HAWK setup ({paper.label}) ranks #{paper.rank_cost} of {n} feasible by goodput per $ "
        f"and #{paper.rank_power} by goodput per W: {_rate(paper.rate90)} req/s at >= 90 % SLO attainment, "
        f"{paper.throughput or 0:.0f} tok/s, {paper.tok_s_per_kusd:.2f} tok/s per k$, {paper.tok_s_per_kw:.1f} tok/s per kW.",
        f"What binds it: {paper.binds}.",
    ]
    for what, best, key in (("per $", best_cost, "tok_s_per_kusd"), ("per W", best_power, "tok_s_per_kw")):
        if best is not paper:
            ratio = getattr(best, key) / getattr(paper, key) if getattr(paper, key) else math.inf
            lines.append(f"Best {what}: {best.label} ({ratio:.2f}x the paper's setup; {_rate(best.rate90)} req/s; binds: {best.binds}).")
    return " ".join(lines)


def _rate(r: float | None) -> str:
    return "never" if r is None else "> 40" if math.isinf(r) else f"{r:.2f}"


# ============================================================================ output


def print_plan(cands: Sequence[Candidate], title: str) -> None:
    from rich.table import Table

    from hawk.sim.report import console

    t = Table(title=title)
    for col in ("#$", "#W", "deployment", "KV path", "dev", "k$", "kW", "req/s @90%", "tok/s", "tok/s/k$", "tok/s/kW", "what binds"):
        t.add_column(col, justify="left" if col in ("deployment", "KV path", "what binds") else "right")
    for c in cands:
        if not c.feasible:
            t.add_row("-", "-", c.label, c.transfer, str(c.devices), f"{c.price_usd / 1e3:.0f}", f"{c.power_w / 1e3:.2f}", "-", "-", "-", "-",
                      f"infeasible: {c.why_infeasible}")
            continue
        mark = " *" if c.is_paper else ""
        t.add_row(str(c.rank_cost), str(c.rank_power), c.label + mark, c.transfer, str(c.devices), f"{c.price_usd / 1e3:.0f}",
                  f"{c.power_w / 1e3:.2f}", _rate(c.rate90), f"{c.throughput or 0:.0f}", f"{c.tok_s_per_kusd:.2f}", f"{c.tok_s_per_kw:.1f}", c.binds)
    con = console()
    con.print(t)
    con.print("* = the paper's setup (§5.1). Simulated on the 'paper' testbed (derived from cited facts; TP != 4 and H100 prefill: planner assumptions).")
    con.print(verdict(cands))


def run_plan(space: PlanSpace, workload: str | Workload | RequestSource = "chatbot", num_requests: int = 300, seed: int = 0, *,
             slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, json_path: str | None = None,
             quiet: bool = False) -> list[dict[str, Any]]:
    """What ``hawk sim --plan`` does: search, print the ranking, write ``--json``."""
    wl = get_workload(workload)
    cands = plan(space, wl, num_requests, seed, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    ttft = wl.slo_ttft_ms if slo_ttft_ms is None else slo_ttft_ms
    tpot = wl.slo_tpot_ms if slo_tpot_ms is None else slo_tpot_ms
    if not quiet:
        print_plan(cands, f"Deployments for {wl.name} (SLO {ttft:g}/{tpot:g} ms, {num_requests} requests, seed {seed}): goodput per $ and per W")
    rows = [{**asdict(c), "label": c.label, "paper_setup": c.is_paper,
             "rate90": None if c.rate90 is not None and math.isinf(c.rate90) else c.rate90,
             "rate90_beyond_cap": c.rate90 is not None and math.isinf(c.rate90)} for c in cands]
    if json_path:
        doc = {"simulated": True, "kind": "plan", "testbed": "paper", "workload": wl.name, "slo_ttft_ms": ttft, "slo_tpot_ms": tpot,
               "num_requests": num_requests, "seed": seed, "target_attainment": TARGET, "space": asdict(space),
               "assumptions": asdict(PlanAssumptions()), "verdict": verdict(cands), "candidates": rows}
        out = Path(json_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    return rows
