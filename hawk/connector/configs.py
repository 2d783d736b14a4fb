"""The paper's five transfer configurations, by name, as data: what the prefill sends, where decode lands it.

| name             | decode device | prefill sends                   | decode lands it                                       |
|------------------|---------------|---------------------------------|-------------------------------------------------------|
| gg-host          | GPU (or CPU)  | compact blocks in host memory   | host buffer, then scatter into the GPU paged cache    |
| gn-host          | NPU           | compact blocks in host memory   | host buffer, then tilize + place pages on the NPU     |
| gg-direct        | GPU (or CPU)  | nothing: blocks read in place   | straight into the GPU paged cache                     |
| gn-direct-single | NPU           | NPU tiles (HAWK's transform)    | one contiguous buffer in one channel, then rearrange  |
| gn-hawk          | NPU           | NPU tiles (HAWK's transform)    | per-channel buffers (+ intra-channel copy) or direct  |
| ng-hawk          | GPU           | NPU pages gathered per channel  | one GPU buffer, one request per channel, then untile  |

``ng-hawk`` is the reverse direction of the paper's §4.5.3: an NPU prefill instance sending to a GPU
decode instance, HAWK's plan read backwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hawk.connector.algorithm1 import KVReceiver, KVSender
from hawk.connector.formats import CompactBlocks, InPlace, NpuPages, NpuTiles, SendFormat
from hawk.connector.landings import (
    ChannelLanding,
    GpuDirectLanding,
    GpuFromTiles,
    HostRx,
    HostToGpuLanding,
    HostToNpuLanding,
    Landing,
    SingleLanding,
)
from hawk.devices.backend import NpuBackend
from hawk.layouts.gpu import GpuKVLayout
from hawk.memory.buffers import ChannelBuffers, SingleBuffer, StagingBuffer
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.cost_model import SAME_DEVICE, CostModel
from hawk.transport.base import Transport
from hawk.transport.paced import paced


@dataclass(frozen=True)
class TransferConfig:
    name: str
    decode_on: str  # "npu" | "gpu"
    send_format: str
    staging: str | None  # where the prefill stages: "device", "host", "npu-channels", or None (read in place)
    landing: str
    prefill_on: str = "gpu"

    @property
    def rx_in_one_bank(self) -> bool:
        """Whether the decode's receive buffer is one contiguous range in one DRAM bank (the
        single-buffer baseline) rather than spread over every channel: it sizes the banks."""
        return self.landing == "single"


CONFIGS: dict[str, TransferConfig] = {
    c.name: c
    for c in (
        TransferConfig("gg-host", "gpu", "compact", "host", "host-to-gpu"),
        TransferConfig("gn-host", "npu", "compact", "host", "host-to-npu"),
        TransferConfig("gg-direct", "gpu", "cache", None, "gpu-direct"),
        TransferConfig("gn-direct-single", "npu", "npu-tiles", "device", "single"),
        TransferConfig("gn-hawk", "npu", "npu-tiles", "device", "channels"),
        TransferConfig("ng-hawk", "gpu", "npu-pages", "npu-channels", "gpu-from-tiles", prefill_on="npu"),
    )
}


def get_config(name: str) -> TransferConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown transfer configuration {name!r}; expected one of {list(CONFIGS)}") from None


def make_sender(
    config: str,
    transport: Transport,
    caches: Sequence[torch.Tensor],
    layout: GpuKVLayout,
    staging_bytes: int,
    transform_impl: str = "auto",
    link_gbps: float | None = None,
    **kwargs,
) -> KVSender:
    """The GPU prefill side of ``config`` over ``transport``, with a staging buffer of ``staging_bytes``;
    ``link_gbps`` paces the batches it posts (push) to that link (timing emulation, ``transport/paced.py``)."""
    cfg = get_config(config)
    if cfg.prefill_on != "gpu":
        raise ValueError(f"{config} sends from an NPU: use make_npu_sender")
    fmt: SendFormat
    if cfg.send_format == "cache":
        fmt = InPlace(caches, layout)
    else:
        on_host = cfg.staging == "host"
        staging = StagingBuffer(staging_bytes, "cpu" if on_host else caches[0].device, pin=on_host and torch.cuda.is_available())
        fmt = NpuTiles(caches, layout, staging, transform_impl) if cfg.send_format == "npu-tiles" else CompactBlocks(caches, layout, staging)
    return KVSender(paced(transport, link_gbps), fmt, cfg.name, **kwargs)


def make_npu_sender(config: str, transport: Transport, kv: NpuKVCacheMemory, staging_bytes: int, **kwargs) -> KVSender:
    """The NPU prefill side of a reverse configuration: per-channel send buffers of ``staging_bytes`` in all."""
    cfg = get_config(config)
    if cfg.prefill_on != "npu":
        raise ValueError(f"{config} sends from a GPU: use make_sender")
    per_channel = -(-staging_bytes // kv.npu.arch.num_channels)
    return KVSender(transport, NpuPages(kv, ChannelBuffers(kv.npu, per_channel, owner="hawk-tx")), cfg.name, **kwargs)


@dataclass
class NpuSide:
    """What an NPU decode instance brings: the device, its KV cache memory, receive-buffer size."""

    npu: NpuBackend
    kv: NpuKVCacheMemory
    rx_bytes: int
    cost: CostModel | None = None
    mode: str = "auto"


@dataclass
class GpuSide:
    """What a GPU decode instance brings: its paged caches and layout, host receive-buffer size."""

    caches: Sequence[torch.Tensor]
    layout: GpuKVLayout
    rx_bytes: int


def make_landing(config: str, side: NpuSide | GpuSide) -> Landing:
    cfg = get_config(config)
    if cfg.decode_on == "npu":
        if not isinstance(side, NpuSide):
            raise ValueError(f"{config} decodes on an NPU: give an NpuSide")
        if cfg.landing == "channels":
            if side.cost is None:
                raise ValueError("gn-hawk needs a cost model to choose staging or direct placement")
            per_channel = -(-side.rx_bytes // side.npu.arch.num_channels)
            return ChannelLanding(side.kv, ChannelBuffers(side.npu, per_channel), side.cost, side.mode, device_cost=SAME_DEVICE)
        if cfg.landing == "single":
            return SingleLanding(side.kv, SingleBuffer(side.npu, side.rx_bytes))
        return HostToNpuLanding(side.kv, HostRx(side.rx_bytes))
    if not isinstance(side, GpuSide):
        raise ValueError(f"{config} decodes on a GPU: give a GpuSide")
    if cfg.landing == "gpu-direct":
        return GpuDirectLanding(side.caches, side.layout)
    if cfg.landing == "gpu-from-tiles":
        return GpuFromTiles(side.caches, side.layout, side.rx_bytes)
    return HostToGpuLanding(side.caches, side.layout, HostRx(side.rx_bytes))


def make_receiver(config: str, transport: Transport, side: NpuSide | GpuSide, post: str = "pull", timeout_s: float = 30.0,
                  link_gbps: float | None = None) -> KVReceiver:
    """The decode side of ``config`` over ``transport``; ``link_gbps`` paces the batches it posts
    (pull) to that link (timing emulation, ``transport/paced.py``)."""
    return KVReceiver(paced(transport, link_gbps), make_landing(config, side), config, post, timeout_s)
