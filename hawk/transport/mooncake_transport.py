"""Mooncake Transfer Engine behind the HAWK transport interface.

The engine is initialised in P2P-handshake mode (no metadata server, no etcd): ``initialize(host,
"P2PHANDSHAKE", protocol, device)`` and peers are named ``"host:rpc_port"``. The Python binding does not
pick the engine's transport from its ``protocol`` argument: the engine's auto-discovery does, steered by
environment variables it reads in ``initialize``. So each protocol here sets its variable around that
call (and clears the others'), under a lock:

* ``"tcp"`` (default): ``MC_FORCE_TCP``. Host memory anywhere; a CUDA build stages GPU memory itself.
* ``"rdma"``: ``MC_FORCE_HCA``. Needs RDMA NICs (GPUDirect for GPU memory); initialize fails without one.
* ``"nvlink_intra"``: ``MC_INTRANODE_NVLINK``. The engine's intra-node NVLink transport: CUDA IPC handles
  exchanged through the handshake, then ``cudaMemcpyBatchAsync`` from GPU to GPU of one host (NVLink where
  the GPUs have it, else PCIe peer copies). No NIC, no RDMA. CUDA memory only (host regions are refused),
  and only in CUDA builds compiled with it (``mooncake-transfer-engine-cuda13`` 0.3.14 is).

``HAWK_MOONCAKE_PROTOCOL`` sets the default protocol (the benchmark CLI passes no engine options).

Facts of mooncake-transfer-engine 0.3.13 / 0.3.14 this module is shaped by (checked on loopback TCP):

* ``get_batch_transfer_status(ids)`` is the only batch completion call, and it *blocks* (a busy loop,
  GIL released) until the batches finish, fail, or hit the engine timeout (``MC_TRANSFER_TIMEOUT``,
  default 30 s, at least 5 s, plus 1 ns per byte). It frees the batch ids, so it is called exactly
  once per id. To expose a non-blocking poll, one worker thread per transport runs the engine calls.
* More than ~1024 requests in flight overflow the TCP lane queue; the batch fails AND the peer's lane
  stays broken afterwards (every later batch to it fails). So a HAWK batch is cut into engine batches
  of at most ``max_batch`` descriptors, run one after another by the worker: never over the limit.
* On failure or timeout the engine frees the batch while requests may still be moving: don't reuse
  the batch's buffers before ``drain_s`` (the engine timeout) has passed.

And of ``nvlink_intra`` (from its source, v0.3.14):

* It registers whole ``cudaMalloc`` allocations (``cuMemGetAddressRange``), once per allocation: a
  second region inside an allocation is a no-op, and unregistering any address drops the allocation.
  So this module counts regions per allocation and unregisters an allocation with its last region.
  PyTorch's ``expandable_segments`` memory has no IPC handle and cannot be registered.
* The engine caches a peer's segment (its allocations and IPC handles) the first time it reaches the
  peer and never refreshes it. This module makes that happen at ``connect()`` and refuses (ValueError)
  descriptors into peer regions the peer registered after that: register before the handshake, as the
  connector does, or connect a new transport.
* The copies run on an engine stream of the local buffer's GPU; the submitting thread's current device
  is the worker's, which is set to that GPU per batch.
"""

from __future__ import annotations

import ctypes
import importlib
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

# protocol -> the environment variable that makes the engine's auto-discovery install that transport
PROTOCOL_ENV: dict[str, str] = {"tcp": "MC_FORCE_TCP", "rdma": "MC_FORCE_HCA", "nvlink_intra": "MC_INTRANODE_NVLINK"}
PROTOCOLS: tuple[str, ...] = tuple(PROTOCOL_ENV)
DEFAULT_PROTOCOL_ENV = "HAWK_MOONCAKE_PROTOCOL"
_STEERING = (*PROTOCOL_ENV.values(), "MC_FORCE_MNNVL")  # cleared around initialize unless the protocol's own
_ENV_LOCK = threading.Lock()
_CUDA_BUILD: bool | None = None


def _load_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransportUnavailable(f"mooncake transport needs the Mooncake engine ({INSTALL_HINT}): {e}") from e
    return TransferEngine


def _cuda_capable_build() -> bool:
    """Whether the loaded engine is a CUDA build (it links libcudart).

    The non-cuda wheel would memcpy from a device pointer (a crash): GPU regions are refused with it. The
    engine's file is read, not the installed distributions' names: both wheels can be on the path at once
    (e.g. the CUDA wheel in a --target folder on PYTHONPATH over a site-packages non-cuda one)."""
    global _CUDA_BUILD
    if _CUDA_BUILD is None:
        try:
            eng = importlib.import_module("mooncake.engine")
            with open(eng.__file__, "rb") as f:
                _CUDA_BUILD = b"libcudart.so" in f.read()
        except (ImportError, OSError, AttributeError, TypeError):
            try:
                importlib.metadata.version("mooncake-transfer-engine-non-cuda")
                _CUDA_BUILD = False
            except importlib.metadata.PackageNotFoundError:
                _CUDA_BUILD = True
    return _CUDA_BUILD


def default_protocol() -> str:
    """``HAWK_MOONCAKE_PROTOCOL`` if set, else "tcp"."""
    return os.environ.get(DEFAULT_PROTOCOL_ENV, "").strip() or "tcp"


def _initialize(engine: Any, host: str, protocol: str, device_name: str) -> int:
    """``engine.initialize`` with exactly ``protocol``'s steering variable set (restored afterwards)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in _STEERING}
        try:
            for k in _STEERING:
                os.environ.pop(k, None)
            os.environ[PROTOCOL_ENV[protocol]] = "1"
            return engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_LIBCUDA: Any = None


def _alloc_range(info: RegionInfo) -> tuple[int, int]:
    """The ``cudaMalloc`` allocation holding a CUDA region: (base, size), as the engine registers it.

    Falls back to the region itself where the driver cannot be asked (then regions sharing an allocation
    are not counted together, which only matters for deregistering one of them early)."""
    global _LIBCUDA
    try:
        if _LIBCUDA is None:
            _LIBCUDA = ctypes.CDLL("libcuda.so.1")
            _LIBCUDA.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with torch.cuda.device(info.device_id):
            rc = _LIBCUDA.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(info.addr))
        if rc == 0 and base.value <= info.addr and info.addr + info.length <= base.value + size.value:
            return int(base.value), int(size.value)
        log.debug("mooncake: cuMemGetAddressRange(%#x) returned %d", info.addr, rc)
    except (OSError, AttributeError, RuntimeError) as e:
        log.debug("mooncake: no allocation range for %r: %s", info.name, e)
    return info.addr, info.length


def _expandable_segments() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def encode_engine_md(segment: str, protocol: str) -> bytes:
    return f"{segment} {protocol}".encode()


def decode_engine_md(md: bytes) -> tuple[str, str]:
    """(segment, protocol); a bare segment (older HAWK) is TCP."""
    text = bytes(md).decode()
    segment, _, protocol = text.partition(" ")
    return segment, protocol or "tcp"


@dataclass(eq=False)
class _Job:
    """One HAWK batch as the worker sees it: engine batches of at most max_batch requests."""

    op: str
    segment: str
    chunks: list[tuple[list[int], list[int], list[int]]]
    device: int = -1  # the local buffers' GPU (the worker's current device while it submits); -1: host
    status: Status = "PENDING"
    error: str | None = None
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)

    def finish(self, status: Status, error: str | None = None) -> None:
        self.status, self.error = status, error
        self.finished.set()


@dataclass
class _PeerState:
    protocol: str
    known: frozenset[tuple[str, int, int]] | None = None  # nvlink_intra: peer regions the engine has cached


class MooncakeTransport(Transport):
    """Mooncake Transfer Engine, P2P handshake; TCP by default, ``nvlink_intra`` for GPUs of one host."""

    name = "mooncake"

    def __init__(
        self,
        agent_name: str | None = None,
        protocol: str | None = None,
        host: str = "127.0.0.1",
        device_name: str = "",
        max_batch: int = MAX_BATCH,
        transfer_timeout_s: int | None = None,
    ) -> None:
        protocol = default_protocol() if protocol is None else protocol
        if protocol not in PROTOCOL_ENV:
            raise ValueError(f"mooncake protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        engine_cls = _load_engine()
        if not 1 <= max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch={max_batch} must be in 1..{MAX_BATCH}")
        self._cuda_ok = _cuda_capable_build()
        if protocol == "nvlink_intra" and not self._cuda_ok:
            raise TransportUnavailable(
                "mooncake protocol 'nvlink_intra' needs a CUDA build of the engine "
                "(mooncake-transfer-engine-cuda13); the installed one is mooncake-transfer-engine-non-cuda"
            )
        super().__init__(agent_name)
        if transfer_timeout_s is not None:
            # Read by the engine's constructor only; process-wide, so set it before the first engine.
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(transfer_timeout_s)))
        self.drain_s = float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
        self.max_batch = max_batch
        self.protocol = protocol
        self._engine = engine_cls()
        rc = _initialize(self._engine, host, protocol, device_name)
        if rc != 0:
            why = {
                "rdma": " (no RDMA NIC found?)",
                "nvlink_intra": " (an engine built without the intra-node NVLink transport logs "
                "'Unsupported transport nvlink_intra')",
            }.get(protocol, "")
            raise TransportError(f"mooncake: initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {rc}{why}")
        self.segment = f"{host}:{self._engine.get_rpc_port()}"
        self._allocs: dict[int, int] = {}  # nvlink_intra: registered regions per cudaMalloc allocation base
        self._worker_device = -1
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
        if self.protocol == "nvlink_intra":
            return self._register_allocation(info, tensor)
        location = f"cuda:{info.device_id}" if info.device == "cuda" else "*"
        rc = self._engine.register_memory(info.addr, info.length, location)
        if rc != 0:
            raise TransportError(f"mooncake: register_memory({info.name!r}, {info.length} B) returned {rc}")
        return tensor  # the token pins the memory if the engine has to be leaked

    def _register_allocation(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        if info.device != "cuda":
            raise ValueError(
                f"region {info.name!r}: mooncake protocol 'nvlink_intra' moves CUDA memory only "
                f"(this region is on {info.device}); use protocol 'tcp' for host memory"
            )
        base, _ = _alloc_range(info)
        if base not in self._allocs:  # the engine registers (and IPC-exports) the whole allocation once
            rc = self._engine.register_memory(info.addr, info.length, f"cuda:{info.device_id}")
            if rc != 0:
                hint = (
                    "; PYTORCH_CUDA_ALLOC_CONF has expandable_segments, whose memory has no CUDA IPC handle"
                    if _expandable_segments()
                    else ""
                )
                raise TransportError(
                    f"mooncake: register_memory({info.name!r}, {info.length} B on cuda:{info.device_id}) "
                    f"returned {rc} (nvlink_intra){hint}"
                )
        self._allocs[base] = self._allocs.get(base, 0) + 1
        return (tensor, base)

    def _engine_deregister(self, info: RegionInfo, token: Any) -> None:
        if self._stuck:
            _LEAKED.append(token)  # a batch may still use it: never free it
            return
        if self.protocol == "nvlink_intra":
            _, base = token
            left = self._allocs.get(base, 0) - 1
            if left > 0:
                self._allocs[base] = left  # other regions of this allocation are still registered
                return
            self._allocs.pop(base, None)
        self._engine.unregister_memory(info.addr)

    def _engine_metadata(self) -> bytes:
        return encode_engine_md(self.segment, self.protocol)

    # ------------------------------------------------------------------------------------ peers
    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        segment, protocol = decode_engine_md(doc["engine_md"])
        if protocol != self.protocol:
            raise ConnectError(
                f"mooncake: peer {doc.get('agent')!r} uses protocol {protocol!r}, this transport {self.protocol!r} "
                f"(set {DEFAULT_PROTOCOL_ENV} or protocol= alike on both sides)"
            )
        probe = getattr(self._engine, "send_probe", None)  # not in every engine build
        rc = probe(segment) if probe is not None else 0  # opens the handshake, proves the peer answers
        if rc != 0:
            raise ConnectError(f"mooncake: peer segment {segment!r} ({doc.get('agent')!r}) did not answer (rc={rc})")
        state = _PeerState(protocol)
        if protocol == "nvlink_intra":
            # The engine fetches the peer's segment (allocations, IPC handles) once and caches it for
            # good: fetch it now, when it holds every region of this metadata, and remember which.
            fetch = getattr(self._engine, "get_first_buffer_address", None)
            if fetch is not None:
                fetch(segment)
            state.known = frozenset((r.name, r.addr, r.length) for r in regions.values())
        return _Peer(segment, doc["agent"], regions, doc["engine_md"], state)

    def _engine_disconnect(self, peer: _Peer) -> None:
        pass  # the engine caches the segment; nothing to tear down per peer in P2P mode

    def _engine_validate(self, peer: _Peer, segs: list[Segment]) -> None:
        state = peer.state
        if not isinstance(state, _PeerState) or state.known is None:
            return
        checked: set[str] = set()
        for s in segs:
            r = s.remote
            if r.name in checked:
                continue
            if (r.name, r.addr, r.length) not in state.known:
                raise ValueError(
                    f"remote region {r.name!r} of peer {peer.id!r} was registered after this transport first "
                    "reached the peer; Mooncake's nvlink_intra caches a peer's memory at that point and never "
                    "refreshes it: register before the handshake, or use a new transport"
                )
            checked.add(r.name)

    # -------------------------------------------------------------------------------- transfers
    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: list[Segment]) -> int:
        chunks = []
        for i in range(0, len(segs), self.max_batch):
            part = segs[i : i + self.max_batch]
            chunks.append(([s.local_addr for s in part], [s.remote_addr for s in part], [s.length for s in part]))
        first = segs[0].local
        device = first.device_id if first.device == "cuda" else -1
        h.engine_state = job = _Job(h.op, peer.id, chunks, device)
        if self._stuck or not self._worker.is_alive():
            raise TransportError("worker thread is not running (a previous batch never returned)")
        self._queue.put(job)
        return len(chunks)

    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]:
        job: _Job = h.engine_state
        return job.status, job.error

    def _engine_block(self, h: TransferHandle, timeout_s: float) -> None:
        job: _Job | None = h.engine_state
        if job is not None:
            job.finished.wait(max(0.0, timeout_s))  # set by the worker; no GIL-holding poll loop meanwhile

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
            if job.device >= 0 and job.device != self._worker_device:
                torch.cuda.set_device(job.device)  # engine events/streams follow this thread's device
                self._worker_device = job.device
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
