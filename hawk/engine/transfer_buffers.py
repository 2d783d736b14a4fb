"""How big the transfer buffers are, and which prompts they can never hold.

``--staging-mb`` and ``--rx-mb`` default to "auto": enough, when empty, for what Algorithm 1 reserves
there (P4 / D3) for the longest request an instance can hold. One rule for every user: instances, their
tensor-parallel followers, the benchmarks. A prompt that can never fit is refused before prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hawk.config import AUTO_BUFFER_MIN_MB, DEFAULT_KV_TOKENS, ServeConfig
from hawk.connector.configs import get_config
from hawk.engine.config import ModelConfig
from hawk.engine.tensor_parallel import Shard
from hawk.errors import PromptTooLong
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout, get_arch

MiB = 1 << 20

# -- the transfer buffers: how big "auto" makes them, and which prompts they can never hold ----------
#
# One rule, here, for every user (instances, their tensor-parallel followers, the benchmarks): the
# staging buffer of a prefill rank and the receive buffers of a decode rank must hold, when empty,
# what Algorithm 1 reserves in them (P4 / D3) for the longest request an instance can hold. What is
# reserved is the KV in the form that crosses the wire, rounded as its reservation is:
#
# - staging, npu-tiles (gn-hawk, gn-direct-single): the request's NPU tiles (``KVTransferPlan.total_bytes``:
#   2L tensors x NPU blocks x tiles per block x tile bytes, bf16 or bfloat8_b), one entry per decode
#   rank sharing the prefill rank's heads, each aligned to the staging ledger's 256 B; the layer-wise
#   send buffer (``LayerwisePlan.total_bytes``) is the same size;
# - staging, compact (gn-host, gg-host): the request's paged GPU blocks (``BlockCopyPlan.total_bytes``);
# - rx, gn-hawk: every channel buffer is ``rx / channels`` and a request reserves its channel extent in
#   each (``plan.channel_bytes()``), so the bound is channels x the most one channel can get: each NPU
#   block of a request is a run of consecutive pages starting anywhere in the page map;
# - rx, gn-direct-single: the whole request in the one buffer; gn-host / gg-host: the compact blocks
#   in the host buffer; gg-direct, layer-wise pushes and gn-hawk's direct landing reserve nothing.

#: Alignment of the staging and host receive ledgers (``memory/buffers.StagingBuffer``, ``connector/landings.HostRx``).
BYTE_BUFFER_ALIGNMENT = 256
BUFFERS = ("staging", "rx")
_FLAGS = {"staging": "--staging-mb", "rx": "--rx-mb"}


def _aligned(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def max_request_tokens(cfg: ServeConfig, mc: ModelConfig) -> int:
    """Longest request an instance of ``cfg`` can hold: its KV cache (``--kv-tokens``, in whole GPU
    blocks, as the prefill engine takes prompts) or the context (``--max-model-len`` or the model's)."""
    cache = _aligned(cfg.kv_tokens or DEFAULT_KV_TOKENS, cfg.gpu_block_size)  # unset: what a prefill instance holds
    return min(cache, cfg.max_model_len or mc.max_position_embeddings)


def _tile_layout(cfg: ServeConfig, mc: ModelConfig, heads: int) -> NpuKVLayout:
    """The decode's tiled cache, reduced to the ``heads`` one transfer moves (one block: sizes only)."""
    return NpuKVLayout(get_arch(cfg.arch), mc.num_layers, 1, heads, cfg.npu_block_size, mc.head_dim, cfg.kv_dtype, shard_pages=cfg.npu_shard_pages)


def _tiles_bytes(lay: NpuKVLayout, tokens: int) -> int:
    """``KVTransferPlan.total_bytes`` of ``tokens``: 2L tensors of whole NPU blocks of tiles."""
    return lay.num_tensors * -(-tokens // lay.block_size) * lay.tiles_per_block * lay.page_size


def _channel_pages_per_block(lay: NpuKVLayout) -> int:
    """Most pages of one tensor one NPU block of a request can put into one DRAM channel: the block's
    tiles are ``tiles_per_block`` consecutive pages starting anywhere (its id and first head decide),
    so count the channel's pages in every window of that length over one period of the page map."""
    pm = lay.page_map
    period = pm.shard_pages * pm.num_banks
    full, rest = divmod(lay.tiles_per_block, period)
    channel_of_bank = np.array([b.channel for b in lay.arch.banks], dtype=np.int64)
    channel = channel_of_bank[pm.bank(np.arange(period, dtype=np.int64))]
    best = 0
    for c in np.unique(channel):
        hit = (channel == c).astype(np.int64)
        prefix = np.concatenate([[0], np.cumsum(np.concatenate([hit, hit]))])
        window = int((prefix[rest : rest + period] - prefix[:period]).max())
        best = max(best, full * int(hit.sum()) + window)
    return best


def _compact_bytes(cfg: ServeConfig, mc: ModelConfig, heads: int, tokens: int) -> int:
    """``BlockCopyPlan.total_bytes`` of ``tokens``: the prefill rank's whole paged blocks."""
    block = GpuKVLayout(mc.num_layers, 1, cfg.gpu_block_size, heads, mc.head_dim, cfg.gpu_kv_dtype).block_bytes
    return mc.num_layers * 2 * -(-tokens // cfg.gpu_block_size) * block


def transfer_buffer_bytes(cfg: ServeConfig, mc: ModelConfig, buffer: str, tokens: int) -> int:
    """Bytes ``buffer`` must have, empty, for one request of ``tokens`` prompt tokens: what Algorithm 1
    reserves there, alignment included, on the rank that reserves the most (``"staging"``: a prefill
    rank's; ``"rx"``: a decode rank's, all channels together). 0 when nothing is reserved there."""
    if buffer not in BUFFERS:
        raise ValueError(f"buffer must be one of {BUFFERS}, got {buffer!r}")
    if cfg.transfer == "colocated" or tokens <= 0:
        return 0
    tc = get_config(cfg.transfer)
    if tc.prefill_on != "gpu":
        raise ValueError(f"{cfg.transfer} sends from an NPU: its buffers are sized by whoever builds it (make_npu_sender)")
    kv = mc.num_kv_heads
    prefill = [Shard(p, cfg.prefill_tp).kv_heads(kv) for p in range(cfg.prefill_tp)]
    decode = [Shard(d, cfg.decode_tp).kv_heads(kv) for d in range(cfg.decode_tp)]
    # (prefill rank, decode rank) -> KV heads one transfer between them moves
    shared = {(p, d): min(ph.stop, dh.stop) - max(ph.start, dh.start) for p, ph in enumerate(prefill) for d, dh in enumerate(decode)}
    shared = {k: n for k, n in shared.items() if n > 0}

    def entry(p: int, d: int) -> int:  # what one transfer sends
        if tc.send_format == "npu-tiles":
            return _tiles_bytes(_tile_layout(cfg, mc, shared[p, d]), tokens)
        return _compact_bytes(cfg, mc, len(prefill[p]), tokens)  # compact blocks: the prefill rank's heads, whoever asks

    if buffer == "staging":
        if tc.staging is None:  # gg-direct: read in place
            return 0
        # every decode rank sharing a prefill rank's heads pulls its own entry, all at once
        per_rank = [sum(_aligned(entry(p, d), BYTE_BUFFER_ALIGNMENT) for (q, d) in shared if q == p) for p in range(cfg.prefill_tp)]
        return max(per_rank)
    if tc.landing == "gpu-direct" or cfg.kv_flow == "layerwise":  # straight into the cache blocks
        return 0
    # a decode rank pulls from the prefill ranks sharing its heads one after the other: the largest counts
    if tc.landing == "channels":
        if cfg.landing_mode == "direct":
            return 0
        arch = get_arch(cfg.arch)
        per_channel = 0
        for n in set(shared.values()):
            lay = _tile_layout(cfg, mc, n)
            pages = -(-tokens // lay.block_size) * _channel_pages_per_block(lay)
            per_channel = max(per_channel, arch.aligned(pages * lay.num_tensors * lay.page_size))
        return per_channel * arch.num_channels
    if tc.landing == "single":
        return max(get_arch(cfg.arch).aligned(entry(p, d)) for p, d in shared)
    return max(_aligned(entry(p, d), BYTE_BUFFER_ALIGNMENT) for p, d in shared)  # the host receive buffer (gn-host, gg-host)


def auto_buffer_mb(cfg: ServeConfig, mc: ModelConfig, buffer: str) -> int:
    """What ``--staging-mb`` / ``--rx-mb`` "auto" means: room for the KV of the longest request this
    instance can hold (:func:`max_request_tokens`) as :func:`transfer_buffer_bytes` counts it, in whole
    MiB, never less than ``AUTO_BUFFER_MIN_MB``."""
    need = transfer_buffer_bytes(cfg, mc, buffer, max_request_tokens(cfg, mc))
    return max(AUTO_BUFFER_MIN_MB, -(-need // MiB))


def buffer_mb(cfg: ServeConfig, mc: ModelConfig, buffer: str) -> int:
    """The size of ``buffer`` in MiB: as given, or auto when the option is unset (None)."""
    given = cfg.staging_mb if buffer == "staging" else cfg.rx_mb
    return auto_buffer_mb(cfg, mc, buffer) if given is None else given


def _usable(cfg: ServeConfig, buffer: str, capacity: int) -> int:
    """Bytes of a ``capacity``-byte buffer a reservation can use: gn-hawk's receive buffer is one
    buffer of ``ceil(capacity / channels)`` bytes per channel."""
    if buffer == "rx" and cfg.transfer == "gn-hawk":
        n = get_arch(cfg.arch).num_channels
        return -(-capacity // n) * n
    return capacity


@dataclass(frozen=True)
class KVLimit:
    """The longest prompt whose KV fits one transfer buffer, empty: longer ones can never be sent."""

    buffer: str  # "staging" | "rx"
    capacity: int  # bytes
    tokens: int
    auto: bool  # the size came from "auto" (sized for shorter requests than this instance accepts)

    def refusal(self, cfg: ServeConfig, mc: ModelConfig, num_tokens: int) -> PromptTooLong:
        need = transfer_buffer_bytes(cfg, mc, self.buffer, num_tokens)
        where = "the prefill's staging buffer" if self.buffer == "staging" else "the decode's receive buffers"
        size = f"{_FLAGS[self.buffer]} {'auto = ' if self.auto else ''}{self.capacity // MiB} MiB"
        fix = (
            f"the buffer was sized for {max_request_tokens(cfg, mc)} tokens (min(--kv-tokens, --max-model-len or the model's context))"
            if self.auto else f"raise {_FLAGS[self.buffer]} or leave it unset (auto: sized for the longest request)"
        )
        return PromptTooLong(
            f"prompt of {num_tokens} tokens: its KV needs {need} B of {where} ({size} = {self.capacity} B) and could never "
            f"be transferred; this instance takes prompts up to {self.tokens} tokens ({fix})"
        )


def kv_limits(cfg: ServeConfig, mc: ModelConfig, capacities: dict[str, int], upto: int) -> list[KVLimit]:
    """For each buffer (name -> bytes), the longest prompt up to ``upto`` tokens whose KV fits it,
    empty; a buffer that fits every such prompt sets no limit. Raises when not even one token fits."""
    out = []
    for buffer, capacity in capacities.items():
        usable = _usable(cfg, buffer, capacity)
        need = lambda t, b=buffer: transfer_buffer_bytes(cfg, mc, b, t)  # noqa: E731 - monotone in t
        if need(upto) <= usable:
            continue
        lo, hi = 0, upto  # need(lo) fits, need(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= usable else (lo, mid)
        given = cfg.staging_mb if buffer == "staging" else cfg.rx_mb
        if lo == 0:
            raise ValueError(
                f"{_FLAGS[buffer]} {capacity // MiB} ({capacity} B) cannot hold the KV of even a one-token prompt "
                f"({need(1)} B for {cfg.transfer}); raise it or leave it unset (auto)"
            )
        out.append(KVLimit(buffer, capacity, lo, given is None))
    return out


def check_kv_fits(cfg: ServeConfig, mc: ModelConfig, limits: list[KVLimit], num_tokens: int) -> None:
    """Raise :class:`PromptTooLong` when a prompt of ``num_tokens`` can never be transferred."""
    for lim in limits:
        if num_tokens > lim.tokens:
            raise lim.refusal(cfg, mc, num_tokens)
