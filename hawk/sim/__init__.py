"""Discrete-event simulation of HAWK's disaggregated cluster (simpy), one concept per file:

workload (arrivals), router, prefill, transfer + link (contention) + calibration (measured
curves), decode (admission + continuous batching), compute (time models), metrics, cluster
(``simulate`` / ``sweep``), report (tables/plots), defaults (calibration with sources).
"""

from hawk.sim.cluster import SimConfig, make_config, simulate, sweep

__all__ = ["SimConfig", "make_config", "simulate", "sweep"]
