"""The disaggregated cluster end to end: ``simulate`` one (configuration, rate), ``sweep`` many.

arrivals (workload.py) → router (router.py) → N prefill instances (prefill.py) → KV transfer over
contended links (transfer.py, link.py; latency calibrated from measurements, calibration.py) →
M decode instances with admission control (decode.py) → per-request results → metrics.py.

Each record says what it is: ``simulated: true``, the transfer curve's source (measured) and the
compute models' sources (assumptions unless you calibrated them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import simpy

from hawk.sim.calibration import TransferCurve
from hawk.sim.compute import DecodeModel, PrefillModel
from hawk.sim.decode import DecodeInstance
from hawk.sim.host import HostStaging
from hawk.sim.defaults import (
    DECODE_MODELS,
    KV_BYTES_PER_TOKEN_PER_RANK,
    PREFILL_MODELS,
    PRESETS,
    Preset,
    default_transfer_curves,
    load_calibration,
)
from hawk.sim.metrics import percentile, summarize
from hawk.sim.prefill import GraphCapture, PrefillInstance
from hawk.sim.request import SimRequest
from hawk.sim.router import Router
from hawk.sim.transfer import KVTransferService
from hawk.sim.workload import Workload, generate_requests, get_workload


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated cluster needs (build one with :func:`make_config`)."""

    name: str
    transfer: TransferCurve
    prefill: PrefillModel
    decode: DecodeModel
    num_prefill: int = 1
    num_decode: int = 1
    bytes_per_token: int = KV_BYTES_PER_TOKEN_PER_RANK
    contention: str = "decode"
    router_policy: str = "round_robin"
    prefill_profile: str = ""
    decode_profile: str = ""
    note: str = ""
    #: timing emulation, as a paced real run (hawk/devices/timing.py): KV transfers paced to a link
    #: of this many Gb/s (the decode's step floor lives in ``decode.floor``)
    link_gbps: float | None = None
    #: request front end: router, HTTP hops and streaming, added to TTFT without occupying an
    #: instance (0 for the testbeds; a real run's cross-validation measures it)
    frontend_s: float = 0.0
    #: the front end's part that grows with the prompt (seconds per prompt token): the prompt travels
    #: as a JSON list of token ids from the client through the router to the prefill, parsed and
    #: validated at each hop; a real run's probes measure it beside ``frontend_s``
    frontend_per_token_s: float = 0.0
    #: decode admission only between steps, as ``DecodeEngine`` and vLLM admit (see ``decode.py``); on
    #: for the ``paper`` testbed (``decode.VLLM_DECODE_FLOW``) and a cross-validation of HAWK's engine
    admit_between_steps: bool = False
    #: host staging as worker time on both nodes (``host.py``); None: the transfer is only a delay
    host: HostStaging | None = None
    #: KV pulls a decode instance runs at once (``DecodeEngine``'s pull threads); None: one per batch slot
    transfer_slots: int | None = None
    #: a contended link's aggregate speed with k transfers active, ``[s(1), s(2), ...]`` (``link.py``):
    #: 1 (fair sharing) unless probes of simultaneous transfers measured more
    link_speedup: tuple[float, ...] = (1.0,)
    #: each prefill instance's staging buffer in bytes, which a pull's KV holds until it has landed
    #: (``staging.py``); None: unlimited (the testbeds, and paths that stage nothing)
    staging_bytes: float | None = None
    #: the first token comes out of the decode step that includes the request (vLLM's disaggregated
    #: serving, ``decode.VLLM_DECODE_FLOW``) instead of at the join (HAWK's engine)
    first_token_on_decode: bool = False
    #: the prefill's CUDA graphs, captured on first use (``prefill.py``); None: no first-use cost
    prefill_graphs: GraphCapture | None = None
    #: graph buckets each prefill instance captured before this run (earlier traffic to the same
    #: servers: a cross-validation's probes and earlier rates), beyond the server's startup ones
    prefill_graphs_captured: tuple[tuple[int, int], ...] = ()

    def describe(self) -> dict[str, Any]:
        return {
            "config": self.name,
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "pd_ratio": f"{self.num_prefill}:{self.num_decode}",
            "prefill_profile": self.prefill_profile,
            "decode_profile": self.decode_profile,
            "transfer_curve": self.transfer.config,
            "transfer_source": self.transfer.source,
            "transfer_measured": self.transfer.measured,
            "prefill_source": self.prefill.source,
            "decode_source": self.decode.source,
            "contention": self.contention,
            "router_policy": self.router_policy,
            "bytes_per_token": self.bytes_per_token,
            "link_gbps": self.link_gbps,
            "npu_timing": getattr(self.decode.floor, "source", None),
            "frontend_s": self.frontend_s,
            "frontend_per_token_s": self.frontend_per_token_s,
            "admit_between_steps": self.admit_between_steps,
            "prefill_chunk_tokens": self.prefill.chunk_tokens,
            "host_staging": None if self.host is None else self.host.source,
            "transfer_slots": self.transfer_slots,
            "link_speedup": list(self.link_speedup),
            "staging_bytes": self.staging_bytes,
            "first_token_on_decode": self.first_token_on_decode,
            "prefill_graphs": None if self.prefill_graphs is None else self.prefill_graphs.source,
        }


def make_config(
    name: str,
    num_prefill: int = 1,
    num_decode: int = 1,
    *,
    transfer_scale: float = 1.0,
    curves: dict[str, TransferCurve] | None = None,
    prefill_models: dict[str, PrefillModel] | None = None,
    decode_models: dict[str, DecodeModel] | None = None,
    presets: dict[str, Preset] | None = None,
    contention: str = "decode",
    router_policy: str = "round_robin",
    calibration: str | Path | None = None,
    host: dict[str, HostStaging] | None = None,
) -> SimConfig:
    """A named configuration (``gg-host``, ``gn-host``, ``gg-direct``, ``gn-hawk``, ``ggh-direct``,
    ``gn-direct-single``) from the default tables, from the tables you pass, or from a calibration
    JSON file (``defaults.load_calibration``). ``host`` maps a transfer path to the worker time its
    host staging costs (``host.py``)."""
    if calibration is not None:
        tables = load_calibration(calibration)
        curves = curves or tables["transfer_curves"]
        prefill_models = prefill_models or tables["prefill_models"]
        decode_models = decode_models or tables["decode_models"]
        presets = presets or tables["presets"]
    presets = presets or PRESETS
    if name not in presets:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(presets)}")
    p = presets[name]
    curves = curves or default_transfer_curves()
    if p.transfer not in curves:
        raise ValueError(f"no transfer calibration for {p.transfer!r}; have: {', '.join(curves)}")
    curve = curves[p.transfer]
    if transfer_scale != 1.0:
        curve = curve.scaled(transfer_scale)
    decode = (decode_models or DECODE_MODELS)[p.decode]
    if p.decode_slowdown != 1.0:
        decode = decode.slowed(p.decode_slowdown)
    return SimConfig(
        name=name, transfer=curve, prefill=(prefill_models or PREFILL_MODELS)[p.prefill], decode=decode,
        num_prefill=num_prefill, num_decode=num_decode, contention=contention, router_policy=router_policy,
        prefill_profile=p.prefill, decode_profile=p.decode, note=p.note, host=(host or {}).get(p.transfer),
    )


def frontend_delay(cfg: SimConfig, input_len: int) -> float:
    """Seconds a request spends in the front end before it reaches a prefill instance: a fixed part
    and one per prompt token (``SimConfig.frontend_per_token_s``)."""
    return cfg.frontend_s + cfg.frontend_per_token_s * input_len


@dataclass
class _Occupancy:
    """Time-average of the number of requests in the system (for Little's-law checks)."""

    now: float = 0.0
    count: int = 0
    area: float = 0.0
    peak: int = 0

    def change(self, t: float, delta: int) -> None:
        self.area += self.count * (t - self.now)
        self.now, self.count = t, self.count + delta
        self.peak = max(self.peak, self.count)


@dataclass
class Cluster:
    """The simpy wiring of one run."""

    cfg: SimConfig
    env: simpy.Environment = field(default_factory=simpy.Environment)

    def __post_init__(self) -> None:
        env, cfg = self.env, self.cfg
        self.occupancy = _Occupancy()
        self.transfer = KVTransferService(env, cfg.transfer, cfg.bytes_per_token, cfg.contention, cfg.link_gbps, cfg.link_speedup,
                                          cfg.staging_bytes)
        h = cfg.host or HostStaging()
        self.prefills = [PrefillInstance(env, i, cfg.prefill, self._prefilled, h.prefill_s_per_byte * cfg.bytes_per_token,
                                         cfg.prefill_graphs, cfg.prefill_graphs_captured)
                         for i in range(cfg.num_prefill)]
        self.decodes = [DecodeInstance(env, i, cfg.decode, self.transfer, self._prefill_kv_free, self._finished, cfg.admit_between_steps,
                                       h.decode_s_per_byte * cfg.bytes_per_token, cfg.transfer_slots,
                                       cfg.first_token_on_decode)
                        for i in range(cfg.num_decode)]
        self.router = Router(self.prefills, self.decodes, cfg.router_policy)
        self.requests: list[SimRequest] = []

    def _prefilled(self, r: SimRequest) -> None:
        self.router.to_decode(r)

    def _prefill_kv_free(self, r: SimRequest) -> None:
        self.prefills[r.prefill].release(r.input_len)

    def _finished(self, r: SimRequest) -> None:
        self.occupancy.change(self.env.now, -1)

    def _arrivals(self, requests: Sequence[SimRequest]):  # simpy process
        for r in requests:
            if r.spec.arrival_s > self.env.now:
                yield self.env.timeout(r.spec.arrival_s - self.env.now)
            if self.cfg.frontend_s > 0 or self.cfg.frontend_per_token_s > 0:
                self.env.process(self._after_frontend(r))
            elif self.router.route(r):
                self.occupancy.change(self.env.now, +1)

    def _after_frontend(self, r: SimRequest):  # simpy process: the front end's delay, then routing
        yield self.env.timeout(frontend_delay(self.cfg, r.input_len))
        if self.router.route(r):
            self.occupancy.change(self.env.now, +1)

    def run(self, requests: Sequence[SimRequest], horizon_s: float | None = None) -> None:
        self.requests = list(requests)
        self.env.process(self._arrivals(self.requests))
        self.env.run(until=horizon_s)
        self.occupancy.change(self.env.now, 0)


def simulate(
    config: str | SimConfig,
    rate: float,
    workload: str | Workload = "chatbot",
    num_requests: int = 500,
    seed: int = 0,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    transfer_scale: float = 1.0,
    contention: str = "decode",
    router_policy: str = "round_robin",
    calibration: str | Path | None = None,
    horizon_s: float | None = None,
    per_request: bool = False,
    lost_at_pull: dict[int, str] | None = None,
) -> dict[str, Any]:
    """Simulate ``num_requests`` Poisson arrivals at ``rate`` req/s through one configuration.

    Returns one record in the serving benchmark's schema (``rate``, ``slo_attainment``,
    ``ttft_p90_ms``, ``output_throughput_tok_s`` ...) plus simulator-only fields: per-stage
    latencies, memory and batch peaks, Little's-law terms. SLOs default to the workload's.
    ``lost_at_pull``: request index -> error, for requests the decode fails as their pull starts
    (a cross-validation replays the failures its real run recorded, ``crossval.lost_at_pull``).
    ``num_prefill`` ... ``calibration`` build the configuration when ``config`` is a name; a
    :class:`SimConfig` is used as it is."""
    wl = get_workload(workload)
    cfg = config if isinstance(config, SimConfig) else make_config(
        config, num_prefill, num_decode, transfer_scale=transfer_scale, contention=contention,
        router_policy=router_policy, calibration=calibration,
    )
    slo_ttft = wl.slo_ttft_ms if slo_ttft_ms is None else slo_ttft_ms
    slo_tpot = wl.slo_tpot_ms if slo_tpot_ms is None else slo_tpot_ms
    reqs = [SimRequest(s, lost_at_pull=(lost_at_pull or {}).get(s.index)) for s in generate_requests(wl, num_requests, rate, seed)]
    cluster = Cluster(cfg)
    cluster.run(reqs, horizon_s)
    for r in reqs:
        if not r.finished and r.error is None:
            r.error = "unfinished at the horizon"
    results = [r.result() for r in reqs]
    rec: dict[str, Any] = {
        "simulated": True,
        "workload": wl.name,
        "rate": rate,
        "seed": seed,
        **cfg.describe(),
        **summarize(results, slo_ttft, slo_tpot),
    }
    rec.update(_stage_stats(results))
    occ = cluster.occupancy
    span = occ.now
    done = [r for r in results if r.ok]
    rec.update(
        sim_end_s=span,
        mean_in_system=occ.area / span if span > 0 else 0.0,  # L (time average)
        arrival_rate_observed=len(done) / span if span > 0 else 0.0,  # lambda over the whole run
        mean_sojourn_s=sum(r.e2e_s for r in done) / len(done) if done else None,  # W
        prefill_kv_peak_tokens=[p.kv_peak for p in cluster.prefills],
        prefill_utilization=[p.busy_s / span if span > 0 else 0.0 for p in cluster.prefills],
        decode_kv_peak_tokens=[d.kv_peak for d in cluster.decodes],
        decode_kv_capacity_tokens=cfg.decode.kv_capacity_tokens,
        decode_batch_peak=[d.batch_peak for d in cluster.decodes],
        decode_max_batch=cfg.decode.max_batch,
        decode_utilization=[d.busy_s / span if span > 0 else 0.0 for d in cluster.decodes],
        decode_host_utilization=[d.host_busy_s / span if span > 0 else 0.0 for d in cluster.decodes],
        link_peak_concurrency=max((lk.peak_concurrency for lk in cluster.transfer.links.values()), default=0),
        rejected=cluster.router.rejected,
        prefill_graph_captures=[[list(b) for b in p.captures] for p in cluster.prefills],
    )
    if per_request:
        rec["requests"] = [r.to_dict() for r in results]
    return rec


def _stage_stats(results: Iterable[Any]) -> dict[str, Any]:
    """Mean and P90 of each stage, to show *where* TTFT goes (queue, prefill, admit wait, transfer)."""
    out: dict[str, Any] = {}
    rs = [r for r in results if r.ok and r.extra]
    for key in ("prefill_queue_s", "prefill_s", "decode_admit_wait_s", "kv_transfer_s", "join_wait_s"):
        xs = [r.extra[key] for r in rs if r.extra.get(key) is not None]
        base = key[:-2]
        out[f"{base}_mean_ms"] = sum(xs) / len(xs) * 1e3 if xs else None
        p90 = percentile(xs, 90)
        out[f"{base}_p90_ms"] = None if p90 is None else p90 * 1e3
    return out


def sweep(
    configs: Sequence[str | SimConfig] = ("gg-host", "gn-host", "gg-direct", "gn-hawk"),
    rates: Sequence[float] = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0),
    workload: str | Workload = "chatbot",
    num_requests: int = 500,
    seed: int = 0,
    *,
    pd_ratios: Sequence[tuple[int, int]] | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    transfer_scale: float = 1.0,
    contention: str = "decode",
    router_policy: str = "round_robin",
    calibration: str | Path | None = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Every (configuration, P:D ratio, rate), same seed, so rates and configurations see the same
    requests. Returns one :func:`simulate` record per point. ``pd_ratios`` (prefill, decode
    instance counts) default to 1:1 for named configurations and to a SimConfig's own counts."""
    out = []
    for c in configs:
        for p, d in pd_ratios or [(c.num_prefill, c.num_decode) if isinstance(c, SimConfig) else (1, 1)]:
            if isinstance(c, SimConfig):
                cfg = replace(c, num_prefill=p, num_decode=d)
            else:
                cfg = make_config(
                    c, p, d, transfer_scale=transfer_scale, contention=contention, router_policy=router_policy, calibration=calibration,
                )
            for rate in rates:
                if not (rate > 0 and not math.isnan(rate)):
                    raise ValueError(f"rates must be positive, got {rate}")
                out.append(simulate(cfg, rate, workload, num_requests, seed, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms))
                if progress is not None:
                    progress()
    return out
