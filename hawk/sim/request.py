"""One simulated request's life: the timestamps every stage writes and the metrics read."""

from __future__ import annotations

from dataclasses import dataclass

from hawk.sim.metrics import RequestResult
from hawk.sim.workload import RequestSpec


@dataclass
class SimRequest:
    """A request inside the simulated cluster (times in simulated seconds)."""

    spec: RequestSpec
    prefill: int = -1  # instance indices chosen by the router
    decode: int = -1
    t_prefill_start: float | None = None
    t_prefilled: float | None = None
    t_admitted: float | None = None  # decode reserved its KV and started the pull (D1)
    t_kv_done: float | None = None  # KV in the decode cache pool (after D7)
    t_first: float | None = None  # first token out (it joins the decode batch)
    t_last: float | None = None
    tokens: int = 0
    finished: bool = False
    error: str | None = None
    #: the decode fails this request as its pull starts, with this error (a cross-validation replays a
    #: failure its real run recorded there, so that the request's pull does not occupy the decode host
    #: in the simulation when it did not in the run); None: it is served
    lost_at_pull: str | None = None

    @property
    def input_len(self) -> int:
        return self.spec.input_len

    @property
    def output_len(self) -> int:
        return self.spec.output_len

    @property
    def kv_reservation(self) -> int:
        """Decode KV reserved at admission: prompt + every output token (outputs are fixed-length,
        as with ``ignore_eos``; HAWK's router and decode engine reserve the same way)."""
        return self.spec.input_len + self.spec.output_len

    @property
    def context(self) -> int:
        return self.spec.input_len + self.tokens

    def result(self) -> RequestResult:
        return RequestResult(
            index=self.spec.index, input_len=self.input_len, output_len=self.output_len, sent_s=self.spec.arrival_s,
            first_s=self.t_first, last_s=self.t_last, output_tokens=self.tokens, ok=self.finished and self.error is None,
            error=self.error,
            extra={
                "prefill": self.prefill, "decode": self.decode,
                "prefill_queue_s": _diff(self.t_prefill_start, self.spec.arrival_s),
                "prefill_s": _diff(self.t_prefilled, self.t_prefill_start),
                "decode_admit_wait_s": _diff(self.t_admitted, self.t_prefilled),
                "kv_transfer_s": _diff(self.t_kv_done, self.t_admitted),
                "join_wait_s": _diff(self.t_first, self.t_kv_done),
            },
        )


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
