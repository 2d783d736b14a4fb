"""Serving workloads: request length distributions and the Poisson arrival process.

Shared by the live serving benchmark (``hawk.bench.serving``) and the simulator so that a
simulated sweep and a measured one see the *same* requests for the same seed.

The paper (§5.1.4) uses DistServe's Chatbot (ShareGPT) and Summarization (LongBench) workloads
with Poisson arrivals. Its Table 7 numbers are not in the text we have, so the means below are
**assumptions** that approximate those datasets as DistServe describes them (chat: mid-length
prompts, a few hundred output tokens; summarization: long prompts, short outputs). The length
shape (a clipped log-normal) is an assumption too. Every field is a parameter; the ``*-tiny``
profiles keep the same character at lengths a CPU can serve.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """A clipped log-normal over token counts: heavy-ish tail, like real prompt/output lengths.

    ``cv`` = 0 gives the fixed length ``mean`` (useful for exact tests)."""

    mean: float
    cv: float = 0.0
    min: int = 1
    max: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cv <= 0:
            x = np.full(n, self.mean)
        else:
            sigma2 = math.log1p(self.cv**2)  # log-normal with this mean and coefficient of variation
            x = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    """A named request mix and the SLOs the paper pairs with it (§5.3)."""

    name: str
    input: LengthDist
    output: LengthDist
    slo_ttft_ms: float
    slo_tpot_ms: float
    note: str = ""

    def scaled(self, input_scale: float = 1.0, output_scale: float = 1.0) -> Workload:
        """Same shape, lengths scaled (e.g. to fit a small model's context on a CPU)."""

        def sc(d: LengthDist, s: float) -> LengthDist:
            return LengthDist(d.mean * s, d.cv, max(1, int(d.min * s)), max(1, int(d.max * s)))

        return replace(self, input=sc(self.input, input_scale), output=sc(self.output, output_scale))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Means approximate DistServe's ShareGPT / LongBench statistics: assumptions, not the paper's Table 7.
WORKLOADS: dict[str, Workload] = {
    "chatbot": Workload(
        "chatbot", LengthDist(750, 0.8, 16, 4096), LengthDist(200, 0.8, 8, 1024), 2000.0, 200.0,
        "ShareGPT-like (assumed means 750 in / 200 out); SLO 2000/200 ms as in the paper",
    ),
    "summarization": Workload(
        "summarization", LengthDist(1750, 0.5, 256, 8192), LengthDist(90, 0.6, 8, 512), 15000.0, 200.0,
        "LongBench-like (assumed means 1750 in / 90 out); SLO 15000/200 ms as in the paper",
    ),
    # CPU-sized versions for the live benchmark on a small model: same character, tiny lengths.
    "chatbot-tiny": Workload(
        "chatbot-tiny", LengthDist(48, 0.5, 8, 128), LengthDist(16, 0.5, 4, 32), 2000.0, 200.0,
        "chatbot shape at CPU scale (48 in / 16 out)",
    ),
    "summarization-tiny": Workload(
        "summarization-tiny", LengthDist(192, 0.3, 64, 384), LengthDist(8, 0.5, 2, 16), 15000.0, 200.0,
        "summarization shape at CPU scale (192 in / 8 out)",
    ),
}


@runtime_checkable
class RequestSource(Protocol):
    """Anything that yields a run's requests itself, e.g. a replayed trace (``traces.TraceWorkload``).

    It stands where a :class:`Workload` does: it has a name, SLOs, and gives the first ``n``
    requests at a mean ``rate``."""

    @property
    def name(self) -> str: ...

    slo_ttft_ms: float
    slo_tpot_ms: float

    def requests(self, n: int, rate: float, seed: int = 0) -> list[RequestSpec]: ...

    def scaled(self, input_scale: float = 1.0, output_scale: float = 1.0) -> Any: ...

    def to_dict(self) -> dict[str, Any]: ...


def get_workload(name: str | Workload | RequestSource) -> Workload | RequestSource:
    """A workload by name; a Workload or a request source (trace) is returned as it is."""
    if isinstance(name, (Workload, RequestSource)):
        return name
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: when it arrives (s from the start) and its lengths in tokens."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int


def unit_gaps(n: int, seed: int) -> np.ndarray:
    """Seeded Poisson gaps at rate 1 (the first is 0: it starts the clock); divide by a rate."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    if n:
        gaps[0] = 0.0
    return gaps


@dataclass
class ArrivalProcess:
    """Poisson arrivals at ``rate`` req/s (``inf``: all at t=0), seeded.

    The unit-rate gaps and the lengths are drawn once per seed and the gaps are divided by the
    rate, so runs at different rates see the same requests in the same order, only compressed in
    time. That coupling is what makes "higher rate, no better SLO attainment" a fair comparison."""

    workload: Workload
    seed: int = 0
    _cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def _draws(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if n not in self._cache:
            gaps = unit_gaps(n, self.seed)
            # one stream per quantity: a longer run keeps the first requests of a shorter one
            ins = self.workload.input.sample(np.random.default_rng([self.seed, 1]), n)
            outs = self.workload.output.sample(np.random.default_rng([self.seed, 2]), n)
            self._cache[n] = (gaps, ins, outs)
        return self._cache[n]

    def requests(self, n: int, rate: float) -> list[RequestSpec]:
        if rate <= 0:
            raise ValueError(f"request rate must be positive, got {rate}")
        gaps, ins, outs = self._draws(n)
        times = np.zeros(n) if math.isinf(rate) else np.cumsum(gaps) / rate
        return [RequestSpec(i, float(times[i]), int(ins[i]), int(outs[i])) for i in range(n)]


def generate_requests(workload: str | Workload | RequestSource, num_requests: int, rate: float, seed: int = 0) -> list[RequestSpec]:
    """The ``num_requests`` requests of one run (see :class:`ArrivalProcess`; a trace replays its own)."""
    wl = get_workload(workload)
    if not isinstance(wl, Workload):
        return wl.requests(num_requests, rate, seed)
    return ArrivalProcess(wl, seed).requests(num_requests, rate)
