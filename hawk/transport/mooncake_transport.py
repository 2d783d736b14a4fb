"""Mooncake Transfer Engine behind the HAWK transport interface.

The engine is initialised in P2P-handshake mode (no metadata server): ``initialize(host,
"P2PHANDSHAKE", protocol, device)`` and peers are named ``"host:rpc_port"``. Protocol "tcp" works
anywhere; "rdma" where the hardware is.

Facts of mooncake-transfer-engine 0.3.13 this module is shaped by (checked on loopback TCP):

* ``get_batch_transfer_status(ids)`` is the only batch completion call, and it *blocks* (a busy loop,
  GIL released) until the batches finish, fail, or hit the engine timeout (``MC_TRANSFER_TIMEOUT``,
  default 30 s, at least 5 s, plus 1 ns per byte). It frees the batch ids, so it is called exactly
  once per id. To expose a non-blocking poll, one worker thread per transport runs the engine calls.
* More than ~1024 requests in flight overflow the TCP lane queue; the batch fails AND the peer's lane
  stays broken afterwards (every later batch to it fails). So a HAWK batch is cut into engine batches
  of at most ``max_batch`` descriptors, run one after another by the worker: never over the limit.
* On failure or timeout the engine frees the batch while requests may still be moving: don't reuse
  the batch's buffers before ``drain_s`` (the engine timeout) has passed.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from hawk.transport.base import (
    ConnectError,
    RegionInfo,
    Segment,
    Status,
    TransferHandle,
    Transport,
    TransportError,
    TransportUnavailable,
    _Peer,
)

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU hosts; it needs Debian's libibverbs1 "
    "ibverbs-providers libnl-3-200 libnl-route-3-200) or mooncake-transfer-engine-cuda13 (CUDA hosts)"
)
MAX_BATCH = 1024  # engine requests in flight per transport (see the module docstring)
_BAD_BATCH_IDS = (0, (1 << 64) - 1)  # 0: submit failed; uint64(-1): the peer segment could not be opened
_LEAKED: list[Any] = []  # engines (and their buffers) kept alive because a worker never returned


def _load_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransportUnavailable(f"mooncake transport needs the Mooncake engine ({INSTALL_HINT}): {e}") from e
    return TransferEngine


def _cuda_capable_build() -> bool:
    """The non-cuda wheel would memcpy from a device pointer (a crash): refuse GPU regions with it."""
    try:
        importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


@dataclass(eq=False)
class _Job:
    """One HAWK batch as the worker sees it: engine batches of at most max_batch requests."""

    op: str
    segment: str
    chunks: list[tuple[list[int], list[int], list[int]]]
    status: Status = "PENDING"
    error: str | None = None
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)

    def finish(self, status: Status, error: str | None = None) -> None:
        self.status, self.error = status, error
        self.finished.set()


class MooncakeTransport(Transport):
    """Mooncake Transfer Engine, P2P handshake, TCP by default."""

    name = "mooncake"

    def __init__(
        self,
        agent_name: str | None = None,
        protocol: str = "tcp",
        host: str = "127.0.0.1",
        device_name: str = "",
        max_batch: int = MAX_BATCH,
        transfer_timeout_s: int | None = None,
    ) -> None:
        engine_cls = _load_engine()
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch={max_batch} must be in 1..{MAX_BATCH}")
        super().__init__(agent_name)
        if transfer_timeout_s is not None:
            # Read by the engine's constructor only; process-wide, so set it before the first engine.
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(transfer_timeout_s)))
        self.drain_s = float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
        self.max_batch = max_batch
        self.protocol = protocol
        self._engine = engine_cls()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransportError(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}")
        self.segment = f"{host}:{self._engine.get_rpc_port()}"
        self._cuda_ok = _cuda_capable_build()
        self._stuck = False
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"{self.agent_name}-worker", daemon=True)
        self._worker.start()

    # ---------------------------------------------------------------------------------- regions
    def _engine_register(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        if info.device == "cuda" and not self._cuda_ok:
            raise ValueError(
                f"region {info.name!r}: the installed mooncake-transfer-engine-non-cuda cannot move GPU memory; "
                "install mooncake-transfer-engine-cuda13 on CUDA hosts"
            )
        location = f"cuda:{info.device_id}" if info.device == "cuda" else "*"
        rc = self._engine.register_memory(info.addr, info.length, location)
        if rc != 0:
            raise TransportError(f"mooncake: register_memory({info.name!r}, {info.length} B) returned {rc}")
        return tensor  # the token pins the memory if the engine has to be leaked

    def _engine_deregister(self, info: RegionInfo, token: Any) -> None:
        if self._stuck:
            _LEAKED.append(token)  # a batch may still use it: never free it
            return
        self._engine.unregister_memory(info.addr)

    def _engine_metadata(self) -> bytes:
        return self.segment.encode()

    # ------------------------------------------------------------------------------------ peers
    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        segment = bytes(doc["engine_md"]).decode()
        probe = getattr(self._engine, "send_probe", None)  # not in every engine build
        rc = probe(segment) if probe is not None else 0  # opens the handshake, proves the peer answers
        if rc != 0:
            raise ConnectError(f"mooncake: peer segment {segment!r} ({doc.get('agent')!r}) did not answer (rc={rc})")
        return _Peer(segment, doc["agent"], regions, doc["engine_md"])

    def _engine_disconnect(self, peer: _Peer) -> None:
        pass  # the engine caches the segment; nothing to tear down per peer in P2P mode

    # -------------------------------------------------------------------------------- transfers
    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: list[Segment]) -> int:
        chunks = []
        for i in range(0, len(segs), self.max_batch):
            part = segs[i : i + self.max_batch]
            chunks.append(([s.local_addr for s in part], [s.remote_addr for s in part], [s.length for s in part]))
        h.engine_state = job = _Job(h.op, peer.id, chunks)
        if self._stuck or not self._worker.is_alive():
            raise TransportError("worker thread is not running (a previous batch never returned)")
        self._queue.put(job)
        return len(chunks)

    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]:
        job: _Job = h.engine_state
        return job.status, job.error

    def _engine_release(self, h: TransferHandle) -> None:
        job: _Job | None = h.engine_state
        if job is not None and job.status == "PENDING":
            job.cancelled = True  # engine batches not started yet are skipped; the running one ends by itself

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run_job(job)

    def _run_job(self, job: _Job) -> None:
        submit = self._engine.batch_transfer_async_read if job.op == "READ" else self._engine.batch_transfer_async_write
        n = len(job.chunks)
        try:
            for k, (local, remote, lengths) in enumerate(job.chunks):
                if job.cancelled:
                    job.finish("ERROR", f"released before engine batch {k + 1}/{n} started")
                    return
                bid = submit(job.segment, local, remote, lengths)
                if bid in _BAD_BATCH_IDS:
                    why = f"engine refused batch {k + 1}/{n} ({len(lengths)} requests; peer unreachable?)"
                    job.finish("ERROR", why)
                    return
                rc = self._engine.get_batch_transfer_status([bid])
                if rc != 0:
                    job.finish("ERROR", f"engine batch {k + 1}/{n} ({len(lengths)} requests) failed or timed out")
                    return
            job.finish("DONE")
        except Exception as e:  # noqa: BLE001 - the worker must survive any engine error
            job.finish("ERROR", f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------------------------ close
    def _engine_quiesce(self) -> None:
        """Stop the worker before memory is unregistered; a worker that never returns pins everything."""
        while True:  # drop queued jobs: they never started
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.finish("ERROR", "transport closed before the batch started")
        self._queue.put(None)
        self._worker.join(timeout=self.drain_s + 5.0)
        if self._worker.is_alive():
            log.error("mooncake: worker still inside the engine after %.0f s; leaking the engine", self.drain_s + 5)
            self._stuck = True

    def _engine_close(self) -> None:
        if self._stuck:
            _LEAKED.append(self._engine)
        self._engine = None  # the engine's destructor closes segments and joins its threads (~1 s)
