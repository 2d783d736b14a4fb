"""KV transfer from a prefill instance to a decode instance, with link contention.

A transfer of ``input_len x bytes_per_token`` bytes costs the calibrated curve's latency when
alone; its *shared* part (bytes on the wire) is served by the link it crosses, fairly divided
among overlapping transfers (``link.py``). Which transfers share a link is the ``scope``:

* ``decode`` (default) — one link per decode instance: the decode node's NIC, into which it pulls
  every request's KV (Algorithm 1 is decode-initiated);
* ``prefill`` — one link per prefill instance (its NIC);
* ``pair`` — one per (prefill, decode) pair;
* ``none`` — no contention: every transfer takes its solo latency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import simpy

from hawk.devices.timing import link_time_s
from hawk.sim.calibration import TransferCurve
from hawk.sim.link import SharedLink
from hawk.sim.request import SimRequest
from hawk.sim.staging import StagingPool

SCOPES = ("decode", "prefill", "pair", "none")


class KVTransferService:
    def __init__(self, env: simpy.Environment, curve: TransferCurve, bytes_per_token: int, scope: str = "decode",
                 link_gbps: float | None = None, speedup: Sequence[float] = (1.0,), staging_bytes: float | None = None):
        """``link_gbps``: timing emulation (``--link-gbps``): the bytes' share of a transfer takes at
        least ``bytes x 8 / N`` (the real run holds each batch back that long, see transport/paced.py);
        the fixed part (control round trips, landing) is the curve's, as in the real run.
        ``speedup``: each shared link's aggregate speed with k transfers active (``link.py``).
        ``staging_bytes``: each prefill instance's staging buffer, held by a transfer's KV until it has
        landed (``staging.py``); None: unlimited."""
        if scope not in SCOPES:
            raise ValueError(f"contention scope {scope!r}: expected one of {SCOPES}")
        self.env, self.curve, self.bytes_per_token, self.scope = env, curve, bytes_per_token, scope
        self.link_gbps, self.speedup = link_gbps, tuple(speedup)
        self.links: dict[object, SharedLink] = {}
        self.staging_bytes = staging_bytes
        self.staging: dict[int, StagingPool] = {}

    @property
    def stages(self) -> bool:
        """Whether a transfer goes through the prefill's staging buffer (then :meth:`move` calls its
        ``on_staged`` once the KV is there)."""
        return self.staging_bytes is not None

    def _link(self, r: SimRequest) -> SharedLink | None:
        key = {"decode": r.decode, "prefill": r.prefill, "pair": (r.prefill, r.decode), "none": None}[self.scope]
        if key is None:
            return None
        if key not in self.links:
            self.links[key] = SharedLink(self.env, f"{self.scope}:{key}", self.speedup)
        return self.links[key]

    def split(self, nbytes: float) -> tuple[float, float]:
        """(fixed, shared) seconds of a transfer of ``nbytes`` alone, paced to the link if one is set."""
        fixed, shared = self.curve.split(nbytes)
        if self.link_gbps is not None:
            shared = max(shared, link_time_s(nbytes, self.link_gbps))
        return fixed, shared

    def solo_latency(self, r: SimRequest) -> float:
        return sum(self.split(r.input_len * self.bytes_per_token))

    def _pool(self, r: SimRequest) -> StagingPool | None:
        if not self.stages:
            return None
        if r.prefill not in self.staging:
            self.staging[r.prefill] = StagingPool(self.env, self.staging_bytes)
        return self.staging[r.prefill]

    def move(self, r: SimRequest, on_staged: Callable[[SimRequest], None] | None = None):  # simpy process body
        """Yields until the KV has landed. With a staging pool, ``on_staged`` is called once the KV is
        in staging (P6: the prefill's paged blocks are free from then on, not from the landing)."""
        nbytes = r.input_len * self.bytes_per_token
        pool = self._pool(r)
        if pool is not None:
            yield pool.acquire(nbytes)  # P4: room in the prefill's staging, in arrival order
            if on_staged is not None:
                on_staged(r)
        yield from self._cross(r, nbytes)
        if pool is not None:
            pool.release(nbytes)  # D9: the decode has it

    def _cross(self, r: SimRequest, nbytes: float):
        fixed, shared = self.split(nbytes)
        if fixed > 0:
            yield self.env.timeout(fixed)
        link = self._link(r)
        if link is None:
            if shared > 0:
                yield self.env.timeout(shared)
        else:
            yield link.transfer(shared)
