"""Where the decode side lands a request's KV, one class per destination kind.

A landing answers Algorithm 1's decode-side questions: which regions to register, how to rebuild
and check the plan from the sender's metadata (D2), what to reserve (D3), how to pair the sender's
region with its own buffers (D4), how to finish into the KV cache (D6-D7) and what to release (D8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from hawk.connector.formats import Held, _sync, cache_region, channel_region, channel_regions
from hawk.connector.messages import KVReady, ProtocolError
from hawk.devices.backend import NpuBackend
from hawk.devices.batched_copy import copy_regions
from hawk.layouts.gpu import GpuKVLayout
from hawk.memory.buffers import ChannelBuffers, SingleBuffer, StagingBuffer
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.memory.reservations import RangeReservations, Reservation
from hawk.plan.block_plan import BlockCopyPlan, Paged, plan_block_copy
from hawk.plan.cost_model import CostModel
from hawk.plan.kv_plan import KVTransferPlan
from hawk.plan.plan_cache import LRU, PLANS
from hawk.plan.requests import Request, merge_runs
from hawk.transform import transform, untransform
from hawk.transport.base import Desc, DescArray


def _check_extents(ready: KVReady, plan: KVTransferPlan) -> None:
    if ready.total_bytes != plan.total_bytes or [list(e) for e in plan.channel_extents] != [list(e) for e in ready.extents]:
        raise ProtocolError(
            f"request {ready.request_id}: sender's metadata ({ready.total_bytes} B, extents {ready.extents}) "
            f"does not match this side's plan ({plan.total_bytes} B, extents {plan.channel_extents})"
        )


class Landing(ABC):
    #: The send format this landing expects from the prefill side.
    format: ClassVar[str]

    @abstractmethod
    def regions(self) -> dict[str, torch.Tensor]:
        """Memory to register with the transport (by region name)."""

    @abstractmethod
    def hello(self) -> tuple[Any, dict]:
        """``(kv layout, extra)`` for the handshake."""

    @abstractmethod
    def plan(self, ready: KVReady, dst_block_ids: Sequence[int], peer: dict[str, Any]) -> Any:
        """D2: rebuild the plan from the sender's metadata (and its handshake, ``peer``) and check it agrees."""

    def reserve(self, plan: Any, owner: str, ttl_s: float | None, peer: dict[str, Any] | None = None) -> Held:
        """D3: reserve receive space (``peer``: the sender's handshake info, with this side's
        ``device_copy``: whether batches with it are copies inside one GPU). Raises
        :class:`~hawk.memory.reservations.BufferFull` when there is no room now; the receiver then
        waits for releases (:meth:`ledgers`) in arrival order."""
        return Held("in-place")

    def needs_room(self, plan: Any, owner: str, peer: dict[str, Any] | None = None) -> bool:
        """Whether :meth:`reserve` takes receive-buffer space for ``plan`` (False: it holds nothing,
        so it never waits behind requests that do). Raises
        :class:`~hawk.memory.reservations.NeverFits` if it could not get that space even with every
        receive buffer empty: such a request fails at once instead of waiting in vain."""
        return False

    def ledgers(self) -> list[RangeReservations]:
        """The ledgers :meth:`reserve` takes from: their releases wake requests waiting for room."""
        return []

    @abstractmethod
    def pair(self, plan: Any, held: Held, ready: KVReady) -> Sequence[Desc]:
        """D4: pair the sender's region with local buffers: one descriptor per request (a list, or a
        :class:`~hawk.transport.base.DescArray` where there are many)."""

    def warm(self, num_tokens: int, dst_block_ids: Sequence[int], peer: dict[str, Any]) -> None:
        """Build what D2-D4 will need from what is known before D2 (called while D1 is in flight)."""

    def finish(self, plan: Any, held: Held) -> None:
        """D6-D7: make the received bytes the KV cache."""

    def release(self, held: Held) -> None:
        """D8: give back what ``reserve`` took."""

    def live(self) -> list[Reservation]:
        """Reservations held right now (accounting)."""
        return []

    def close(self) -> None:
        """Free the receive buffers this landing allocated."""

    #: Whether the prefill may push into this landing layer by layer (kv_flow=layerwise): the
    #: destination is the decode's own cache blocks, so nothing is reserved or copied here.
    layerwise: ClassVar[bool] = False

    def finish_layers(self) -> None:
        """D7 of a layer-wise push: make the pages the prefill wrote visible to the decode's kernels."""

    def takes_landed(self) -> bool:
        """Whether a pull may let the sender write the KV straight into the destination pages (where it
        can address them): D3-D6 then do nothing and D7 is :meth:`finish_layers`."""
        return False


class _NpuTilesLanding(Landing):
    """Receives HAWK's transformed tiles into the NPU's KV cache; every channel is a region."""

    format = "npu-tiles"

    def __init__(self, kv: NpuKVCacheMemory):
        self.kv = kv
        self.npu: NpuBackend = kv.npu

    def regions(self) -> dict[str, torch.Tensor]:
        return {channel_region(c): self.npu.channel_memory(c) for c in range(self.npu.arch.num_channels)}

    def hello(self) -> tuple[Any, dict]:
        return self.kv.layout, {"bases": list(self.kv.bases)}

    def plan(self, ready, dst_block_ids, peer) -> KVTransferPlan:
        plan = PLANS.kv_plan(ready.num_tokens, ready.src_block_ids, dst_block_ids, peer["layout"], self.kv.layout, self.kv.bases)
        _check_extents(ready, plan)
        return plan

    def warm(self, num_tokens: int, dst_block_ids: Sequence[int], peer: dict[str, Any]) -> None:
        PLANS.warm(num_tokens, dst_block_ids, peer["layout"], self.kv.layout, self.kv.bases)


class ChannelLanding(_NpuTilesLanding):
    """gn-hawk: one buffer per DRAM channel; staging + intra-channel copy, or direct into the pages."""

    def __init__(self, kv: NpuKVCacheMemory, buffers: ChannelBuffers, cost: CostModel, mode: str = "auto",
                 device_cost: CostModel | None = None):
        if mode not in ("auto", "staging", "direct"):
            raise ValueError(f"landing mode must be auto, staging or direct, got {mode!r}")
        super().__init__(kv)
        self.buffers, self.cost, self.mode = buffers, cost, mode
        #: The figures for a sender whose batches are copies inside this GPU (``peer["device_copy"]``).
        self.device_cost = device_cost

    def choose(self, plan: KVTransferPlan, peer: dict[str, Any] | None = None) -> str:
        if self.mode != "auto":
            return self.mode
        cost = self.device_cost if self.device_cost is not None and peer and peer.get("device_copy") else self.cost
        return cost.choose(plan)

    def reserve(self, plan, owner, ttl_s, peer=None) -> Held:
        mode = self.choose(plan, peer)
        if mode == "direct":
            return Held("direct")
        return Held("staging", dict(self.buffers.reserve(plan.channel_bytes(), owner, ttl_s)))

    def needs_room(self, plan, owner, peer=None) -> bool:
        if self.choose(plan, peer) == "direct":
            return False
        self.buffers.require_fits(plan.channel_bytes(), owner)
        return True

    def ledgers(self) -> list[RangeReservations]:
        return list(self.buffers.ledgers.values())

    def _addresses(self, held: Held) -> dict[int, int]:
        return {c: self.buffers.address(r, c) for c, r in held.reservations.items()}

    def pair(self, plan, held, ready) -> DescArray:
        """One descriptor per run (direct) or per channel (staging), as arrays: a direct placement is
        over a thousand runs, which a transport that takes arrays posts without an object per run.
        A function of the placement, the landing's addresses and where the sender staged: kept with
        the placement, so a repeated destination reuses it as it is."""
        addresses = self._addresses(held)
        key = (held.mode, ready.region, ready.offset, tuple(sorted(addresses.items())))
        memo = plan._shared_memo()
        hit = memo.get("descs")
        if hit is not None and hit[0] == key:
            return hit[1]
        if held.mode == "direct":
            runs = plan.direct_runs()
            src_off, chan, dst_off, length = runs.src_offset, runs.dst_region, runs.dst_offset, runs.length
        else:
            reqs = plan.staging_requests(addresses)
            src_off, chan, dst_off, length = (np.array([getattr(r, f) for r in reqs], dtype=np.int64).reshape(-1)
                                              for f in ("src_offset", "dst_region", "dst_offset", "length"))
        names, idx = channel_regions(chan)
        descs = DescArray(names, idx, np.asarray(dst_off, dtype=np.int64), (ready.region,), np.zeros(len(length), dtype=np.int64),
                          ready.offset + np.asarray(src_off, dtype=np.int64), np.asarray(length, dtype=np.int64))
        memo["descs"] = (key, descs)
        return descs

    def finish(self, plan, held) -> None:
        if held.mode == "staging":
            self.npu.copy(plan.staging_copy_runs(self._addresses(held)))
        self.npu.synchronize()

    layerwise = True  # pushed layer by layer, always straight into the pages (direct placement)

    def finish_layers(self) -> None:
        self.npu.synchronize()

    def takes_landed(self) -> bool:
        return self.mode == "auto"  # a forced mode ("staging", "direct") is kept for comparison

    def release(self, held) -> None:
        self.buffers.release(held.reservations)

    def live(self) -> list[Reservation]:
        return self.buffers.live()

    def close(self) -> None:
        self.buffers.close()


class SingleLanding(_NpuTilesLanding):
    """gn-direct-single: one contiguous buffer in one channel, then cross-channel rearrangement."""

    def __init__(self, kv: NpuKVCacheMemory, buffer: SingleBuffer):
        super().__init__(kv)
        self.buffer = buffer

    def reserve(self, plan, owner, ttl_s, peer=None) -> Held:
        return Held("single", {0: self.buffer.reserve(plan.total_bytes, owner, ttl_s)})

    def needs_room(self, plan, owner, peer=None) -> bool:
        self.buffer.ledger.require_fits(plan.total_bytes, owner)
        return True

    def ledgers(self) -> list[RangeReservations]:
        return [self.buffer.ledger]

    def pair(self, plan, held, ready) -> list[Desc]:
        addr = self.buffer.address(held.reservations[0])
        return [
            Desc(channel_region(r.dst_region), r.dst_offset, ready.region, ready.offset + r.src_offset, r.length)
            for r in plan.single_requests(self.buffer.channel, addr)
        ]

    def finish(self, plan, held) -> None:
        self.npu.copy(plan.single_copy_runs(self.buffer.channel, self.buffer.address(held.reservations[0])))
        self.npu.synchronize()

    def release(self, held) -> None:
        for r in held.reservations.values():
            self.buffer.release(r)

    def live(self) -> list[Reservation]:
        return self.buffer.live()

    def close(self) -> None:
        self.buffer.close()


class HostRx:
    """A host receive region with its ledger (pinned when CUDA is present): the ``*-host`` path."""

    REGION = "host-rx"

    def __init__(self, capacity: int):
        pin = torch.cuda.is_available()
        self.tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.ledger = RangeReservations(self.REGION, capacity, alignment=256)

    def view(self, r: Reservation) -> torch.Tensor:
        return self.tensor[r.offset : r.offset + r.size]


@dataclass(eq=False)
class _HostPlan:
    blocks: BlockCopyPlan
    fixup: KVTransferPlan | None = None  # gn-host: compact blocks -> NPU pages
    dst_block_ids: Sequence[int] = ()  # gg-host: where the blocks go in the decode cache


class _HostLanding(Landing):
    """Shared by the two host-staged baselines: receive compact blocks into host memory."""

    format = "compact"

    def __init__(self, rx: HostRx):
        self.rx = rx

    def regions(self) -> dict[str, torch.Tensor]:
        return {HostRx.REGION: self.rx.tensor}

    def _blocks(self, ready: KVReady, src: Paged) -> BlockCopyPlan:
        plan = plan_block_copy(ready.num_tokens, ready.src_block_ids, src)
        if plan.total_bytes != ready.total_bytes:
            raise ProtocolError(f"request {ready.request_id}: sender sends {ready.total_bytes} B, plan expects {plan.total_bytes} B")
        return plan

    def reserve(self, plan, owner, ttl_s, peer=None) -> Held:
        return Held("host", {0: self.rx.ledger.reserve(plan.blocks.total_bytes, owner, ttl_s)})

    def needs_room(self, plan, owner, peer=None) -> bool:
        self.rx.ledger.require_fits(plan.blocks.total_bytes, owner)
        return True

    def ledgers(self) -> list[RangeReservations]:
        return [self.rx.ledger]

    def pair(self, plan, held, ready) -> list[Desc]:
        r = held.reservations[0]
        return [Desc(HostRx.REGION, r.offset, ready.region, ready.offset, plan.blocks.total_bytes)]

    def release(self, held) -> None:
        for r in held.reservations.values():
            self.rx.ledger.release(r)

    def live(self) -> list[Reservation]:
        return self.rx.ledger.live()

    def _compact_on(self, held: Held, plan: _HostPlan, device: torch.device) -> list[torch.Tensor]:
        """The received blocks copied host -> device, viewed as one paged cache per layer."""
        data = self.rx.view(held.reservations[0]).to(device, non_blocking=True)
        return plan.blocks.compact_layout.layer_views(data)


class HostToNpuLanding(_HostLanding):
    """gn-host: host staging, then the layout fix-up (tilize + channel placement) on the NPU side.

    The fix-up runs where the paper's baseline runs it: on the decode node's CPU, over the staged
    host copy (a Tenstorrent host tilizes a tensor before writing it to the device), and only the
    tiles cross to the NPU's DRAM. Tilizing on the NPU's backing GPU instead would hand the
    baseline HAWK's own fast path."""

    def __init__(self, kv: NpuKVCacheMemory, rx: HostRx):
        super().__init__(rx)
        self.kv, self.npu = kv, kv.npu

    def hello(self) -> tuple[Any, dict]:
        return self.kv.layout, {"bases": list(self.kv.bases)}

    def plan(self, ready, dst_block_ids, peer) -> _HostPlan:
        blocks = self._blocks(ready, peer["layout"])
        compact = blocks.compact_layout
        fixup = PLANS.kv_plan(ready.num_tokens, range(blocks.num_blocks), dst_block_ids, compact, self.kv.layout, self.kv.bases)
        return _HostPlan(blocks, fixup)

    def finish(self, plan, held) -> None:
        dev = self.npu.torch_device
        tiles = transform(self._compact_on(held, plan, torch.device("cpu")), plan.fixup)  # the host's tilize
        fx = plan.fixup
        pb = fx.page_bytes
        pages = tiles.view(-1, pb).to(dev)  # the tiles' writes into the NPU's DRAM
        a, b = (torch.as_tensor(x, device=dev) for x in fx.offset_terms())
        page_ids = torch.as_tensor(fx.page, device=dev)
        for t in range(fx.num_tensors):
            self.kv.write_pages(t, page_ids, pages[(a + t * b) // pb])
        _sync(pages)  # the tilize and page writes ran on this thread's stream
        self.npu.synchronize()


class HostToGpuLanding(_HostLanding):
    """gg-host: host staging, then the blocks scattered into the decode GPU's paged cache."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged, rx: HostRx):
        super().__init__(rx)
        layout.check_cache(list(caches))
        self.caches, self.layout = list(caches), layout

    def hello(self) -> tuple[Any, dict]:
        return self.layout, {}

    def plan(self, ready, dst_block_ids, peer) -> _HostPlan:
        blocks = self._blocks(ready, peer["layout"])
        blocks.scatter_copies(self.layout, dst_block_ids)  # validates the destination
        return _HostPlan(blocks, dst_block_ids=list(dst_block_ids)[: blocks.num_blocks])

    def finish(self, plan, held) -> None:
        dev = self.caches[0].device
        compact = self.rx.view(held.reservations[0]).to(dev, non_blocking=True)
        regions = {-1: compact, **{i: self.layout.layer_bytes_view(c) for i, c in enumerate(self.caches)}}
        copy_regions(plan.blocks.scatter_copies(self.layout, plan.dst_block_ids), regions)
        _sync(compact)  # this thread's stream: not the other work of a GPU the decode may share


def head_slice_requests(blocks: BlockCopyPlan, dst: GpuKVLayout, dst_block_ids: Sequence[int]) -> list[Request]:
    """gg-direct between ranks holding different KV heads: only the shared heads of each block move.

    Whole blocks are no longer contiguous on both sides, so a request covers the shared heads of
    one token row (NHD) or of one block (HND); adjacent pieces are merged where both sides continue.
    """
    src = blocks.src
    if not isinstance(src, GpuKVLayout) or not isinstance(dst, GpuKVLayout):
        raise ValueError(f"head-sliced GPU->GPU copies are described for HAWK's NHD / HND caches, not {src.paged().name} -> {dst.paged().name}")
    lo, hi = max(src.head_start, dst.head_start), min(src.head_start + src.num_kv_heads, dst.head_start + dst.num_kv_heads)
    if lo >= hi:
        raise ValueError(f"no shared KV heads: source holds {src.heads}, destination {dst.heads}")
    same = (src.num_layers, src.block_size, src.head_dim, src.dtype, src.order)
    theirs = (dst.num_layers, dst.block_size, dst.head_dim, dst.dtype, dst.order)
    if same != theirs:
        raise ValueError(f"GPU->GPU head-sliced copy needs matching layouts: source {same}, destination {theirs}")
    n = blocks.num_blocks
    did = np.asarray(list(dst_block_ids)[:n], dtype=np.int64)
    if len(did) < n:
        raise ValueError(f"destination has {len(did)} blocks, the request needs {n}")
    hd = src.head_dim * src.elem_bytes  # bytes of one head's row
    bs = src.block_size
    kv = np.arange(2, dtype=np.int64)[:, None]

    def offsets(lay: GpuKVLayout, ids: np.ndarray) -> np.ndarray:
        block = kv * lay.num_blocks + ids[None, :]  # [2, n]
        if lay.order == "NHD":  # [.., block, token, head, dim]: one piece per token row
            row = block[..., None] * bs + np.arange(bs, dtype=np.int64)
            return ((row * lay.num_kv_heads + (lo - lay.head_start)) * hd).ravel()
        return ((block * lay.num_kv_heads + (lo - lay.head_start)) * bs * hd).ravel()  # HND: per block

    length = (hi - lo) * hd * (1 if src.order == "NHD" else bs)
    s_off, d_off = offsets(src, blocks.src_block_ids), offsets(dst, did)
    out: list[Request] = []
    for layer in range(src.num_layers):
        out += [Request(*r) for r in merge_runs(layer, s_off, layer, d_off, length)]
    return out


class GpuDirectLanding(Landing):
    """gg-direct: read vLLM blocks straight from the prefill GPU's cache into this GPU's cache."""

    format = "cache"

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged):
        layout.check_cache(list(caches))
        self.caches, self.layout = list(caches), layout
        self._descs: LRU[DescArray] = LRU(128)

    def regions(self) -> dict[str, torch.Tensor]:
        return {cache_region(i): self.layout.layer_bytes_view(c) for i, c in enumerate(self.caches)}  # what block offsets index

    def hello(self) -> tuple[Any, dict]:
        return self.layout, {}

    def plan(self, ready, dst_block_ids, peer) -> DescArray:
        """The descriptors themselves, kept per (layouts, tokens, both sides' block ids): a repeated
        request shape with the same blocks (what an idle allocator hands back) costs a lookup. As a
        :class:`DescArray`: the transport checks and addresses a batch without a Python object per
        descriptor (a list of 160 cost ~1 ms of submit on an H200 host)."""
        src = peer["layout"]
        key = (src, ready.num_tokens, np.asarray(ready.src_block_ids, dtype=np.int64).tobytes(), np.asarray(dst_block_ids, dtype=np.int64).tobytes())
        return self._descs.get_or_build(key, lambda: self._build(ready, dst_block_ids, src))

    def _build(self, ready, dst_block_ids, src) -> DescArray:
        blocks = plan_block_copy(ready.num_tokens, ready.src_block_ids, src)
        if blocks.src.heads != self.layout.heads:  # tensor-parallel ranks of different degrees
            reqs = head_slice_requests(blocks, self.layout, dst_block_ids)
        else:
            reqs = blocks.direct_requests(self.layout, dst_block_ids)
        return DescArray.from_descs(Desc(cache_region(r.dst_region), r.dst_offset, cache_region(r.src_region), r.src_offset, r.length) for r in reqs)

    def pair(self, plan, held, ready) -> DescArray:
        return plan

    def finish(self, plan, held) -> None:
        _sync(self.caches[0])  # the transport's batch has ended (its own events); nothing else to wait for

    layerwise = True

    def finish_layers(self) -> None:
        _sync(self.caches[0])  # as finish: the writer's work has ended (D2 or Pushed says so) before this

    def takes_landed(self) -> bool:
        return True  # on one GPU the prefill copies the blocks in itself (the READ's copy, issued there)


class GpuFromTiles(Landing):
    """Reverse direction: NPU tiles arrive channel by channel into one GPU buffer, then are untiled into
    the paged cache (the GPU does the rest of the layout change, as the paper's §4.5.3 describes)."""

    format = "npu-pages"
    REGION = "rx-gpu"

    def __init__(self, caches: Sequence[torch.Tensor], layout: Paged, rx_bytes: int):
        layout.check_cache(list(caches))
        self.caches, self.layout = list(caches), layout
        self.rx = StagingBuffer(rx_bytes, caches[0].device, name=self.REGION)

    def regions(self) -> dict[str, torch.Tensor]:
        return {self.REGION: self.rx.tensor}

    def hello(self) -> tuple[Any, dict]:
        return self.layout, {}

    def plan(self, ready, dst_block_ids, peer) -> KVTransferPlan:
        npu = peer["layout"]
        plan = PLANS.kv_plan(ready.num_tokens, dst_block_ids, ready.src_block_ids, self.layout, npu, peer["bases"])
        _check_extents(ready, plan)
        if len(ready.sources) != len(plan.channel_extents):
            raise ProtocolError(f"request {ready.request_id}: {len(ready.sources)} sources for {len(plan.channel_extents)} channel extents")
        return plan

    def reserve(self, plan, owner, ttl_s, peer=None) -> Held:
        return Held("gpu-rx", {0: self.rx.reserve(plan.total_bytes, owner, ttl_s)})

    def needs_room(self, plan, owner, peer=None) -> bool:
        self.rx.ledger.require_fits(plan.total_bytes, owner)
        return True

    def ledgers(self) -> list[RangeReservations]:
        return [self.rx.ledger]

    def pair(self, plan, held, ready) -> list[Desc]:
        base = held.reservations[0].offset
        return [Desc(self.REGION, base + off, str(region), int(addr), n) for (_, off, n), (region, addr, _) in zip(plan.channel_extents, ready.sources)]

    def finish(self, plan, held) -> None:
        untransform(self.rx.view(held.reservations[0]), plan, self.caches)
        _sync(self.caches[0])

    def release(self, held) -> None:
        for r in held.reservations.values():
            self.rx.ledger.release(r)

    def live(self) -> list[Reservation]:
        return self.rx.ledger.live()
