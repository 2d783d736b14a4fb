"""Prometheus metrics: the router's per-request histograms, and gauges of what the instances hold.

Each app gets its own registry (not prometheus_client's global one) so several servers can live in
one process (tests, the demo) without "duplicated timeseries" errors. Router workers sharing a port
(``router_workers.py``) keep their values in prometheus_client's multiprocess directory, and each
renders the sum over all of them.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: prometheus_client's switch to multiprocess values (read when it is first imported): set for router workers
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_KV_S = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
_KV_BYTES = (1e4, 1e5, 1e6, 4e6, 1.6e7, 6.4e7, 2.56e8, 1.024e9, 4.096e9, 1.6384e10)


def accounting_families(role: str, acct: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> list[Any]:
    """Gauges for one instance's accounting dict: each number becomes ``hawk_<role>_<key>``,
    lists become their length, and the NPU's per-channel usage becomes labelled byte gauges.
    Abort counts are counters."""
    labels = dict(labels or {})
    names, values = list(labels), list(labels.values())
    out: list[Any] = []
    for key, v in acct.items():
        if key == "npu_channels" and isinstance(v, Mapping):
            g = GaugeMetricFamily(f"hawk_{role}_npu_channel_bytes", "emulated NPU DRAM channel occupancy", labels=[*names, "channel", "kind"])
            for ch, use in v.items():
                g.add_metric([*values, str(ch), "used"], float(use["used"]))
                g.add_metric([*values, str(ch), "capacity"], float(use["capacity"]))
            out.append(g)
            continue
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, (list, tuple, set, dict)):
            v = len(v)
        if not isinstance(v, (int, float)):
            continue
        fam = CounterMetricFamily if key.startswith("abort") else GaugeMetricFamily  # abort counts only grow
        g = fam(f"hawk_{role}_{key}", f"{role} instance accounting: {key}", labels=names)
        g.add_metric(values, float(v))
        out.append(g)
    return out


class AccountingCollector(Collector):
    """Reads an instance's accounting at scrape time, so the gauges are never stale."""

    def __init__(self, role: str, read: Callable[[], Mapping[str, Any]]):
        self.role, self.read = role, read

    def collect(self) -> Iterable[Any]:
        yield from accounting_families(self.role, self.read())


class SnapshotCollector(Collector):
    """The router's view of every instance's accounting, as last fetched over HTTP."""

    def __init__(self) -> None:
        self.snapshots: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.up: dict[tuple[str, str], bool] = {}

    def collect(self) -> Iterable[Any]:
        up = GaugeMetricFamily("hawk_instance_up", "instance answered its last accounting fetch", labels=["role", "instance"])
        for (role, url), ok in self.up.items():
            up.add_metric([role, url], 1.0 if ok else 0.0)
        yield up
        merged: dict[str, Any] = {}
        for (role, url), acct in self.snapshots.items():
            for fam in accounting_families(role, acct, {"instance": url}):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        yield from merged.values()


def instance_registry(role: str, read: Callable[[], Mapping[str, Any]]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AccountingCollector(role, read))
    GCCollector(registry=reg)  # python_gc_collections_total{generation} and the objects collected
    Gauge("hawk_gc_frozen_objects", "objects frozen out of garbage collection at startup (--gc-freeze)", registry=reg).set_function(gc.get_freeze_count)
    return reg


class RouterMetrics:
    """Request counts, latencies and KV-transfer sizes the router observes, plus instance gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("hawk_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.finished = Counter("hawk_request_finish", "generations by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("hawk_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("hawk_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("hawk_time_to_first_token_seconds", "arrival at the router to the first token", buckets=_TTFT, registry=r)
        self.tpot = Histogram("hawk_time_per_output_token_seconds", "mean gap between later tokens of a request", buckets=_TPOT, registry=r)
        self.e2e = Histogram("hawk_e2e_request_latency_seconds", "arrival to the last token", buckets=_E2E, registry=r)
        self.kv_seconds = Histogram("hawk_kv_transfer_seconds", "KV transfer time per request (decode side, D1-D7)", buckets=_KV_S, registry=r)
        self.kv_bytes = Histogram("hawk_kv_transfer_bytes", "KV bytes moved per request", buckets=_KV_BYTES, registry=r)
        self.instances = SnapshotCollector()
        r.register(self.instances)

    def observe(self, summary: Mapping[str, Any]) -> None:
        """Record one finished generation from its ``hawk`` summary."""
        self.finished.labels(summary.get("finish_reason") or "unknown").inc()
        self.prompt_tokens.inc(summary.get("prompt_tokens", 0))
        self.generation_tokens.inc(summary.get("completion_tokens", 0))
        for hist, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s"), (self.kv_seconds, "kv_transfer_s")):
            v = summary.get(key)
            if v is not None:
                hist.observe(v)
        if summary.get("kv_bytes") is not None and summary.get("kv_mode") != "colocated":
            self.kv_bytes.observe(summary["kv_bytes"])

    def render(self) -> bytes:
        """This router's metrics; with several workers on one port, every worker's counts summed
        (the instance gauges are this worker's own reading of the instances, the same for all)."""
        if not os.environ.get(MULTIPROC_ENV):
            return generate_latest(self.registry)
        reg = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(reg)
        reg.register(self.instances)
        return generate_latest(reg)
