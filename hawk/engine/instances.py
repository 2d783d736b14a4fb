"""Whole instances, assembled: a prefill instance (model + paged GPU cache + HAWK sender), a decode
instance (model + NPU or GPU cache + HAWK receiver), and the colocated reference (no transfer).

These are what the servers wrap and what tests and benchmarks drive directly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from hawk.connector.algorithm1 import KVTransferFailed, PullResult
from hawk.devices.timing import engine_step_model, timing_label
from hawk.engine import capacity
from hawk.engine.block_manager import BlockManager
from hawk.engine.decode_engine import MIXED_PREFILL_SEQS, DecodeEngine, LocalKV, RemoteKV
from hawk.engine.loader import LoadedModel, load_model
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.prefill_engine import PrefillEngine
from hawk.engine.ranks import DecodeRank, InstanceConfig, PrefillRank, compute_dtype, decode_len, gpu_layout, held, ledger
from hawk.engine.step_threads import StepThreads
from hawk.engine.tensor_parallel import Shard, kv_request_id, overlapping_ranks
from hawk.engine.tp_ranks import Followers, record_slices
from hawk.engine.transfer_buffers import MiB, buffer_mb, check_kv_fits, kv_limits
from hawk.engine.vllm_cpu_kernel import in_place_layout

log = logging.getLogger(__name__)


def _npu_step_time(cfg: InstanceConfig, loaded: LoadedModel, on_npu: bool) -> Any:
    """``--npu-timing``: the modelled decode step (timing emulation), only for decode on the NPU."""
    label = timing_label(cfg.npu_timing if on_npu else None, cfg.link_gbps)
    if label:
        log.warning("timing emulation on: %s (times are modelled, not measured on that hardware)", label)
    if not (cfg.npu_timing and on_npu):
        return None
    mc = loaded.config
    params = sum(p.numel() for p in loaded.model.parameters())
    model = engine_step_model(cfg.npu_timing, params, mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.kv_dtype)
    log.warning("decode step paced to %s", model.source)
    return model.step_time


def _with_pids(ranks: dict[int, Any], pids: dict[int, int]) -> dict[int, Any]:
    """Each follower's ledger with its process id (what an operator signals, or a fault test kills)."""
    return {r: {**a, "pid": pids.get(r)} for r, a in ranks.items()}


class _CountedRelease:
    """Frees a request's prefill blocks once every (sender rank, decode rank) entry let go of them."""

    def __init__(self, count: int, free: Any):
        self.count, self.free = count, free
        self._lock = threading.Lock()

    def one(self) -> None:
        with self._lock:
            self.count -= 1
            done = self.count == 0
        if done:
            self.free()


class _FollowedRanks:
    """What prefill and decode instances share about their follower ranks (tensor parallelism;
    none at TP1): health, accounting, and closing engine, followers and rank 0 in that order."""

    followers: Followers | None
    engine: Any
    rank: Any

    def _with_ranks(self, out: dict[str, Any]) -> dict[str, Any]:
        """``out`` (rank 0's accounting) plus the followers' ledgers and health."""
        if self.followers is not None:
            out["ranks"] = _with_pids(self.followers.accounting(), self.followers.pids)
            out["healthy"] = self.followers.healthy
        return out

    def close(self) -> None:
        self.engine.close()
        if self.followers is not None:
            self.followers.close()
        self.rank.close()

    @property
    def healthy(self) -> bool:
        return self.followers is None or self.followers.healthy

    @property
    def dead_ranks(self) -> list[int]:
        """Follower ranks whose process is gone (none at TP1)."""
        return self.followers.dead if self.followers is not None else []

    @property
    def rank_pids(self) -> dict[int, int]:
        """The follower ranks' process ids (none at TP1; rank 0 is this process)."""
        return self.followers.pids if self.followers is not None else {}


def prefill_graph_tokens(cfg: InstanceConfig) -> int:
    """The prefill engine's graph size limit: none under ``--no-graphs`` or prefill TP (rank 0's step
    hook tells the followers each step, and the followers run eagerly)."""
    return 0 if cfg.graphs is False or cfg.prefill_tp > 1 else cfg.prefill_graph_tokens


class PrefillInstance(_FollowedRanks):
    """The GPU role: batched prefill into a vLLM-layout paged cache, KV offered through HAWK's sender.

    With ``prefill_tp`` N > 1, rank 0 lives here and ranks 1..N-1 are processes (tp_ranks.py):
    rank 0's engine schedules, each forward is broadcast to the other ranks, and every rank offers
    its heads' KV from its own sender; ``kv_address`` lists the ranks' addresses, comma-separated.
    """

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        if cfg.transfer == "colocated":
            raise ValueError("colocated mode has no separate prefill instance (use ColocatedInstance)")
        self.cfg = cfg.validate()
        tp = cfg.prefill_tp
        # Before the followers start: a rank that dies while the others load calls _on_rank_dead.
        self._lock = threading.Lock()
        self._owed: dict[int, dict[str, _CountedRelease]] = {r: {} for r in range(1, tp)}
        self.followers = Followers("prefill", cfg, tp, self._on_notice, self._on_rank_dead) if tp > 1 else None
        try:
            if tp > 1 and loaded is not None and not loaded.model.shard.parallel:
                loaded = None  # a whole model given for a sharded instance: load rank 0's slices
            self.rank = PrefillRank(cfg, Shard(0, tp), loaded)
        except BaseException:
            if self.followers is not None:
                self.followers.close()
            raise
        self.capacity = self.rank.capacity
        self.loaded, self.layout, self.caches = self.rank.loaded, self.rank.layout, self.rank.caches
        self.transport, self.sender = self.rank.transport, self.rank.sender
        layer_push = self.sender.begin_push if cfg.kv_flow == "layerwise" else None
        self.engine = PrefillEngine(
            self.loaded.model, self.layout, self.caches, self._handoff, max_prefill_chunk=cfg.max_prefill_chunk, layer_push=layer_push,
            graph_tokens=prefill_graph_tokens(cfg),
        )
        self.engine.runner.warmup_prefill()  # one-prompt prefill graphs before traffic (none on a CPU)
        # A prompt whose KV can never fit this rank's staging, or (by this config) the decode's receive
        # buffers, is refused before prefill (the engine's limit is also what the router checks against).
        mc = self.loaded.config
        buffers = {"staging": self.rank.staging_bytes, "rx": buffer_mb(cfg, mc, "rx") * MiB}
        try:
            self.kv_limits = kv_limits(cfg, mc, buffers, self.engine.max_prompt_tokens)
        except BaseException:
            self.close()
            raise
        self.engine.max_prompt_tokens = min([self.engine.max_prompt_tokens, *(lim.tokens for lim in self.kv_limits)])
        if self.followers is not None:
            self.loaded.model.set_group(self.followers.group.all_reduce)
            slices = record_slices(self.engine.runner.attn)
            self.loaded.model.step_hook = lambda ids, pos: self.followers.step(ids, pos, slices[0])  # type: ignore[union-attr]

    @property
    def kv_address(self) -> str:
        extra = self.followers.addresses if self.followers is not None else []
        return ",".join([self.sender.address, *extra])

    def check_prompt(self, num_tokens: int) -> None:
        """Raise :class:`PromptTooLong`, saying which buffer, for a prompt whose KV can never be sent."""
        check_kv_fits(self.cfg, self.loaded.config, self.kv_limits, num_tokens)

    def discard(self, request_id: str) -> bool:
        """Drop a prefilled request nobody will pull, on every rank (with ``decode_tp`` > 1 its
        entries are named per decode rank, so the sender's own ``discard(request_id)`` misses them)."""
        mine = [self.sender.discard(k) for k in self.rank.kv_ids(request_id)]
        if self.followers is not None:
            for r in self.followers.ranks:
                self.followers.call_async(r, "discard", [request_id])  # a dead rank's share is counted down by _on_rank_dead
        return any(mine)

    def drained(self) -> bool:
        """Nothing held on rank 0 or on a live follower: no staging, no KV waiting or in flight,
        no paged block (what a dying instance waits for before it exits, so its release is seen)."""
        a = self.accounting()
        ranks = [r for r in a.get("ranks", {}).values() if not r.get("dead")]
        return _prefill_empty(a) and a["gpu_blocks_used"] == 0 and all(_prefill_empty(r) for r in ranks)

    def _handoff(self, request_id: str, num_tokens: int, blocks: list[int], free: Any) -> None:
        """Offer the request's KV on every rank; the blocks return when all entries released them."""
        tp, mc = self.cfg.prefill_tp, self.loaded.config
        per_rank = {p: overlapping_ranks(Shard(p, tp).kv_heads(mc.num_kv_heads), mc.num_kv_heads, self.cfg.decode_tp) for p in range(tp)}
        release = _CountedRelease(sum(map(len, per_rank.values())), free)
        if self.followers is not None:
            for p in range(1, tp):
                with self._lock:
                    for j in per_rank[p]:
                        self._owed[p][kv_request_id(request_id, j, self.cfg.decode_tp)] = release
                self.followers.call(p, "add", request_id, num_tokens, list(blocks))
        for kv_id in self.rank.kv_ids(request_id):
            self.sender.add(kv_id, num_tokens, blocks, release.one)

    def _on_notice(self, rank: int, kind: str, payload: Any) -> None:
        """A follower released one (request, decode rank) entry: count it down."""
        if kind == "released":
            with self._lock:
                release = self._owed[rank].pop(payload, None)
            if release is not None:
                release.one()

    def _on_rank_dead(self, rank: int) -> None:
        """What a dead rank held is gone with it: its share of every request's blocks comes back.

        Every waiting entry on the surviving ranks is dropped too: a request needs the heads of
        every prefill rank, so none of them can be completed, and a decode that pulls one gets a
        prompt "unknown KV" error instead of waiting on the dead rank's socket.
        """
        with self._lock:
            owed = list(self._owed[rank].values())
            self._owed[rank].clear()
        for release in owed:
            release.one()
        if not hasattr(self, "sender"):
            return  # died while rank 0 was still loading: the constructor fails with RankDied
        for kv_id in self.sender.accounting()["waiting"]:
            self.sender.discard(kv_id)
        if self.followers is not None:
            for r in self.followers.ranks:
                if r != rank:
                    self.followers.call_async(r, "discard", None)

    def accounting(self) -> dict[str, Any]:
        a = self.sender.accounting()
        out = {
            "staging_reservations": len(a["staging"]),
            "staging_bytes": sum(r.size for r in a["staging"]),
            "staging_held": held(a["staging"]),
            "kv_waiting": a["waiting"],
            "kv_staging_queue": a["staging_queue"],
            "kv_in_flight": a["in_flight"],
            "kv_pushes": a.get("pushes", []),
            "draining": a["draining"],
            "gpu_blocks_used": self.engine.blocks.num_blocks - self.engine.blocks.num_free,
            "gpu_blocks_total": self.engine.blocks.num_blocks,
        }
        return self._with_ranks(out)


def _prefill_empty(a: dict[str, Any]) -> bool:
    """A prefill rank's ledger holds nothing (staging, waiting, in flight, draining)."""
    return (a["staging_reservations"] == 0 and not a["kv_waiting"] and not a.get("kv_staging_queue") and not a["kv_in_flight"]
            and not a.get("kv_pushes") and a["draining"] == 0)


class TPReceiver:
    """What the decode engine pulls through (``RemoteKV``): every rank's pairs, run at once.

    Rank 0 asks the other ranks to pull their parts and pulls its own; the request's KV is in
    place when all have landed. A rank that fails or dies fails the request (its reservations
    are released by Algorithm 1 on every surviving rank; the un-pulled prefill entries expire).
    """

    def __init__(self, rank: DecodeRank, followers: Followers | None):
        self.rank, self.followers = rank, followers

    def pull(self, address: str, request_id: str, block_ids: list[int], num_tokens: int | None = None) -> PullResult:
        t0 = time.perf_counter()
        others = [self.followers.call_async(r, "pull", address, request_id, list(block_ids)) for r in self.followers.ranks] if self.followers else []
        errors: list[str] = []
        try:
            results = self.rank.pull_pairs(address, request_id, list(block_ids), num_tokens)
        except KVTransferFailed as e:
            results, errors = [], [str(e)]
        for fut in others:
            try:
                r = fut.result(self.rank.receiver.timeout_s * 2)
                results += [PullResult(request_id, x["num_tokens"], x["bytes"], x["requests"], x["mode"], {}) for x in r]
            except Exception as e:  # noqa: BLE001 - a dead or failing rank fails the request
                errors.append(str(e) or type(e).__name__)
        if errors:
            raise KVTransferFailed("; ".join(errors))
        total = time.perf_counter() - t0
        modes = sorted({r.mode for r in results})
        timings = {"total_s": total}
        if len(results) == 1 and "total_s" in results[0].timings:  # one pull: its steps, and the handshake before it
            timings = {**results[0].timings, "connect_s": max(0.0, total - results[0].timings["total_s"]), "total_s": total}
        return PullResult(request_id, results[0].num_tokens, sum(r.bytes for r in results), sum(r.requests for r in results), ",".join(modes), timings)

    @property
    def timeout_s(self) -> float:
        return self.rank.receiver.timeout_s

    def push_to(self, address: str, request_id: str, block_ids: list[int], num_tokens: int, on_handed: Any = None) -> PullResult:
        """The layer-wise flow (kv_flow=layerwise): one rank, one prefill (validate refuses TP)."""
        if self.followers is not None or "," in address:
            raise KVTransferFailed(f"request {request_id}: layer-wise push needs decode_tp 1 and prefill_tp 1")
        return self.rank.receiver.push_to(address, request_id, block_ids, num_tokens, on_handed=on_handed)

    def cancel_push(self, address: str, request_id: str, why: str) -> bool:
        """Stop a layer-wise push this rank waits for (its request was aborted or the engine closes)."""
        return self.rank.receiver.cancel_push(address, request_id, why)

    def keep_alive(self, address: str, request_ids: Any) -> None:
        dtp = self.rank.cfg.decode_tp
        ids = [kv_request_id(r, j, dtp) for r in request_ids for j in range(dtp)]
        for addr in address.split(","):
            self.rank.receiver.keep_alive(addr, ids)


class DecodeInstance(_FollowedRanks):
    """The NPU role (emulated NPU, tiled KV cache) or, for gg-*, a GPU with a paged cache.

    With ``decode_tp`` M > 1, rank 0 lives here and schedules; ranks 1..M-1 are processes that
    run each broadcast step over their own heads' cache and pull their own heads' KV.
    """

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        self.cfg = cfg.validate()
        tp = cfg.decode_tp
        self.followers = Followers("decode", cfg, tp) if tp > 1 else None
        try:
            if tp > 1 and loaded is not None and not loaded.model.shard.parallel:
                loaded = None
            self.rank = DecodeRank(cfg, Shard(0, tp), loaded)
        except BaseException:
            if self.followers is not None:
                self.followers.close()
            raise
        r = self.rank
        self.capacity = r.capacity
        cfg = self.cfg = r.cfg  # the cache and batch as resolved (capacity.py)
        try:  # a prompt whose KV can never land in the receive buffers is refused before its pull
            self.kv_limits = kv_limits(cfg, r.loaded.config, {"rx": r.rx_bytes}, r.blocks.num_blocks * r.blocks.block_size)
        except BaseException:
            r.close()
            if self.followers is not None:
                self.followers.close()
            raise
        self.loaded, self.transport, self.npu, self.blocks, self.receiver = r.loaded, r.transport, r.npu, r.blocks, r.receiver
        if self.npu is not None:
            self.kv = r.kv
        else:
            self.caches = r.caches
        attn = r.attn
        if self.followers is not None:
            self.loaded.model.set_group(self.followers.group.all_reduce)
            slices = record_slices(attn)
            self.loaded.model.step_hook = lambda ids, pos: self.followers.step(ids, pos, slices[0])  # type: ignore[union-attr]
        eos = tuple(self.loaded.config.eos_token_ids)
        self.engine = DecodeEngine(
            self.loaded.model, attn, RemoteKV(self.blocks, TPReceiver(r, self.followers)), eos, cfg.max_batch,
            graphs=False if tp > 1 else cfg.graphs, max_model_len=cfg.max_model_len or None,
            step_time=_npu_step_time(cfg, self.loaded, self.npu is not None), overlap=cfg.async_scheduling,
        )
        self.engine.warmup()  # capture the decode graphs before traffic (none on a CPU)

    def check_prompt(self, num_tokens: int) -> None:
        """Raise :class:`PromptTooLong` for a prompt whose KV can never land in this rank's receive
        buffers (checked before its KV is pulled; a prefill of the same config refuses it earlier)."""
        check_kv_fits(self.cfg, self.loaded.config, self.kv_limits, num_tokens)

    def drained(self) -> bool:
        """Nothing received or reserved on rank 0 or a live follower, no KV block in use."""
        a = self.accounting()
        ranks = [r for r in a.get("ranks", {}).values() if not r.get("dead")]
        return a["kv_blocks_used"] == 0 and all(r["rx_reservations"] == 0 and r["draining"] == 0 and not r.get("kv_expecting") and not r.get("rx_waiting") for r in [a, *ranks])

    def accounting(self) -> dict[str, Any]:
        out = {
            **ledger(self.rank),
            "kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks,
        }
        if self.npu is not None:
            out["npu_channels"] = {c: {"used": u, "capacity": cap} for c, (u, cap) in self.npu.channel_usage().items()}
        return self._with_ranks(out)


def step_threads(cfg: InstanceConfig) -> StepThreads | None:
    """A CPU engine's threads per step, where ``--prompt-threads`` asks for more than ``--threads``."""
    if str(cfg.prefill_device) != "cpu" or cfg.threads is None or cfg.prompt_threads is None or cfg.prompt_threads <= cfg.threads:
        return None
    return StepThreads(cfg.threads, cfg.prompt_threads)


class ColocatedInstance:
    """The oracle: one model prefilling and decoding over one paged cache, with no transfer."""

    def __init__(self, cfg: InstanceConfig, loaded: LoadedModel | None = None):
        self.loaded = loaded or load_model(cfg.model, cfg.prefill_device, compute_dtype(cfg), cfg.seed)
        mc = self.loaded.config
        self.capacity = capacity.resolve(cfg, mc, "colocated", capacity.weight_bytes(self.loaded.model))
        cfg = self.cfg = dataclasses.replace(cfg, kv_tokens=self.capacity.kv_tokens, max_batch=self.capacity.max_num_seqs,
                                             max_num_batched_tokens=cfg.step_budget)
        # On a CPU, the cache vLLM's CPU kernel reads in place (its own block order): nothing outside
        # this instance reads it, so its order is the attention's choice (hawk/engine/vllm_cpu_kernel.py).
        self.layout = in_place_layout(gpu_layout(cfg, mc, cfg.kv_tokens), cfg.prefill_device, compute_dtype(cfg))
        self.caches = self.layout.allocate(cfg.prefill_device)
        self.blocks = BlockManager(self.layout.num_blocks, self.layout.block_size)
        self._handed: dict[str, list[int]] = {}
        mixed = cfg.mixed_steps
        self.prefill = PrefillEngine(
            self.loaded.model, self.layout, self.caches, self._handoff, block_manager=self.blocks, max_prefill_chunk=cfg.max_prefill_chunk,
            graph_tokens=prefill_graph_tokens(cfg), threaded=not mixed,
        )
        if self.prefill.runner is not None:
            self.prefill.runner.warmup_prefill()
        rows = cfg.max_batch + MIXED_PREFILL_SEQS + 1 if mixed else cfg.max_batch  # a mixed step's prompts ride beside the decode rows
        attn = PagedAttention(self.layout, self.caches, max_batch=rows, max_model_len=decode_len(cfg, mc),
                              decode_split_tokens=cfg.decode_split_tokens)
        self.decode = DecodeEngine(
            self.loaded.model, attn, LocalKV(self.blocks, kv_here=attn.device.type == "cpu"), tuple(mc.eos_token_ids), cfg.max_batch,
            graphs=cfg.graphs, max_model_len=cfg.max_model_len or None, overlap=cfg.async_scheduling,
            prefill=self.prefill if mixed else None, max_num_batched_tokens=cfg.max_num_batched_tokens,
            mixed_graphs=cfg.mixed_graphs,
            mixed_graph_tokens=min(prefill_graph_tokens(cfg), cfg.max_num_batched_tokens),
            step_token_target=cfg.step_token_target, step_target_backlog=cfg.step_target_backlog,
            step_threads=step_threads(cfg) if mixed else None,
        )
        self.decode.warmup()
        if mixed:
            runner = self.decode.runner
            runner.warmup_prefill()
            # mixed steps past MIXED_PREFILL_SEQS sequences: one or two chunks beside the decode rows
            if not runner.warmup_mixed((1, 2)):
                runner.warmup_piecewise()

    def _handoff(self, request_id: str, num_tokens: int, blocks: list[int], free: Any) -> None:
        self._handed[request_id] = blocks  # the decode engine takes these blocks over as they are

    def take_blocks(self, request_id: str) -> list[int]:
        return self._handed.pop(request_id)

    def discard(self, request_id: str) -> bool:
        """Free a prefilled request's blocks that will never be decoded (its client left)."""
        blocks = self._handed.pop(request_id, None)
        if blocks is not None:
            self.blocks.free(blocks)
        return blocks is not None

    def accounting(self) -> dict[str, Any]:
        return {"kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free, "kv_blocks_total": self.blocks.num_blocks, "handed_over": len(self._handed)}

    def close(self) -> None:
        if self.cfg.mixed_steps:  # the decode loop steps the prefill: stop it first
            self.decode.close()
            self.prefill.close()
        else:
            self.prefill.close()
            self.decode.close()
        for b in self._handed.values():
            self.blocks.free(b)
        self._handed.clear()
