"""``hawk bench serving``'s command line: the sweep (hawk/bench/serving.py) or, with ``--saturation``, the ramp
to saturation and its same-run bound (hawk/bench/saturation.py). A module of its own because it uses both,
and the ramp uses the sweep's pieces.

    python -m hawk.bench.serving_cli --url http://127.0.0.1:8000 --workload chatbot-tiny --rates 0.5,1,2
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from typing import Any

from hawk.bench import serving
from hawk.bench.saturation import SaturationOptions, run_saturation
from hawk.bench.serving import _floats, run_serving_report, trace_rates, trace_token_counter
from hawk.sim.command import add_trace_options, workload_from_args
from hawk.sim.workload import get_workload


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m hawk.bench.serving_cli", description=serving.__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    p.add_argument("--rates", default=None, help="comma-separated request rates (req/s); 'inf' = all at once; default 0.5,1,2 (a timed trace: its own)")
    p.add_argument("--workload", default="chatbot-tiny", help="chatbot, summarization, chatbot-tiny, summarization-tiny")
    p.add_argument("--num-requests", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="default: the workload's")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="default: the workload's")
    p.add_argument("--input-scale", type=float, default=1.0, help="scale the workload's input lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="scale the workload's output lengths")
    p.add_argument("--model", default=None)
    p.add_argument("--config", default=None, help="label for the records (default: the router's transfer config)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1, help="sequential warm-up requests before the sweep")
    p.add_argument("--token-ids", default="1000,10000", help="prompt token ids are drawn from [LO, HI): keep inside the vocabulary")
    p.add_argument("--per-request", action="store_true", help="keep every request's timings in the JSON")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--saturation", action="store_true", help="ramp the rate (from the first --rates value, default 1) until throughput stops growing; report saturation, the rate at 90%% SLO attainment and a same-run bound from the server's step times (hawk/bench/saturation.py)")
    p.add_argument("--ramp-factor", type=float, default=1.5, help="--saturation: each rate is the previous one times this")
    p.add_argument("--min-growth", type=float, default=0.05, help="--saturation: stop once throughput grows by less than this fraction")
    p.add_argument("--max-steps", type=int, default=8, help="--saturation: most rates in the ramp")
    p.add_argument("--rate-duration-s", type=float, default=0.0, help="--saturation: each rate sends at least rate x this many requests (default: --num-requests only)")
    p.add_argument("--bound-batch", type=int, default=256, help="--saturation: the decode batch of the bound (the server's --max-num-seqs; at most what a HAWK server reports in /v1/models); 0 = no bound (nor the step at 80%%)")
    add_trace_options(p)
    p.add_argument("--trace-tokenizer", default=None, help="ShareGPT: count tokens with this model's tokenizer (a spec as for serve --model); default: 4 chars/token")
    a = p.parse_args(argv)
    if a.saturation:
        return [_saturation(a)]
    try:
        wl = workload_from_args(a, trace_token_counter(a.trace_tokenizer) if a.trace_tokenizer else None)
        rates = trace_rates(_floats(a.rates) if a.rates else None, wl, a.num_requests)
    except ValueError as e:
        p.error(str(e))
    return run_serving_report(
        a.url, rates, wl, a.num_requests, a.seed, a.slo_ttft_ms, a.slo_tpot_ms,
        model=a.model, config=a.config, max_concurrency=a.max_concurrency, warmup_requests=a.warmup,
        input_scale=a.input_scale, output_scale=a.output_scale,
        token_id_range=tuple(int(x) for x in a.token_ids.split(",")), json_path=a.json, plot_path=a.plot, per_request=a.per_request,
    )


def _saturation(a: argparse.Namespace) -> dict[str, Any]:
    """``--saturation``: the ramp and its bound (hawk/bench/saturation.py), one JSON record."""
    start = _floats(a.rates)[0] if a.rates else 1.0
    opts = SaturationOptions(start, a.ramp_factor, a.min_growth, a.max_steps, a.num_requests, a.bound_batch, a.seed, duration_s=a.rate_duration_s)
    wl = get_workload(a.workload)
    if a.input_scale != 1.0 or a.output_scale != 1.0:
        wl = wl.scaled(a.input_scale, a.output_scale)
    rec = run_saturation(a.url, wl, opts, model=a.model, config=a.config, slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1, default=float)
    b = rec["bound"] or {"bound_rps": math.nan}
    print(f"saturation {rec['saturation_rps']:.3g} req/s at rate {rec['saturation_rate']:.3g} = {rec['saturation_over_bound'] or math.nan:.2f} of the "
          f"bound {b['bound_rps']:.3g} req/s; 90% SLO attainment up to {rec['slo90_rate_rps']} req/s", flush=True)
    return rec


if __name__ == "__main__":
    main()
