"""What the sending side sends: the form a request's KV takes in the sender's registered memory.

- ``npu-tiles``: HAWK's transform output (NPU tiles grouped by channel) in a staging region.
- ``compact``  : the request's vLLM blocks gathered in order, in a staging region (host for ``*-host``).
- ``cache``    : nothing is produced; the peer reads blocks straight out of the paged cache (gg-direct).
- ``npu-pages``: the reverse direction (paper §4.5.3): an NPU prefill gathers the request's pages into
  its per-channel buffers, so each channel is one contiguous request toward the GPU.

A format owns its staging memory: it reserves (P4), fills (P3 + P5), says where the bytes are (P7) and
releases (P9). Algorithm 1 only sequences those calls.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from hawk.devices.batched_copy import copy_regions, span_table
from hawk.devices.streams import synchronize_current
from hawk.devices.ipc_events import EventRecorder
from hawk.layouts.gpu import PAGED_LAYOUTS
from hawk.layouts.npu import NpuKVLayout
from hawk.memory.buffers import ChannelBuffers, StagingBuffer
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.memory.reservations import Reservation
from hawk.plan.block_plan import BlockCopyPlan, Paged, plan_block_copy
from hawk.plan.kv_plan import KVTransferPlan, TileDest
from hawk.plan.layer_plan import LayerwisePlan, plan_layerwise
from hawk.plan.plan_cache import LRU, PLANS
from hawk.transform import bind, bind_layers, transform
from hawk.transport.base import Desc, DescArray, contiguous_span

#: Transport region name of a sender's staging buffer.
STAGING_REGION = "staging"


@dataclass
class Held:
    """What one request holds on one side between reserving and releasing."""

    mode: str
    reservations: dict[Any, Reservation] = field(default_factory=dict)


@dataclass(eq=False)
class DirectTarget:
    """A layer-wise push written by its producing kernels straight into the receiver's memory: the
    receiver's regions as one tensor here, layer 0's destination in it and each layer's byte shift
    from layer 0 (the sender's transform does P3 and P5 in one pass; no staging, no WRITE)."""

    memory: torch.Tensor
    dest: TileDest
    shifts: list[int]


@dataclass
class Staged:
    """Where a request's bytes wait in the sender's registered memory: what P7 reports.

    ``sources`` is set when the bytes are spread over several regions (one per channel extent).
    """

    held: Held
    region: str = ""
    offset: int = 0
    sources: list[list] = field(default_factory=list)
    #: Host seconds spent in P4 (``reserve_s``), launching P3 + P5 (``transform_s``) and waiting for
    #: them (``transform_wait_s``): the sender's half of the host-side breakdown.
    timings: dict[str, float] = field(default_factory=dict)
    #: A landed pull answered before its transform ended: the IPC handle of the CUDA event that fires
    #: when the bytes are in the decode's pages (``hawk.devices.ipc_events``); empty when they are there.
    ready_event: bytes = b""


def cache_region(layer: int) -> str:
    """Transport region name of one layer's paged cache (both sides of gg-direct use it)."""
    return f"kv-L{layer}"


def channel_region(channel: int) -> str:
    """Transport region name of one NPU DRAM channel's window."""
    return f"npu-ch{channel}"


def channel_regions(channels: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """Runs' channel numbers as a :class:`DescArray` side: the channels' region names (each once)
    and every run's index into them."""
    uniq, idx = np.unique(np.asarray(channels, dtype=np.int64), return_inverse=True)
    return tuple(channel_region(int(c)) for c in uniq), idx.reshape(-1)


def _landed(memory: torch.Tensor, t0: float, events: EventRecorder | None) -> Staged:
    """A landed pull's bytes are queued on this thread's stream (on ``memory``'s device) since ``t0``: wait
    for them, or (with ``events``, for a receiver in another process) record the event it waits on instead."""
    t1 = time.perf_counter()
    handle = b""
    if events is not None and memory.is_cuda:
        handle = events.record(memory.get_device())  # the decode waits on it: D2 leaves while the bytes move
    else:
        _sync(memory)  # the decode hears of it (KVReady) only once it is there
    timings = {"reserve_s": 0.0, "transform_s": t1 - t0, "transform_wait_s": time.perf_counter() - t1}
    return Staged(Held("landed"), timings=timings, ready_event=handle)


def _sync(t: torch.Tensor) -> None:
    """Until the calling thread's stream on ``t``'s device has run (not the whole device: a GPU may hold
    both roles, and one request's step must not wait for another's forward)."""
    if t.is_cuda:
        synchronize_current(t.get_device())


class SendFormat(ABC):
    name: ClassVar[str]
    #: True when the peer reads the paged cache itself, so the blocks stay allocated until D9.
    reads_cache_in_place: ClassVar[bool] = False
    #: The sender's own KV layout (sent in the handshake).
    layout: Any

    @abstractmethod
    def regions(self) -> dict[str, torch.Tensor]:
        """Memory to register with the transport."""

    def hello_extra(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def plan(self, num_tokens: int, block_ids: Sequence[int], peer: dict[str, Any], dst_block_ids: Sequence[int]) -> Any:
        """Build this request's plan from the receiver's handshake info and its D1 request."""

    @abstractmethod
    def size(self, plan: Any) -> int:
        """Bytes the request occupies in the sender's memory."""

    @abstractmethod
    def stage(self, plan: Any, owner: str, ttl_s: float) -> Staged:
        """P4 + P3/P5: reserve and fill; raises BufferFull when there is no room (yet)."""

    def fits_empty(self, plan: Any) -> bool:
        """Whether :meth:`stage` could take ``plan`` with nothing else held (a pull that never can is
        refused at once instead of waiting for room)."""
        return True

    def release(self, held: Held) -> None:
        """P9: give back what ``stage`` reserved."""

    def live(self) -> list[Reservation]:
        return []

    def expire(self, now: float) -> list[Reservation]:
        return []

    def extents(self, plan: Any) -> list[list[int]]:
        return []

    # -- the layer-wise push (kv_flow=layerwise): the sender writes each layer into the receiver's
    # -- destination as soon as the prefill's forward has written it into the paged cache.

    #: Whether this format can push a request layer by layer.
    layerwise: ClassVar[bool] = False

    def plan_layers(self, num_tokens: int, block_ids: Sequence[int], peer: dict[str, Any], dst_block_ids: Sequence[int]) -> Any:
        """The layer-wise plan of one request, from the receiver's handshake and its destination."""
        raise ValueError(f"send format {self.name!r} cannot push layer by layer (kv_flow=layerwise supports gn-hawk and gg-direct)")

    def reserve_layers(self, plan: Any, owner: str, ttl_s: float) -> Staged:
        """Reserve what the layers will be produced into (nothing for a format read in place)."""
        return Staged(Held("in-place"))

    def produce_layers(self, plan: Any, layers: Sequence[int], staged: Staged) -> None:
        """Write these layers' bytes into their slices of ``staged`` (nothing when read in place); a
        group at once, as a push posts them, so per-call setup is paid once per group."""

    def dest_regions(self, peer: dict[str, Any]) -> list[str]:
        """The receiver's regions a layer-wise push (or a landed pull) of this format writes into, in
        address order."""
        return []

    def land(self, plan: Any, dests: Sequence[torch.Tensor], events: EventRecorder | None = None) -> Staged | None:
        """P3 + P5 of a pull with no P4: the request's bytes straight into the receiver's memory
        (:meth:`dest_regions`, as this process addresses them); None where this format cannot (the
        caller stages instead). Finished on return, or with ``events`` (a receiver in another process
        that waits on one) still running: ``Staged.ready_event`` then says when they are there."""
        return None

    def direct_target(self, plan: Any, dests: Sequence[torch.Tensor]) -> DirectTarget | None:
        """How to produce every layer of ``plan`` straight into the receiver's :meth:`dest_regions`
        (``dests``, as this process addresses them), or None: staging + WRITE."""
        return None

    def produce_layers_into(self, plan: Any, layers: Sequence[int], target: DirectTarget) -> None:
        """Produce these layers' bytes straight into the receiver's memory (:meth:`direct_target`)."""
        raise NotImplementedError

    def layer_descs(self, plan: Any, layer: int, staged: Staged) -> Sequence[Desc]:
        """Layer ``layer``'s WRITE batch, from this side's view: local = sender, remote = receiver (a
        list of Desc or a DescArray)."""
        raise NotImplementedError


class _InStagingBuffer(SendFormat):
    """A format whose bytes go into one registered staging buffer."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged, staging: StagingBuffer):
        layout.check_cache(list(caches))
        self.caches, self.layout, self.staging = list(caches), layout, staging

    def regions(self) -> dict[str, torch.Tensor]:
        return {STAGING_REGION: self.staging.tensor}

    @abstractmethod
    def produce(self, plan: Any, out: torch.Tensor) -> None:
        """Write the request's bytes into ``out`` (its reserved staging range)."""

    def stage(self, plan: Any, owner: str, ttl_s: float) -> Staged:
        t0 = time.perf_counter()
        res = self.staging.reserve(self.size(plan), owner, ttl_s)
        t1 = time.perf_counter()
        try:
            self.produce(plan, self.staging.view(res))
            t2 = time.perf_counter()
            _sync(self.staging.tensor)
        except BaseException:
            self.staging.ledger.release(res)
            raise
        t3 = time.perf_counter()
        return Staged(Held("staging", {0: res}), STAGING_REGION, res.offset, timings={"reserve_s": t1 - t0, "transform_s": t2 - t1, "transform_wait_s": t3 - t2})

    def fits_empty(self, plan: Any) -> bool:
        return self.staging.ledger.fits_empty(self.size(plan))

    def release(self, held: Held) -> None:
        for r in held.reservations.values():
            self.staging.ledger.release(r)

    def live(self) -> list[Reservation]:
        return self.staging.ledger.live()

    def expire(self, now: float) -> list[Reservation]:
        return self.staging.ledger.expire(now)


class NpuTiles(_InStagingBuffer):
    """HAWK: gather + re-block + tilize (+ bfloat8_b) + channel grouping, straight into staging."""

    name = "npu-tiles"

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged, staging: StagingBuffer, impl: str = "auto"):
        super().__init__(caches, layout, staging)
        self.impl = impl
        self._plans: LRU[tuple] = LRU(64)  # whole plans by receiver layout and bases, tokens and both sides' block ids
        self._spans: LRU[tuple] = LRU(8)  # a receiver's channels as one tensor, by its list of them
        self._landings: LRU[tuple] = LRU(64)  # bound transforms into a receiver's DRAM, by plan and its channel list
        self._layer_calls: LRU[tuple] = LRU(16)  # a layer-wise push's per-layer transform, by plan and destination

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> KVTransferPlan:
        """The request's plan, kept whole like gg-direct's landing copies: a repeated request (the same
        blocks on both sides, as idle pools hand back) costs a lookup instead of ~50-90 us of checks and
        assembly, and the transform's launch state kept on the plan object is reused with it. Keyed by
        the receiver's layout object (held by the entry, so its id stays unique), its bases (a tuple by
        its id, also held: a receiver's handshake gives one tuple, and hashing one int per tensor on every
        pull is host time; anything else by its contents), the token count with its type, and both id
        arrays as the planner converts them (shape and bytes)."""
        dst, bases = peer["layout"], peer["bases"]
        if not isinstance(dst, NpuKVLayout):
            raise ValueError("npu-tiles needs an NPU receiver layout")
        gids, nids = np.asarray(block_ids, dtype=np.int64), np.asarray(dst_block_ids, dtype=np.int64)
        key = (id(dst), id(bases) if type(bases) is tuple else tuple(bases), type(num_tokens), num_tokens,
               gids.shape, gids.tobytes(), nids.shape, nids.tobytes())
        return self._plans.get_or_build(key, lambda: (dst, bases, PLANS.kv_plan(num_tokens, gids, nids, self.layout, dst, bases)))[2]

    def size(self, plan: KVTransferPlan) -> int:
        return plan.total_bytes

    def produce(self, plan: KVTransferPlan, out: torch.Tensor) -> None:
        if out.device == self.caches[0].device:
            transform(self.caches, plan, out, self.impl)
        else:  # staging elsewhere (e.g. host): transform on the cache's device, then one copy
            out.copy_(transform(self.caches, plan, None, self.impl))

    def extents(self, plan: KVTransferPlan) -> list[list[int]]:
        return [list(e) for e in plan.channel_extents]

    # Layer-wise: the staging holds the request layer-major (hawk/plan/layer_plan.py); each layer's
    # tiles are written straight into their NPU cache pages (direct placement: no receive buffer
    # and no intra-channel copy on the decode side, whose pages were allocated before prefill).
    layerwise = True

    def plan_layers(self, num_tokens, block_ids, peer, dst_block_ids) -> LayerwisePlan:
        dst = peer["layout"]
        if not isinstance(dst, NpuKVLayout):
            raise ValueError("npu-tiles needs an NPU receiver layout")
        return plan_layerwise(num_tokens, block_ids, dst_block_ids, self.layout, dst, peer["bases"], PLANS.kv_plan)

    def reserve_layers(self, plan: LayerwisePlan, owner: str, ttl_s: float) -> Staged:
        res = self.staging.reserve(plan.total_bytes, owner, ttl_s)
        return Staged(Held("layerwise", {0: res}), STAGING_REGION, res.offset)

    def produce_layers(self, plan: LayerwisePlan, layers: Sequence[int], staged: Staged) -> None:
        n = plan.layer_bytes
        out = self.staging.view(staged.held.reservations[0])
        if out.device == self.caches[0].device:
            self._layer_call(plan, staged, lambda: (out, [i * n for i in range(plan.num_layers)], None))(*layers)
            return
        for layer in layers:
            out[layer * n : (layer + 1) * n].copy_(transform([self.caches[layer]], plan.plan, None, self.impl))

    def _layer_call(self, plan: LayerwisePlan, where: Any, args: Callable[[], tuple]) -> Callable[..., None]:
        """The push's transform of any layers (:func:`hawk.transform.bind_layers`), bound on its first
        layer and kept per (plan, destination): a push calls it once per group of layers from the
        forward's thread. The entry holds both, so their ids stay unique."""
        def build() -> tuple:
            out, shifts, dest = args()
            return plan, where, bind_layers(self.caches, plan.plan, out, shifts, self.impl, dest)

        return self._layer_calls.get_or_build((id(plan), id(where)), build)[2]

    def dest_regions(self, peer: dict[str, Any]) -> list[str]:
        return [channel_region(c) for c in range(peer["layout"].arch.num_channels)]

    def _memory_dest(self, plan: KVTransferPlan, memory: torch.Tensor) -> TileDest | None:
        """``plan``'s tiles in the decode's DRAM (``memory``: its channels back to back, equal sizes) if
        this GPU's kernels can write them there: None where that memory is elsewhere, the tensor
        bases are not evenly spaced, or an address does not fit the kernels' tables."""
        nch = plan.dst.arch.num_channels
        if memory.device != self.caches[0].device or memory.numel() % nch:
            return None
        try:
            dest = plan.memory_dest(memory.numel() // nch)
        except ValueError:
            return None
        return dest if dest.extent <= memory.numel() else None

    def _span(self, dests: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """:func:`contiguous_span` of a receiver's channels (~20 us), once per list: the sender looks a
        receiver's regions up once and passes the same list on every pull (the entry holds it, so its
        id stays unique)."""
        return self._spans.get_or_build(id(dests), lambda: (dests, contiguous_span(dests)))[1]

    def land(self, plan: KVTransferPlan, dests: Sequence[torch.Tensor], events: EventRecorder | None = None) -> Staged | None:
        """The tiles straight into the decode's pages (``dests``: its channels as this process addresses
        them), by ``plan``'s transform bound to them (:func:`hawk.transform.bind`), kept per (plan, dests)
        like gg-direct's landing copies: a repeated request (its plan kept whole) costs one lookup and one
        launch, not the transform's checks and setup again. The entry holds both, so their ids stay
        unique; a None (this GPU cannot write those pages) is kept too."""
        _, _, memory, run = self._landings.get_or_build((id(plan), id(dests)), lambda: (plan, dests, *self._bind_landing(plan, dests)))
        if run is None:
            return None
        t0 = time.perf_counter()
        run()
        return _landed(memory, t0, events)

    def _bind_landing(self, plan: KVTransferPlan, dests: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, Callable[[], None] | None]:
        """(the channels as one tensor, the transform bound to it), or None for the call where
        :meth:`_memory_dest` finds no destination there."""
        memory = self._span(dests)  # the channels, back to back
        dest = None if memory is None else self._memory_dest(plan, memory)
        return memory, None if dest is None else bind(self.caches, plan, memory, self.impl, dest)

    def direct_target(self, plan: LayerwisePlan, dests: Sequence[torch.Tensor]) -> DirectTarget | None:
        """Each layer's transform writes its tiles into their pages of the decode's DRAM (see
        :meth:`_memory_dest`); None where it cannot, or a layer's tensors are not evenly spaced."""
        memory = self._span(dests)
        if memory is None:
            return None
        dest = self._memory_dest(plan.plan, memory)
        if dest is None:
            return None
        shifts = [plan.shift(layer) for layer in range(plan.num_layers)]
        if any(s is None or s < 0 or s + dest.extent > memory.numel() for s in shifts):
            return None
        return DirectTarget(memory, dest, shifts)  # type: ignore[arg-type]

    def produce_layers_into(self, plan: LayerwisePlan, layers: Sequence[int], target: DirectTarget) -> None:
        self._layer_call(plan, target, lambda: (target.memory, target.shifts, target.dest))(*layers)

    def layer_descs(self, plan: LayerwisePlan, layer: int, staged: Staged) -> DescArray:
        base = staged.offset + layer * plan.layer_bytes
        r = plan.direct_runs(layer)
        names, idx = channel_regions(r.dst_region)
        return DescArray((STAGING_REGION,), np.zeros(len(r.length), dtype=np.int64), base + np.asarray(r.src_offset, dtype=np.int64),
                         names, idx, np.asarray(r.dst_offset, dtype=np.int64), np.asarray(r.length, dtype=np.int64))


def gather_compact(caches: Sequence[torch.Tensor], plan: BlockCopyPlan) -> torch.Tensor:
    """The request's blocks in compact form (``[layers][pieces][blocks]``, flat bytes) on the caches' device:
    one row gather per layer from its region seen as overlapping rows of a piece's length, starting
    every ``g`` bytes (``g`` divides every piece's start)."""
    lay = plan.src
    stride, starts, plen = lay.block_pieces()
    g = math.gcd(stride, plen, *starts)
    dev = caches[0].device
    ids = torch.as_tensor(plan.src_block_ids, device=dev)
    rows = ((torch.as_tensor(starts, device=dev)[:, None] + ids[None, :] * stride) // g).reshape(-1)
    out = []
    for c in caches:
        region = lay.layer_bytes_view(c)
        out.append(region.as_strided(((region.numel() - plen) // g + 1, plen), (g, 1))[rows])
    return torch.cat(out).reshape(-1)


class CompactBlocks(_InStagingBuffer):
    """The request's blocks as they are, gathered into staging (the host-staged baselines)."""

    name = "compact"

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> BlockCopyPlan:
        return plan_block_copy(num_tokens, block_ids, self.layout)

    def size(self, plan: BlockCopyPlan) -> int:
        return plan.total_bytes

    def produce(self, plan: BlockCopyPlan, out: torch.Tensor) -> None:
        if out.device == self.caches[0].device:  # byte offsets index each layer's region
            copy_regions(plan.gather_copies(), {-1: out, **{i: self.layout.layer_bytes_view(c) for i, c in enumerate(self.caches)}})
        else:  # gather on the GPU, then one device -> host copy
            out.copy_(gather_compact(self.caches, plan), non_blocking=out.is_pinned())


@dataclass(frozen=True, eq=False)
class InPlacePlan:
    """gg-direct's plan of one pull: the request's blocks here and, from D1, where they go (``dst`` is
    None when the receiver's layout is not a paged GPU cache: then only the peer's READ can move them).

    ``landings`` keeps what landing it takes, per receiver (:meth:`InPlace.land`): by the id of the
    receiver's list of layer tensors, each entry holding that list (so the id stays unique) and either
    its copies or None (this plan cannot land there)."""

    blocks: BlockCopyPlan
    dst: Paged | None
    dst_block_ids: np.ndarray
    landings: dict[int, tuple] = field(default_factory=dict, repr=False)

    @property
    def total_bytes(self) -> int:
        return self.blocks.total_bytes


#: Receivers a plan keeps landing copies for (a sender passes one list per receiver; more is churn).
_LANDINGS_PER_PLAN = 4


class InPlace(SendFormat):
    """gg-direct: the peer reads the blocks out of the registered paged cache, layer by layer; on one
    GPU (a landed pull) this side copies them into the peer's blocks itself, in one launch."""

    name = "cache"
    reads_cache_in_place = True

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged):
        layout.check_cache(list(caches))
        self.caches, self.layout = list(caches), layout
        self._bytes = [layout.layer_bytes_view(c) for c in self.caches]  # each layer's region: what block offsets index
        self._src = np.array([b.data_ptr() for b in self._bytes], dtype=np.int64)  # each layer's first byte
        self._plans: LRU[tuple] = LRU(128)  # whole plans by receiver layout, tokens and both sides' block ids

    def regions(self) -> dict[str, torch.Tensor]:
        return {cache_region(i): b for i, b in enumerate(self._bytes)}

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> InPlacePlan:
        """The request's plan, kept whole as gn-hawk's sender keeps its plans (:meth:`NpuTiles.plan`): a
        repeated request (the same blocks on both sides, as idle pools hand back) costs a lookup, and the
        landing copies kept on the plan come with it, instead of checking and assembling it again (and the
        landing checking every layer of the receiver). Keyed by the receiver's layout object (held
        by the entry, so its id stays unique), the token count with its type, and both id arrays as the
        planner converts them (shape and bytes)."""
        dst = peer.get("layout")
        gids, dids = np.asarray(block_ids, dtype=np.int64), np.asarray(dst_block_ids, dtype=np.int64)
        key = (id(dst), type(num_tokens), num_tokens, gids.shape, gids.tobytes(), dids.shape, dids.tobytes())
        return self._plans.get_or_build(key, lambda: (dst, self._plan(num_tokens, gids, dst, dids)))[1]

    def _plan(self, num_tokens: int, gids: np.ndarray, dst: Any, dids: np.ndarray) -> InPlacePlan:
        """An uncached plan (the source ids checked here; the destination's when a landing or READ pairs them)."""
        return InPlacePlan(plan_block_copy(num_tokens, gids, self.layout), dst if isinstance(dst, PAGED_LAYOUTS) else None, dids)

    def size(self, plan: InPlacePlan) -> int:
        return plan.total_bytes

    def stage(self, plan: InPlacePlan, owner: str, ttl_s: float) -> Staged:
        return Staged(Held("in-place"))

    def dest_regions(self, peer: dict[str, Any]) -> list[str]:
        dst = peer.get("layout")
        if not isinstance(dst, PAGED_LAYOUTS) or dst.heads != self.layout.heads:
            return []  # tensor-parallel ranks of other degrees: the peer's READ slices the heads
        return [cache_region(i) for i in range(dst.num_layers)]

    def land(self, plan: InPlacePlan, dests: Sequence[torch.Tensor], events: EventRecorder | None = None) -> Staged | None:
        """The request's blocks copied into the peer's blocks (``dests``: its layer caches as this
        process addresses them, on this GPU): the copy the peer's READ would make, issued here, so
        that with ``events`` D2 leaves while it runs. What it takes (the checks of every layer, the
        runs, their offsets on the device) is kept on the plan per ``dests``, as the decode's READ
        path keeps its descriptors: a repeat is one launch."""
        hit = plan.landings.get(id(dests))
        if hit is None or hit[0] is not dests:
            hit = (dests, self._copies_into(plan, dests))  # a bad destination id raises here, every time
            if len(plan.landings) >= _LANDINGS_PER_PLAN:
                plan.landings.clear()
            plan.landings[id(dests)] = hit
        copies = hit[1]
        if copies is None:
            return None
        t0 = time.perf_counter()
        runs, table = copies
        if table is not None:
            table.run()  # one launch
        else:  # a CPU, or ranges one launch cannot take: a copy each
            for sr, so, dr, do, n in runs:
                dests[dr][do : do + n].copy_(self._bytes[sr][so : so + n], non_blocking=True)
        return _landed(dests[0], t0, events)

    def _copies_into(self, plan: InPlacePlan, dests: Sequence[torch.Tensor]) -> tuple | None:
        """(the request's runs, their SpanTable on a GPU or None) into ``dests``; None where this plan
        cannot land there: no paged receiver layout, another layer count, another device, too small."""
        dev = self.caches[0].device
        if plan.dst is None or len(dests) != len(self.caches) or any(d.device != dev for d in dests):
            return None
        if any(d.numel() < plan.dst.layer_bytes for d in dests):
            return None
        runs = plan.blocks.direct_runs(plan.dst, plan.dst_block_ids)
        if dev.type != "cuda":
            return runs, None
        src = self._src[runs.src_region] + runs.src_offset
        dst = np.array([d.data_ptr() for d in dests], dtype=np.int64)[runs.dst_region] + runs.dst_offset
        return runs, span_table(dev, src, dst, runs.length)

    # Layer-wise: nothing is produced; layer l's blocks are written from this cache's layer-l
    # region into the receiver's layer-l region (its blocks were allocated before prefill).
    layerwise = True

    def plan_layers(self, num_tokens, block_ids, peer, dst_block_ids) -> list[DescArray]:
        dst = peer["layout"]
        if not isinstance(dst, PAGED_LAYOUTS):
            raise ValueError("a layer-wise push from the paged cache needs a GPU receiver layout")
        if dst.heads != self.layout.heads:
            raise ValueError(f"layer-wise push needs the same KV heads on both sides (tensor parallelism is not supported): {self.layout.heads} vs {dst.heads}")
        per_layer: list[list[Desc]] = [[] for _ in range(self.layout.num_layers)]
        for r in plan_block_copy(num_tokens, block_ids, self.layout).direct_requests(dst, dst_block_ids):
            per_layer[r.src_region].append(Desc(cache_region(r.src_region), r.src_offset, cache_region(r.dst_region), r.dst_offset, r.length))
        return [DescArray.from_descs(d) for d in per_layer]  # made once per push; posted as arrays

    def layer_descs(self, plan: list[DescArray], layer: int, staged: Staged) -> DescArray:
        return plan[layer]


class NpuPages(SendFormat):
    """Reverse direction: the NPU gathers the request's pages into its per-channel buffers.

    The bytes each channel holds are that channel's extent of the very send-buffer format the GPU
    side would have produced, so the GPU receives one contiguous request per channel and untiles it.
    """

    name = "npu-pages"

    def __init__(self, kv: NpuKVCacheMemory, buffers: ChannelBuffers):
        self.kv, self.buffers, self.npu = kv, buffers, kv.npu
        self.layout = kv.layout

    def regions(self) -> dict[str, torch.Tensor]:
        return {channel_region(c): self.npu.channel_memory(c) for c in range(self.npu.arch.num_channels)}

    def hello_extra(self) -> dict[str, Any]:
        return {"bases": list(self.kv.bases)}

    def plan(self, num_tokens, block_ids, peer, dst_block_ids) -> KVTransferPlan:
        gpu = peer["layout"]
        if not isinstance(gpu, PAGED_LAYOUTS):
            raise ValueError("npu-pages needs a GPU receiver layout")
        return PLANS.kv_plan(num_tokens, dst_block_ids, block_ids, gpu, self.layout, self.kv.bases)

    def size(self, plan: KVTransferPlan) -> int:
        return plan.total_bytes

    def stage(self, plan: KVTransferPlan, owner: str, ttl_s: float) -> Staged:
        t0 = time.perf_counter()
        held = Held("channels", dict(self.buffers.reserve(plan.channel_bytes(), owner, ttl_s)))
        t1 = time.perf_counter()
        try:
            addr = {c: self.buffers.address(r, c) for c, r in held.reservations.items()}
            self.npu.copy(plan.gather_copy_runs(addr))
            t2 = time.perf_counter()
            self.npu.synchronize()
        except BaseException:
            self.release(held)
            raise
        t3 = time.perf_counter()
        sources = [[channel_region(c), addr[c], n] for c, _, n in plan.channel_extents]
        return Staged(held, sources=sources, timings={"reserve_s": t1 - t0, "transform_s": t2 - t1, "transform_wait_s": t3 - t2})

    def fits_empty(self, plan: KVTransferPlan) -> bool:
        ledgers = self.buffers.ledgers
        return all(c in ledgers and ledgers[c].fits_empty(n) for c, n in plan.channel_bytes().items())

    def release(self, held: Held) -> None:
        self.buffers.release(held.reservations)

    def live(self) -> list[Reservation]:
        return self.buffers.live()

    def expire(self, now: float) -> list[Reservation]:
        return [r for led in self.buffers.ledgers.values() for r in led.expire(now)]

    def extents(self, plan: KVTransferPlan) -> list[list[int]]:
        return [list(e) for e in plan.channel_extents]


FORMATS: dict[str, type[SendFormat]] = {f.name: f for f in (NpuTiles, CompactBlocks, InPlace, NpuPages)}
