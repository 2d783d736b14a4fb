"""One request's GPU -> NPU plan cut by layer: what a layer-wise push sends after each layer's forward.

Why a plan of its own: the whole-request send buffer groups tiles by channel, then bank, then tensor,
so one layer's tiles are spread over every bank's extent. A push that starts while later layers are
still being computed needs each layer's bytes by themselves. So the layer-wise send buffer is
layer-major: layer ``l`` occupies ``[l * layer_bytes, (l + 1) * layer_bytes)`` and inside it has the
layout of a one-layer model's send buffer (channel, bank, then K and V).

Every K/V tensor of the NPU cache shares one page map, so one one-layer plan serves every layer: the
transform reads ``caches[l]`` through it, and the direct requests of layer ``l`` are layer 0's shifted
by the distance between the tensors' DRAM bases (when the bases are evenly spaced, as lockstep
interleaved allocation makes them; otherwise each layer is planned on its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.plan.kv_plan import KVTransferPlan, plan_kv_transfer
from hawk.plan.requests import Runs

#: ``planner(num_tokens, gpu_ids, npu_ids, src, dst, bases)``: plan_kv_transfer or a cached one.
Planner = Callable[..., KVTransferPlan]


def one_layer(layout: GpuKVLayout | NpuKVLayout) -> GpuKVLayout | NpuKVLayout:
    """The same cache with a single layer: the shape one layer's tiles are planned in."""
    return dataclasses.replace(layout, num_layers=1)


@dataclass(eq=False)
class LayerwisePlan:
    """Layer 0's one-layer plan, and how every other layer's requests follow from it."""

    plan: KVTransferPlan  # one layer, layer 0's tensor bases: the transform uses it for every layer
    num_layers: int
    bases: tuple[int, ...]  # all 2L tensor bases of the destination cache
    planner: Planner
    _per_layer: dict[int, Runs] = field(default_factory=dict)

    @property
    def layer_bytes(self) -> int:
        return self.plan.total_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def shift(self, layer: int) -> int | None:
        """How far layer ``layer``'s tensors sit from layer 0's (None: K and V moved differently)."""
        dk, dv = self.bases[2 * layer] - self.bases[0], self.bases[2 * layer + 1] - self.bases[1]
        return dk if dk == dv else None

    def direct_runs(self, layer: int) -> Runs:
        """Layer ``layer``'s requests straight into its cache pages; source offsets are within the
        layer's own slice of the send buffer."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        hit = self._per_layer.get(layer)
        if hit is not None:
            return hit
        shift = self.shift(layer)
        if shift is not None:
            r = self.plan.direct_runs()
            runs = Runs(r.src_region, r.src_offset, r.dst_region, r.dst_offset + shift, r.length)
        else:
            p = self.plan
            bases = (self.bases[2 * layer], self.bases[2 * layer + 1])
            runs = self.planner(p.num_tokens, p.gpu_block_ids, p.npu_block_ids, p.src, p.dst, bases).direct_runs()
        self._per_layer[layer] = runs
        return runs


def plan_layerwise(
    num_tokens: int,
    gpu_block_ids: Sequence[int],
    npu_block_ids: Sequence[int],
    src: GpuKVLayout,
    dst: NpuKVLayout,
    dst_bases: Sequence[int],
    planner: Planner = plan_kv_transfer,
) -> LayerwisePlan:
    """Plan one request for a layer-wise push (same checks as the whole-request plan)."""
    if src.num_layers != dst.num_layers:
        raise ValueError(f"layer count differs: GPU {src.num_layers}, NPU {dst.num_layers}")
    bases = tuple(int(b) for b in dst_bases)
    if len(bases) != dst.num_tensors:
        raise ValueError(f"dst_bases has {len(bases)} entries, expected {dst.num_tensors} (2 per layer)")
    plan = planner(num_tokens, np.asarray(gpu_block_ids), np.asarray(npu_block_ids), one_layer(src), one_layer(dst), bases[:2])
    return LayerwisePlan(plan, src.num_layers, bases, planner)
