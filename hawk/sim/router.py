"""The simulated router: picks a prefill and a decode instance for each arriving request.

HAWK's router (``hawk.serve.router``) uses round-robin for both roles; ``least_loaded`` is the
obvious alternative for P:D studies (fewest queued prompt tokens / fewest held requests). A request
that could never fit an instance's memory is refused up front, as the real router answers 400.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hawk.sim.decode import DecodeInstance
from hawk.sim.prefill import PrefillInstance
from hawk.sim.request import SimRequest

POLICIES = ("round_robin", "least_loaded")


class Router:
    def __init__(self, prefills: Sequence[PrefillInstance], decodes: Sequence[DecodeInstance], policy: str = "round_robin"):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: expected one of {POLICIES}")
        if not prefills or not decodes:
            raise ValueError("the cluster needs at least one prefill and one decode instance")
        self.prefills, self.decodes, self.policy = list(prefills), list(decodes), policy
        self._p, self._d = itertools.count(), itertools.count()
        self.rejected = 0

    def route(self, r: SimRequest) -> bool:
        """Assign and submit ``r``; False (with ``r.error`` set) when it can never be served."""
        if r.input_len > min(p.model.kv_capacity_tokens for p in self.prefills) or not all(d.fits(r) for d in self.decodes):
            r.error = "request does not fit an instance's KV memory"
            self.rejected += 1
            return False
        if self.policy == "round_robin":
            p = self.prefills[next(self._p) % len(self.prefills)]
            d = self.decodes[next(self._d) % len(self.decodes)]
        else:
            p = min(self.prefills, key=lambda i: (i.queued_tokens + i.kv_used, i.index))
            d = min(self.decodes, key=lambda i: (i.load, i.index))
        r.prefill, r.decode = p.index, d.index
        p.submit(r)
        return True

    def to_decode(self, r: SimRequest) -> None:
        """Prefill is done: hand the request (its KV handle) to its decode instance."""
        self.decodes[r.decode].submit(r)
