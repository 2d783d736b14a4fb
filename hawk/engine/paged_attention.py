"""Attention over a vLLM-layout paged KV cache (the GPU side: prefill, and decode for gg-* / colocated).

New K/V go to their slots; a sequence starting at position 0 attends over its fresh K/V (prefill),
one that continues reads its context back from the cache blocks (decode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hawk.engine.attention import SeqSlice, attend
from hawk.layouts.gpu import GpuKVLayout

__all__ = ["PagedAttention", "SeqSlice"]


class PagedAttention:
    def __init__(self, layout: GpuKVLayout, caches: Sequence[torch.Tensor]):
        layout.check_cache(list(caches))
        self.layout, self.caches = layout, list(caches)
        self._batch: list[SeqSlice] = []
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ctx: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def begin(self, batch: Sequence[SeqSlice]) -> None:
        """Declare the next forward's sequences, in the order their tokens are concatenated."""
        bs, dev = self.layout.block_size, self.caches[0].device
        blocks, slots, ctx = [], [], []
        for s in batch:
            need = -(-(s.start + s.q_len) // bs)
            if len(s.block_ids) < need:
                raise ValueError(f"sequence needs {need} blocks for {s.start + s.q_len} tokens, has {len(s.block_ids)}")
            pos = torch.arange(s.start, s.start + s.q_len)
            ids = torch.as_tensor(list(s.block_ids), dtype=torch.int64)
            blocks.append(ids[pos // bs])
            slots.append(pos % bs)
            if s.start == 0:
                ctx.append(None)
            else:
                n = s.start + s.q_len
                p = torch.arange(n)
                ctx.append((ids[p // bs].to(dev), (p % bs).to(dev)))
        self._batch = list(batch)
        self._slots = (torch.cat(blocks).to(dev), torch.cat(slots).to(dev))
        self._ctx = ctx

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.caches[layer_idx]
        blk, slot = self._slots  # type: ignore[misc]
        dt = cache.dtype
        if self.layout.order == "NHD":
            cache[0, blk, slot] = k.to(dt)
            cache[1, blk, slot] = v.to(dt)
        else:
            cache[0, blk, :, slot] = k.to(dt)
            cache[1, blk, :, slot] = v.to(dt)
        out, off = [], 0
        for s, ctx in zip(self._batch, self._ctx):
            qs = q[off : off + s.q_len]
            if ctx is None:
                out.append(attend(qs, k[off : off + s.q_len], v[off : off + s.q_len]))
            else:
                b, sl = ctx
                if self.layout.order == "NHD":
                    kc, vc = cache[0, b, sl], cache[1, b, sl]
                else:
                    kc, vc = cache[0, b, :, sl], cache[1, b, :, sl]
                out.append(attend(qs, kc.to(q.dtype), vc.to(q.dtype)))
            off += s.q_len
        return torch.cat(out)
