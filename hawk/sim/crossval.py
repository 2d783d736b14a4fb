"""Cross-validation: does the simulator, calibrated on a machine, predict a real serving run there?

The ``here`` testbed's models are rebuilt from *probe* measurements of the running system (taken
before the serving sweep, never fitted to its result), the simulator runs the sweep's workload,
seed and rates, and the P90 TTFT / P90 TPOT of both are compared (issue 10: within 20 %).

What is measured, and what it becomes (:class:`Probes` -> :func:`calibrated_config`):

* prefill time per prompt (sequential requests of several lengths: the server's ``prefill_s``)
  -> ``PrefillModel`` base + per token (least squares);
* KV transfer time per byte (the same requests' ``kv_transfer_s`` and ``kv_bytes``, D1-D7)
  -> a ``TransferCurve`` through each probed size's median (``transfer_curve``) and the KV bytes
  per prompt token;
* decode step time per batch size (B requests at once: the server's median TPOT)
  -> ``DecodeModel`` base + per sequence;
* the front end (client TTFT minus the server-side stages of the sequential requests: HTTP hops,
  the router, streaming) -> ``SimConfig.frontend_s`` + ``frontend_per_token_s`` per prompt token
  (least squares over the same prompt lengths, :func:`frontend_line`).

With timing emulation on, the simulator gets the same pacing the real run had: the decode step's
floor is the same ``hawk.devices.timing`` model the engine slept to, and transfers are paced to the
same link (``SimConfig.link_gbps``). This module is pure (no HTTP): ``benchmarks/cross_validate.py``
runs the servers and feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import simpy

from hawk.devices.timing import StepModel
from hawk.engine.graph_buckets import WARMUP_RUNS
from hawk.sim.calibration import TransferCurve
from hawk.sim.cluster import SimConfig
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.prefill import GraphCapture, PrefillInstance
from hawk.sim.request import SimRequest
from hawk.sim.workload import RequestSpec

#: issue 10's acceptance: P90 TTFT and P90 TPOT within 20 % of the real run
TOLERANCE = 0.20


@dataclass
class Probes:
    """Calibration measurements of one running system (seconds, bytes)."""

    prefill: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, prefill_s)
    transfer: list[tuple[float, float]] = field(default_factory=list)  # (kv bytes, kv_transfer_s)
    kv_tokens: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, kv bytes)
    decode: list[tuple[int, float]] = field(default_factory=list)  # (batch, step s = server TPOT)
    frontend: list[float] = field(default_factory=list)  # client TTFT - server-side stages
    concurrent: list[tuple[int, float, float]] = field(default_factory=list)  # (k sent at once, kv bytes, kv_transfer_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` through the median ``y`` of each distinct ``x`` (one slow
    outlier, such as a first request that compiled kernels, must not set the model), with both kept
    non-negative (a time model cannot go below 0); one distinct x gives its median as ``a`` and slope 0."""
    groups: dict[float, list[float]] = {}
    for xv, yv in zip(xs, ys):
        groups.setdefault(float(xv), []).append(float(yv))
    x = np.asarray(sorted(groups), float)
    y = np.asarray([np.median(groups[k]) for k in sorted(groups)], float)
    if len(x) == 0:
        raise ValueError("no points to fit")
    if np.ptp(x) == 0:
        return float(y.mean()), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(y.mean()), 0.0
    if a < 0:  # through the origin instead
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(b)


def transfer_curve(points: Sequence[tuple[float, float]], source: str) -> TransferCurve:
    """The KV transfer (D1-D7) as a measured curve: the fitted line's intercept at zero bytes (the
    fixed cost), then each probed size's median, linear in between and beyond the largest with the
    last segment's slope (``TransferCurve``, as ``hawk bench transfer`` curves are). Why not the
    line alone: a host-staged pull's CPU fix-up costs more per byte as the KV outgrows the caches
    (one H200 host, bfloat8_b, 8B shape: 9.1 ms/MB between 437 and 1750 prompt tokens, 13.2 ms/MB
    between 1750 and 3500, ``crossval_h200/paced_bfp8_summarization_gn-host.json``), so a least-squares
    line overstates a mean-length pull and understates the longest."""
    fixed, per_byte = fit_line([b for b, _ in points], [t for _, t in points])
    groups: dict[float, list[float]] = {}
    for b, t in points:
        groups.setdefault(float(b), []).append(float(t))
    sizes = sorted(x for x in groups if x > 1.0)
    medians = [float(np.median(groups[x])) for x in sizes]
    return TransferCurve(
        "here-measured", (1.0, *sizes), (min([fixed, *medians]), *medians),
        f"{source}: {fixed * 1e3:.2f} ms fixed (least squares) + the median at each of {len(sizes)} probed sizes "
        f"(D1-D7, piecewise linear; {per_byte * 1e9:.3f} ms/MB on average)", measured=True,
    )


@dataclass(frozen=True)
class Calibrated:
    """The ``here`` models fitted from :class:`Probes`, with what each was fitted from."""

    prefill: PrefillModel
    decode: DecodeModel
    transfer: TransferCurve
    bytes_per_token: int
    frontend_s: float
    link_speedup: tuple[float, ...] = (1.0,)  # s(1), s(2), ... of simultaneous pulls (link_speedup())
    frontend_per_token_s: float = 0.0  # the front end's growth with the prompt (frontend_line())

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill.to_dict(), "decode": {k: v for k, v in self.decode.to_dict().items() if k != "floor"},
            "transfer": self.transfer.to_dict(), "bytes_per_token": self.bytes_per_token, "frontend_s": self.frontend_s,
            "link_speedup": list(self.link_speedup), "frontend_per_token_s": self.frontend_per_token_s,
        }


def calibrate(p: Probes, *, max_batch: int, kv_tokens: int, max_batch_tokens: int = 8192, prefill_chunk: int = 0,
              machine: str = "this machine", prefill_kv_tokens: int | None = None) -> Calibrated:
    """Fit the models (see the module docstring); ``max_batch`` / ``kv_tokens`` are the served
    decode's limits (``prefill_kv_tokens`` the prefill's, when its cache is sized apart: the memory
    rule gives a prefill instance a fixed cache), ``max_batch_tokens`` the prefill engine's token
    budget and ``prefill_chunk`` its ``max_prefill_chunk`` (0: whole prompts)."""
    pa, pb = fit_line([n for n, _ in p.prefill], [t for _, t in p.prefill])
    da, db = fit_line([b for b, _ in p.decode], [t for _, t in p.decode])
    bpt = sum(b for _, b in p.kv_tokens) / max(1, sum(n for n, _ in p.kv_tokens))
    src = f"measured: probes of the running system on {machine}"
    curve = transfer_curve(p.transfer, src)
    fe_fixed, fe_per_token = frontend_line(p)
    return Calibrated(
        PrefillModel(pa, pb, 0.0, max_batch_tokens, prefill_kv_tokens or kv_tokens, f"{src}: {pa * 1e3:.1f} ms + {pb * 1e3:.3f} ms/token (least squares)",
                     chunk_tokens=prefill_chunk),
        DecodeModel(da, db, 0.0, max_batch, kv_tokens, f"{src}: {da * 1e3:.1f} ms + {db * 1e3:.2f} ms/sequence (median TPOT at each batch)"),
        curve, int(round(bpt)), fe_fixed, link_speedup(p, curve), fe_per_token,
    )


def frontend_line(p: Probes) -> tuple[float, float]:
    """(fixed s, s per prompt token) of the front end, fitted like the prefill (:func:`fit_line`) over
    the sequential probes' prompt lengths, which ``p.frontend`` follows one for one. Why a line and
    not the median: the prompt travels as a JSON list of token ids from the client through the router
    to the prefill and is parsed and validated at each hop, so the front end grows with it (one H200,
    8B shape: 8-9 ms at 16 tokens, 13-15 ms at 2343, ``crossval_h200/paced_bfp8_chatbot_gn-hawk_20261204.json``),
    and a P90 is set by the longest prompts. Probes without paired lengths (older files whose
    frontend list does not follow the prefill list) keep the median, flat."""
    if not p.frontend:
        return 0.0, 0.0
    if len(p.frontend) != len(p.prefill):
        return float(np.median(p.frontend)), 0.0
    return fit_line([n for n, _ in p.prefill], p.frontend)


def link_speedup(p: Probes, curve: TransferCurve, slots: int | None = None) -> tuple[float, ...]:
    """``s(1..slots)``, the aggregate speed of k simultaneous pulls over one alone, from the probes
    that sent k requests at once. Under processor sharing k equal pulls that start together all end
    after ``fixed + k * shared / s(k)``, with (fixed, shared) the solo curve's at their size, so
    ``s(k) = k * mean(shared) / mean(T - fixed)``, kept within [1, k]; between probed k linear, past
    the largest its value; with no such probe 1 (fair sharing, the safe assumption). Why: on one H200
    host, gn-host's concurrent CPU fix-ups ran faster together than fair sharing of one fix-up's speed
    gives (``docs/reproduce.md``), and only a probe of the same system may say by how much."""
    slots = slots or PULL_THREADS
    groups: dict[int, tuple[list[float], list[float]]] = {}
    for k, nbytes, t in p.concurrent:
        fixed, shared = curve.split(nbytes)
        g = groups.setdefault(int(k), ([], []))
        g[0].append(shared)
        g[1].append(t - fixed)
    points = {1: 1.0}
    for k, (shared, excess) in groups.items():
        if k > 1 and float(np.mean(excess)) > 0:
            points[k] = min(float(k), max(1.0, k * float(np.mean(shared)) / float(np.mean(excess))))
    ks = sorted(points)
    return tuple(float(x) for x in np.interp(range(1, slots + 1), ks, [points[k] for k in ks]))


#: KV pulls a ``DecodeEngine`` runs at once (its ``transfer_threads`` default; a test checks they agree)
PULL_THREADS = 4


def graph_capture(probe: dict[str, Any], max_tokens: int = 2048) -> GraphCapture:
    """The prefill's first-use graph capture from ``benchmarks/prefill_graph_capture_probe.py``'s record:
    the capture's own time is each measured first use less the forward it ran ``1 + WARMUP_RUNS``
    times (warm-up runs and replay), the median over the probed sizes."""
    runs = int(probe.get("warmup_runs", WARMUP_RUNS))
    if runs != WARMUP_RUNS:
        raise ValueError(f"the probe ran {runs} warm-up runs per capture, the engine now {WARMUP_RUNS}: re-measure")
    own = [(r["first_ms"] - (1 + runs) * r["replay_ms"]) / 1e3 for r in probe["rows"]]
    return GraphCapture(max_tokens, max(0.0, float(np.median(own))),
                        f"measured: {probe.get('device', '?')}, {len(own)} two-prompt buckets ({probe.get('started_at', '?')})")


def probe_captures(graphs: GraphCapture, prefill: PrefillModel, sends: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The graph buckets the probes' simultaneous sends captured: ``(k, prompt tokens)`` = k prompts
    sent at once. The prefill engine's thread takes what is queued the moment it wakes
    (``PrefillEngine._loop``), so the first prompt runs alone and the other k - 1, arriving during its
    forward, share the next forwards (token budget, chunks): played here on the simulator's own
    prefill instance, one send after another."""
    env = simpy.Environment()
    inst = PrefillInstance(env, 0, replace(prefill, kv_capacity_tokens=1 << 40), lambda r: None, graphs=graphs)
    for i, (k, n) in enumerate(sends):
        env.process(_send_together(env, inst, 1e3 * i, k, n))
    env.run()
    return tuple(inst.captures)


def _send_together(env: simpy.Environment, inst: PrefillInstance, at: float, k: int, n: int):  # simpy process
    """``k`` prompts of ``n`` tokens at ``at``: the first alone, the rest just after it is taken."""
    yield env.timeout(at - env.now)
    inst.submit(SimRequest(RequestSpec(0, at, n, 1)))
    yield env.timeout(1e-6)
    for i in range(1, k):
        inst.submit(SimRequest(RequestSpec(i, at, n, 1)))


def calibrated_config(c: Calibrated, name: str, *, npu_step: StepModel | None = None, link_gbps: float | None = None,
                      staging_bytes: float | None = None, prefill_graphs: GraphCapture | None = None,
                      captured: Sequence[tuple[int, int]] = ()) -> SimConfig:
    """One prefill + one decode instance on the calibrated models, paced as the real run was.
    Contention: none for the direct paths (the real run paces each batch on its own,
    ``transport/paced.py``); for the host-staged ones (``*-host``) the per-byte part of a pull is the
    decode host's CPU work (copies, and ``gn-host``'s tilize), which concurrent pulls share: ``decode``
    scope, at the speed-up simultaneous pulls were measured to get (:func:`link_speedup`). At most
    :data:`PULL_THREADS` pulls run at once. The decode admits between steps, as
    ``DecodeEngine`` does (a request that arrives during a paced 30 ms step waits for it before its
    KV pull starts). ``staging_bytes``: the served prefill's staging buffer, which a host-staged
    pull's KV holds until it has landed (``staging.py``); the other paths land in place.
    ``prefill_graphs``: the prefill's CUDA graphs, captured on first use (``prefill.py``), with
    ``captured`` the buckets the same server captured before (probes, earlier rates)."""
    decode = replace(c.decode, floor=npu_step) if npu_step is not None else c.decode
    return SimConfig(
        name=name, transfer=c.transfer, prefill=c.prefill, decode=decode, bytes_per_token=c.bytes_per_token,
        contention="decode" if name.endswith("-host") else "none", prefill_profile="here-measured", decode_profile="here-measured",
        note="calibrated from probes of the real run's machine", link_gbps=link_gbps, frontend_s=c.frontend_s,
        frontend_per_token_s=c.frontend_per_token_s,
        admit_between_steps=True, transfer_slots=PULL_THREADS, link_speedup=c.link_speedup,
        staging_bytes=staging_bytes if name.endswith("-host") else None,
        prefill_graphs=prefill_graphs, prefill_graphs_captured=tuple(tuple(b) for b in captured),
    )


def lost_at_pull(real: dict[str, Any]) -> dict[int, str]:
    """Requests of one real rate that the decode failed as their pull started: index -> error.
    These are failures of the decode's own reservation for the KV (D3: ``buffer '...'`` in the error,
    which ``RangeReservations`` raises), made before any byte crosses the link and before the decode
    host's fix-up; the simulator has no such failure, so it is told about them
    (``simulate(lost_at_pull=...)``) and both sides then score the same requests, with no phantom
    pull on the decode host in between. A refusal by the prefill's staging (``prefill refused``) is
    not one: such a pull first waited for room, holding a pull thread."""
    out = {}
    for r in real.get("requests") or []:
        err = r.get("error") or ""
        if (not r.get("ok") and r.get("ttft_s") is None and "decode failed" in err and "buffer '" in err
                and "prefill refused" not in err):
            out[int(r["index"])] = err
    return out


def deviation(sim: float | None, real: float | None) -> float | None:
    """(sim - real) / real; None when either is missing."""
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def compare(measured: Sequence[dict[str, Any]], simulated: Sequence[dict[str, Any]], scenario: str,
            metrics: Sequence[str] = ("ttft_p90_ms", "tpot_p90_ms", "ttft_p50_ms", "tpot_p50_ms"),
            judged: Sequence[str] = ("ttft_p90_ms", "tpot_p90_ms")) -> list[dict[str, Any]]:
    """One row per (rate, metric): real, simulated, deviation, and for ``judged`` metrics whether it
    is within :data:`TOLERANCE`."""
    rows = []
    sims = {round(r["rate"], 9): r for r in simulated}
    for m in measured:
        s = sims.get(round(m["rate"], 9))
        if s is None:
            continue
        for k in metrics:
            d = deviation(s.get(k), m.get(k))
            rows.append({
                "scenario": scenario, "rate": m["rate"], "metric": k, "real": m.get(k), "sim": s.get(k), "deviation": d,
                "within": (None if d is None else abs(d) <= TOLERANCE) if k in judged else None,
            })
    return rows


#: A real request is a *one-off* when its TTFT exceeds the simulator's for the same request by both
#: this factor and this many seconds: a stall no calibrated model has (a kernel compiled on first use
#: of a new shape or alignment, a first allocation), which with few requests per rate is the P90.
ONE_OFF_FACTOR, ONE_OFF_S = 3.0, 0.25

#: Server-side stages both records carry (seconds); the rest of TTFT is front end + join wait.
STAGES = ("prefill_queue_s", "prefill_s", "decode_admit_wait_s", "kv_transfer_s")


def _ms(x: Any) -> float | None:
    return None if x is None else float(x) * 1e3


def per_request(real: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """One rate's real and simulated requests side by side, matched by index (the same workload,
    seed and rate give both the same request stream; both records need ``requests``, i.e.
    ``per_request=True``). Per request: prompt tokens, TTFT real / simulated, each server-side stage
    real / simulated (the real ones from the router's ``hawk`` timings; the simulator's prefill queue
    without its front end), the stage with the largest excess and whether it is a one-off
    (:data:`ONE_OFF_FACTOR`, :data:`ONE_OFF_S`). Requests without a TTFT on either side are left out."""
    sims = {r["index"]: r for r in sim.get("requests") or []}
    frontend, per_token = float(sim.get("frontend_s") or 0.0), float(sim.get("frontend_per_token_s") or 0.0)
    rows = []
    for r in real.get("requests") or []:
        s = sims.get(r["index"])
        if s is None or r.get("ttft_s") is None or s.get("ttft_s") is None:
            continue
        hawk = (r.get("extra") or {}).get("hawk") or {}
        sx = dict(s.get("extra") or {})
        if sx.get("prefill_queue_s") is not None:
            sx["prefill_queue_s"] = max(0.0, sx["prefill_queue_s"] - frontend - per_token * r["input_len"])
        stages = {k: (_ms(hawk.get(k)), _ms(sx.get(k))) for k in STAGES}
        real_ms, sim_ms = r["ttft_s"] * 1e3, s["ttft_s"] * 1e3
        known = {k: a - b for k, (a, b) in stages.items() if a is not None and b is not None}
        rest_real = real_ms - sum(a for a, _ in stages.values() if a is not None)
        rest_sim = sim_ms - sum(b for _, b in stages.values() if b is not None)
        stages["rest"] = (rest_real, rest_sim)  # front end, join wait, hops
        known["rest"] = rest_real - rest_sim
        worst = max(known, key=lambda k: known[k])
        rows.append({
            "rate": real.get("rate"), "index": r["index"], "input_len": r["input_len"], "sent_s": r.get("sent_s"),
            "real_ttft_ms": real_ms, "sim_ttft_ms": sim_ms, "excess_ms": real_ms - sim_ms,
            "stages_ms": {k: {"real": a, "sim": b} for k, (a, b) in stages.items()},
            "worst_stage": worst, "worst_excess_ms": known[worst],
            "one_off": real_ms > ONE_OFF_FACTOR * sim_ms and real_ms - sim_ms > ONE_OFF_S * 1e3,
        })
    return rows


def format_one_offs(rows: Sequence[dict[str, Any]], scenario: str = "") -> list[str]:
    """One line per one-off request of :func:`per_request` rows (none: an empty list)."""
    out = []
    for r in rows:
        if not r["one_off"]:
            continue
        w = r["stages_ms"][r["worst_stage"]]
        sent = "" if r.get("sent_s") is None else f", sent at {r['sent_s']:.3f} s"
        out.append(
            f"{scenario + ' ' if scenario else ''}rate {r['rate']:g}: request {r['index']} ({r['input_len']} prompt tokens{sent}): "
            f"TTFT {r['real_ttft_ms']:.0f} ms, simulated {r['sim_ttft_ms']:.0f} ms; {r['worst_stage']} "
            f"{w['real']:.0f} ms vs {w['sim']:.0f} ms simulated"
        )
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: scenario, rate, metric, real, simulated, deviation, within 20 %."""
    out = ["| scenario | rate | metric | real (ms) | sim (ms) | deviation | within 20 % |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = (lambda v: "-" if v is None else f"{v:.1f}")
        d = "-" if r["deviation"] is None else f"{r['deviation'] * 100:+.1f} %"
        w = "" if r["within"] is None else ("yes" if r["within"] else "**no**")
        out.append(f"| {r['scenario']} | {r['rate']:g} | {r['metric']} | {f(r['real'])} | {f(r['sim'])} | {d} | {w} |")
    return "\n".join(out)
