"""``hawk sim --reproduce-paper``: the paper's rows and claims (paper.py), what the missed rows
would need (paper_bounds.py), printed, written as JSON and plotted."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hawk.sim.paper import TARGET, Row, plot_all, print_rows, reproduce, write_json
from hawk.sim.paper_bounds import bounds
from hawk.sim.testbeds import MEASURED_HERE, PAPER_CALIBRATION, paper_testbed


def print_bounds(b: dict[str, Any]) -> None:
    """One line per bound of ``paper_bounds.py``: what the missed rows would need."""
    t9 = b["table9"]
    print("bound Table 9: the paper's gaps imply GGH-Direct / GG-Direct throughput "
          + ", ".join(f"{wl} {v['paper_implied_ggh_over_gg']:.3f}" for wl, v in t9.items()) + " (below 1: a faster decode lowering it)")
    for wl, v in b["gn_host_lone"].items():
        print(f"bound GN-Host [{wl}]: the P{round(v['quantile'] * 100)} prompt ({v['prompt_tokens']} tokens) alone: "
              f"TTFT {v['ttft_s']:.2f} s, TPOT {v['tpot_s'] * 1e3:.0f} ms: {'meets' if v['meets_slo_alone'] else 'misses'} the SLO")
    f9 = b["gn_host_fig9_fixup"]
    print(f"bound GN-Host: with the layout fix-up at Fig. 9's {f9['fixup_gb_s']:.2f} GB/s instead of the CPU tilize measured here, "
          f"GN-Host 90 % rates {f9['gn_host_rate90']}")
    g = b["gg_host_per_token"]
    for where, v in g["placements"].items():
        print(f"bound GG-Host: +{g['extra_s_per_prompt_token'] * 1e3:.2f} ms per prompt token on the {where} (what Summarization's "
              f"0.38 req/s needs) gives GG-Host 90 % rates {v['gg_host_rate90']}")
    pinned = b["gg_host_chatbot_pinned"]
    for where, v in pinned["placements"].items():
        print(f"bound GG-Host: on the {where} only, the cost that keeps Chatbot at {pinned['chatbot_gg_host_rate']} req/s "
              f"({v['s_per_prompt_token'] * 1e3:.2f} ms per prompt token) gives Summarization {v['summarization_gg_host_rate90']:.3f} req/s")
    n = b["npu_tpot"]
    print(f"bound GN-HAWK: p150a steps {n['step_factor']:.2f}x slower put Summarization's P90 TPOT at 200 ms at {n['summarization_rate']} req/s "
          f"(Fig. 11); the same steps give Chatbot at {n['chatbot_rate']} req/s P90 TPOT {n['chatbot_tpot_p90_ms']:.0f} ms, "
          f"SLO attainment {n['chatbot_slo_attainment']:.0%}, and a 90 % rate of {n['chatbot_gn_hawk_rate90']}")


def reproduce_paper(num_requests: int = 1000, seed: int = 0, json_path: str | None = None, plots_dir: str | None = None,
                    quiet: bool = False) -> list[Row]:
    """What ``hawk sim --reproduce-paper`` does."""
    tb = paper_testbed()
    rows, extra = reproduce(num_requests, seed, tb)
    extra["bounds"] = bounds(extra["runner"], extra["points"])
    if not quiet:
        print_rows(rows)
        for c in extra["claims"]:
            print(f"claim [{c['workload']}] {c['claim']}: {'holds' if c['holds'] else 'does NOT hold'} (ours: {c['ours']})")
        print_bounds(extra["bounds"])
    if json_path:
        write_json(rows, json_path, tb, {"num_requests": num_requests, "seed": seed, "target_attainment": TARGET,
                                         "calibration": asdict(PAPER_CALIBRATION), "measured_here": asdict(MEASURED_HERE)}, extra)
    if plots_dir:
        plot_all(plots_dir, extra["runner"], extra["points"])
    return rows
