"""Cross-validate the simulator against a real serving run on this machine (issue 10, item 4).

For each scenario: start a real HAWK system (router + prefill + decode processes, emulated NPU,
NIXL over loopback), calibrate the ``here`` models from probes of it (sequential requests: prefill
time per token, KV transfer time per MB, the front end; B requests at once: decode step time per
batch size), run ``hawk bench serving`` at the given rates, stop it, then simulate the same
workload, seed and rates on the calibrated models and compare P90 TTFT / P90 TPOT (and P50s).
Both sides keep their per-request records, matched request by request (``per_request`` in the JSON:
each server-side stage real vs simulated), and a real request far slower than its simulated twin is
printed as a one-off (with few requests per rate, one such stall is the P90).

    python benchmarks/cross_validate.py                       # CPU, SmolLM2-135M, ~2 min on 2 cores
    python benchmarks/cross_validate.py --scenarios paced --link-gbps 200 --decode-device npu-emu:cuda:0 \
        --prefill-device cuda:0 --model llama-3.1-8b --dtype bf16 --workload chatbot --rates 1,2,4 \
        --transfer gn-hawk,gn-host,gg-direct --transport auto

Scenarios: ``plain`` (no timing emulation) and ``paced`` (``--npu-timing p150a --link-gbps N``:
the simulator then applies the same pacing, see ``hawk/sim/crossval.py``). Writes JSON (probes,
calibration, real and simulated records, comparison rows) and a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hawk.bench.equivalence import config_for
from hawk.bench.serving import run_serving_bench
from hawk.config import defaults
from hawk.devices.timing import engine_step_model, timing_label
from hawk.serve.common import CLUSTER_SECRET_ENV, cluster_secret_from_env
from hawk.sim.cluster import simulate
from hawk.sim.crossval import (
    Probes,
    calibrate,
    calibrated_config,
    compare,
    format_one_offs,
    format_table,
    graph_capture,
    lost_at_pull,
    per_request,
    probe_captures,
)
from hawk.sim.prefill import GraphCapture
from hawk.sim.workload import LengthDist, Workload, generate_requests, get_workload

PREFILL_LENS = (8, 32, 64, 128)  # spans chatbot-tiny's 8..128 prompts (the default when no workload is given)
DECODE_BATCHES = (1, 2, 4, 8)
DECODE_PROMPT, DECODE_OUT = 48, 24


def fixed(name: str, input_len: int, output_len: int) -> Workload:
    """A workload of identical requests (cv 0): what a probe needs."""
    return Workload(name, LengthDist(input_len), LengthDist(output_len), 1e9, 1e9)


def _hawks(recs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for rec in recs:
        for r in rec.get("requests", []):
            h = (r.get("extra") or {}).get("hawk")
            if r.get("ok") and h:
                out.append((r, h))
    return out


def prefill_lengths(wl: Workload, longest: int | None = None) -> tuple[int, ...]:
    """Probe prompt lengths spanning the workload's (a line fitted on 8-128 tokens says little about
    750-token prompts): its minimum, a quarter of its mean, its mean and twice it, capped at its maximum;
    and ``longest``, the sweep's longest prompt, when it is longer still. Why: a P90 TTFT is set by the
    longest few prompts, and a host-staged pull costs more per byte as the KV grows, so a curve
    extrapolated past the probes understated them (chatbot gn-host: 4.9 s measured against 2.7 s)."""
    i = wl.input
    lens = {int(max(8, i.min)), int(max(8, i.mean // 4)), int(i.mean), int(min(i.max, 2 * i.mean))}
    if longest is not None and longest > max(lens):
        lens.add(int(longest))
    return tuple(sorted(lens))


def longest_prompt(wl: Workload, num_requests: int, seed: int) -> int:
    """The longest prompt the sweep sends (its lengths depend on the seed, not on the rate)."""
    return max(s.input_len for s in generate_requests(wl, num_requests, 1.0, seed))


#: simultaneous pulls probed for a host-staged path's speed-up (hawk/sim/crossval.py, link_speedup)
CONCURRENT_PULLS = (2, 4)


def probe(url: str, seed: int, lengths: tuple[int, ...] = PREFILL_LENS, repeats: int = 2, concurrent_len: int | None = None) -> Probes:
    """Calibration probes of the running system (see the module docstring); ~15-25 s on 2 CPU cores.
    Each probe starts with one unrecorded request: first requests of a shape compile kernels.
    ``concurrent_len``: also send k prompts of that length at once (k in :data:`CONCURRENT_PULLS`), so
    the simulator knows how simultaneous host-staged pulls share the decode host."""
    p = Probes()
    for n in lengths:  # sequential: nothing queues, each stage is seen alone
        recs = run_serving_bench(url, [float("inf")], fixed(f"probe-prefill-{n}", n, 2), repeats, seed + n,
                                 max_concurrency=1, warmup_requests=1, per_request=True)
        for r, h in _hawks(recs):
            p.prefill.append((n, h["prefill_s"]))
            p.transfer.append((float(h["kv_bytes"]), h["kv_transfer_s"]))
            p.kv_tokens.append((n, float(h["kv_bytes"])))
            server = sum(h.get(k) or 0.0 for k in ("prefill_queue_s", "prefill_s", "decode_admit_wait_s", "kv_transfer_s"))
            p.frontend.append(r["ttft_s"] - server)
    for b in DECODE_BATCHES:  # b at once: the decode runs batch b for most of their steps
        recs = run_serving_bench(url, [float("inf")], fixed(f"probe-decode-{b}", DECODE_PROMPT, DECODE_OUT), b, seed + 100 + b,
                                 warmup_requests=1, per_request=True)
        tpots = [h["tpot_s"] for _, h in _hawks(recs) if h.get("tpot_s")]
        if tpots:
            p.decode.append((b, float(np.median(tpots))))
    for k in CONCURRENT_PULLS if concurrent_len else ():
        recs = run_serving_bench(url, [float("inf")], fixed(f"probe-concurrent-{k}", concurrent_len, 2), k, seed + 200 + k,
                                 warmup_requests=0, per_request=True)
        p.concurrent += [(k, float(h["kv_bytes"]), h["kv_transfer_s"]) for _, h in _hawks(recs)]
    return p


#: the prefill's first-use graph capture, measured on the GPU the paced runs use (prefill_graph_capture_probe.py)
GRAPH_CAPTURE = Path(__file__).resolve().parent / "results" / "prefill_graph_capture_h200.json"
#: when the prefill began replaying CUDA graphs (commit 8348c19, 2026-12-02 06:49:52 UTC): runs saved before
#: prefilled eagerly, with nothing captured on first use
PREFILL_GRAPHS_SINCE = 1796194192.0


def prefill_graphs(prefill_device: str, graph_tokens: int) -> GraphCapture | None:
    """The simulator's prefill graph model for a run whose prefill is on ``prefill_device``: None on a
    CPU (no graphs); without a capture measurement (:data:`GRAPH_CAPTURE`) only the warm-up runs
    (``ModelRunner.WARMUP_RUNS`` forwards), a lower bound of a first use."""
    if not prefill_device.startswith("cuda") or graph_tokens <= 0:
        return None
    if not GRAPH_CAPTURE.exists():
        return GraphCapture(graph_tokens, 0.0, "the engine's warm-up runs only (the capture itself not measured here)")
    return graph_capture(json.loads(GRAPH_CAPTURE.read_text()), graph_tokens)


def concurrent_prompt_len(transfer: str, wl: Workload) -> int | None:
    """The prompt length of the probes' simultaneous sends: the workload's mean for the host-staged paths
    (whose pulls share the decode host: ``hawk.sim.crossval.link_speedup``); None: the probes send none."""
    return int(wl.input.mean) if transfer.endswith("-host") else None


def probe_sends(probes: Probes, concurrent_len: int | None) -> list[tuple[int, int]]:
    """The probes' simultaneous sends ``(k, prompt tokens)`` in the order :func:`probe` sends them."""
    sends = [(b, DECODE_PROMPT) for b, _ in probes.decode]
    if concurrent_len and probes.concurrent:
        sends += [(k, concurrent_len) for k in sorted({int(k) for k, _, _ in probes.concurrent})]
    return sends


def simulate_rates(sim_cfg: Any, probes: Probes, concurrent_len: int | None, real: list[dict[str, Any]], wl: Workload,
                   rates: list[float], num_requests: int, seed: int) -> list[dict[str, Any]]:
    """The simulator over the sweep's rates in the order the real run served them, on one server's
    state: the graph buckets its probes and each earlier rate captured stay captured; requests the
    real decode lost at their pull are lost there too (``lost_at_pull``)."""
    graphs = sim_cfg.prefill_graphs
    captured = list(probe_captures(graphs, sim_cfg.prefill, probe_sends(probes, concurrent_len))) if graphs else []
    lost = {round(m["rate"], 9): lost_at_pull(m) for m in real}
    out = []
    for r in rates:
        cfg = dataclasses.replace(sim_cfg, prefill_graphs_captured=tuple(map(tuple, captured)))
        out.append(simulate(cfg, r, wl, num_requests, seed, per_request=True, lost_at_pull=lost.get(round(r, 9))))
        captured += [tuple(b) for b in out[-1]["prefill_graph_captures"][0]]
    return out


def served_limits(system: Any, cfg: Any) -> dict[str, int]:
    """The batch and KV capacities the running system resolved (``hawk/engine/capacity.py``'s memory
    rule where the config leaves them open): the simulator admits requests against the same ones."""
    from hawk.engine.capacity import default_max_num_seqs, prefill_capacity

    secret = cluster_secret_from_env()
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    def info(url: str) -> dict[str, Any]:
        r = httpx.get(f"{url}/internal/info", headers=headers, timeout=10.0, trust_env=False)
        r.raise_for_status()
        return r.json()

    return {"max_batch": default_max_num_seqs(cfg), "decode_kv_tokens": int(info(system.cluster.decode_urls[0])["max_kv_tokens"]),
            "prefill_kv_tokens": prefill_capacity(cfg).kv_tokens, "prefill_staging_bytes": info(system.cluster.prefill_urls[0]).get("staging_bytes")}


def run_scenario(name: str, a: argparse.Namespace, transfer: str) -> dict[str, Any]:
    """One real system: probes, the sweep, then the simulator on the calibrated models."""
    from hawk.serve.launcher import start_system

    paced = name == "paced"
    cfg = config_for(defaults(  # a GPU-decoding configuration decodes on the NPU's backing device
        model=a.model, dtype=a.dtype, prefill_device=a.prefill_device, decode_device=a.decode_device,
        transport=a.transport, npu_timing="p150a" if paced else None, link_gbps=a.link_gbps if paced else None, kv_dtype=a.kv_dtype,
    ), transfer).validate()
    wl = get_workload(a.workload)
    t0 = time.monotonic()
    os.environ.setdefault(CLUSTER_SECRET_ENV, secrets.token_urlsafe(32))  # the launcher's children get it; we read /internal/info
    with start_system(cfg, log_dir=a.log_dir) as system:
        print(f"[{name}] system up in {time.monotonic() - t0:.1f} s at {system.url}", flush=True)
        limits = served_limits(system, cfg)
        probes = probe(system.url, a.seed, prefill_lengths(wl, longest_prompt(wl, a.num_requests, a.seed)),
                       concurrent_len=concurrent_prompt_len(transfer, wl))
        print(f"[{name}] probes done at {time.monotonic() - t0:.1f} s", flush=True)
        real = run_serving_bench(system.url, a.rates, wl, a.num_requests, a.seed, warmup_requests=1, per_request=True)
        print(f"[{name}] sweep done at {time.monotonic() - t0:.1f} s", flush=True)
    cal = calibrate(probes, max_batch=limits["max_batch"], kv_tokens=limits["decode_kv_tokens"], prefill_chunk=cfg.max_prefill_chunk,
                    machine=platform.node() or "this machine", prefill_kv_tokens=limits["prefill_kv_tokens"])
    npu_step = None
    if paced and cfg.decode_device.startswith("npu-emu"):
        from hawk.engine.instances import compute_dtype
        from hawk.engine.loader import load_model

        loaded = load_model(cfg.model, "cpu" if a.prefill_device == "cpu" else cfg.decode_compute_device, compute_dtype(cfg), cfg.seed)
        mc = loaded.config
        params = sum(t.numel() for t in loaded.model.parameters())
        npu_step = engine_step_model("p150a", params, mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.kv_dtype)
        del loaded
    sim_cfg = calibrated_config(cal, cfg.transfer, npu_step=npu_step, link_gbps=cfg.link_gbps, staging_bytes=limits["prefill_staging_bytes"],
                                prefill_graphs=prefill_graphs(cfg.prefill_device, cfg.prefill_graph_tokens if cfg.graphs is not False else 0))
    sim = simulate_rates(sim_cfg, probes, concurrent_prompt_len(transfer, wl), real, wl, a.rates,
                         a.num_requests, a.seed)
    sims = {round(s["rate"], 9): s for s in sim}
    pairs = [row for m in real if round(m["rate"], 9) in sims for row in per_request(m, sims[round(m["rate"], 9)])]
    one_offs = format_one_offs(pairs, f"[{name}] {transfer}")
    for line in one_offs:
        print("one-off: " + line, flush=True)
    return {
        "scenario": name,
        "timing_emulation": timing_label(cfg.npu_timing, cfg.link_gbps),
        "config": {k: v for k, v in cfg.to_dict().items() if k in ("model", "dtype", "transfer", "transport", "prefill_device", "decode_device", "npu_timing", "link_gbps", "max_batch", "kv_tokens", "kv_dtype")},
        "served_limits": limits,
        "probes": probes.to_dict(),
        "calibration": cal.to_dict(),
        "npu_step_model": None if npu_step is None else dataclasses.asdict(npu_step),
        "real": real,
        "simulated": sim,
        "rows": compare(real, sim, f"{transfer} {name}"),
        "per_request": pairs,
        "one_offs": one_offs,
        "wall_s": time.monotonic() - t0,
    }


def resimulate(path: str) -> list[dict[str, Any]]:
    """The comparison rows of a saved run, with TODAY's simulator fed the same saved probes and the
    same workload, rates, request count and seed (the real records are kept as measured). Why: a run
    on a machine that is lent for minutes stays comparable when the simulator improves."""
    from hawk.devices.timing import StepModel

    saved = json.loads(Path(path).read_text())
    a = saved["args"]
    wl = get_workload(a["workload"])
    rows = []
    for s in saved["scenarios"]:
        cfg = s["config"]
        probes = Probes(**{k: [tuple(x) if isinstance(x, list) else x for x in v] for k, v in s["probes"].items()})
        chunk = defaults().max_prefill_chunk  # the serving default the run used (not saved with it)
        lim = s.get("served_limits") or {"max_batch": cfg["max_batch"], "decode_kv_tokens": cfg["kv_tokens"], "prefill_kv_tokens": None}
        cal = calibrate(probes, max_batch=lim["max_batch"], kv_tokens=lim["decode_kv_tokens"], prefill_chunk=chunk,
                        machine=saved.get("machine", {}).get("node", "saved run"), prefill_kv_tokens=lim["prefill_kv_tokens"])
        npu_step = None if s["npu_step_model"] is None else StepModel(**s["npu_step_model"])
        sim_cfg = calibrated_config(cal, cfg["transfer"], npu_step=npu_step, link_gbps=cfg["link_gbps"],
                                    staging_bytes=lim.get("prefill_staging_bytes"),
                                    prefill_graphs=prefill_graphs(cfg["prefill_device"], defaults().prefill_graph_tokens)
                                    if (s["real"][0].get("started_at") or 0) >= PREFILL_GRAPHS_SINCE else None)
        sim = simulate_rates(sim_cfg, probes, concurrent_prompt_len(cfg["transfer"], wl), s["real"], wl,
                             a["rates"], a["num_requests"], a["seed"])
        rows += compare(s["real"], sim, f"{cfg['transfer']} {s['scenario']}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--resimulate":
        argv = sys.argv[1:]
    if argv and argv[0] == "--resimulate":  # python benchmarks/cross_validate.py --resimulate FILE...
        rows = [r for f in argv[1:] for r in resimulate(f)]
        print(format_table(rows))
        return {"rows": rows}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="plain,paced", help="plain and/or paced (--npu-timing p150a --link-gbps N)")
    p.add_argument("--link-gbps", type=float, default=0.2,
                   help="the paced scenario's link (default 0.2 Gb/s: slow enough to bind on a CPU run; 200 on the GPU)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--kv-dtype", default=defaults().kv_dtype, help="the NPU KV dtype (bfp8_b: the p150a's, tilized on the host by gn-host)")
    p.add_argument("--transfer", default="gn-hawk", help="transfer configurations, comma-separated: one real system each")
    p.add_argument("--transport", default=defaults().transport, help="KV transport of the real system (hawk/config.py)")
    p.add_argument("--prefill-device", default="cpu")
    p.add_argument("--decode-device", default="npu-emu:cpu")
    p.add_argument("--workload", default="chatbot-tiny")
    p.add_argument("--rates", default="1,2")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="write the Markdown table here")
    a = p.parse_args(argv)
    a.rates = [float(x) for x in a.rates.split(",") if x]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    t0 = time.monotonic()
    scenarios = [run_scenario(s, a, t) for t in a.transfer.split(",") if t for s in a.scenarios.split(",") if s]
    rows = [r for s in scenarios for r in s["rows"]]
    table = format_table(rows)
    print(table)
    judged = [r for r in rows if r["within"] is not None]
    out = {
        "what": "simulator (here testbed, calibrated from probes of the same run) vs a real HAWK serving run",
        "emulation": "the NPU is emulated (memory in host RAM); paced scenarios emulate p150a / link timing",
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "args": {k: v for k, v in vars(a).items() if k not in ("json", "table")},
        "scenarios": scenarios,
        "rows": rows,
        "all_within": all(r["within"] for r in judged) if judged else None,
        "wall_s": time.monotonic() - t0,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    if a.table:
        Path(a.table).write_text(table + "\n")
    return out


if __name__ == "__main__":
    main()
