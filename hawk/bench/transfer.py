"""``hawk bench transfer``: KV-transfer latency of the five configurations (the paper's Fig. 9).

Two processes, as in serving: a prefill process holding a paged KV cache (Llama-3.1-70B TP4 rank
shape: 80 layers, 2 KV heads, head_dim 128) and the decode process running this driver. Latency
is measured as the paper does: from the decode side's request (D1) until the KV is stored in its
KV-cache pool (after D7). Before each pull the driver tells the prefill process which blocks hold
the request's KV, as a finished prefill would. All configurations are set up at once and timed in
rounds per size (one pull of each per round, the first rotating): their ratios compare like with like.

Every record also carries a same-run reference: ``copy_ms``, the median time of one plain device copy
of the same bytes from the prefill's memory device to the decode's (``copy_path``), measured in this
process, and ``x_copy`` / ``transfer_x_copy`` (the pull's and its transfer step's multiple of it).
With ``--transport auto`` each record names the engine(s) that carried its batches (``engine``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from hawk.layouts.device import parse_device
from hawk.layouts.gpu import GpuKVLayout

MiB = 1 << 20
DEFAULT_SIZES_MB = (10, 20, 40, 80, 160, 320, 640, 1280)
DEFAULT_CONFIGS = ("gg-host", "gn-host", "gg-direct", "gn-direct-single", "gn-hawk")


@dataclass(frozen=True)
class ModelShape:
    """The per-rank KV shape transfers are sized in (default: Llama-3.1-70B at TP4)."""

    layers: int = 80
    kv_heads: int = 2
    head_dim: int = 128
    gpu_block: int = 16
    npu_block: int = 64

    def bytes_per_token(self, elem: int = 2) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * elem


@dataclass
class BenchSpec:
    sizes_mb: tuple[int, ...] = DEFAULT_SIZES_MB
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    transport: str = "nixl"
    repeats: int = 5
    warmup: int = 1
    prefill_device: str = "cpu"
    npu_device: str = "npu-emu:cpu"
    gpu_decode_device: str = "cpu"
    arch: str = "blackhole-p150a"
    kv_dtype: str = "bf16"
    post: str = "pull"
    shape: ModelShape = field(default_factory=ModelShape)
    shuffle_blocks: bool = False
    transform_impl: str = "auto"
    shard_pages: int = 1  # the NPU cache's page map (1 = interleaved)
    plan_ahead: bool = True  # the decode side plans while D1 is in flight (the prompt length is known)
    copy_ref: bool = True  # time a plain device copy of the same bytes per (configuration, size)

    def tokens(self, size_mb: int) -> int:
        return max(1, size_mb * MiB // self.shape.bytes_per_token())

    @property
    def max_tokens(self) -> int:
        return max(self.tokens(s) for s in self.sizes_mb)

    def gpu_layout(self) -> GpuKVLayout:
        s = self.shape
        blocks = -(-self.max_tokens // s.gpu_block) + 1
        return GpuKVLayout(s.layers, blocks, s.gpu_block, s.kv_heads, s.head_dim, "bf16")


def split_config(name: str) -> tuple[str, str]:
    """``gn-hawk@direct`` -> (``gn-hawk``, ``direct``): a configuration with a forced landing mode."""
    base, _, mode = name.partition("@")
    return base, mode or "auto"


# -- the prefill process -----------------------------------------------------------------------


def _npu_source(spec: BenchSpec, device: str) -> Any:
    """Reverse direction: an emulated NPU (memory on ``device``) whose KV cache is full of random tiles."""
    from hawk.devices.emulated import open_npu
    from hawk.layouts.npu import NpuKVLayout, get_arch
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory

    s = spec.shape
    blocks = -(-spec.max_tokens // s.npu_block) + 1
    probe = NpuKVLayout(get_arch(spec.arch), s.layers, blocks, s.kv_heads, s.npu_block, s.head_dim, spec.kv_dtype, shard_pages=spec.shard_pages)
    send = spec.max_tokens * s.bytes_per_token() + 4 * MiB
    per_bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + -(-send // probe.arch.num_banks)
    npu = open_npu(f"npu-emu:{device}", spec.arch, bank_capacity=-(-int(per_bank * 1.25 + 8 * MiB) // MiB) * MiB)
    kv = NpuKVCacheMemory(npu, NpuKVLayout(npu.arch, s.layers, blocks, s.kv_heads, s.npu_block, s.head_dim, spec.kv_dtype, shard_pages=spec.shard_pages))
    gen = torch.Generator(device=npu.torch_device).manual_seed(0)
    npu.memory.random_(0, 64, generator=gen)  # bytes < 64: finite bf16 / bfloat8_b values in every page
    return kv


def _prefill_main(conn: Any, spec: BenchSpec) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from hawk.connector.configs import get_config, make_npu_sender, make_sender
    from hawk.transport.registry import make_transport

    layout = spec.gpu_layout()
    dev = torch.device(spec.prefill_device)
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = []
    for _ in range(layout.num_layers):
        c = torch.empty(layout.layer_shape, dtype=torch.float32, device=dev).uniform_(-2, 2, generator=gen)
        caches.append(c.to(layout.torch_dtype))
    staging = spec.max_tokens * spec.shape.bytes_per_token() + 4 * MiB
    senders: dict[str, tuple[Any, Any]] = {}  # configuration -> (sender, its transport)
    npu_kv = None
    try:
        conn.send(("ready", None))
        while True:
            cmd, *args = conn.recv()
            if cmd == "config":  # this configuration's sender (the benchmark holds every one at once)
                name = args[0]
                if name not in senders:
                    transport = make_transport(spec.transport)
                    config = split_config(name)[0]
                    if get_config(config).prefill_on == "npu":
                        npu_kv = npu_kv or _npu_source(spec, spec.prefill_device)
                        senders[name] = (make_npu_sender(config, transport, npu_kv, staging), transport)
                    else:
                        senders[name] = (make_sender(config, transport, caches, layout, staging, spec.transform_impl), transport)
                conn.send(("ok", senders[name][0].address))
            elif cmd == "add":
                name, rid, ntok, blocks = args
                senders[name][0].add(rid, ntok, blocks)
                conn.send(("ok", None))
            elif cmd == "engines":  # batches this side posted, by engine (auto; push mode posts here)
                conn.send(("ok", _engine_batches(senders[args[0]][1])))
            elif cmd == "accounting":
                a = senders[args[0]][0].accounting()
                conn.send(("ok", {k: (len(v) if isinstance(v, list) else v) for k, v in a.items()}))
            elif cmd == "stop":
                break
    finally:
        for sender, transport in senders.values():
            sender.close()
            transport.close()
        conn.send(("bye", None))


class PrefillProcess:
    """The prefill side of the benchmark, in its own process, driven over a pipe."""

    def __init__(self, spec: BenchSpec):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_main, args=(child, spec), daemon=True)
        self.proc.start()
        self._call_expect("ready", timeout=600)

    def _call_expect(self, want: str, timeout: float = 120) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"prefill process did not answer within {timeout} s")
        tag, val = self.conn.recv()
        if tag != want:
            raise RuntimeError(f"prefill process answered {tag!r}")
        return val

    def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self._call_expect("ok")

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self._call_expect("bye", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


# -- the decode side (this process) -------------------------------------------------------------


def _decode_side(spec: BenchSpec, config: str, mode: str) -> tuple[Any, Any]:
    """Build what the decode instance of ``config`` receives into; returns (side, cleanup)."""
    from hawk.connector.configs import GpuSide, NpuSide, get_config
    from hawk.devices.emulated import open_npu
    from hawk.layouts.npu import NpuKVLayout, get_arch
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory
    s = spec.shape
    rx = spec.max_tokens * s.bytes_per_token() + 4 * MiB
    if get_config(config).decode_on == "gpu":
        layout = spec.gpu_layout()
        caches = layout.allocate(spec.gpu_decode_device)
        return GpuSide(caches, layout, rx), None
    blocks = -(-spec.max_tokens // s.npu_block) + 1
    arch0 = get_arch(spec.arch)
    probe = NpuKVLayout(arch0, s.layers, blocks, s.kv_heads, s.npu_block, s.head_dim, spec.kv_dtype, shard_pages=spec.shard_pages)
    one_bank = get_config(config).rx_in_one_bank
    per_bank = probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + -(-rx // arch0.num_banks) * (2 if one_bank else 1)
    bank = -(-int(per_bank * 1.25 + 8 * MiB) // (64 * 1024)) * 64 * 1024
    if one_bank:  # the single buffer must fit in one bank
        bank = max(bank, rx + probe.num_tensors * probe.tensor_buffer(0).bytes_per_bank + 8 * MiB)
    npu = open_npu(spec.npu_device, spec.arch, bank_capacity=bank)
    layout = NpuKVLayout(npu.arch, s.layers, blocks, s.kv_heads, s.npu_block, s.head_dim, spec.kv_dtype, shard_pages=spec.shard_pages)
    kv = NpuKVCacheMemory(npu, layout)
    memory = parse_device(spec.npu_device).memory_kind
    return NpuSide(npu, kv, rx, _cost_model(spec.transport, memory), mode), kv


def _cost_model(transport: str, memory: str) -> Any:
    """The landing's cost model; for "auto" (until plan/cost_model.py has its own figures) the engine
    auto picks for the benchmark's same-host prefill process: cuda-ipc for CUDA memory, else nixl."""
    from hawk.plan.cost_model import cost_model_for

    if transport == "auto":
        try:
            return cost_model_for("auto", memory)
        except ValueError:
            transport = "cuda-ipc" if memory.startswith("cuda") else "nixl"
    return cost_model_for(transport, memory)


def _engine_batches(transport: Any) -> dict[str, int]:
    """Batches by the engine that carried them (auto), or all under the transport's own name."""
    f = getattr(transport, "batches_by_engine", None)
    return dict(f()) if f is not None else {transport.name: transport.stats()["batches"]}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def _sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def device_copy_ms(nbytes: int, src: str, dst: str, repeats: int, warmup: int = 1) -> float:
    """Median ms of one plain ``copy_`` of ``nbytes`` from a buffer on ``src`` to one on ``dst``: the
    reference a transfer between those memories is held against (issue 9: "<= 2x a device copy")."""
    sd, dd = torch.device(src), torch.device(dst)
    a = torch.ones(nbytes, dtype=torch.uint8, device=sd)
    b = torch.zeros(nbytes, dtype=torch.uint8, device=dd)  # both touched: no first-use page faults timed
    times = []
    try:
        for i in range(warmup + max(1, repeats)):
            _sync(sd, dd)
            t0 = time.perf_counter()
            b.copy_(a)
            _sync(sd, dd)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        del a, b
        if torch.cuda.is_available() and "cuda" in (sd.type, dd.type):
            torch.cuda.empty_cache()
    return statistics.median(times) * 1e3


def _blocks(n: int, shuffle: bool, seed: int) -> list[int]:
    ids = list(range(n))
    if shuffle:
        g = torch.Generator().manual_seed(seed)
        ids = [ids[i] for i in torch.randperm(n, generator=g).tolist()]
    return ids


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


@dataclass
class _Decode:
    """One configuration's decode side in the benchmark: its receiver and what it receives into."""

    name: str
    cfg: Any
    address: str
    transport: Any
    receiver: Any
    kv: Any

    def close(self) -> None:
        self.receiver.close()
        self.transport.close()
        if self.kv is not None:
            self.kv.close()


def run_transfer_bench(spec: BenchSpec, progress: Any = None) -> list[dict[str, Any]]:
    """Measure every (configuration, size); returns one record per pair.

    Every configuration is set up at once and, per size, timed in rounds: one transfer of each per
    round, the first rotating (as ``hawk bench engine`` times its paths), so that a drift of the
    machine during the run reaches every configuration alike and their ratios compare like with like."""
    from hawk.connector.configs import get_config, make_receiver
    from hawk.transport.registry import make_transport

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    records: list[dict[str, Any]] = []
    copies: dict[tuple[int, str, str], float] = {}
    prefill = PrefillProcess(spec)
    decodes: list[_Decode] = []
    try:
        for name in spec.configs:
            config, mode = split_config(name)
            address = prefill.call("config", name)
            side, kv = _decode_side(spec, config, mode)
            transport = make_transport(spec.transport)
            receiver = make_receiver(config, transport, side, post=spec.post, timeout_s=120)
            decodes.append(_Decode(name, get_config(config), address, transport, receiver, kv))
        for size in spec.sizes_mb:
            records += _time_size(spec, prefill, decodes, size, copies, progress)
        time.sleep(0.05)  # accounting after the run: nothing may be left reserved on either side
        for d in decodes:
            acct = d.receiver.accounting()
            pre = prefill.call("accounting", d.name)
            if acct["reservations"] or pre["staging"] or pre["in_flight"]:
                raise RuntimeError(f"{d.name}: reservations leaked: decode {acct}, prefill {pre}")
    finally:
        for d in decodes:
            d.close()
        prefill.close()
    return records


def _time_size(spec: BenchSpec, prefill: PrefillProcess, decodes: list[_Decode], size: int,
               copies: dict[tuple[int, str, str], float], progress: Any) -> list[dict[str, Any]]:
    """Every configuration's transfers of ``size`` MiB, in rounds; one record each."""
    ntok = spec.tokens(size)
    blocks: dict[str, tuple[list[int], list[int]]] = {}
    for d in decodes:
        sblock = spec.shape.npu_block if d.cfg.prefill_on == "npu" else spec.shape.gpu_block
        nblock = spec.shape.npu_block if d.cfg.decode_on == "npu" else spec.shape.gpu_block
        blocks[d.name] = (_blocks(-(-ntok // sblock), spec.shuffle_blocks, size),
                          _blocks(-(-ntok // nblock), spec.shuffle_blocks, size + 1))
    lat: dict[str, list[float]] = {d.name: [] for d in decodes}
    parts: dict[str, list[dict[str, float]]] = {d.name: [] for d in decodes}
    last: dict[str, Any] = {}
    before = {d.name: (_engine_batches(d.transport), prefill.call("engines", d.name)) for d in decodes}
    for i in range(spec.warmup + spec.repeats):
        for d in decodes[i % len(decodes):] + decodes[: i % len(decodes)]:
            gblocks, dblocks = blocks[d.name]
            rid = f"{d.name}-{size}-{i}-{uuid.uuid4().hex[:6]}"
            prefill.call("add", d.name, rid, ntok, gblocks)
            t0 = time.perf_counter()
            last[d.name] = d.receiver.pull(d.address, rid, dblocks, num_tokens=ntok if spec.plan_ahead else None)
            dt = time.perf_counter() - t0
            if i >= spec.warmup:
                lat[d.name].append(dt)
                parts[d.name].append(last[d.name].timings)
            if progress is not None:
                progress()
    out = []
    for d in decodes:
        used = {"decode": _delta(_engine_batches(d.transport), before[d.name][0]),
                "prefill": _delta(prefill.call("engines", d.name), before[d.name][1])}  # fmt: skip
        out.append(_record(spec, d, size, ntok, lat[d.name], parts[d.name], last[d.name], used, copies))
    return out


def _record(spec: BenchSpec, d: _Decode, size: int, ntok: int, lat: list[float], parts: list[dict[str, float]],
            last: Any, used: dict[str, dict[str, int]], copies: dict[tuple[int, str, str], float]) -> dict[str, Any]:
    """One (configuration, size) record: medians, spread, the host breakdown and a same-run device copy."""
    cfg = d.cfg
    src = spec.prefill_device
    dst = parse_device(spec.npu_device if cfg.decode_on == "npu" else spec.gpu_decode_device).torch_device
    key = (last.bytes, src, dst)
    if spec.copy_ref and key not in copies:
        copies[key] = device_copy_ms(last.bytes, src, dst, spec.repeats)
    copy_ms = copies.get(key)
    median_ms = statistics.median(lat) * 1e3
    transfer_ms = statistics.median(p["transfer_s"] for p in parts) * 1e3
    return {
        "config": d.name,
        "transport": spec.transport,
        "engine": "+".join(sorted(set(used["decode"]) | set(used["prefill"]))) or spec.transport,
        "engine_batches": used,
        "size_mb": size,
        "tokens": ntok,
        "median_ms": median_ms,
        "p90_ms": _pct(lat, 0.9) * 1e3,
        "iqr_ms": [_pct(lat, 0.25) * 1e3, _pct(lat, 0.75) * 1e3],  # the spread issue 9 asks beside the median
        "min_ms": min(lat) * 1e3,
        "requests": last.requests,
        "bytes_moved": last.bytes,
        "mode": last.mode,
        "ready_ms": statistics.median(p["ready_s"] for p in parts) * 1e3,
        "pair_ms": statistics.median(p["pair_s"] for p in parts) * 1e3,
        "transfer_ms": transfer_ms,
        "copy_ms": copy_ms,
        "copy_path": f"{src} -> {dst}",
        "x_copy": median_ms / copy_ms if copy_ms else None,
        "transfer_x_copy": transfer_ms / copy_ms if copy_ms else None,
        "finish_ms": statistics.median(p["finish_s"] for p in parts) * 1e3,
        "host_breakdown_ms": host_breakdown(parts),
        "host_ms": host_ms(host_breakdown(parts)),
        "prefill_device": f"npu-emu:{spec.prefill_device}" if cfg.prefill_on == "npu" else spec.prefill_device,
        "decode_device": spec.npu_device if cfg.decode_on == "npu" else spec.gpu_decode_device,
        "npu": f"emulated {spec.arch}" if "npu" in (cfg.decode_on, cfg.prefill_on) else "",
        "kv_dtype": spec.kv_dtype if cfg.decode_on == "npu" else "bf16",
        "post": spec.post,
        "repeats": spec.repeats,
        "interleaved": len(spec.configs),  # configurations timed in rounds (one transfer of each per round)
    }


#: Breakdown entries that are not host work: the bytes moving (on the wire, or through the transform
#: kernel and the landing's device copy), which a faster link or device shortens, not the host.
NOT_HOST = ("submit_s", "transfer_wait_s", "sender_transform_wait_s", "total_s")


def host_breakdown(parts: list[dict[str, float]]) -> dict[str, float]:
    """Median ms of every breakdown step over the repeats (the ``BREAKDOWN`` order)."""
    from hawk.connector.algorithm1 import BREAKDOWN

    return {k[:-2]: statistics.median(p.get(k, 0.0) for p in parts) * 1e3 for k in BREAKDOWN}


def host_ms(breakdown: dict[str, float]) -> float:
    """The host's fixed work of one transfer: every step but the ones that move bytes (``NOT_HOST``) and
    the landing's finish (D7: a device copy). On the CPU the transform launch *is* the transform, and
    UCX over loopback copies while posting, so ``submit`` is counted with the wire here (on a GPU it
    is posting only; read it from the breakdown)."""
    skip = {k[:-2] for k in NOT_HOST} | {"finish", "sender_transform"}
    return sum(v for k, v in breakdown.items() if k not in skip)


#: Columns per printed table beside the (config, size) lead: a table stays readable in 80-100
#: columns, piped or in a terminal (the JSON has every number in one record).
COLUMNS_PER_TABLE = 5


def _print_tables(title: str, head: list[str], rows: list[list[str]], lead: int = 2, left: tuple[str, ...] = ("config", "mode", "engine")) -> None:
    """``rows`` as tables of at most ``COLUMNS_PER_TABLE`` columns after the first ``lead`` (repeated
    in each), at the console's width: a terminal's, or 80 when piped."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    rest = list(range(lead, len(head)))
    groups = [rest[k:k + COLUMNS_PER_TABLE] for k in range(0, len(rest), COLUMNS_PER_TABLE)]
    for n, group in enumerate(groups):
        cols = list(range(lead)) + group
        t = Table(title=f"{title} ({n + 1}/{len(groups)})" if len(groups) > 1 else title, box=box.SIMPLE_HEAD)
        for c in cols:
            t.add_column(head[c], justify="left" if head[c] in left else "right", no_wrap=True)
        for row in rows:
            t.add_row(*(row[c] for c in cols))
        con.print(t)


def print_breakdown(records: list[dict[str, Any]]) -> None:
    """The host-side breakdown, one row per (configuration, size): where the median pull's ms went."""
    keys = [k for k in records[0]["host_breakdown_ms"]] if records and "host_breakdown_ms" in records[0] else []
    if not keys:
        return
    head = ["config", "MiB", *(k.replace("sender_", "tx_").replace("transform", "xf") for k in keys), "host"]
    rows = [[r["config"], str(r["size_mb"]), *(f"{r['host_breakdown_ms'][k]:.2f}" for k in keys), f"{r['host_ms']:.2f}"] for r in records]
    _print_tables("host-side breakdown per transfer (median ms; tx_* run inside the D1-D2 round trip)", head, rows)


def print_table(records: list[dict[str, Any]]) -> None:
    def num(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    head = ["config", "size_mb", "median_ms", "p90_ms", "requests", "mode", "engine", "ready_ms", "pair_ms", "transfer_ms",
            "finish_ms", "copy_ms", "x_copy", "transfer_x_copy"]  # fmt: skip
    rows = [
        [
            r["config"], str(r["size_mb"]), f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}", str(r["requests"]), r["mode"],
            r.get("engine", r.get("transport", "")), f"{r['ready_ms']:.2f}", f"{r['pair_ms']:.2f}", f"{r['transfer_ms']:.2f}",
            f"{r['finish_ms']:.2f}", num(r.get("copy_ms"), ".3f"), num(r.get("x_copy")), num(r.get("transfer_x_copy")),
        ]
        for r in records
    ]
    _print_tables("KV transfer latency (decode request -> KV in cache pool); copy = one device copy of the same bytes", head, rows)
    print_breakdown(records)


def plot(records: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in records):
        rs = [r for r in records if r["config"] == name]
        ax.plot([r["size_mb"] for r in rs], [r["median_ms"] for r in rs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV cache size per transfer (MiB)")
    ax.set_ylabel("latency, median (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def save_json(records: list[dict[str, Any]], path: str) -> None:
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
