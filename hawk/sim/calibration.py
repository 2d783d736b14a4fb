"""KV-transfer latency curves: measured latency vs size, interpolated piecewise-linearly.

The simulator does not model *how* a configuration moves KV (that is what HAWK itself does); it
replays what ``hawk bench transfer`` measured. A curve is the median latency (decode request D1 →
KV in the cache pool, after D7) at each measured size of one configuration; between sizes it is
linear, below the smallest size it is flat (fixed costs dominate small transfers), above the
largest it continues with the last segment's slope (bandwidth-bound), never decreasing.

For link contention a latency is split into a *fixed* part (the curve's minimum: set-up, control
messages, kernel launches — no one else's bytes slow it) and a *shared* part (the rest: bytes on
the wire, which concurrent transfers on one link divide among themselves); see ``link.py``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

MiB = 1 << 20


@dataclass(frozen=True)
class TransferCurve:
    """Latency (s) of one configuration's KV transfer as a function of bytes (per TP rank)."""

    config: str
    sizes_bytes: tuple[float, ...]
    latency_s: tuple[float, ...]
    source: str = "assumption"
    measured: bool = False

    def __post_init__(self) -> None:
        if len(self.sizes_bytes) != len(self.latency_s) or not self.sizes_bytes:
            raise ValueError(f"{self.config}: need equally many sizes and latencies (got {len(self.sizes_bytes)}, {len(self.latency_s)})")
        if any(b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:])):
            raise ValueError(f"{self.config}: sizes must be strictly increasing")
        if any(t < 0 for t in self.latency_s):
            raise ValueError(f"{self.config}: latencies must be non-negative")

    def latency(self, nbytes: float) -> float:
        """Interpolated latency; exact at the calibration sizes."""
        xs, ys = self.sizes_bytes, self.latency_s
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ys[-1] + max(0.0, slope) * (nbytes - xs[-1])
        i = bisect.bisect_right(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)

    @property
    def fixed_s(self) -> float:
        return min(self.latency_s)

    def split(self, nbytes: float) -> tuple[float, float]:
        """(fixed, shared) seconds of a transfer of ``nbytes`` alone on its link."""
        t = self.latency(nbytes)
        fixed = min(t, self.fixed_s)
        return fixed, t - fixed

    def scaled(self, factor: float) -> TransferCurve:
        """Every latency times ``factor`` (what-if: a slower or faster path)."""
        return replace(self, latency_s=tuple(t * factor for t in self.latency_s), source=f"{self.source} x{factor:g}")

    @classmethod
    def linear(cls, config: str, fixed_ms: float, gbytes_per_s: float, source: str = "assumption") -> TransferCurve:
        """An analytical path: ``fixed_ms`` plus bytes at ``gbytes_per_s`` (e.g. a NIC's line rate)."""
        xs = (1.0 * MiB, 4096.0 * MiB)
        return cls(config, xs, tuple(fixed_ms / 1e3 + x / (gbytes_per_s * 1e9) for x in xs), source)

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "sizes_mb": [x / MiB for x in self.sizes_bytes], "latency_ms": [t * 1e3 for t in self.latency_s], "source": self.source, "measured": self.measured}


def curves_from_records(records: Iterable[Mapping[str, Any]], source: str, stat: str = "median_ms") -> dict[str, TransferCurve]:
    """Build one curve per configuration from ``hawk bench transfer`` records
    (each with ``config``, ``size_mb`` in MiB and ``stat`` in ms); repeated sizes are averaged."""
    by: dict[str, dict[float, list[float]]] = {}
    for r in records:
        by.setdefault(str(r["config"]), {}).setdefault(float(r["size_mb"]), []).append(float(r[stat]))
    out = {}
    for cfg, pts in by.items():
        sizes = sorted(pts)
        out[cfg] = TransferCurve(cfg, tuple(s * MiB for s in sizes), tuple(sum(pts[s]) / len(pts[s]) / 1e3 for s in sizes), source, measured=True)
    return out


def load_transfer_curves(path: str | Path, stat: str = "median_ms") -> dict[str, TransferCurve]:
    """Curves from a ``hawk bench transfer --json`` file (a list of records)."""
    p = Path(path)
    data = json.loads(p.read_text())
    records: Sequence[Mapping[str, Any]] = data["records"] if isinstance(data, dict) else data
    return curves_from_records(records, source=f"measured: {p.name} ({stat})", stat=stat)
