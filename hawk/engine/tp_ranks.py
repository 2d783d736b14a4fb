"""The ranks 1..N-1 of a tensor-parallel instance, and rank 0's handle on them.

Rank 0 (in the instance's own process) schedules; every other rank is a spawned process that
holds its model shard, its heads' KV cache and its own transfer endpoint, and follows commands
on a pipe: ``step`` (run this forward: the batch description rank 0 broadcasts before each of its
own forwards, as vLLM's TP workers receive theirs), ``add`` (offer a prefilled request's KV),
``pull`` (land a request's KV), ``accounting`` and ``close``. The model's all-reduces go over the
instance's gloo/NCCL group; the pipes carry only the small control traffic.

A rank that dies closes its pipe: rank 0 fails every call waiting on it, hands its holds back
(``on_dead``) and reports the instance unhealthy from then on.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from hawk.config import ServeConfig
from hawk.engine.gc_policy import freeze_startup_heap
from hawk.engine.ranks import DecodeRank, PrefillRank, held, ledger
from hawk.engine.tensor_parallel import Shard, TPGroup

log = logging.getLogger(__name__)

#: Test hook: a follower rank given this env value exits when a pull reaches it ("die-in-pull"), or
#: right after joining its group, before it has loaded anything ("die-at-start").
FAULT_ENV = "HAWK_TP_FAULT"


class RankDied(RuntimeError):
    """A tensor-parallel rank's process went away."""


def record_slices(attn: Any) -> list[Any]:
    """Remember the slices of each ``attn.begin`` (rank 0 broadcasts them with the step's tokens)."""
    box: list[Any] = [None]
    begin = attn.begin

    def recording_begin(slices: Any, *args: Any, **kwargs: Any) -> Any:
        box[0] = list(slices)
        return begin(slices, *args, **kwargs)

    attn.begin = recording_begin
    return box


class Followers:
    """Rank 0's view of ranks 1..N-1: spawns them, joins their group, calls them, watches them."""

    def __init__(
        self,
        role: str,
        cfg: ServeConfig,
        tp: int,
        on_notice: Callable[[int, str, Any], None] | None = None,
        on_dead: Callable[[int], None] | None = None,
        start_timeout_s: float = 300.0,
    ):
        import torch.multiprocessing as mp

        self.ranks = list(range(1, tp))
        self.on_notice, self.on_dead = on_notice, on_dead
        ctx = mp.get_context("spawn")
        port = TPGroup.free_port()
        backend = "nccl" if str(cfg.prefill_device if role == "prefill" else cfg.decode_compute_device).startswith("cuda") else "gloo"
        self._conns: dict[int, Any] = {}
        self._procs: dict[int, Any] = {}
        self._send_locks = {r: threading.Lock() for r in self.ranks}
        self._pending: dict[int, tuple[int, Future]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: set[int] = set()
        self._ready: dict[int, Future] = {r: Future() for r in self.ranks}
        for r in self.ranks:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(role, cfg.to_json(), r, tp, port, backend, child), name=f"hawk-{role}-tp{r}", daemon=True)
            p.start()
            child.close()
            self._conns[r], self._procs[r] = parent, p
        self.group = TPGroup(Shard(0, tp), port, backend)  # the ranks' rendezvous
        for r in self.ranks:
            threading.Thread(target=self._read, args=(r,), name=f"hawk-tp-read{r}", daemon=True).start()
        self.addresses = [str(self._ready[r].result(start_timeout_s)) for r in self.ranks]

    @property
    def healthy(self) -> bool:
        return not self.dead

    @property
    def dead(self) -> list[int]:
        """Ranks whose process is gone (noticed on the pipe or by the process table): a serving
        instance reports them in /health and is restarted, since a rank cannot rejoin its group."""
        with self._lock:
            gone = set(self._dead)
        return sorted(gone | {r for r, p in self._procs.items() if not p.is_alive()})

    @property
    def pids(self) -> dict[int, int]:
        """Each follower's process id (operators and fault tests signal a rank by it)."""
        return {r: int(p.pid) for r, p in self._procs.items() if p.pid is not None}

    # -- commands ------------------------------------------------------------------------------

    def _send(self, rank: int, msg: tuple) -> None:
        if rank in self._dead:
            raise RankDied(f"tensor-parallel rank {rank} is dead")
        try:
            with self._send_locks[rank]:
                self._conns[rank].send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            raise RankDied(f"tensor-parallel rank {rank}: {e}") from e

    def step(self, ids: torch.Tensor, positions: torch.Tensor, slices: Any) -> None:
        """Broadcast one forward's batch description: the other ranks run the same forward."""
        msg = ("step", ids.tolist(), positions.tolist(), slices)
        for r in self.ranks:
            self._send(r, msg)

    def call_async(self, rank: int, cmd: str, *args: Any) -> Future:
        fut: Future = Future()
        cid = next(self._ids)
        with self._lock:
            if rank in self._dead:
                fut.set_exception(RankDied(f"tensor-parallel rank {rank} is dead"))
                return fut
            self._pending[cid] = (rank, fut)
        try:
            self._send(rank, (cmd, cid, *args))
        except RankDied as e:
            with self._lock:
                self._pending.pop(cid, None)
            fut.set_exception(e)
        return fut

    def call(self, rank: int, cmd: str, *args: Any, timeout: float = 120.0) -> Any:
        return self.call_async(rank, cmd, *args).result(timeout)

    def accounting(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for r in self.ranks:
            try:
                out[r] = self.call(r, "accounting", timeout=30)
            except Exception as e:  # noqa: BLE001
                out[r] = {"dead": True, "error": str(e) or type(e).__name__}
        return out

    # -- replies -------------------------------------------------------------------------------

    def _read(self, rank: int) -> None:
        conn = self._conns[rank]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._died(rank)
                return
            kind = msg[0]
            if kind == "ready":
                self._ready[rank].set_result(msg[1])
            elif kind in ("ok", "err"):
                with self._lock:
                    _, fut = self._pending.pop(msg[1], (None, None))
                if fut is not None:
                    fut.set_result(msg[2]) if kind == "ok" else fut.set_exception(RuntimeError(f"rank {rank}: {msg[2]}"))
            elif self.on_notice is not None:
                try:
                    self.on_notice(rank, kind, msg[1])
                except Exception:  # noqa: BLE001
                    log.exception("tensor-parallel notice failed")

    def _died(self, rank: int) -> None:
        with self._lock:
            self._dead.add(rank)
            failing = [f for cid, (r, f) in list(self._pending.items()) if r == rank]
            self._pending = {cid: v for cid, v in self._pending.items() if v[0] != rank}
        err = RankDied(f"tensor-parallel rank {rank} died")
        if not self._ready[rank].done():
            self._ready[rank].set_exception(err)
        for f in failing:
            if not f.done():
                f.set_exception(err)
        if self.on_dead is not None:
            self.on_dead(rank)

    def kill(self, rank: int) -> None:
        """Kill one rank's process (fault tests)."""
        self._procs[rank].kill()

    def close(self, join_s: float = 10.0) -> None:
        """Ask every live rank to close (it releases its buffers), then kill the ones that hang;
        a short ``join_s`` suits an instance that is going down because a rank died."""
        for r in self.ranks:
            try:
                self._send(r, ("close",))
            except RankDied:
                pass
        for r, p in self._procs.items():
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            self._conns[r].close()


# ================================================================================ the follower


def rank_main(role: str, cfg_json: str, rank: int, tp: int, port: int, backend: str, conn: Any) -> None:
    """A follower rank's process: build this rank's part, then follow rank 0's commands."""
    torch.set_num_threads(1)
    cfg = ServeConfig.from_json(cfg_json).for_rank(role, rank)
    device = torch.device(cfg.prefill_device if role == "prefill" else cfg.decode_compute_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every default allocation on this rank's GPU
    shard = Shard(rank, tp)
    group = TPGroup(shard, port, backend)
    if os.environ.get(FAULT_ENV) == "die-at-start":
        os._exit(3)
    part: Any = PrefillRank(cfg, shard) if role == "prefill" else DecodeRank(cfg, shard)
    model = part.loaded.model
    model.set_group(group.all_reduce)
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    attn = part.attn if role == "decode" else _prefill_attention(part)
    send("ready", part.sender.address if role == "prefill" else "")
    if cfg.gc_freeze:
        freeze_startup_heap()
    fault = os.environ.get(FAULT_ENV, "")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        cmd = msg[0]
        if cmd == "close":
            break
        try:
            if cmd == "step":
                _, ids, pos, slices = msg
                _forward(model, attn, ids, pos, slices)
            elif cmd == "add":
                _, cid, rid, n, blocks = msg
                for kv_id in part.kv_ids(rid):
                    part.sender.add(kv_id, n, blocks, lambda k=kv_id: send("released", k))
                send("ok", cid, None)
            elif cmd == "discard":  # the request's client left, or a peer rank died: free its entries
                _, cid, rids = msg
                send("ok", cid, _discard(part, rids))
            elif cmd == "pull":
                if fault == "die-in-pull":
                    os._exit(17)
                threading.Thread(target=_pull, args=(part, msg, send), daemon=True).start()
            elif cmd == "accounting":
                if role == "prefill":
                    a = part.sender.accounting()
                    send("ok", msg[1], {"staging_reservations": len(a["staging"]), "staging_held": held(a["staging"]), "kv_waiting": a["waiting"], "kv_staging_queue": a["staging_queue"], "kv_in_flight": a["in_flight"], "draining": a["draining"]})
                else:
                    send("ok", msg[1], ledger(part))
        except Exception as e:  # noqa: BLE001 - report to rank 0, keep following
            log.exception("tensor-parallel rank %d: %s failed", rank, cmd)
            if cmd != "step":
                send("err", msg[1], f"{type(e).__name__}: {e}")
    part.close()


def _discard(part: Any, request_ids: list[str] | None) -> int:
    """Drop this prefill rank's waiting entries of ``request_ids`` (None: every waiting entry);
    returns how many were dropped (their blocks' share is counted down on rank 0)."""
    sender = part.sender
    kv_ids = sender.accounting()["waiting"] if request_ids is None else [k for rid in request_ids for k in part.kv_ids(rid)]
    return sum(1 for k in kv_ids if sender.discard(k))


def _prefill_attention(part: Any) -> Any:
    from hawk.engine.paged_attention import PagedAttention

    return PagedAttention(part.layout, part.caches)


@torch.inference_mode()
def _forward(model: Any, attn: Any, ids: list[int], pos: list[int], slices: Any) -> None:
    """Rank 0's forward, on this rank's shard (the logits are rank 0's business)."""
    need = max(pos) + 1
    if need > len(model.rope):
        model.reserve_positions(max(need, 2 * len(model.rope)))
    attn.begin(slices)
    model(torch.tensor(ids, dtype=torch.int64, device=model.device), torch.tensor(pos, dtype=torch.int64, device=model.device), attn)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _pull(part: Any, msg: tuple, send: Callable[..., None]) -> None:
    _, cid, address, rid, blocks = msg
    try:
        results = part.pull_pairs(address, rid, blocks)
        send("ok", cid, [{"num_tokens": r.num_tokens, "bytes": r.bytes, "requests": r.requests, "mode": r.mode} for r in results])
    except Exception as e:  # noqa: BLE001
        send("err", cid, f"{type(e).__name__}: {e}" + ("" if str(e) else traceback.format_exc(limit=2)))
