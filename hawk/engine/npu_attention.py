"""Decode attention over the NPU's tiled, interleaved KV cache, where the tiles live.

Reading: a sequence's blocks are gathered page by page through the page map (page -> bank, slot)
and decoded from their tile dtype; nothing keeps a row-major copy between steps. Writing: a new
token's K/V row is put in place by read-modify-write of its tile, as the NPU does (untilize,
replace the row, re-tilize; bfloat8_b re-derives that row's shared exponents).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hawk.engine.attention import attend
from hawk.engine.attention import SeqSlice
from hawk.layouts.tt import TILE, bytes_to_tiles, from_tiles, tiles_to_bytes, to_tiles
from hawk.memory.npu_kv_cache import NpuKVCacheMemory


class NpuTileAttention:
    def __init__(self, kv: NpuKVCacheMemory):
        self.kv = kv
        self.layout = kv.layout
        self.device = kv.npu.torch_device
        self._batch: list[SeqSlice] = []
        self._row_pages: torch.Tensor | None = None  # [n_new, H, Wt] pages holding each new row
        self._row_in_tile: torch.Tensor | None = None  # [n_new]

    def begin(self, batch: Sequence[SeqSlice]) -> None:
        lay = self.layout
        bs, wt = lay.block_size, lay.col_tiles
        pages, rows = [], []
        for s in batch:
            if s.start == 0:
                raise ValueError("the NPU decode cache is filled by KV transfer; prefill does not run here")
            need = -(-(s.start + s.q_len) // bs)
            if len(s.block_ids) < need:
                raise ValueError(f"sequence needs {need} NPU blocks for {s.start + s.q_len} tokens, has {len(s.block_ids)}")
            for p in range(s.start, s.start + s.q_len):
                r = p % bs
                blk = s.block_ids[p // bs]
                h = torch.arange(lay.num_kv_heads)[:, None]
                c = torch.arange(wt)[None, :]
                pages.append(lay.page_index(blk, h, r // TILE, c))
                rows.append(r % TILE)
        keys = [(s.block_ids[p // bs], p % bs) for s in batch for p in range(s.start, s.start + s.q_len)]
        if len(set(keys)) != len(keys):
            raise ValueError("two new tokens map to the same cache row")
        self._batch = list(batch)
        self._row_pages = torch.stack(pages).to(self.device)
        self._row_in_tile = torch.tensor(rows, device=self.device)

    def _write_rows(self, t: int, values: torch.Tensor) -> None:
        """Put ``values [n_new, H, D]`` into their tile rows of tensor ``t`` (read-modify-write)."""
        lay = self.layout
        n, h, wt = self._row_pages.shape  # type: ignore[union-attr]
        pages = self._row_pages.reshape(-1)  # type: ignore[union-attr]
        bank, slot = lay.page_map.bank(pages), lay.page_map.slot(pages)
        view = self.kv.pages(t)
        raw = view[bank, slot, : lay.page_size]
        tiles = from_tiles(bytes_to_tiles(raw, lay.dtype), (pages.numel(), TILE, TILE))
        tiles = tiles.view(n, h, wt, TILE, TILE)
        row = self._row_in_tile[:, None, None].expand(n, h, wt)  # type: ignore[index]
        new = values.to(torch.float32).reshape(n, h, wt, TILE)
        tiles[torch.arange(n)[:, None, None], torch.arange(h)[None, :, None], torch.arange(wt)[None, None, :], row] = new
        view[bank, slot, : lay.page_size] = tiles_to_bytes(to_tiles(tiles.reshape(-1, TILE, TILE)), lay.dtype)

    def _context(self, t: int, s: SeqSlice) -> torch.Tensor:
        """``[ctx, H, D]`` of one sequence, decoded from its tiles."""
        n = s.start + s.q_len
        nblk = -(-n // self.layout.block_size)
        blocks = torch.as_tensor(list(s.block_ids[:nblk]), device=self.device)
        x = self.kv.read_blocks(t, blocks)  # [nblk, H, bs, D]
        return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:n]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tk, tv = 2 * layer_idx, 2 * layer_idx + 1
        self._write_rows(tk, k.to(self.device))
        self._write_rows(tv, v.to(self.device))
        out, off = [], 0
        for s in self._batch:
            kc = self._context(tk, s).to(q.device, q.dtype)
            vc = self._context(tv, s).to(q.device, q.dtype)
            out.append(attend(q[off : off + s.q_len], kc, vc))
            off += s.q_len
        return torch.cat(out)
