"""Same-host transports built on torch copies: "local" (one process) and "cuda-ipc" (two processes).

"local" serves tests and the colocated mode: peers are other LocalTransport objects of this process,
found by agent name, and a batch is a run of ``copy_`` calls on byte views (cpu<->cpu synchronously;
anything touching CUDA on a dedicated stream, completed by a CUDA event).

"cuda-ipc" reaches a peer process on the same host: its metadata carries a CUDA IPC handle for every
registered CUDA region; connect() opens them (torch's own IPC rebuild, so ref counting and the
producer's sync event are honoured) and batches are peer copies on a dedicated stream. Host regions of
a *peer* cannot be reached this way (pageable memory has no IPC handle); local host regions can be the
other end of a copy. There is no engine-level liveness: submit checks that the peer pid still exists,
and the connector's control channel is what notices a peer that dies mid-copy. Each metadata() call
exports fresh handles (torch counts one consumer per export): publish one blob per peer. Teardown: the
consumer disconnects (or closes) before the producer frees or exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from hawk.devices.batched_copy import MIN_PAIRS, copy_spans
from hawk.devices.cuda_runtime import DEVICE_TO_DEVICE, CudaRuntimeError, Runtime, runtime
from hawk.devices.span_copier import RawEvent, SpanCopier
from hawk.transport.base import (
    ConnectError,
    RegionInfo,
    SegArray,
    Segment,
    Status,
    TransferError,
    TransferHandle,
    Transport,
    TransportUnavailable,
    _Peer,
    byte_view,
    used_regions,
)

log = logging.getLogger(__name__)
_REGISTRY: dict[str, weakref.ref[LocalTransport]] = {}
_REGISTRY_LOCK = threading.Lock()


class _CopyBatch:
    """Completion of one batch of copies: CPU ones are done at submit, CUDA ones end at their events."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def done(self) -> bool:
        return all(ev.query() for ev in self.events)

    def block(self) -> None:
        """Until every copy has run; the GIL is released while the host waits on the events."""
        for ev in self.events:
            ev.synchronize()


def _side_stream(streams: dict[int, Any], dev: torch.device) -> Any:
    idx = int(dev.index or 0)
    s = streams.get(idx)
    if s is None:
        s = streams[idx] = torch.cuda.Stream(device=dev)
    return s


# ------------------------------------------------------------------------- same-GPU copies, fast path
#: How same-GPU copies are issued: "torch" (``copy_`` per pair, the default) or "raw" (cudaMemcpyAsync
#: of the CUDA runtime torch loaded, :mod:`hawk.devices.cuda_runtime`, once it passes a self-test on the device).
#: On an H200 (2026-11-30, tests/test_transport_auto.py with -s, two runs) 256 MiB moved at 532 / 947 GB/s
#: with torch and 258 / 661 raw in one process, 969 / 474 torch and 541 / 688 raw over cuda-ipc: raw is
#: not reliably faster for large copies, so it is opt-in (docs/transport.md).
COPY_ENV = "HAWK_CUDA_COPY"
_SELF_TESTED: dict[int, bool] = {}  # per device index: the raw copy's self-test passed


def _raw_copy_fn(dev: torch.device) -> Runtime | None:
    """The raw runtime for same-device copies on ``dev`` if enabled and self-tested there, else None (use torch)."""
    if os.environ.get(COPY_ENV, "torch") != "raw":
        return None
    idx = int(dev.index if dev.index is not None else torch.cuda.current_device())
    rt = runtime()
    ok = _SELF_TESTED.get(idx)
    if ok is None:
        ok = False
        if rt is not None:
            try:  # a copy with odd offsets and length on a fresh stream, compared with torch's
                with torch.cuda.device(idx):
                    a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=dev)
                    b = torch.zeros_like(a)
                    st = torch.cuda.Stream(device=dev)
                    st.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(st):
                        rt.memcpy_async(b.data_ptr() + 3, a.data_ptr() + 5, 777_777, DEVICE_TO_DEVICE, st.cuda_stream)
                    st.synchronize()
                    ok = torch.equal(b[3 : 3 + 777_777], a[5 : 5 + 777_777]) and not b[:3].any()
            except Exception as e:  # noqa: BLE001 - any failure: keep torch's copies
                log.warning("same-GPU copies use torch (cudaMemcpyAsync self-test raised %s)", e)
                ok = False
            if not ok:
                log.warning("same-GPU copies use torch (cudaMemcpyAsync self-test failed on cuda:%d)", idx)
        _SELF_TESTED[idx] = ok
    return rt if ok else None


@contextlib.contextmanager
def _on_side_streams(streams: dict[int, Any], sdev: torch.device | None, ddev: torch.device | None) -> Any:
    """Make the side stream of each CUDA device of a (src, dst) group current, after it waited for that
    device's current stream; yields (the group's CUDA devices, whether it is one GPU to itself)."""
    devs = [d for d in (sdev, ddev) if d is not None]
    if len(devs) == 2 and devs[0] == devs[1]:
        devs = devs[:1]
    with contextlib.ExitStack() as stack:
        for d in devs:
            s = _side_stream(streams, d)
            s.wait_stream(torch.cuda.current_stream(d))
            stack.enter_context(torch.cuda.stream(s))
        same_gpu = len(devs) == 1 and sdev is not None and ddev is not None
        if same_gpu:
            stack.enter_context(torch.cuda.device(devs[0]))
        yield devs, same_gpu


def _raw_copies(raw: Runtime, side: Any, copies: Any) -> None:
    """``(dst address, src address, bytes)`` as raw cudaMemcpyAsync calls on ``side``."""
    sp = side.cuda_stream
    for d, s, n in copies:
        try:
            raw.memcpy_async(d, s, n, DEVICE_TO_DEVICE, sp)
        except CudaRuntimeError as e:
            side.synchronize()  # the pairs issued so far end before the batch is reported failed
            raise TransferError(f"device-to-device copy of {n} B: {e}") from e


#: One copy of a batch: (dst region's bytes, dst offset, src region's bytes, src offset, length). The
#: region tensors are whole registered regions (flat uint8); offsets were validated by the transport.
Span = tuple[torch.Tensor, int, torch.Tensor, int, int]


def copy_span_batch(spans: list[Span], streams: dict[int, Any],
                    copiers: dict[int, SpanCopier | None] | None = None) -> _CopyBatch:
    """Copy byte ranges of whole regions, as transports hold them; CUDA copies go on dedicated side
    streams, one per device, and the batch completes at their events.

    CPU<->CPU ranges are plain memcpys, done on return. Ranges touching CUDA are grouped by their
    (src device, dst device); each group is issued inside its side streams (both devices' for a peer
    copy, so torch's cross-device sync stays off the default streams), after those streams waited for
    the devices' current streams (data written by earlier kernels of this process is copied). Ranges
    are grouped by their (dst region, src region) first, so per-range host work is a tuple append and
    no tensor view is made where none is needed. A group on one GPU with
    :data:`~hawk.devices.batched_copy.MIN_PAIRS` ranges or more is one launch whose address table is
    computed with numpy (:func:`~hawk.devices.batched_copy.copy_spans`): a gg-direct pull is 160
    ranges, a direct-placement gn-hawk pull over a thousand, and a ``copy_`` each costs microseconds.
    With ``HAWK_CUDA_COPY=raw`` a smaller same-GPU group is raw cudaMemcpyAsync calls (see COPY_ENV).
    ``copiers`` (the caller's, per device index): a same-GPU group of many ranges goes through a
    :class:`~hawk.devices.span_copier.SpanCopier` on that device's side stream, with no torch stream
    switch, allocation or event on the host (where the raw runtime loads; else as above)."""
    by_regions: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]] = {}
    for dst, doff, src, soff, n in spans:
        entry = by_regions.get((id(dst), id(src)))
        if entry is None:
            entry = by_regions[(id(dst), id(src))] = (dst, src, [])
        entry[2].append((doff, soff, n))
    groups: dict[tuple[torch.device | None, torch.device | None], list[tuple[torch.Tensor, torch.Tensor, list]]] = {}
    for dst, src, items in by_regions.values():
        if not dst.is_cuda and not src.is_cuda:
            for doff, soff, n in items:
                dst[doff : doff + n].copy_(src[soff : soff + n])
            continue
        key = (src.device if src.is_cuda else None, dst.device if dst.is_cuda else None)
        groups.setdefault(key, []).append((dst, src, items))
    events: list[Any] = []
    for (sdev, ddev), parts in groups.items():
        if copiers is not None and sdev is not None and sdev == ddev and sum(len(it) for _, _, it in parts) >= MIN_PAIRS:
            ev = _copier_batch(copiers, streams, sdev, parts)
            if ev is not None:
                events.append(ev)
                continue
        with _on_side_streams(streams, sdev, ddev) as (devs, same_gpu):
            done, last = False, devs[0]  # last: the device whose side stream runs the batch's final step
            many = sum(len(items) for _, _, items in parts) >= MIN_PAIRS
            if many and len(devs) == 2:
                done, last = _peer_span_copy(_span_addresses(parts), devs[0], devs[1]), devs[1]  # ends with the scatter
            elif many and same_gpu:
                t = _span_addresses(parts)
                done = copy_spans(devs[0], t[:, 0], t[:, 1], t[:, 2])  # many ranges on one GPU: one launch
            if not done:
                last = devs[0]
                raw = _raw_copy_fn(devs[0]) if same_gpu else None
                if raw is not None:
                    _raw_copies(raw, _side_stream(streams, devs[0]),
                                ((dst.data_ptr() + doff, src.data_ptr() + soff, n) for dst, src, items in parts
                                 for doff, soff, n in items))  # fmt: skip
                else:
                    for dst, src, items in parts:
                        for doff, soff, n in items:
                            dst[doff : doff + n].copy_(src[soff : soff + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(_side_stream(streams, last))
        events.append(ev)
    return _CopyBatch(events)


def _copier_for(copiers: dict[int, SpanCopier | None], streams: dict[int, Any], dev: torch.device) -> SpanCopier | None:
    """The SpanCopier on ``dev``'s side stream, made on first use (None where the raw runtime is not loaded)."""
    idx = int(dev.index if dev.index is not None else torch.cuda.current_device())
    if idx not in copiers:
        copiers[idx] = SpanCopier.for_stream(_side_stream(streams, dev))
    return copiers[idx]


def _copier_batch(copiers: dict[int, SpanCopier | None], streams: dict[int, Any], dev: torch.device,
                  parts: list[tuple[torch.Tensor, torch.Tensor, list]]) -> RawEvent | None:
    """A same-GPU group through the device's SpanCopier; None: not taken."""
    copier = _copier_for(copiers, streams, dev)
    if copier is None:
        return None
    t = _span_addresses(parts)
    return copier.copy(t[:, 0], t[:, 1], t[:, 2])


def _span_addresses(parts: list[tuple[torch.Tensor, torch.Tensor, list]]) -> np.ndarray:
    """``[n, 3]`` int64 (source address, destination address, bytes) of a group's ranges."""
    flat: list[tuple[int, int, int]] = []
    for dst, src, items in parts:
        dp, sp = dst.data_ptr(), src.data_ptr()
        flat.extend([(sp + soff, dp + doff, n) for doff, soff, n in items])
    return np.array(flat, dtype=np.int64).reshape(-1, 3)


def _peer_span_copy(t: np.ndarray, sdev: torch.device, ddev: torch.device) -> bool:
    """Many ranges from one GPU to another (``t``: :func:`_span_addresses`) as three launches: gather
    them into one packed buffer on the source GPU, one peer copy of it, scatter on the destination GPU
    (the side streams current). Per-range peer copies cost a torch ``copy_`` each: a layer-wise push
    of one layer is dozens of ranges, a direct-placement pull thousands. False (nothing copied) where
    a range is not 8-byte aligned."""
    src, dst, n = t[:, 0], t[:, 1], t[:, 2]
    if ((src | dst | n) % 8).any():
        return False
    pack = np.cumsum(n) - n
    total = int(n.sum())
    tmp_s = torch.empty(total, dtype=torch.uint8, device=sdev)  # on the side streams: stream-ordered reuse
    tmp_d = torch.empty(total, dtype=torch.uint8, device=ddev)
    if not copy_spans(sdev, src, tmp_s.data_ptr() + pack, n, force=True):
        return False
    tmp_d.copy_(tmp_s, non_blocking=True)
    return copy_spans(ddev, tmp_d.data_ptr() + pack, dst, n, force=True)


class LocalTransport(Transport):
    """Peers are LocalTransport objects in this process; copies with torch."""

    name = "local"
    takes_arrays = True  # a same-GPU SegArray is one SpanCopier launch; anything else is copied as Segments
    drain_s = 0.0  # copies are issued at submit: nothing keeps running after an error

    def __init__(self, agent_name: str | None = None) -> None:
        super().__init__(agent_name)
        self._streams: dict[int, Any] = {}
        self._copiers: dict[int, SpanCopier | None] = {}
        self._pointers: dict[tuple, tuple] = {}  # see _region_pointers
        with _REGISTRY_LOCK:
            if self.agent_name in _REGISTRY and _REGISTRY[self.agent_name]() is not None:
                raise ValueError(f"agent name {self.agent_name!r} is already used in this process")
            _REGISTRY[self.agent_name] = weakref.ref(self)

    # regions: the token is the flat byte view the copies slice
    def _engine_register(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        return byte_view(tensor)

    def _engine_deregister(self, info: RegionInfo, token: Any) -> None:
        pass

    def _engine_metadata(self) -> bytes:
        return b""

    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        if doc.get("pid") != os.getpid() or doc.get("host") != socket.gethostname():
            raise ConnectError(
                f"{self.name}: peer {doc.get('agent')!r} lives in process {doc.get('pid')} on {doc.get('host')!r}; "
                "this transport only reaches transports of this process (use cuda-ipc, nixl or mooncake)"
            )
        return _Peer(doc["agent"], doc["agent"], regions, doc["engine_md"], _lookup(doc["agent"], self.name))

    def _engine_disconnect(self, peer: _Peer) -> None:
        pass

    def _peer_ready(self, peer: _Peer) -> None:
        """Fail the batch early when the peer is gone (checked once per batch)."""
        other = peer.state()
        if other is None or other.closed:
            raise TransferError(f"peer {peer.id!r} is closed")

    def _peer_region(self, peer: _Peer, remote: RegionInfo) -> torch.Tensor:
        """The peer's whole region ``remote`` as flat bytes: straight from the peer object (same process)."""
        reg = peer.state()._regions.get(remote.name)
        if reg is None or reg.info != remote:
            raise TransferError(f"peer region {remote.name!r} was deregistered or changed since connect()")
        return reg.token

    def _peer_view(self, peer: _Peer, seg: Segment) -> torch.Tensor:
        """The peer's bytes for ``seg``."""
        return self._peer_region(peer, seg.remote)[seg.remote_offset : seg.remote_offset + seg.length]

    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: Sequence[Segment]) -> int:
        self._peer_ready(peer)
        if isinstance(segs, SegArray):
            batch = self._array_batch(peer, segs, h.op == "READ")
            if batch is not None:
                h.engine_state = batch
                return 1
        # Each region is looked up (and a peer's checked) once per batch, not once per descriptor.
        local: dict[str, torch.Tensor] = {}
        remote: dict[str, torch.Tensor] = {}
        spans: list[Span] = []
        read = h.op == "READ"
        for s in segs:
            lt = local.get(s.local.name)
            if lt is None:
                lt = local[s.local.name] = self._regions[s.local.name].token
            rt = remote.get(s.remote.name)
            if rt is None:
                rt = remote[s.remote.name] = self._peer_region(peer, s.remote)
            if read:
                spans.append((lt, s.local_offset, rt, s.remote_offset, s.length))
            else:
                spans.append((rt, s.remote_offset, lt, s.local_offset, s.length))
        h.engine_state = copy_span_batch(spans, self._streams, self._copiers)
        return 1

    def _array_batch(self, peer: _Peer, segs: SegArray, read: bool) -> _CopyBatch | None:
        """A batch given as arrays, when every region it names is on one CUDA device: addresses by
        numpy, one SpanCopier launch, no object per descriptor. None: the caller copies it as Segments."""
        ptrs = self._region_pointers(peer, segs)
        if ptrs is None:
            return None
        dev, lptr, rptr = ptrs
        lbase = lptr[segs.local_idx] + segs.local_offset
        rbase = rptr[segs.remote_idx] + segs.remote_offset
        src, dst = (rbase, lbase) if read else (lbase, rbase)
        copier = _copier_for(self._copiers, self._streams, dev)
        ev = copier.copy(src, dst, segs.length) if copier is not None else None
        return _CopyBatch([ev]) if ev is not None else None

    def _region_pointers(self, peer: _Peer, segs: SegArray) -> tuple[torch.device, np.ndarray, np.ndarray] | None:
        """(device, local and remote region addresses) of a batch's region tables, or None where they are
        not all on one CUDA device. Kept per tables object (the transport hands the same one for the
        same regions until they change; the entry holds it, so its id stays unique)."""
        other = peer.state() if callable(peer.state) else None  # a peer in this process: its regions may change
        version = other._region_version if other is not None else None
        key = (peer.id, id(segs.local), id(segs.remote))
        hit = self._pointers.get(key)
        if hit is not None and all(a is b for a, b in zip(hit, (segs.local, segs.remote, peer.state))) and hit[3] == version:
            return hit[4]
        local = [self._regions[r.name].token for r in segs.local]
        remote = [self._peer_region(peer, r) for r in segs.remote]
        dev = local[0].device
        ptrs = None
        if dev.type == "cuda" and all(t.device == dev for t in (*local, *remote)):
            ptrs = (dev, np.array([t.data_ptr() for t in local], dtype=np.int64),
                    np.array([t.data_ptr() for t in remote], dtype=np.int64))
        if len(self._pointers) >= 64:
            self._pointers.clear()
        self._pointers[key] = (segs.local, segs.remote, peer.state, version, ptrs)
        return ptrs

    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]:
        return ("DONE" if h.engine_state.done() else "PENDING"), None

    def _engine_release(self, h: TransferHandle) -> None:
        h.engine_state = None

    def stream_ordered(self, peer: str) -> bool:
        return True  # copy_span_batch's side streams wait for the caller's current stream first

    def peer_tensors(self, peer: str, names: Sequence[str]) -> list[torch.Tensor] | None:
        with self._lock:
            p = self._peer(peer)
            try:
                return [self._peer_region(p, p.regions[n]) for n in names]
            except (KeyError, TransferError):
                return None

    def _engine_block(self, h: TransferHandle, timeout_s: float) -> None:
        batch = h.engine_state
        if batch is not None:
            batch.block()  # device copies end in microseconds to milliseconds: no timeout needed here

    def _engine_close(self) -> None:
        for s in self._streams.values():
            s.synchronize()  # in-flight copies still use tensors we are about to drop
        for c in self._copiers.values():
            if c is not None:
                c.close()
        self._copiers.clear()
        self._streams.clear()
        with _REGISTRY_LOCK:
            ref = _REGISTRY.get(self.agent_name)
            if ref is not None and ref() in (self, None):
                del _REGISTRY[self.agent_name]


def _lookup(agent: str, engine: str) -> weakref.ref[LocalTransport]:
    with _REGISTRY_LOCK:
        ref = _REGISTRY.get(agent)
    t = ref() if ref is not None else None
    if t is None or t.closed:
        raise ConnectError(f"{engine}: no open transport named {agent!r} in this process")
    return ref  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------- cuda-ipc
def _export_ipc(view: torch.Tensor) -> list[Any]:
    """CUDA IPC handle of a uint8 view, via torch's reduction (one export per metadata() call)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(view)
    (_, size, _stride, toff, _scls, _dtype, dev, handle, ssize, soff, _rg, rch, rco, evh, evs) = args
    return [int(dev), bytes(handle), int(ssize), int(soff), bytes(rch), int(rco), evh, bool(evs), int(toff),
            int(size[0])]  # fmt: skip


def _open_ipc(w: list[Any]) -> torch.Tensor:
    """Open a peer's exported region as a uint8 tensor of this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dev, handle, ssize, soff, rch, rco, evh, evs, toff, n = w
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([n]), (1,), toff, torch.storage.TypedStorage, torch.uint8,
        dev, handle, ssize, soff, False, rch, rco, evh, evs,
    )  # fmt: skip


class CudaIpcTransport(LocalTransport):
    """Two processes, one host, CUDA: peer copies through CUDA IPC handles (same process: like local)."""

    name = "cuda-ipc"

    def __init__(self, agent_name: str | None = None) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailable("cuda-ipc transport needs CUDA, and torch.cuda.is_available() is False")
        super().__init__(agent_name)

    def _engine_metadata(self) -> bytes:
        # A fresh export per call: each blob is meant for one peer (torch counts one consumer per export).
        handles = {n: _export_ipc(r.token) for n, r in self._regions.items() if r.info.device == "cuda"}
        return msgpack.packb(handles, use_bin_type=True)

    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        if doc.get("pid") == os.getpid():
            return super()._engine_connect(doc, regions, known)
        if doc.get("host") != socket.gethostname():
            raise ConnectError(f"cuda-ipc: peer {doc.get('agent')!r} is on host {doc.get('host')!r}, not this one")
        if known is not None and isinstance(known.state, dict):
            for s in self._streams.values():
                s.synchronize()  # the old mappings are dropped when the new peer replaces it: copies end first
        try:
            handles = msgpack.unpackb(doc["engine_md"], raw=False)
            opened = {n: _open_ipc(w) for n, w in handles.items()}
        except Exception as e:  # noqa: BLE001 - any failure to open is a connect failure
            raise ConnectError(f"cuda-ipc: cannot open the IPC handles of peer {doc.get('agent')!r}: {e}") from e
        return _Peer(doc["agent"], doc["agent"], regions, doc["engine_md"], {"pid": int(doc["pid"]), "opened": opened})

    def _engine_validate(self, peer: _Peer, segs: Sequence[Segment]) -> None:
        if isinstance(peer.state, dict):
            for r in used_regions(segs, "remote"):
                if r.name not in peer.state["opened"]:
                    i = next(i for i, s in enumerate(segs) if s.remote.name == r.name)
                    raise ValueError(
                        f"descriptor {i}: remote region {r.name!r} is {r.device} memory of another "
                        "process; cuda-ipc reaches only a peer's CUDA regions"
                    )

    def _peer_ready(self, peer: _Peer) -> None:
        if not isinstance(peer.state, dict):
            return super()._peer_ready(peer)
        try:
            os.kill(peer.state["pid"], 0)  # existence check only
        except ProcessLookupError:
            raise TransferError(f"peer process {peer.state['pid']} ({peer.id!r}) is gone") from None
        except PermissionError:
            pass

    def _peer_region(self, peer: _Peer, remote: RegionInfo) -> torch.Tensor:
        if not isinstance(peer.state, dict):
            return super()._peer_region(peer, remote)
        return peer.state["opened"][remote.name]

    def _engine_disconnect(self, peer: _Peer) -> None:
        if isinstance(peer.state, dict):
            for s in self._streams.values():
                s.synchronize()  # copies from the peer's memory must end before we unmap it
            peer.state["opened"].clear()
