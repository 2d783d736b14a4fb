"""The transport interface: named memory regions, peers, and batched READ/WRITE of byte ranges.

One small interface over several engines (NIXL, Mooncake, same-process copies, CUDA IPC) so that the
connector never knows which engine moves its bytes. The unit of work is a *batch*: every descriptor of
one :meth:`Transport.submit` call goes to the engine as one request list, because HAWK's whole point is
to move a KV cache as a few large per-channel requests in one batch, never thousands of small ones.

Lifecycle of a process::

    t = make_transport("nixl")                 # or construct an engine class directly
    t.register("stage", tensor)                # keeps a reference: the memory stays alive
    blob = t.metadata()                        # send to the peer out of band (zmq, pipe, ...)
    peer = t.connect(peer_blob)                # idempotent; refreshes the peer's region table
    h = t.submit("READ", peer, [Desc("stage", 0, "ch0", 4096, 1 << 20), ...])
    t.wait(h, timeout_s=10.0)                  # raises TransferError / TransferTimeout
    t.release(h)
    t.close()

Buffer-reuse rule (engines may still touch memory after a failure):
after ``DONE`` the batch's byte ranges are free at once. After ``ERROR``, a timeout, or a release of a
handle that was still ``PENDING``, the engine may still be writing into (READ) or reading from (WRITE)
the batch's local ranges, and the peer's ranges likewise. Keep those ranges out of reuse for
:attr:`Transport.drain_s` seconds (or until :meth:`Transport.close`) and keep the regions registered.
"""

from __future__ import annotations

import abc
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import msgpack
import numpy as np
import torch

Op = Literal["READ", "WRITE"]
Status = Literal["PENDING", "DONE", "ERROR"]
OPS: tuple[str, ...] = ("READ", "WRITE")
METADATA_VERSION = 1


# ----------------------------------------------------------------------------------------------- errors
class TransportError(RuntimeError):
    """Base of every transport failure (engine, peer, state)."""


class TransportUnavailable(TransportError, ImportError):
    """The engine's Python package (or a system library it needs) is not installed."""


class ConnectError(TransportError):
    """Peer metadata was malformed, for another engine, or the peer could not be reached."""


class TransferError(TransportError):
    """A submitted batch failed; the message names the engine, the peer and what failed."""


class TransferTimeout(TransferError):
    """A batch did not finish within the caller's timeout (it may still be in flight)."""


# ------------------------------------------------------------------------------------------ data types
class Desc(NamedTuple):
    """One request of a batch: ``length`` bytes between a local and a remote region.

    READ copies remote[remote_offset:+length] -> local[local_offset:+length]; WRITE the other way.
    A named tuple: a direct-placement batch is thousands of these, made and checked per transfer.
    """

    local_region: str
    local_offset: int
    remote_region: str
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """What a peer needs to address a registered region: name, address, size and device."""

    name: str
    addr: int
    length: int
    device: str  # "cpu" or "cuda"
    device_id: int  # cuda ordinal; -1 for cpu

    def to_wire(self) -> list[Any]:
        return [self.addr, self.length, self.device, self.device_id]

    @classmethod
    def from_wire(cls, name: str, v: Sequence[Any]) -> RegionInfo:
        addr, length, device, device_id = v
        if device not in ("cpu", "cuda") or int(length) <= 0 or int(addr) < 0:
            raise ConnectError(f"malformed region {name!r} in peer metadata: {v!r}")
        return cls(str(name), int(addr), int(length), str(device), int(device_id))


class Segment(NamedTuple):
    """A validated descriptor resolved to absolute addresses (what engines consume)."""

    local: RegionInfo
    local_offset: int
    remote: RegionInfo
    remote_offset: int
    length: int

    @property
    def local_addr(self) -> int:
        return self.local.addr + self.local_offset

    @property
    def remote_addr(self) -> int:
        return self.remote.addr + self.remote_offset


class _Rows(Sequence):
    """What DescArray and SegArray share: row ``i`` is ``row_type(local table[local_idx[i]], local_offset[i],
    remote table[remote_idx[i]], remote_offset[i], length[i])``, built on access."""

    row_type: ClassVar[type]
    local_idx: np.ndarray
    local_offset: np.ndarray
    remote_idx: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    def _tables(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(np.asarray(self.length).sum())

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - Sequence's signature
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        local, remote = self._tables()
        return self.row_type(local[int(self.local_idx[i])], int(self.local_offset[i]),
                             remote[int(self.remote_idx[i])], int(self.remote_offset[i]), int(self.length[i]))


@dataclass(frozen=True, eq=False)
class DescArray(_Rows):
    """A batch of descriptors as arrays: row ``i`` is ``Desc(local_names[local_idx[i]], local_offset[i],
    remote_names[remote_idx[i]], remote_offset[i], length[i])``.

    What a plan's runs already are (numpy arrays), handed to :meth:`Transport.submit` without a Python
    object per descriptor: validation is vectorized and an engine that takes arrays
    (``Transport.takes_arrays``) computes addresses with numpy. It is also a sequence of :class:`Desc`
    (built on access), so any caller or engine that iterates descriptors works on it unchanged.
    """

    row_type: ClassVar[type] = Desc
    local_names: tuple[str, ...]
    local_idx: np.ndarray
    local_offset: np.ndarray
    remote_names: tuple[str, ...]
    remote_idx: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    def _tables(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.local_names, self.remote_names

    def __post_init__(self) -> None:
        cols = (self.local_idx, self.local_offset, self.remote_idx, self.remote_offset, self.length)
        n = len(self.length)
        if any(np.ndim(c) != 1 or len(c) != n or not np.issubdtype(np.asarray(c).dtype, np.integer) for c in cols):
            raise ValueError("DescArray columns must be 1-D integer arrays of one length")
        for name, idx, names in (("local", self.local_idx, self.local_names),
                                 ("remote", self.remote_idx, self.remote_names)):
            if n and (int(idx.min()) < 0 or int(idx.max()) >= len(names)):
                raise ValueError(f"DescArray: a {name} region index is outside its {len(names)} names")

    @classmethod
    def from_descs(cls, descs: Iterable[Desc]) -> DescArray:
        """The array form of a list of :class:`Desc` (tests, and callers that have a list at hand)."""
        rows = [tuple(d) for d in descs]
        lnames = tuple(dict.fromkeys(r[0] for r in rows))
        rnames = tuple(dict.fromkeys(r[2] for r in rows))
        li, ri = {n: i for i, n in enumerate(lnames)}, {n: i for i, n in enumerate(rnames)}

        def col(k: int) -> np.ndarray:
            return np.array([r[k] for r in rows], dtype=np.int64)

        return cls(lnames, np.array([li[r[0]] for r in rows], dtype=np.int64), col(1),
                   rnames, np.array([ri[r[2]] for r in rows], dtype=np.int64), col(3), col(4))

    @classmethod
    def concat(cls, parts: Sequence[Sequence[Desc]]) -> DescArray:
        """One batch of ``parts`` in order (DescArrays, or lists of Desc), region names merged."""
        arrays = [p if isinstance(p, DescArray) else cls.from_descs(p) for p in parts]
        cols: list[list[np.ndarray]] = [[] for _ in range(5)]
        names: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for a in arrays:
            for side, (nm, idx) in enumerate(((a.local_names, a.local_idx), (a.remote_names, a.remote_idx))):
                table = names[side]
                remap = np.array([table.setdefault(n, len(table)) for n in nm], dtype=np.int64)
                cols[3 * side].append(remap[idx] if len(nm) else np.asarray(idx, dtype=np.int64))
            cols[1].append(a.local_offset)
            cols[4].append(a.remote_offset)
            cols[2].append(a.length)
        li, lo, n, ri, ro = (np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols)
        return cls(tuple(names[0]), li, lo, tuple(names[1]), ri, ro, n)


@dataclass(frozen=True, eq=False)
class SegArray(_Rows):
    """A validated :class:`DescArray` resolved against both region tables (what engines that take
    arrays consume); like DescArray, also a sequence of :class:`Segment` built on access."""

    row_type: ClassVar[type] = Segment
    local: tuple[RegionInfo, ...]
    local_idx: np.ndarray
    local_offset: np.ndarray
    remote: tuple[RegionInfo, ...]
    remote_idx: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray

    def _tables(self) -> tuple[tuple[RegionInfo, ...], tuple[RegionInfo, ...]]:
        return self.local, self.remote

    def used(self, side: str) -> list[RegionInfo]:
        """The regions of ``side`` ("local" or "remote") that some descriptor names."""
        infos, idx = (self.local, self.local_idx) if side == "local" else (self.remote, self.remote_idx)
        return [infos[int(i)] for i in np.unique(idx)]


@dataclass(eq=False)
class TransferHandle:
    """One submitted batch. Opaque to callers except for the read-only facts below."""

    id: int
    op: str
    peer: str
    descriptors: int
    nbytes: int
    local_regions: frozenset[str]
    submitted_at: float = field(default_factory=time.monotonic)
    status: Status = "PENDING"
    error: str | None = None
    released: bool = False
    engine_state: Any = None  # owned by the engine subclass


@dataclass
class _Region:
    info: RegionInfo
    tensor: torch.Tensor  # the caller's tensor: holding it keeps the memory alive
    token: Any = None  # engine registration token


@dataclass
class _Peer:
    id: str
    agent: str
    regions: dict[str, RegionInfo]
    engine_md: bytes
    state: Any = None  # engine-specific


_ids = itertools.count(1)


def unique_agent_name(prefix: str) -> str:
    """Host, pid, a per-process counter and random bits: unique even across pid reuse and forks."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{next(_ids)}-{secrets.token_hex(3)}"


def region_info(name: str, tensor: torch.Tensor) -> RegionInfo:
    """Describe a tensor as a region; ValueError for what no engine can register."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"region {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"region {name!r}: tensor must be contiguous (got strides {tuple(tensor.stride())})")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= 0:
        raise ValueError(f"region {name!r}: tensor is empty (0 bytes)")
    dev = tensor.device
    if dev.type == "cpu":
        return RegionInfo(name, tensor.data_ptr(), nbytes, "cpu", -1)
    if dev.type == "cuda":
        return RegionInfo(name, tensor.data_ptr(), nbytes, "cuda", int(dev.index or 0))
    raise ValueError(f"region {name!r}: device {dev} is not supported (cpu or cuda)")


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (same memory)."""
    return tensor.reshape(-1).view(torch.uint8)


def _check_int(what: str, i: int, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"descriptor {i}: {what}={v!r} is not an int")
    return v


def resolve(
    descs: Iterable[Desc], local: dict[str, RegionInfo], remote: dict[str, RegionInfo], peer: str
) -> list[Segment]:
    """Validate every descriptor against both region tables before anything reaches an engine.

    Per descriptor this is a handful of type and bound checks (consecutive descriptors mostly share
    their regions, so a region is looked up when it changes): it runs on every transfer's path."""
    out: list[Segment] = []
    append = out.append
    lname = rname = None
    lr = rr = None
    for i, d in enumerate(descs):
        if not isinstance(d, Desc):
            raise ValueError(f"descriptor {i}: expected Desc, got {type(d).__name__}")
        ln, lo, rn, ro, n = d
        if type(n) is not int or type(lo) is not int or type(ro) is not int:  # bool and numpy ints too
            _check_int("length", i, n)
            _check_int("local_offset", i, lo)
            _check_int("remote_offset", i, ro)
        if n <= 0:
            raise ValueError(f"descriptor {i}: length={n} must be positive")
        if ln != lname:
            lr, lname = local.get(ln), ln
            if lr is None:
                raise ValueError(f"descriptor {i}: unknown local region {ln!r} (have {sorted(local)})")
        if rn != rname:
            rr, rname = remote.get(rn), rn
            if rr is None:
                raise ValueError(f"descriptor {i}: unknown remote region {rn!r} of peer {peer!r} (have {sorted(remote)})")
        if lo < 0 or lo + n > lr.length:
            raise ValueError(
                f"descriptor {i}: local_offset={lo} length={n} outside local region {lr.name!r} of {lr.length} bytes"
            )
        if ro < 0 or ro + n > rr.length:
            raise ValueError(
                f"descriptor {i}: remote_offset={ro} length={n} outside remote region {rr.name!r} "
                f"of {rr.length} bytes"
            )
        append(Segment(lr, lo, rr, ro, n))
    if not out:
        raise ValueError("empty batch: submit needs at least one descriptor")
    return out


def contiguous_span(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Flat uint8 views that follow each other in one storage, as one tensor over all of them (None
    when they do not: other storages, gaps, another device)."""
    if not views:
        return None
    v0 = views[0]
    storage = v0.untyped_storage()
    end = v0.data_ptr()
    for v in views:
        if v.dtype != torch.uint8 or v.dim() != 1 or v.device != v0.device or v.data_ptr() != end:
            return None
        if v.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += v.numel()
    total = end - v0.data_ptr()
    if v0.storage_offset() + total > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=v0.device).set_(storage, v0.storage_offset(), (total,), (1,))


def used_regions(segs: Sequence[Segment], side: str) -> list[RegionInfo]:
    """The regions of ``side`` ("local" or "remote") that some segment of a batch names, each once
    (a SegArray's without an object per descriptor)."""
    if isinstance(segs, SegArray):
        return segs.used(side)
    return list({getattr(s, side).name: getattr(s, side) for s in segs}.values())


def desc_bytes(descs: Sequence[Desc]) -> int:
    """Bytes a batch moves (a DescArray's without an object per descriptor)."""
    return descs.nbytes if isinstance(descs, DescArray) else sum(d.length for d in descs)


@dataclass(frozen=True, eq=False)
class RegionTables:
    """A DescArray's region names resolved on both sides, with each region's length: what validating
    its rows needs and what stays the same from one batch to the next between the same regions."""

    local: tuple[RegionInfo, ...]
    remote: tuple[RegionInfo, ...]
    local_lengths: np.ndarray
    remote_lengths: np.ndarray


def region_tables(descs: DescArray, local: dict[str, RegionInfo], remote: dict[str, RegionInfo], peer: str) -> RegionTables:
    """``descs``' region names looked up in both tables (ValueError for an unknown one)."""
    infos = []
    for side, names, table in (("local", descs.local_names, local), ("remote", descs.remote_names, remote)):
        got = []
        for name in names:
            r = table.get(name)
            if r is None:
                where = "" if side == "local" else f" of peer {peer!r}"
                raise ValueError(f"descriptor region: unknown {side} region {name!r}{where} (have {sorted(table)})")
            got.append(r)
        infos.append(tuple(got))
    lengths = [np.array([r.length for r in regions], dtype=np.int64) for regions in infos]
    return RegionTables(infos[0], infos[1], lengths[0], lengths[1])


def resolve_array(descs: DescArray, local: dict[str, RegionInfo] | RegionTables, remote: dict[str, RegionInfo] | None = None,
                  peer: str = "") -> SegArray:
    """:func:`resolve` for a :class:`DescArray`: the same checks, vectorized, and the same messages.
    ``local`` may be the batch's :class:`RegionTables` already (then ``remote`` is not needed)."""
    if not len(descs):
        raise ValueError("empty batch: submit needs at least one descriptor")
    tables = local if isinstance(local, RegionTables) else region_tables(descs, local, remote or {}, peer)
    lo, ro, n = (np.asarray(c, dtype=np.int64) for c in (descs.local_offset, descs.remote_offset, descs.length))
    li, ri = np.asarray(descs.local_idx, dtype=np.int64), np.asarray(descs.remote_idx, dtype=np.int64)
    bad = np.flatnonzero(n <= 0)
    if len(bad):
        raise ValueError(f"descriptor {int(bad[0])}: length={int(n[bad[0]])} must be positive")
    for side, idx, off, regions, lengths in (("local", li, lo, tables.local, tables.local_lengths),
                                             ("remote", ri, ro, tables.remote, tables.remote_lengths)):
        bad = np.flatnonzero((off < 0) | (off + n > lengths[idx]))
        if len(bad):
            i = int(bad[0])
            r = regions[int(idx[i])]
            raise ValueError(f"descriptor {i}: {side}_offset={int(off[i])} length={int(n[i])} outside {side} region "
                             f"{r.name!r} of {r.length} bytes")
    return SegArray(tables.local, li, lo, tables.remote, ri, ro, n)


# ------------------------------------------------------------------------------------------- interface
class Transport(abc.ABC):
    """Register regions, exchange metadata, connect peers, move batches; see the module docstring.

    Subclasses implement the ``_engine_*`` hooks; everything else (tables, validation, handles, stats,
    waiting, teardown order) lives here so every engine behaves the same to the connector.
    """

    name: ClassVar[str] = "abstract"
    drain_s: float = 1.0  # how long a failed batch may still touch memory (see the module docstring)
    #: The engine's hooks take a :class:`SegArray` as it is (else :meth:`submit` hands them Segments).
    takes_arrays: ClassVar[bool] = False

    def __init__(self, agent_name: str | None = None) -> None:
        self.agent_name = agent_name or unique_agent_name(f"hawk-{self.name}")
        self._lock = threading.RLock()
        self._regions: dict[str, _Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._hids = itertools.count(1)
        self._closed = False
        self._stats = self._zero_stats()
        self._tables: dict[tuple, RegionTables] = {}  # see _tables_for; cleared when regions or peers change
        self._region_version = 0  # bumped when a region comes or goes (same-process peers check it)

    # -------------------------------------------------------------------------------------- regions
    def register(self, name: str, tensor: torch.Tensor) -> RegionInfo:
        """Register a contiguous cpu/cuda tensor under ``name``; the transport keeps it alive."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ValueError(f"region name must be a non-empty str, got {name!r}")
        info = region_info(name, tensor)
        with self._lock:
            if name in self._regions:
                raise ValueError(f"region {name!r} is already registered")
            token = self._engine_register(info, tensor)
            self._regions[name] = _Region(info, tensor, token)
            self._tables.clear()
            self._region_version += 1
        return info

    def deregister(self, name: str) -> None:
        """Unregister a region; refuses while an unreleased, unfinished batch uses it."""
        with self._lock:
            reg = self._regions.get(name)
            if reg is None:
                raise ValueError(f"unknown region {name!r}")
            for h in self._handles.values():
                if name in h.local_regions and self._refresh(h) == "PENDING":
                    raise TransportError(f"{self.name}: region {name!r} is used by in-flight batch #{h.id}")
            self._engine_deregister(reg.info, reg.token)
            del self._regions[name]
            self._tables.clear()
            self._region_version += 1

    def regions(self) -> dict[str, RegionInfo]:
        with self._lock:
            return {n: r.info for n, r in self._regions.items()}

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor registered as ``name`` (for callers that fill or read it)."""
        reg = self._regions.get(name)
        if reg is None:
            raise ValueError(f"unknown region {name!r}")
        return reg.tensor

    # ---------------------------------------------------------------------------------------- peers
    def metadata(self) -> bytes:
        """Everything a peer needs: engine connection info plus the region table."""
        self._check_open()
        with self._lock:
            doc = {
                "hawk_transport": METADATA_VERSION,
                "engine": self.name,
                "agent": self.agent_name,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "regions": {n: r.info.to_wire() for n, r in self._regions.items()},
                "engine_md": self._engine_metadata(),
            }
        return msgpack.packb(doc, use_bin_type=True)

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's metadata and return its id. Idempotent: reconnecting refreshes its regions."""
        self._check_open()
        doc = self._decode_metadata(peer_metadata)
        regions = {n: RegionInfo.from_wire(n, v) for n, v in doc["regions"].items()}
        with self._lock:
            self._tables.clear()
            known = next((p for p in self._peers.values() if p.agent == doc["agent"]), None)
            if known is not None and known.engine_md == doc["engine_md"]:
                known.regions = regions
                return known.id
            peer = self._engine_connect(doc, regions, known)
            self._peers[peer.id] = peer
            return peer.id

    def disconnect(self, peer: str) -> None:
        """Forget a peer (no-op if unknown). Release its batches first."""
        with self._lock:
            p = self._peers.pop(peer, None)
            self._tables.clear()
            if p is not None:
                self._engine_disconnect(p)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def remote_regions(self, peer: str) -> dict[str, RegionInfo]:
        return dict(self._peer(peer).regions)

    # ------------------------------------------------------------------------------------ transfers
    def submit(self, op: Op, peer: str, descs: Sequence[Desc]) -> TransferHandle:
        """Post all ``descs`` as one batch. ValueError for bad descriptors (nothing is posted then).

        Engine failures do not raise here: the handle turns ``ERROR`` and :meth:`wait` raises.
        """
        self._check_open()
        if op not in OPS:
            raise ValueError(f"op={op!r} must be one of {OPS}")
        with self._lock:
            p = self._peer(peer)
            segs: Sequence[Segment]
            if isinstance(descs, DescArray):
                arr = resolve_array(descs, self._tables_for(p, descs))
                nbytes, names = arr.nbytes, frozenset(r.name for r in arr.used("local"))
                segs = arr if self.takes_arrays else list(arr)
            else:
                segs = resolve(descs, {n: r.info for n, r in self._regions.items()}, p.regions, peer)
                nbytes, names = sum(s.length for s in segs), frozenset(s.local.name for s in segs)
            self._engine_validate(p, segs)
            h = TransferHandle(next(self._hids), op, peer, len(segs), nbytes, names)
            st = self._stats
            st["batches"] += 1
            st["descriptors"] += len(segs)
            st["bytes"] += nbytes
            st[f"{op.lower()}_batches"] += 1
            st["last_batch_descriptors"] = len(segs)
            st["max_batch_descriptors"] = max(st["max_batch_descriptors"], len(segs))
            self._handles[h.id] = h
            try:
                st["engine_requests"] += self._engine_submit(h, p, segs)
            except Exception as e:  # noqa: BLE001 - any engine failure becomes the batch's error
                self._fail(h, f"submit failed: {type(e).__name__}: {e}")
        return h

    def _tables_for(self, p: _Peer, descs: DescArray) -> RegionTables:
        """``descs``' regions resolved, kept per (peer, local names, remote names) until a region or a
        peer changes: batches between the same regions (every pull of one configuration) look their
        regions up once. The same tables object comes back each time, so engines may key their own
        per-region state on it (holding it, so that its id is not reused)."""
        key = (p.id, descs.local_names, descs.remote_names)
        hit = self._tables.get(key)
        if hit is None:
            if len(self._tables) >= 256:
                self._tables.clear()
            local = {n: r.info for n, r in self._regions.items()}
            hit = self._tables[key] = region_tables(descs, local, p.regions, p.id)
        return hit

    def poll(self, handle: TransferHandle) -> Status:
        """PENDING, DONE or ERROR; never blocks."""
        with self._lock:
            return self._refresh(handle)

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until the batch is DONE; TransferError if it failed, TransferTimeout after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        spins = 0
        if not handle.released:
            try:
                self._engine_block(handle, timeout_s)
            except Exception:  # noqa: BLE001 - the poll below reports the batch's state
                pass
        while True:
            s = self.poll(handle)
            if s == "DONE":
                return
            if handle.released and s == "PENDING":
                raise TransferError(self._describe(handle, "was released before it completed"))
            if s == "ERROR":
                raise TransferError(self._describe(handle, f"failed: {handle.error}"))
            now = time.monotonic()
            if now >= deadline:
                self._stats["timeouts"] += 1
                raise TransferTimeout(
                    self._describe(
                        handle,
                        f"not done after {timeout_s:.3g} s; it may still be in flight: keep its buffers "
                        f"out of reuse for {self.drain_s:.3g} s or until close()",
                    )
                )
            # Spin briefly (sub-ms transfers), then back off to at most 1 ms between polls.
            spins += 1
            time.sleep(0 if spins < 200 else min(1e-3, 2e-5 * (spins - 199)))

    def transfer(self, op: Op, peer: str, descs: Sequence[Desc], timeout_s: float) -> None:
        """submit + wait + release, for callers that need no overlap."""
        h = self.submit(op, peer, descs)
        try:
            self.wait(h, timeout_s)
        finally:
            self.release(h)

    def release(self, handle: TransferHandle) -> None:
        """Free the engine's request. Always safe and idempotent.

        Releasing a PENDING handle asks the engine to cancel; it does NOT make the buffers safe to reuse:
        after ERROR, a timeout or such a release, keep the batch's ranges out of reuse for ``drain_s``.
        """
        with self._lock:
            if handle.released:
                return
            handle.released = True
            self._handles.pop(handle.id, None)
        try:
            self._engine_release(handle)
        except Exception:  # noqa: BLE001 - release must never raise; engines park what they cannot free
            pass

    # ---------------------------------------------------------------------------------------- stats
    @staticmethod
    def _zero_stats() -> dict[str, int]:
        keys = (
            "batches descriptors bytes engine_requests read_batches write_batches completed failed timeouts "
            "last_batch_descriptors max_batch_descriptors"
        )
        return dict.fromkeys(keys.split(), 0)

    def stats(self) -> dict[str, int]:
        """Counters since creation (or reset_stats).

        ``batches`` = submit() calls (HAWK transfer requests are their ``descriptors``; per transfer:
        descriptors / batches), ``bytes``, ``engine_requests`` = requests the engine was handed (1 per
        batch unless it had to split: Mooncake over 1024 descriptors, NIXL mixing DRAM and VRAM),
        ``read_batches``/``write_batches``, outcomes ``completed``/``failed``/``timeouts``, and
        ``last_batch_descriptors``/``max_batch_descriptors``.
        """
        return dict(self._stats)

    def reset_stats(self) -> None:
        self._stats = self._zero_stats()

    # ------------------------------------------------------------------------------------- teardown
    def close(self) -> None:
        """Release batches, drop peers, unregister regions, stop the engine — in that order. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.values())
        for h in handles:
            self.release(h)
        self._engine_quiesce()
        with self._lock:
            for p in list(self._peers.values()):
                try:
                    self._engine_disconnect(p)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            self._peers.clear()
            for r in list(self._regions.values()):
                try:
                    self._engine_deregister(r.info, r.token)
                except Exception:  # noqa: BLE001
                    pass
            self._regions.clear()
        self._engine_close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.agent_name} regions={len(self._regions)} peers={len(self._peers)}>"

    # ------------------------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name} transport {self.agent_name} is closed")

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise TransportError(f"{self.name}: unknown peer {peer!r}; connect() it first (have {sorted(self._peers)})")
        return p

    def _decode_metadata(self, blob: bytes) -> dict[str, Any]:
        try:
            doc = msgpack.unpackb(blob, raw=False)
            ok = isinstance(doc, dict) and isinstance(doc.get("regions"), dict) and "engine_md" in doc
        except Exception as e:  # noqa: BLE001 - any decode error means malformed metadata
            raise ConnectError(f"{self.name}: malformed peer metadata ({type(e).__name__}: {e})") from e
        if not ok:
            raise ConnectError(f"{self.name}: malformed peer metadata (not a HAWK transport blob)")
        if doc.get("hawk_transport") != METADATA_VERSION:
            v = doc.get("hawk_transport")
            raise ConnectError(f"{self.name}: peer metadata version {v!r} != {METADATA_VERSION}")
        if doc.get("engine") != self.name:
            raise ConnectError(f"peer metadata is for transport {doc.get('engine')!r}, this is {self.name!r}")
        return doc

    def _refresh(self, h: TransferHandle) -> Status:
        if h.status == "PENDING" and not h.released:
            try:
                s, err = self._engine_poll(h)
            except Exception as e:  # noqa: BLE001
                s, err = "ERROR", f"{type(e).__name__}: {e}"
            if s == "DONE":
                h.status = "DONE"
                self._stats["completed"] += 1
            elif s == "ERROR":
                self._fail(h, err or "engine reported an error")
        return h.status

    def _fail(self, h: TransferHandle, why: str) -> None:
        if h.status != "ERROR":
            h.status, h.error = "ERROR", why
            self._stats["failed"] += 1

    def _describe(self, h: TransferHandle, what: str) -> str:
        return (
            f"{self.name}: {h.op} batch #{h.id} ({h.descriptors} descriptor(s), {h.nbytes} B) "
            f"with peer {h.peer!r} {what}"
        )

    # ------------------------------------------------------------------------------- engine hooks
    @abc.abstractmethod
    def _engine_register(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        """Register memory with the engine; return a token for deregistration."""

    @abc.abstractmethod
    def _engine_deregister(self, info: RegionInfo, token: Any) -> None: ...

    @abc.abstractmethod
    def _engine_metadata(self) -> bytes:
        """Engine connection info (agent metadata, segment name, IPC handles...)."""

    @abc.abstractmethod
    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        """Make the peer reachable; ``known`` is the same agent connected before with older metadata."""

    @abc.abstractmethod
    def _engine_disconnect(self, peer: _Peer) -> None: ...

    def _engine_validate(self, peer: _Peer, segs: list[Segment]) -> None:
        """Raise ValueError for descriptors this engine cannot move (before anything is posted)."""

    @abc.abstractmethod
    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: list[Segment]) -> int:
        """Post the batch; store engine state in ``h.engine_state``; return engine requests posted."""

    @abc.abstractmethod
    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]: ...

    @abc.abstractmethod
    def _engine_release(self, h: TransferHandle) -> None: ...

    def stream_ordered(self, peer: str) -> bool:
        """Whether a batch to ``peer`` reads and writes device memory in order after the work already
        enqueued on the caller's current CUDA stream (so it may be posted before that work has run, as
        a layer-wise push does from the forward's thread). False: post only bytes that are ready."""
        return False

    def peer_tensors(self, peer: str, names: Sequence[str]) -> list[torch.Tensor] | None:
        """The peer's regions ``names``, in that order, as flat uint8 tensors this process's kernels can
        write; None where this engine cannot give them (another host or GPU, a paced link).

        Why: a sender that can address the receiver's memory writes its bytes there in the pass that
        produces them: no staging, no copy. The tensors stay valid while the peer is connected;
        ordering and completing those writes is the caller's (on its CUDA stream), and nothing here
        checks them against the regions' bounds: the caller writes inside each ``[0, numel)`` only."""
        return None

    def peer_memory(self, peer: str, names: Sequence[str]) -> torch.Tensor | None:
        """:meth:`peer_tensors` when they are back to back in one allocation, as one flat uint8 tensor;
        None otherwise (or where there are none)."""
        views = self.peer_tensors(peer, names)
        return None if views is None else contiguous_span(views)

    def _engine_block(self, h: TransferHandle, timeout_s: float) -> None:
        """Block until ``h`` is likely finished, without holding the GIL, where the engine can (CUDA
        events); :meth:`wait` polls afterwards either way. The default returns at once (wait spins).

        Why: ``wait`` runs on connector threads of processes whose engine thread is host-bound Python
        (a prefill enqueuing its forward, a decode loop); a spinning poll takes the GIL from it."""

    def _engine_quiesce(self) -> None:
        """Stop engine activity before peers are dropped and memory is unregistered (close())."""

    @abc.abstractmethod
    def _engine_close(self) -> None: ...
