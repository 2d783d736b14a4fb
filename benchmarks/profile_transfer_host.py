"""Host cost of every step of one KV transfer, sender and receiver in ONE process (no control channel).

Builds what `hawk bench transfer` builds (the real send formats, landings, staging and channel buffers,
plan cache and transport), for the Llama-3.1-8B KV shape (32 layers, 8 KV heads, head_dim 128, bf16,
vLLM blocks of 16; emulated Blackhole p150a NPU, 64-token blocks), then runs Algorithm 1's steps one
by one and times each with ``time.perf_counter`` (medians over the repeats), then once more under
cProfile, one profiler per step:

    sender   tx_plan, tx_reserve, tx_transform (the launch: host time), tx_transform_wait (device),
             tx_ready (P7's metadata)
    receiver rx_warm (planning ahead of D2), rx_plan, rx_reserve, rx_pair (descriptors), submit,
             transfer_wait, finish (D7; ``finish_sync`` is the part spent in device syncs), rx_release,
             tx_release

After each case, one more pull lands on zeroed destination memory and its rows are compared with the
source's (``landed_exactly``: the bytes the profiled code paths move are checked on the device itself).

Block ids: ``same`` repeats one request's blocks on every repeat (what `hawk bench transfer` does: every
cache keyed by block ids hits), ``fresh`` gives every repeat new GPU and NPU block ids (what serving
sees: per-request caches miss).

    python benchmarks/profile_transfer_host.py --json /tmp/prof.json                      # cuda:0, about 30-60 s
    python benchmarks/profile_transfer_host.py --device cpu --layers 2 --tokens 256,1024   # host paths on a CPU
    python benchmarks/profile_transfer_host.py --device cpu --stub-triton ...              # + transform_triton's host work

The transport is "local" by default: both transports live in this process, so a batch is the same
copy_span_batch call a cuda-ipc peer gets (only the peer region's lookup differs); the control round
trip (D1/D2 over the control socket) is not part of this profile. On a CPU, ``submit`` includes the
memcpy itself (CPU copies are synchronous); on CUDA it is posting only, and each case reports how often
the same-GPU one-launch copy path was taken (``same_gpu_copy_path``).

``--stub-triton`` (CPU only) replaces the Triton kernels by no-ops so ``transform_triton``'s host path
(plan tables, launch state, argument setup) can be profiled without a GPU; the bytes are then wrong.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import gc
import json
import os
import platform
import pstats
import statistics
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hawk.connector.configs import GpuSide, NpuSide, make_landing  # noqa: E402
from hawk.connector.formats import STAGING_REGION, Held, InPlace, NpuTiles, Staged, _InStagingBuffer, _sync  # noqa: E402
from hawk.connector.landings import GpuDirectLanding  # noqa: E402
from hawk.connector.messages import KVReady  # noqa: E402
from hawk.devices.emulated import open_npu  # noqa: E402
from hawk.layouts.gpu import GpuKVLayout  # noqa: E402
from hawk.layouts.npu import NpuKVLayout, get_arch  # noqa: E402
from hawk.memory.buffers import StagingBuffer  # noqa: E402
from hawk.memory.npu_kv_cache import NpuKVCacheMemory  # noqa: E402
from hawk.plan.cost_model import cost_model_for  # noqa: E402
from hawk.transport.registry import make_transport  # noqa: E402

MiB = 1 << 20
STEPS = ("tx_plan", "tx_reserve", "tx_transform", "tx_transform_wait", "tx_ready", "rx_warm", "rx_plan", "rx_reserve",
         "rx_pair", "submit", "transfer_wait", "finish", "finish_sync", "rx_release", "tx_release")  # fmt: skip
#: Steps that are (mostly) the device working, left out of the combined host profile.
DEVICE_STEPS = ("tx_transform_wait", "transfer_wait", "finish_sync")


# ------------------------------------------------------------------------------------------- setup
class World:
    """Everything both sides hold, sized for the largest request of the run."""

    def __init__(self, a: argparse.Namespace, max_tokens: int, pool_extra: int):
        self.a = a
        self.dev = torch.device(a.device)
        L, H, D = a.layers, a.kv_heads, a.head_dim
        gblocks = -(-max_tokens // a.gpu_block) + pool_extra + 1
        self.gpu = GpuKVLayout(L, gblocks, a.gpu_block, H, D, "bf16")
        gen = torch.Generator(device=self.dev).manual_seed(0)
        self.caches = []
        for _ in range(L):
            c = torch.empty(self.gpu.layer_shape, dtype=torch.bfloat16, device=self.dev)
            c.uniform_(-2, 2, generator=gen)
            self.caches.append(c)
        bpt = self.gpu.bytes_per_token()
        send = max_tokens * bpt + 4 * MiB
        self.rx_bytes = send
        self.staging_bytes = send
        self.formats: dict[str, Any] = {}
        self.landings: dict[str, Any] = {}
        self.sides: dict[str, Any] = {}
        self.kv = None
        self.npu = None
        self.nblocks = -(-max_tokens // a.npu_block) + pool_extra + 1
        self.dst_caches: list[torch.Tensor] | None = None

    def fmt(self, config: str) -> Any:
        if config not in self.formats:
            if config == "gg-direct":
                self.formats[config] = InPlace(self.caches, self.gpu)
            else:
                staging = StagingBuffer(self.staging_bytes, self.dev)
                self.formats[config] = NpuTiles(self.caches, self.gpu, staging, self.a.transform_impl)
        return self.formats[config]

    def landing(self, config: str) -> Any:
        if config not in self.landings:
            if config == "gg-direct":
                self.dst_caches = self.gpu.allocate(self.dev)
                side = GpuSide(self.dst_caches, self.gpu, self.rx_bytes)
            else:
                side = self._npu_side()
            self.landings[config] = make_landing(config, side)
        return self.landings[config]

    def _npu_side(self) -> NpuSide:
        a = self.a
        arch0 = get_arch(a.arch)
        probe = NpuKVLayout(arch0, a.layers, self.nblocks, a.kv_heads, a.npu_block, a.head_dim, a.kv_dtype)
        per_bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + -(-self.rx_bytes // arch0.num_banks)
        bank = -(-int(per_bank * 1.25 + 8 * MiB) // (64 * 1024)) * 64 * 1024
        spec = f"npu-emu:{self.dev}"
        self.npu = open_npu(spec, a.arch, bank_capacity=bank)
        layout = NpuKVLayout(self.npu.arch, a.layers, self.nblocks, a.kv_heads, a.npu_block, a.head_dim, a.kv_dtype)
        self.kv = NpuKVCacheMemory(self.npu, layout)
        transport = "local" if a.transport == "auto" else a.transport
        cost = cost_model_for(transport, "cuda" if self.dev.type == "cuda" else "cpu")
        return NpuSide(self.npu, self.kv, self.rx_bytes, cost, "auto")

    def close(self) -> None:
        for lnd in self.landings.values():
            with contextlib.suppress(Exception):
                lnd.close()
        if self.kv is not None:
            with contextlib.suppress(Exception):
                self.kv.close()


class Link:
    """A sender transport and a receiver transport in this process, connected (pull: the receiver reads)."""

    def __init__(self, name: str, fmt: Any, landing: Any):
        self.tx = make_transport(name)
        self.rx = make_transport(name)
        for n, t in fmt.regions().items():
            self.tx.register(n, t)
        for n, t in landing.regions().items():
            self.rx.register(n, t)
        self.peer = self.rx.connect(self.tx.metadata())
        self.engine = self.rx.engine_for(self.peer) if hasattr(self.rx, "engine_for") else self.rx.name

    def close(self) -> None:
        self.rx.close()
        self.tx.close()


# --------------------------------------------------------------------------------------- one pull
class SyncTimer:
    """Wraps a device's synchronize to add up the seconds spent in it (finish's device part)."""

    def __init__(self) -> None:
        self.s = 0.0

    def wrap(self, obj: Any, attr: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.s += time.perf_counter() - t0

        setattr(obj, attr, timed)


def handshake_infos(fmt: Any, landing: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What each side learnt of the other at the handshake: (the sender's view of the receiver, the
    receiver's view of the sender), as the connector keeps them."""
    layout, extra = landing.hello()
    return {"layout": layout, **extra}, {"layout": fmt.layout, **fmt.hello_extra()}


def one_pull(fmt: Any, landing: Any, link: Link, infos: tuple[dict[str, Any], dict[str, Any]], ntok: int, gids: list[int],
             dids: list[int], rid: str, sync: SyncTimer, profs: dict[str, cProfile.Profile] | None) -> tuple[dict[str, float], dict[str, Any]]:
    """Algorithm 1's steps for one request, each timed (and profiled when ``profs`` is given)."""
    out: dict[str, float] = {}
    clock = time.perf_counter
    rx_info, tx_info = infos

    def step(name: str, fn: Any) -> Any:
        p = profs.get(name) if profs is not None else None
        if p is not None:
            p.enable()
        t0 = clock()
        try:
            return fn()
        finally:
            out[name] = out.get(name, 0.0) + clock() - t0
            if p is not None:
                p.disable()

    staged_held = None
    held = None
    try:
        # ---- sender: P2-P7
        plan = step("tx_plan", lambda: fmt.plan(ntok, gids, rx_info, dids))
        if isinstance(fmt, _InStagingBuffer):
            res = step("tx_reserve", lambda: fmt.staging.reserve(fmt.size(plan), rid, 30.0))
            staged = Staged(Held("staging", {0: res}), STAGING_REGION, res.offset)
            staged_held = staged.held
            step("tx_transform", lambda: fmt.produce(plan, fmt.staging.view(res)))
            step("tx_transform_wait", lambda: _sync(fmt.staging.tensor))
        else:
            staged = step("tx_reserve", lambda: fmt.stage(plan, rid, 30.0))
            staged_held = staged.held
        ready = step("tx_ready", lambda: KVReady(rid, fmt.name, ntok, list(gids), staged.region, staged.offset, fmt.size(plan),
                                                 fmt.extents(plan), staged.sources, {}))  # fmt: skip
        # ---- receiver: D2-D8 (rx_warm runs while D1 is in flight in a real pull)
        step("rx_warm", lambda: landing.warm(ntok, dids, tx_info))
        rplan = step("rx_plan", lambda: landing.plan(ready, dids, tx_info))
        held = step("rx_reserve", lambda: landing.reserve(rplan, rid, None))
        descs = step("rx_pair", lambda: landing.pair(rplan, held, ready))
        h = step("submit", lambda: link.rx.submit("READ", link.peer, descs))

        def wait() -> None:
            try:
                link.rx.wait(h, 60.0)
            finally:
                link.rx.release(h)

        step("transfer_wait", wait)
        s0 = sync.s
        step("finish", lambda: landing.finish(rplan, held))
        # The device part of D7: the NPU's synchronize (gn-*), or all of it for gg-direct (a device sync only).
        out["finish_sync"] = out["finish"] if isinstance(landing, GpuDirectLanding) else sync.s - s0
        out["finish"] -= out["finish_sync"]
        info = {"descs": len(descs), "bytes": int(sum(d.length for d in descs)), "mode_used": held.mode}
    finally:
        if held is not None:
            h2 = held
            step("rx_release", lambda: landing.release(h2))
        if staged_held is not None:
            sh = staged_held
            step("tx_release", lambda: fmt.release(sh))
    return out, info


def landed_exactly(w: World, config: str, ntok: int, gids: list[int], dids: list[int]) -> bool | None:
    """Whether the destination holds exactly the request's rows after a pull (None: not checkable here,
    i.e. a lossy bfloat8_b NPU cache)."""
    a = w.a
    H, D = a.kv_heads, a.head_dim
    g = torch.as_tensor(gids[: -(-ntok // a.gpu_block)], device=w.dev)
    for layer in range(a.layers):
        for kv in range(2):
            want = w.caches[layer][kv].index_select(0, g)  # [blocks, slot, head, dim] (NHD)
            want = want.reshape(-1, H, D)[:ntok]
            if config == "gg-direct":
                assert w.dst_caches is not None
                d = torch.as_tensor(dids[: -(-ntok // a.gpu_block)], device=w.dev)
                got = w.dst_caches[layer][kv].index_select(0, d).reshape(-1, H, D)[:ntok]
            else:
                if a.kv_dtype != "bf16":
                    return None
                d = torch.as_tensor(dids[: -(-ntok // a.npu_block)], device=w.dev)
                got = w.kv.read_blocks(2 * layer + kv, d).permute(0, 2, 1, 3).reshape(-1, H, D)[:ntok]
                want = want.float()
            if not torch.equal(got, want):
                return False
    return True


# ------------------------------------------------------------------------------------------ profiles
def _fname(key: tuple) -> str:
    file, line, fn = key
    if file == "~":
        return fn
    parts = file.replace("\\", "/").split("/")
    short = "/".join(parts[-3:]) if "hawk" not in parts else "/".join(parts[parts.index("hawk"):])
    return f"{short}:{line}({fn})"


def top_entries(prof: pstats.Stats | None, sort: str, n: int, reps: int) -> list[dict[str, Any]]:
    """Top ``n`` functions by ``sort`` ("tottime" | "cumtime"), times in microseconds per repeat."""
    if prof is None:
        return []
    rows = []
    for key, (cc, nc, tt, ct, _callers) in prof.stats.items():  # type: ignore[attr-defined]
        rows.append({"func": _fname(key), "calls": nc / reps, "tottime_us": tt / reps * 1e6, "cumtime_us": ct / reps * 1e6})
    k = "tottime_us" if sort == "tottime" else "cumtime_us"
    rows.sort(key=lambda r: r[k], reverse=True)
    return rows[:n]


def merged(profs: list[cProfile.Profile]) -> pstats.Stats | None:
    live = []
    for p in profs:
        try:
            p.create_stats()
            if p.stats:  # type: ignore[attr-defined]
                live.append(p)
        except Exception:  # noqa: BLE001
            pass
    if not live:
        return None
    st = pstats.Stats(live[0])
    for p in live[1:]:
        st.add(p)
    return st


# ---------------------------------------------------------------------------------------------- run
def blocks_for(kind: str, rep: int, n_gpu: int, n_npu: int) -> tuple[list[int], list[int]]:
    """``same``: blocks 0..n-1 every time; ``fresh``: a window shifted by one block per repeat (contiguous,
    as a fresh allocator hands them out, but new ids: nothing keyed by block ids is reused)."""
    off = 0 if kind == "same" else rep + 1
    return list(range(off, off + n_gpu)), list(range(off, off + n_npu))


class FastCopyCounter:
    """Counts what the same-GPU copy paths of the local / cuda-ipc transports' submit answered:
    ``copier`` = the raw-runtime SpanCopier took the batch (given as Segments or as arrays),
    ``one_launch`` = ``copy_spans`` did (one launch under torch's streams), ``declined`` = neither
    (per-range torch copies)."""

    def __init__(self) -> None:
        import hawk.transport.local as local

        self.counts = self._zero()
        self._local = local
        real_spans = getattr(local, "copy_spans", None)
        real_copier = getattr(local, "_copier_batch", None)
        if real_spans is not None:
            def counted(*args: Any, **kw: Any) -> bool:
                ok = real_spans(*args, **kw)
                self.counts["one_launch" if ok else "declined"] += 1
                return ok

            local.copy_spans = counted
        if real_copier is not None:
            def counted_copier(*args: Any, **kw: Any) -> Any:
                ev = real_copier(*args, **kw)
                if ev is not None:
                    self.counts["copier"] += 1
                return ev

            local._copier_batch = counted_copier
        real_arrays = local.LocalTransport._array_batch

        def counted_arrays(transport: Any, *args: Any, **kw: Any) -> Any:
            batch = real_arrays(transport, *args, **kw)
            if batch is not None:
                self.counts["copier"] += 1
            return batch

        local.LocalTransport._array_batch = counted_arrays

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"copier": 0, "one_launch": 0, "declined": 0}

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, self._zero()
        return out


def run_case(w: World, config: str, mode: str, ntok: int, kind: str, reps: int, prof_reps: int, warmup: int,
             top: int, link_name: str, fast: FastCopyCounter, verify: bool = True) -> dict[str, Any]:
    a = w.a
    fmt = w.fmt(config)
    landing = w.landing(config)
    if mode != "auto":
        landing.mode = mode
    elif hasattr(landing, "mode"):
        landing.mode = "auto"
    link = Link(link_name, fmt, landing)
    infos = handshake_infos(fmt, landing)
    fast.take()
    if w.npu is not None and not isinstance(getattr(w.npu, "_hawk_prof_sync", None), SyncTimer):
        w.npu._hawk_prof_sync = SyncTimer()  # type: ignore[attr-defined]
        w.npu._hawk_prof_sync.wrap(w.npu, "synchronize")  # type: ignore[attr-defined]
    sync = w.npu._hawk_prof_sync if w.npu is not None else SyncTimer()  # type: ignore[attr-defined]
    n_gpu = -(-ntok // a.gpu_block)
    n_npu = -(-ntok // (a.npu_block if config != "gg-direct" else a.gpu_block))
    rec: dict[str, Any] = {"config": config, "mode": mode, "tokens": ntok, "blocks": kind, "engine": link.engine}
    try:
        times: dict[str, list[float]] = {s: [] for s in STEPS}
        totals: list[float] = []
        info: dict[str, Any] = {}
        rep = 0
        for i in range(warmup + reps):
            gids, dids = blocks_for(kind, rep, n_gpu, n_npu)
            rep += 1
            gc.disable()
            t0 = time.perf_counter()
            try:
                t, info = one_pull(fmt, landing, link, infos, ntok, gids, dids, f"r{rep}", sync, None)
            finally:
                gc.enable()
            if i >= warmup:
                totals.append(time.perf_counter() - t0)
                for k in STEPS:
                    times[k].append(t.get(k, 0.0))
        profs = {s: cProfile.Profile() for s in STEPS}
        for _ in range(prof_reps):
            gids, dids = blocks_for(kind, rep, n_gpu, n_npu)
            rep += 1
            one_pull(fmt, landing, link, infos, ntok, gids, dids, f"r{rep}", sync, profs)
        if verify:  # one more pull, then the destination's rows against the source's (bytes exact)
            gids, dids = blocks_for(kind, rep, n_gpu, n_npu)
            rep += 1
            for c in w.dst_caches if config == "gg-direct" else [w.npu.memory]:  # what earlier pulls left goes
                c.zero_()
            one_pull(fmt, landing, link, infos, ntok, gids, dids, f"r{rep}", sync, None)
            rec["landed_exactly"] = landed_exactly(w, config, ntok, gids, dids)
        rec.update(info)
        rec["same_gpu_copy_path"] = fast.take()  # over all pulls of the case (warm-up and profiled ones too)
        rec["steps_us"] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        rec["p90_us"] = {k: sorted(v)[min(len(v) - 1, int(0.9 * len(v)))] * 1e6 for k, v in times.items()}
        rec["total_us"] = statistics.median(totals) * 1e6
        rec["host_us"] = sum(v for k, v in rec["steps_us"].items() if k not in DEVICE_STEPS)
        rec["repeats"] = reps
        rec["profile_repeats"] = prof_reps
        if prof_reps:
            host = merged([profs[s] for s in STEPS if s not in DEVICE_STEPS])
            rec["profile"] = {
                "host_tottime": top_entries(host, "tottime", top, prof_reps),
                "host_cumtime": top_entries(host, "cumtime", top, prof_reps),
                "steps": {s: {"tottime": top_entries(st, "tottime", top, prof_reps), "cumtime": top_entries(st, "cumtime", top, prof_reps)}
                          for s in STEPS if (st := merged([profs[s]])) is not None},  # fmt: skip
            }
    finally:
        link.close()
    return rec


def print_case_table(recs: list[dict[str, Any]]) -> None:
    short = {"tx_transform_wait": "tx_xf_wait", "tx_transform": "tx_xf", "transfer_wait": "xfer_wait", "finish_sync": "fin_sync"}
    cols = [s for s in STEPS]
    head = f"{'config':<16}{'blk':<6}{'tok':>6}{'mode':>9}{'desc':>6}{'MiB':>7} " + "".join(f"{short.get(c, c):>11}" for c in cols) + f"{'host':>9}{'total':>9}"
    print("\nmedian microseconds per step (host steps; tx_xf_wait / xfer_wait / fin_sync are the device working)")
    print(head)
    for r in recs:
        if "steps_us" not in r:
            print(f"{r['config']:<16}{r['blocks']:<6}{r['tokens']:>6}  ERROR {r.get('error', '')[:150]}")
            continue
        s = r["steps_us"]
        name = r["config"] + ("" if r["mode"] == "auto" else f"@{r['mode']}")
        print(f"{name:<16}{r['blocks']:<6}{r['tokens']:>6}{r.get('mode_used', r.get('mode', '')):>9}{r.get('descs', 0):>6}"
              f"{r.get('bytes', 0) / MiB:>7.0f} " + "".join(f"{s[c]:>11.1f}" for c in cols) + f"{r['host_us']:>9.0f}{r['total_us']:>9.0f}")  # fmt: skip


def print_profiles(recs: list[dict[str, Any]], top: int, step_top: int) -> None:
    for r in recs:
        p = r.get("profile")
        if not p:
            continue
        name = r["config"] + ("" if r["mode"] == "auto" else f"@{r['mode']}")
        print(f"\n=== cProfile {name} {r['tokens']} tok, {r['blocks']} blocks (us per transfer, {r['profile_repeats']} transfers; host steps only)")
        for sort in ("tottime", "cumtime"):
            print(f"  -- top {top} by {sort}: calls tottime cumtime function")
            for e in p[f"host_{sort}"][:top]:
                print(f"  {e['calls']:8.1f} {e['tottime_us']:9.1f} {e['cumtime_us']:9.1f}  {e['func']}")
        if step_top:
            for s, st in p["steps"].items():
                if s in DEVICE_STEPS or r["steps_us"].get(s, 0) < 40:
                    continue
                print(f"  -- {s} (median {r['steps_us'][s]:.0f} us): top {step_top} by tottime")
                for e in st["tottime"][:step_top]:
                    print(f"  {e['calls']:8.1f} {e['tottime_us']:9.1f} {e['cumtime_us']:9.1f}  {e['func']}")


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return ""


def stub_triton() -> None:
    """CPU only: Triton kernels become no-ops, so transform_triton's host work can be profiled."""
    import hawk.transform as tr
    import hawk.transform.triton_kernel as tk

    class _Stub:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kw: None

    for name in ("_transform_kernel", "_rows_kernel"):
        if hasattr(tk, name):
            setattr(tk, name, _Stub())
    real = tr.transform

    def transform(caches, plan, out=None, impl="auto"):  # noqa: ANN001, ANN202
        return real(caches, plan, out, "triton" if impl == "auto" else impl)

    tr.transform = transform
    import hawk.connector.formats as fm

    fm.transform = transform


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", default="1024,16384", help="comma-separated token counts")
    p.add_argument("--configs", default="gn-hawk,gn-hawk@direct,gg-direct",
                   help="gn-hawk (auto landing mode), gn-hawk@staging, gn-hawk@direct, gg-direct")
    p.add_argument("--blocks", default="same,fresh", help="same: one request's blocks every repeat; fresh: new ids each repeat")
    p.add_argument("--transport", default="local", help="local (one process; what cuda-ipc does per pair) or auto")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--large-repeats", type=int, default=10, help="repeats for token counts above --large")
    p.add_argument("--large", type=int, default=4096)
    p.add_argument("--profile-repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--gpu-block", type=int, default=16)
    p.add_argument("--npu-block", type=int, default=64)
    p.add_argument("--kv-dtype", default="bf16", help="NPU cache dtype: bf16 or bfp8_b")
    p.add_argument("--arch", default="blackhole-p150a")
    p.add_argument("--transform-impl", default="auto")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--step-top", type=int, default=6, help="per-step tottime entries printed (all go to the JSON)")
    p.add_argument("--budget-s", type=float, default=85.0, help="skip what is left after this many seconds")
    p.add_argument("--stub-triton", action="store_true", help="CPU only: no-op Triton kernels (host path of transform_triton)")
    p.add_argument("--no-verify", action="store_true", help="skip the per-case check that the KV landed byte-exact")
    p.add_argument("--json", default="")
    a = p.parse_args()
    t_start = time.perf_counter()
    if a.stub_triton:
        if a.device != "cpu":
            raise SystemExit("--stub-triton is for --device cpu only")
        stub_triton()
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    tokens = [int(x) for x in a.tokens.split(",") if x]
    configs = [c for c in a.configs.split(",") if c]
    kinds = [k for k in a.blocks.split(",") if k]
    pool_extra = max(a.warmup + a.repeats + a.profile_repeats, a.warmup + a.large_repeats + a.profile_repeats) + 2
    w = World(a, max(tokens), pool_extra)
    recs: list[dict[str, Any]] = []
    fast = FastCopyCounter()
    meta = {"device": str(w.dev), "gpu": torch.cuda.get_device_name(w.dev) if w.dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": _triton_version(), "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "kv_dtype": a.kv_dtype,
            "transport": a.transport, "stub_triton": a.stub_triton, "setup_s": 0.0,
            "env": {k: v for k, v in os.environ.items() if k.startswith("HAWK_")}}  # fmt: skip
    meta["setup_s"] = round(time.perf_counter() - t_start, 2)
    print(f"setup {meta['setup_s']} s on {meta['gpu']} ({w.dev}); {a.layers} layers x {a.kv_heads} heads x {a.head_dim}, "
          f"{w.gpu.bytes_per_token() / 1024:.0f} KiB/token")  # fmt: skip
    try:
        for ntok in tokens:
            for config in configs:
                base, _, mode = config.partition("@")
                for kind in kinds:
                    el = time.perf_counter() - t_start
                    if el > a.budget_s:
                        recs.append({"config": base, "mode": mode or "auto", "tokens": ntok, "blocks": kind, "error": f"skipped: {el:.0f} s budget used"})
                        continue
                    big = ntok > a.large
                    reps = a.large_repeats if big else a.repeats
                    prof = min(a.profile_repeats, 5) if big else a.profile_repeats
                    t0 = time.perf_counter()
                    try:
                        r = run_case(w, base, mode or "auto", ntok, kind, reps, prof, a.warmup, a.top, a.transport, fast,
                                     not (a.no_verify or a.stub_triton))  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
                        traceback.print_exc()
                        r = {"config": base, "mode": mode or "auto", "tokens": ntok, "blocks": kind, "error": f"{type(e).__name__}: {e}"}
                    r["wall_s"] = round(time.perf_counter() - t0, 2)
                    recs.append(r)
                    if "steps_us" in r:
                        print(f"  {config:<16} {kind:<5} {ntok:>6} tok: host {r['host_us']:.0f} us, total {r['total_us']:.0f} us "
                              f"({r.get('descs')} descs, mode {r.get('mode_used', r.get('mode'))}, same-GPU copy path "
                              f"{r['same_gpu_copy_path']}, landed exactly: {r.get('landed_exactly')}, {r['wall_s']} s)",
                              flush=True)  # fmt: skip
    finally:
        w.close()
    print_case_table(recs)
    print_profiles(recs, a.top, a.step_top)
    meta["wall_s"] = round(time.perf_counter() - t_start, 2)
    print(f"\nwall {meta['wall_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "cases": recs}, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
