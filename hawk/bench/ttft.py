"""``hawk bench ttft``: time to first token, disaggregated against colocated, per prompt length.

Why its own benchmark: the equivalence run measures TTFT on four short chat prompts, where the KV is
small and the ratio says little about prompts of real length. Here every prompt length runs through
the colocated oracle and through each configuration in the same process, same model, same devices,
interleaved repeat by repeat (so drift on a shared machine hits both sides alike), and every record
carries the decode side's host-side breakdown of its transfer (hawk/connector/algorithm1.BREAKDOWN).
``ratio`` is the ratio of the medians; ``ratio_paired`` the median of each repeat's ratio to the
colocated run just before it, steadier where single runs swing (a 2-core CPU box: +-15 %).

    python -m hawk bench ttft --prompts 256,1024 --configs gn-hawk,gg-direct --json ttft.json
    python -m hawk bench ttft --configs gn-hawk --kv-flows pull,layerwise   # both KV flows, one run

``--kv-flows``: ``pull`` (prefill, then the decode pulls the KV) and/or ``layerwise`` (the decode hands
its blocks over first; the prefill pushes each layer as its forward finishes it). Each record names its
flow; a layer-wise record's ``kv_exposed_ms`` is the part of the transfer the forward did not hide.
``--profile-posts FILE``: a cProfile of the host work each layer-wise post adds to the forward's thread
(posts happen there over a stream-ordered transport on CUDA, or with HAWK_LAYERWISE_INLINE=always).

The instance options (model, devices, dtype, transport, buffers, ...) are ``hawk serve``'s, generated from
``ServeConfig`` (``hawk/bench/ttft_cli.py``); ``--kv-tokens`` is a floor, raised to hold the longest prompt.

TTFT runs from submitting the prompt to the prefill engine until the decode engine emits the first
token (prefill, KV transfer and the decode's admission included), as in the equivalence benchmark.
On the CPU box the NPU is emulated in host memory and the "GPU" is the CPU: label results so.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from hawk.config import KV_FLOWS, ServeConfig


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` seeded token ids (TTFT depends on the length, not the words; ids 0-99 hold specials)."""
    rng = np.random.default_rng(seed)
    return rng.integers(min(100, vocab - 1), vocab, size=n).tolist()


def _median_breakdown(results: Sequence[Any]) -> dict[str, float]:
    rows = [r.host_breakdown_ms() for r in results if r is not None]
    if not rows:
        return {}
    from hawk.connector.algorithm1 import BREAKDOWN

    return {k[:-2]: statistics.median(b.get(k, 0.0) for b in rows) for k in BREAKDOWN}


def _median_timings(results: Sequence[Any]) -> dict[str, float]:
    """Every timing a push recorded (decode laps and the prefill's ``sender_*``), median ms: where a
    layer-wise push's time went, beyond the pull breakdown's keys."""
    rows = [r.timings for r in results if r is not None and getattr(r, "timings", None)]
    keys = sorted({k for t in rows for k in t})
    return {k[:-2] if k.endswith("_s") else k: statistics.median(t.get(k, 0.0) for t in rows) * (1e3 if k.endswith("_s") else 1.0)
            for k in keys}  # counts (e.g. ``sender_posts``) stay counts


def _settle(seconds: float) -> None:
    """Wait for every CUDA device, then idle ``seconds``."""
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
    time.sleep(seconds)


def _median_pieces(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Where a request's TTFT went (``equivalence._collect``'s ``pieces_s``), median ms per piece:
    before the prefill call, the call (its queue and engine time), after it to the first token."""
    keys = sorted({k for r in rows for k in r})
    return {k[:-2] + "_ms" if k.endswith("_s") else k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in keys}


def _pull_result(decode: Any, rid: str) -> Any:
    """The decode's record of request ``rid``'s pull (its rank-0 receiver keeps the last few hundred)."""
    receiver = getattr(getattr(decode, "rank", None), "receiver", None)
    return receiver.result(rid) if receiver is not None and hasattr(receiver, "result") else None


def _profile_posts(sender: Any, prof: cProfile.Profile, measured: list[bool]) -> None:
    """Run the sender's layer posts from the forward's thread (transform launches and WRITE submit,
    the host work a layer-wise push adds to the forward) under ``prof``, while ``measured[0]`` (the
    warm-up's posts compile kernels: they would fill the profile)."""
    post = sender._push_layer_inline

    def profiled(push: Any, layer: int, marker: Any = None) -> None:
        if not measured[0]:
            post(push, layer, marker)
            return
        prof.enable()
        try:
            post(push, layer, marker)
        finally:
            prof.disable()

    sender._push_layer_inline = profiled


def write_profile(prof: cProfile.Profile, path: str) -> None:
    """The profile as text: the top functions by cumulative and by own time."""
    out = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(40)
    with open(path, "w") as f:
        f.write(out.getvalue())


def run(
    base: ServeConfig, prompts: Sequence[int], configs: Sequence[str], repeats: int = 3, warmup: int = 1, flows: Sequence[str] = ("pull",),
    profile: cProfile.Profile | None = None, settle_s: float = 0.05,
) -> list[dict[str, Any]]:
    """One record per (configuration, KV flow, prompt length): median TTFT against colocated, in one run.
    ``profile``: collects the layer-wise pushes' posts from the forward's thread (measured repeats only).
    ``settle_s``: idle time before each request, the devices synchronized first (what the one before
    left running, its release and clean-up, is not charged to the next)."""
    from hawk.bench.equivalence import config_for, run_colocated, run_disaggregated
    from hawk.engine.gc_policy import freeze_startup_heap
    from hawk.engine.instances import ColocatedInstance, DecodeInstance, PrefillInstance, compute_dtype
    from hawk.engine.loader import load_model
    from hawk.engine.sequence import SamplingParams
    from hawk.layouts.device import parse_device

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    loaded = load_model(base.model, base.prefill_device, compute_dtype(base), base.seed)
    vocab = int(loaded.config.vocab_size)
    colocated = ColocatedInstance(replace(base, transfer="colocated"), loaded=loaded)
    pairs: dict[str, tuple[Any, Any]] = {}
    keys = [f"{c}/{f}" for c in configs for f in flows]
    measured = [False]  # the repeat under way is measured (not warm-up): what ``profile`` collects
    try:
        for key in keys:
            name, flow = key.split("/")
            cfg = replace(config_for(base, name), kv_flow=flow).validate()
            p = PrefillInstance(cfg, loaded=loaded)
            same = parse_device(cfg.decode_compute_device).torch_device == parse_device(cfg.prefill_device).torch_device
            pairs[key] = (p, DecodeInstance(cfg, loaded=loaded if same else None))  # one copy of the weights per device
            if profile is not None and flow == "layerwise":
                _profile_posts(p.sender, profile, measured)
        if base.gc_freeze:  # as each serving process does once it is up
            freeze_startup_heap()
        records = []
        for n in prompts:
            ids = prompt_ids(n, vocab, seed=n)
            ttft: dict[str, list[float]] = {"colocated": [], **{k: [] for k in keys}}
            first: dict[str, list[int]] = {k: [] for k in ttft}
            pulls: dict[str, list[Any]] = {k: [] for k in keys}
            moved: dict[str, list[float]] = {k: [] for k in keys}
            exposed: dict[str, list[float]] = {k: [] for k in keys}
            pieces: dict[str, list[dict[str, float]]] = {k: [] for k in ttft}
            for i in range(warmup + repeats):
                measured[0] = i >= warmup
                runs = [("colocated", lambda rid: run_colocated(colocated, ids, params, rid))]
                runs += [(k, lambda rid, k=k: run_disaggregated(*pairs[k], ids, params, rid)) for k in keys]
                for key, go in runs:
                    _settle(settle_s)
                    rid = f"ttft-{key.replace('/', '-')}-{n}-{i}-{time.monotonic_ns()}"
                    toks, info = go(rid)
                    if i < warmup:
                        continue
                    ttft[key].append(info["ttft_s"] * 1e3)
                    first[key].append(toks[0] if toks else -1)
                    if "pieces_s" in info:
                        pieces[key].append(info["pieces_s"])
                    if key in pulls:
                        pulls[key].append(_pull_result(pairs[key][1], rid))
                        moved[key].append(info.get("kv_transfer_s", 0.0) * 1e3)
                        exposed[key].append(info.get("kv_exposed_s", 0.0) * 1e3)
            colo = statistics.median(ttft["colocated"])
            for key in keys:
                c, flow = key.split("/")
                t = statistics.median(ttft[key])
                breakdown = _median_breakdown(pulls[key])
                cfg = pairs[key][1].cfg
                records.append(
                    {
                        "config": c,
                        "kv_flow": flow,
                        "kv_exposed_ms": statistics.median(exposed[key]) if flow == "layerwise" else None,
                        "prompt_tokens": n,
                        "identical": first[key] == first["colocated"],
                        "ttft_ms": t,
                        "colocated_ttft_ms": colo,
                        "ratio": t / colo,
                        # each repeat's pair ran back to back: a slow spell of the host hits both
                        "ratio_paired": statistics.median(a / b for a, b in zip(ttft[key], ttft["colocated"])),
                        "ttft_ms_all": ttft[key],
                        "colocated_ttft_ms_all": ttft["colocated"],
                        "kv_transfer_ms": statistics.median(moved[key]),
                        "host_breakdown_ms": breakdown,
                        "push_timings_ms": _median_timings(pulls[key]) if flow == "layerwise" else None,
                        "pieces_ms": _median_pieces(pieces[key]),
                        "colocated_pieces_ms": _median_pieces(pieces["colocated"]),
                        "kv_bytes": getattr(pulls[key][-1], "bytes", 0) if pulls[key] else 0,
                        "kv_mode": getattr(pulls[key][-1], "mode", "") if pulls[key] else "",
                        "repeats": repeats,
                        "settle_ms": settle_s * 1e3,
                        "model": base.model,
                        "dtype": base.dtype,
                        "prefill_device": cfg.prefill_device,
                        "decode_device": cfg.decode_device + (" (emulated NPU)" if parse_device(cfg.decode_device).is_npu else ""),
                        "transport": cfg.transport,
                    }
                )
        return records
    finally:
        for p, d in pairs.values():
            d.close()
            p.close()
        colocated.close()


def print_table(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="TTFT, disaggregated vs colocated (median ms)")
    for col in ("config", "flow", "prompt", "first token =", "TTFT", "colocated", "ratio", "KV transfer", "exposed", "control", "tx plan", "tx transform", "rx plan", "descs", "submit", "wait", "finish", "mode"):
        t.add_column(col, justify="left" if col in ("config", "flow", "mode") else "right")
    for r in records:
        b = r["host_breakdown_ms"]
        f = lambda k: f"{b.get(k, 0.0):.2f}"  # noqa: E731
        t.add_row(
            r["config"], r.get("kv_flow", "pull"), str(r["prompt_tokens"]), "yes" if r["identical"] else "NO", f"{r['ttft_ms']:.1f}",
            f"{r['colocated_ttft_ms']:.1f}", f"{r['ratio']:.3f}", f"{r['kv_transfer_ms']:.2f}",
            "" if r.get("kv_exposed_ms") is None else f"{r['kv_exposed_ms']:.2f}", f("control"), f("sender_plan"), f("sender_transform"), f("plan"),
            f("descs"), f("submit"), f("transfer_wait"), f("finish"), r["kv_mode"],
        )
    Console(width=200).print(t)


def measure(
    cfg: ServeConfig, prompts: Sequence[int], configs: Sequence[str], flows: Sequence[str], repeats: int = 3, warmup: int = 1,
    json_path: str | None = None, profile_path: str | None = None, settle_s: float = 0.05,
) -> list[dict[str, Any]]:
    """What the command does: check its lists, size the caches to the longest prompt, :func:`run`, print
    the table, write the JSON (and the posts' profile) when asked."""
    if not prompts or min(prompts) < 1 or not configs:
        raise ValueError("--prompts needs positive token counts and --configs at least one configuration")
    if not flows or any(f not in KV_FLOWS for f in flows):
        raise ValueError(f"--kv-flows takes {', '.join(KV_FLOWS)}, got {','.join(flows)!r}")
    base = replace(cfg, kv_tokens=max(cfg.kv_tokens or 0, max(prompts) + 256))  # buffers: auto, sized for the longest prompt
    prof = cProfile.Profile() if profile_path else None
    records = run(base, prompts, configs, repeats, warmup, flows, prof, settle_s)
    if prof is not None and profile_path:
        write_profile(prof, profile_path)
    print_table(records)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return records
