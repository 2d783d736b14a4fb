"""Which way to land a plan: staging + intra-channel copy, or direct placement into cache pages.

A first-order model, deliberately small:

    time = requests * per_request_overhead + bytes / link_bandwidth + copied_bytes * 2 / device_copy_bandwidth

Staging sends one request per channel and then copies every byte once inside its channel; direct
placement sends one request per contiguous run of cache pages and copies nothing. Few large
requests win when requests are expensive (RDMA over a NIC, TCP); direct wins when the device copy
is the slower part. The numbers are per transport and per destination device; the defaults are the
ceilings measured on the machines here (DESIGN.md §4) and can be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hawk.plan.kv_plan import KVTransferPlan

Mode = Literal["staging", "direct"]


@dataclass(frozen=True)
class CostModel:
    request_overhead_s: float
    link_bytes_per_s: float
    device_copy_bytes_per_s: float  # read + write bytes per second of the destination's on-device copy

    def time(self, requests: int, nbytes: int, copied_bytes: int) -> float:
        return (
            requests * self.request_overhead_s
            + nbytes / self.link_bytes_per_s
            + 2 * copied_bytes / self.device_copy_bytes_per_s
        )

    def staging_time(self, plan: KVTransferPlan) -> float:
        return self.time(plan.num_channels_used, plan.total_bytes, plan.total_bytes)

    def direct_time(self, plan: KVTransferPlan, direct_requests: int | None = None) -> float:
        n = len(plan.direct_requests()) if direct_requests is None else direct_requests
        return self.time(n, plan.total_bytes, 0)

    def choose(self, plan: KVTransferPlan) -> Mode:
        return "staging" if self.staging_time(plan) <= self.direct_time(plan) else "direct"


GB = 1e9

#: Per-request overhead and bandwidth of each transport as measured here (DESIGN.md §4).
LINKS: dict[str, tuple[float, float]] = {
    "nixl": (5e-6, 10 * GB),  # UCX shared memory between two processes on the CPU box
    "mooncake": (30e-6, 1.5 * GB),  # Mooncake TCP over loopback
    "local": (2e-6, 10 * GB),
    "cuda-ipc": (10e-6, 350 * GB),  # peer copies between the two H200s
    "rdma-200g": (5e-6, 25 * GB),  # the paper's HDR InfiniBand (for what-if planning)
}

#: On-device copy bandwidth (read + write bytes/s) of where NPU memory lives.
DEVICE_COPY: dict[str, float] = {"cpu": 10 * GB, "cuda": 4000 * GB, "tt-p150a": 512 * GB}


def cost_model_for(transport: str, npu_memory: str) -> CostModel:
    """The model for a transport name and an NPU memory kind (``cpu``, ``cuda``, or a real device)."""
    if transport not in LINKS:
        raise ValueError(f"no cost figures for transport {transport!r}; known: {sorted(LINKS)}")
    kind = "cuda" if npu_memory.startswith("cuda") else npu_memory
    if kind not in DEVICE_COPY:
        raise ValueError(f"no copy bandwidth for NPU memory {npu_memory!r}; known: {sorted(DEVICE_COPY)}")
    overhead, link = LINKS[transport]
    return CostModel(overhead, link, DEVICE_COPY[kind])
