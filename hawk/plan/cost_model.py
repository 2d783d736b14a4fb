"""Which way to land a plan: staging + intra-channel copy, or direct placement into cache pages.

A first-order model, deliberately small:

    time = requests * per_request_overhead + bytes / link_bandwidth
           + copied_bytes * 2 / device_copy_bandwidth + (copy_overhead if anything is copied)

Staging sends one request per channel and then copies every byte once inside its channel; direct
placement sends one request per contiguous run of cache pages and copies nothing. Few large
requests win when requests are expensive (RDMA over a NIC, TCP); direct wins when the device copy
is the slower part. The numbers are per transport and per destination device; the defaults are the
ceilings measured on the machines here (docs/benchmarks.md) and can be overridden. A new transport
needs its row in ``LINKS`` (a new NPU memory kind its ``DEVICE_COPY``) before a decode on the NPU can plan with it.
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
    copy_overhead_s: float = 0.0  # fixed cost of the on-device copy step (its launch and wait)

    def time(self, requests: int, nbytes: int, copied_bytes: int) -> float:
        return (
            requests * self.request_overhead_s
            + nbytes / self.link_bytes_per_s
            + 2 * copied_bytes / self.device_copy_bytes_per_s
            + (self.copy_overhead_s if copied_bytes else 0.0)
        )

    def staging_time(self, plan: KVTransferPlan) -> float:
        return self.time(plan.num_channels_used, plan.total_bytes, plan.total_bytes)

    def direct_time(self, plan: KVTransferPlan, direct_requests: int | None = None) -> float:
        n = len(plan.direct_runs()) if direct_requests is None else direct_requests
        return self.time(n, plan.total_bytes, 0)

    def choose(self, plan: KVTransferPlan) -> Mode:
        return "staging" if self.staging_time(plan) <= self.direct_time(plan) else "direct"


GB = 1e9

#: Per-request overhead and bandwidth by (transport, where the memory is), as measured here (docs/benchmarks.md).
LINKS: dict[tuple[str, str], tuple[float, float]] = {
    ("nixl", "cpu"): (5e-6, 10 * GB),  # UCX shared memory between two processes on the CPU box
    ("nixl", "cuda"): (10e-6, 350 * GB),  # UCX cuda_ipc between the two H200s
    ("mooncake", "cpu"): (30e-6, 1.5 * GB),  # Mooncake TCP over loopback
    ("mooncake", "cuda"): (30e-6, 1.5 * GB),
    ("local", "cpu"): (2e-6, 10 * GB),
    ("local", "cuda"): (5e-6, 350 * GB),
    ("cuda-ipc", "cuda"): (10e-6, 350 * GB),  # peer copies between the two H200s
    ("auto", "cpu"): (5e-6, 10 * GB),  # auto picks per peer; plan for its slower same-host case
    ("auto", "cuda"): (10e-6, 350 * GB),
    ("rdma-200g", "tt-p150a"): (5e-6, 25 * GB),  # the paper's HDR InfiniBand (for what-if planning)
}

#: On-device copy bandwidth (read + write bytes/s) of where NPU memory lives.
DEVICE_COPY: dict[str, float] = {"cpu": 10 * GB, "cuda": 4000 * GB, "tt-p150a": 512 * GB}


#: A sender whose batches are copies inside the GPU that holds the NPU memory (local / cuda-ipc, one
#: device): a request is a few table entries of one launch, the "link" is the device's own copy, and
#: staging adds the intra-channel copy's launch and wait. From one H200 (2026-12-01, `hawk bench transfer
#: --transport auto`, both roles on GPU0): submitting 1280 direct runs cost ~0.2 ms more than 8 staging
#: requests, a device copy moved ~2 TB/s each way, and the staging finish cost ~0.15 ms beyond its copy.
SAME_DEVICE = CostModel(request_overhead_s=0.2e-6, link_bytes_per_s=2000 * GB, device_copy_bytes_per_s=4000 * GB,
                        copy_overhead_s=150e-6)


def cost_model_for(transport: str, npu_memory: str) -> CostModel:
    """The model for a transport name and an NPU memory kind (``cpu``, ``cuda``, or a real device)."""
    kind = "cuda" if npu_memory.startswith("cuda") else npu_memory
    if kind not in DEVICE_COPY:
        raise ValueError(f"no copy bandwidth for NPU memory {npu_memory!r}; known: {sorted(DEVICE_COPY)}")
    if (transport, kind) not in LINKS:
        raise ValueError(f"no cost figures for transport {transport!r} to {kind} memory; known: {sorted(LINKS)}")
    overhead, link = LINKS[(transport, kind)]
    return CostModel(overhead, link, DEVICE_COPY[kind])
