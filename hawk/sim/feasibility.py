"""Which of the paper's serving numbers a simulator of this kind can reach at all, computed.

``--reproduce-paper`` misses some rows. Before looking for a mechanism it is worth knowing whether
any mechanism the simulator could hold (monotone in device speed, costs that grow with the KV
bytes, the paper's own Fig. 9 / Table 1 fixed) can reach them. Three such bounds need no fitting,
only the paper's numbers, the testbed and a request simulated alone:

* **Table 9 (GGH-Direct).** Fig. 13's gap (GN-HAWK below GG-Direct) and Table 9's gap (GN-HAWK
  below GGH-Direct) together fix GGH-Direct's throughput over GG-Direct's; where that ratio is
  below 1 a faster decode would have to *lower* the throughput at 90 % attainment.
* **"GN-Host never reaches 90 %".** A request alone meets or misses its SLO whatever the rate; if
  the 90th-percentile prompt alone meets it, then at a low enough rate at least 90 % of requests
  do, so "never" can hold only above some lowest evaluated rate (not in the paper's text).
* **Summarization's TPOT (Fig. 11) and Chatbot's.** A decode instance carries on average
  rate x output tokens x step seconds sequences (Little's law). At the paper's two operating points
  Chatbot (200 output tokens) carries about 2.4x Summarization's batch (90) at the same step time, so a
  slower decode step that makes Summarization miss 200 ms P90 TPOT at 0.60 req/s makes Chatbot miss
  it first; ``paper_bounds.npu_tpot_bound`` computes it.
* **GG-Host on both workloads.** A per-byte host cost that moves a throughput-bound workload's
  rate from GG-Direct's to GG-Host's adds a known time per prompt token; the same cost on the
  latency-bound workload's 90th-percentile prompt, alone, gives its TTFT with no queueing at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hawk.sim.cluster import Cluster, SimConfig
from hawk.sim.request import SimRequest
from hawk.sim.workload import ArrivalProcess, RequestSpec, Workload


def implied_throughput_ratio(gap_vs_a_pct: float, gap_vs_b_pct: float) -> float:
    """B's throughput over A's when one configuration is ``gap_vs_a_pct`` % below A and
    ``gap_vs_b_pct`` % below B (e.g. GN-HAWK below GG-Direct and below GGH-Direct): both gaps
    are measured against the same GN-HAWK throughput, so B / A = (1 - gap_a) / (1 - gap_b)."""
    return (1 - gap_vs_a_pct / 100) / (1 - gap_vs_b_pct / 100)


@dataclass(frozen=True)
class Lone:
    """One request served with nothing else in the system."""

    prompt_tokens: int
    ttft_s: float
    tpot_s: float

    def meets(self, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        return self.ttft_s <= slo_ttft_s and self.tpot_s <= slo_tpot_s


def lone_request(cfg: SimConfig, prompt_tokens: int, output_tokens: int = 10) -> Lone:
    """TTFT and TPOT of one request alone on ``cfg``: the least any rate can give it."""
    r = SimRequest(RequestSpec(0, 0.0, prompt_tokens, output_tokens))
    Cluster(cfg).run([r])
    res = r.result()
    assert res.first_s is not None and res.last_s is not None, "a lone request always finishes"
    return Lone(prompt_tokens, res.first_s, (res.last_s - res.first_s) / max(1, output_tokens - 1))


def prompt_quantile(wl: Workload, q: float, n: int = 1000, seed: int = 0) -> int:
    """The ``q`` quantile of the prompt lengths of the seeded requests ``--reproduce-paper`` runs."""
    ins = [r.input_len for r in ArrivalProcess(wl, seed).requests(n, 1.0)]
    return int(np.quantile(ins, q))


def extra_s_per_token(rate_without: float, rate_with: float, busy_s_per_request: float, mean_prompt: float) -> float:
    """The serial time per prompt token a cost must add to a throughput-bound instance busy
    ``busy_s_per_request`` per request at ``rate_without`` to bring it to ``rate_with``: its
    capacity scales as 1 / (time per request), so the time must grow by rate_without / rate_with."""
    if not 0 < rate_with <= rate_without:
        raise ValueError(f"need 0 < rate_with <= rate_without, got {rate_with}, {rate_without}")
    return busy_s_per_request * (rate_without / rate_with - 1) / mean_prompt


def mean_decode_batch(rate: float, output_tokens: float, step_s: float) -> float:
    """Little's law on a decode instance: requests arrive at ``rate`` and each stays ``output_tokens``
    steps of ``step_s``, so it holds rate x output_tokens x step_s sequences on average."""
    if rate < 0 or output_tokens < 0 or step_s < 0:
        raise ValueError(f"need non-negative rate, tokens and step, got {rate}, {output_tokens}, {step_s}")
    return rate * output_tokens * step_s
