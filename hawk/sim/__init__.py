"""Discrete-event simulation of HAWK's disaggregated cluster (simpy), one concept per file:

workload (arrivals), router, prefill, transfer + link (contention) + calibration (measured
curves), decode (admission + continuous batching), compute (time models), metrics, cluster
(``simulate`` / ``sweep``), report (tables/plots), defaults (calibration with sources).
"""

from typing import Any

__all__ = ["SimConfig", "make_config", "simulate", "sweep"]


def __getattr__(name: str) -> Any:
    """Load the simulator (and simpy) on first use, so ``hawk.sim.metrics`` works without simpy."""
    if name in __all__:
        from hawk.sim import cluster

        return getattr(cluster, name)
    raise AttributeError(name)
