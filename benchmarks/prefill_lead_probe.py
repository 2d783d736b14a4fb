"""How far the prefill's host thread runs ahead of the GPU, layer by layer, inside `hawk bench ttft`.

A layer-wise push hides the transfer only while the forward's thread (which also posts each group of
layers) enqueues work faster than the GPU runs it. Every prefill forward of ``--min-tokens`` or more
gets an event and a host timestamp at each layer's start and at its end; with the GPU idle when a
prefill starts, ``lead`` (GPU time at a layer's start minus host time at its enqueue, both from the
forward's start) near 0 means the GPU waited for the host there. The forwards are listed in the order
they ran (per repeat: colocated, then each configuration/flow in ``--configs`` x ``--kv-flows`` order).
``--profile FILE``: a cProfile of the forward's thread over every such forward (inflates host time).
``--bare N``: first, N forwards of ``--min-tokens`` tokens on a plain runner, before any instance (and
its threads) exists. At the end, the CPU time each OS thread of the process used (``/proc``), with the
Python thread's name where it has one: what competes with the forward's thread.

    python benchmarks/prefill_lead_probe.py --json lead.json -- --model llama-3.1-8b --dtype bf16 \\
        --prefill-device cuda:0 --decode-device npu-emu:cuda:0 --prompts 1024 --configs gn-hawk \\
        --kv-flows pull,layerwise --repeats 5 --warmup 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import os
import statistics
import threading
import time
from typing import Any

import torch

import hawk.engine.loader as loader
from hawk.bench import ttft


class LeadRecorder:
    """Layer-start events and host stamps of each long-enough forward of one model."""

    def __init__(self, min_tokens: int, profile: cProfile.Profile | None) -> None:
        self.min_tokens, self.profile = min_tokens, profile
        self.forwards: list[list[tuple[float, Any]]] = []
        self._cur: list[tuple[float, Any]] | None = None

    def _stamp(self) -> None:
        assert self._cur is not None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._cur.append((time.perf_counter(), ev))

    def attach(self, model: Any) -> None:
        if not torch.cuda.is_available():  # (the thread census still runs: a CPU check of the probe)
            return
        def begin(_m: Any, args: tuple[Any, ...]) -> None:
            self._cur = [] if args[0].shape[0] >= self.min_tokens else None
            if self._cur is not None:
                self._stamp()
                if self.profile is not None:
                    self.profile.enable()

        def layer(_m: Any, _args: Any) -> None:
            if self._cur is not None:
                self._stamp()

        def end(_m: Any, _args: Any, _out: Any) -> None:
            if self._cur is not None:
                if self.profile is not None:
                    self.profile.disable()
                self._stamp()
                self.forwards.append(self._cur)
                self._cur = None

        model.register_forward_pre_hook(begin)
        for blk in model.layers:
            blk.register_forward_pre_hook(layer)
        model.register_forward_hook(end)

    def summary(self) -> list[dict[str, Any]]:
        if not self.forwards:
            return []
        torch.cuda.synchronize()
        out = []
        for stamps in self.forwards:
            h0, e0 = stamps[0]
            host = [(h - h0) * 1e3 for h, _ in stamps]
            gpu = [e0.elapsed_time(e) for _, e in stamps]
            lead = [g - h for g, h in zip(gpu, host)]
            out.append({"host_ms": host[-1], "gpu_ms": gpu[-1], "min_lead_ms": min(lead[1:]), "lead_ms": lead})
        return out


def bare_forwards(model: Any, tokens: int, n: int) -> None:
    """``n`` prefills of ``tokens`` tokens on a runner of their own, the GPU idle before each."""
    from hawk.bench import engine as eb
    from hawk.engine.attention import SeqSlice
    from hawk.engine.runner import ModelRunner

    cache = eb.build_paged(model.config, "bf16", 1, tokens, model.device)
    runner = ModelRunner(model, cache.attn, max_batch=1, graphs=False)
    ids = [[(7919 * i + 11) % model.config.vocab_size for i in range(tokens)]]
    for _ in range(n):
        runner.forward(ids, [SeqSlice(cache.blocks[0], 0, tokens)])
        torch.cuda.synchronize()


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) per OS thread of this process, named by Python where it can be."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        key = f"{names.get(int(tid), comm)} [{tid}]"
        out[key] = cpu
    return out


def report(rows: list[dict[str, Any]]) -> None:
    for i, r in enumerate(rows):
        print(f"forward {i}: host {r['host_ms']:.2f} ms, gpu {r['gpu_ms']:.2f} ms, min lead {r['min_lead_ms']:.2f} ms, "
              f"lead at layers 8/16/24/end {r['lead_ms'][8]:.2f}/{r['lead_ms'][16]:.2f}/{r['lead_ms'][24]:.2f}/{r['lead_ms'][-1]:.2f}")
    if rows:
        print(f"median host {statistics.median(r['host_ms'] for r in rows):.2f} ms, gpu {statistics.median(r['gpu_ms'] for r in rows):.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--bare", type=int, default=0)
    p.add_argument("--model", default="llama-3.1-8b", help="with no ttft arguments: the model of the bare forwards")
    p.add_argument("ttft_args", nargs=argparse.REMAINDER, help="after --: hawk bench ttft's arguments")
    a = p.parse_args()
    prof = cProfile.Profile() if a.profile else None
    rec = LeadRecorder(a.min_tokens, prof)
    real = loader.load_model

    def load_and_attach(*args: Any, **kw: Any) -> Any:
        loaded = real(*args, **kw)
        rec.attach(loaded.model)
        if a.bare:
            bare_forwards(loaded.model, a.min_tokens, a.bare)
        return loaded

    loader.load_model = load_and_attach
    ttft_args = [x for x in a.ttft_args if x != "--"]
    if not ttft_args:  # bare forwards only
        load_and_attach(a.model, "cuda:0", torch.bfloat16)
        rows = rec.summary()
        report(rows)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"forwards": rows}, f, indent=1)
        return
    seen: dict[str, float] = {}
    done = threading.Event()

    def sample() -> None:  # twice a second: threads that exit keep their last reading
        while not done.wait(0.5):
            seen.update(thread_cpu())

    sampler = threading.Thread(target=sample, name="cpu-sampler", daemon=True)
    t0 = time.monotonic()
    sampler.start()
    records = ttft.main(ttft_args)
    done.set()
    sampler.join()
    wall = time.monotonic() - t0
    cpu = sorted(seen.items(), key=lambda kv: -kv[1])
    print(f"wall {wall:.1f} s; CPU seconds by thread (the model's load included in the main thread's):")
    for name, sec in cpu[:20]:
        print(f"  {sec:8.2f}  {name}")
    rows = rec.summary()
    report(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"forwards": rows, "ttft": records, "thread_cpu_s": dict(cpu), "wall_s": wall}, f, indent=1)
    if prof is not None and a.profile:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)  # where the posts' time goes
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_callees("_push_layer_inline|_layer_call|_plan_inline")
        with open(a.profile, "w") as f:
            f.write(s.getvalue())


if __name__ == "__main__":
    main()
