"""Decode attention over the NPU's tiled, interleaved KV cache, where the tiles live.

Reading: each sequence's context is read tile by tile through the page map (page -> bank, slot) and
decoded from its tile dtype; nothing keeps a row-major copy between steps. Writing: a new token's K/V
row is put in place, touching only that row's bytes, as the NPU does: a bf16 row is two runs of 16
values per tile; a bfloat8_b row re-derives only its own shared exponents (one per face row).

Two paths, one contract (``PagedBackend``):
- Triton (``triton_npu_attention.py``) when the memory is on CUDA: metadata lives in persistent device
  buffers written once per ``begin``; ``__call__`` launches fixed grids for a padded batch and never
  syncs, so a CUDA graph captured after ``begin(.., pad_to=B)`` replays after any later one. It gives
  the paged decode's bits for the same K/V values (same splits, chunks, steps and merge: the kernels
  share them with ``triton_attention.py``), so a disaggregated run decodes the colocated one's tokens.
  Except bfloat8_b's default on an sm_90 GPU, the register kernel (``gluon_npu_attention.py``: its own
  chunks and splits, 0.67x the paged decode's time at batch 64): its values are the codec's, its
  sums in another order (within tolerance; bfloat8_b changes the values anyway).
- torch (CPU, or no triton): the same reads and writes vectorised over the batch; only the row tiles
  up to each sequence's length are decoded.
``hawk/layouts/tt.py`` is the oracle for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hawk.devices.staging import HostStaging
from hawk.engine import triton_npu_attention as tk
from hawk.engine.attention import SeqSlice, attend
from hawk.layouts.tt import TILE, pack_bfp8_rows
from hawk.memory.npu_kv_cache import NpuKVCacheMemory

#: 2^(E-133) for every shared exponent byte (exact in fp32), and each value byte's signed magnitude.
_BFP8_SCALE = torch.tensor([2.0 ** (e - 133) for e in range(256)], dtype=torch.float32)
_BFP8_MAG = torch.tensor([(-1.0 if b & 0x80 else 1.0) * (b & 0x7F) for b in range(256)], dtype=torch.float32)


class NpuTileAttention:
    """``PagedBackend`` over ``NpuKVCacheMemory``: decode only (the cache is filled by KV transfer).

    ``max_batch``: most rows (new tokens, pad rows included) one forward may have; ``max_model_len``
    bounds the block table width (default: every block of the cache). ``backend``: ``"auto"`` (Triton
    on CUDA memory when importable, else torch), ``"triton"`` (also on CPU under TRITON_INTERPRET, for
    tests) or ``"torch"``. ``num_splits`` overrides the split-K factor of the Triton path (default: the
    paged decode's for the same padded batch, which equal bits need).
    """

    def __init__(
        self,
        kv: NpuKVCacheMemory,
        max_batch: int = 256,
        max_model_len: int | None = None,
        backend: str = "auto",
        num_splits: int | None = None,
    ):
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.kv = kv
        self.layout = lay = kv.layout
        self.device = kv.pages(0).device
        self.max_batch = max_batch
        bs = lay.block_size
        self.max_blocks = lay.max_num_blocks if max_model_len is None else min(lay.max_num_blocks, -(-max_model_len // bs))
        geom = tk.tile_geometry(kv) if backend != "torch" else None
        if backend == "triton" and geom is None:
            raise ValueError(f"the Triton path cannot address this cache (triton missing, dtype {lay.dtype} or head_dim {lay.head_dim})")
        use_triton = geom is not None and (backend == "triton" or self.device.type == "cuda")
        self._geom = geom if use_triton else None
        self.graph_safe = bool(use_triton and self.device.type == "cuda")
        self.num_splits = num_splits
        #: launch shape of the fast Triton kernel (None: ``tk.decode_config``); ``generic`` forces the
        #: per-row-tile kernel. Both are for probes and tests; fix them before capturing a graph.
        self.decode_config: tk.DecodeConfig | None = None
        self.generic = False
        self._rows = 0
        self._batch: list[SeqSlice] = []
        self._decode_only = False  # every q_len == 1: the row write may share the decode launch
        if self._geom is not None:
            self._meta = torch.zeros(max_batch, tk.META_BLOCKS + self.max_blocks, dtype=torch.int32, device=self.device)
            self._meta[:, tk.META_ROW_LOC] = -1
            self._ws: dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
            self._stage = _MetaStage(self._meta)
        else:
            self._flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(kv.pages(0).untyped_storage())
            self._bases = [kv.pages(t).storage_offset() for t in range(lay.num_tensors)]
            self._scale = _BFP8_SCALE.to(self.device)
            self._mag = _BFP8_MAG.to(self.device)

    # ---- begin -------------------------------------------------------------------------------

    def begin(self, batch: Sequence[SeqSlice], pad_to: int | None = None) -> None:
        """Declare the next forward; validates, then builds all metadata on the host in one go."""
        if self._geom is not None and all(s.q_len == 1 for s in batch):  # a decode step: the hot path
            rows = len(batch) if pad_to is None else pad_to
            if rows < len(batch):
                raise ValueError(f"pad_to={pad_to} is smaller than the batch ({len(batch)})")
            self._begin_decode(batch, rows)  # validates as it goes
            self._batch, self._rows, self._decode_only = list(batch), rows, True
            return
        bs = self.layout.block_size
        q_lens = [s.q_len for s in batch]
        for s in batch:
            if s.start == 0:
                raise ValueError("the NPU decode cache is filled by KV transfer; prefill does not run here")
            if s.q_len <= 0:
                raise ValueError(f"every q_len must be > 0, got {s.q_len}")
            need = -(-(s.start + s.q_len) // bs)
            if len(s.block_ids) < need:
                raise ValueError(f"sequence needs {need} NPU blocks for {s.start + s.q_len} tokens, has {len(s.block_ids)}")
        tokens = sum(q_lens)
        rows = tokens
        if pad_to is not None:
            if any(n != 1 for n in q_lens):
                raise ValueError("pad_to is for decode batches (every q_len == 1)")
            if pad_to < len(batch):
                raise ValueError(f"pad_to={pad_to} is smaller than the batch ({len(batch)})")
            rows = pad_to
        # every new token's (sequence, position) -> (npu block, row), without per-token Python work
        seq_of = np.repeat(np.arange(len(batch)), q_lens)
        starts = np.repeat(np.array([s.start for s in batch], dtype=np.int64), q_lens)
        first = np.repeat(np.cumsum([0] + q_lens[:-1]), q_lens) if batch else np.zeros(0, np.int64)
        pos = starts + np.arange(tokens) - first
        nblk = [-(-(s.start + s.q_len) // bs) for s in batch]
        table = np.zeros((len(batch), max(nblk, default=0)), dtype=np.int64)
        for i, s in enumerate(batch):
            table[i, : nblk[i]] = s.block_ids[: nblk[i]]
        blk = table[seq_of, pos // bs] if tokens else np.zeros(0, np.int64)
        loc = blk * bs + pos % bs
        if np.unique(loc).size != loc.size:
            raise ValueError("two new tokens map to the same cache row")
        self._batch = list(batch)
        self._rows = rows
        self._decode_only = all(n == 1 for n in q_lens)
        if self._geom is not None:
            self._begin_triton(table, nblk, seq_of, pos, loc, rows)
        else:
            self._begin_torch(table, nblk, blk, pos)

    def _begin_triton(self, table: np.ndarray, nblk: list[int], seq_of: np.ndarray, pos: np.ndarray, loc: np.ndarray, rows: int) -> None:
        """Fill rows ``[:rows]`` of the persistent metadata with one H2D copy (fresh host array: no reuse race)."""
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows exceed max_batch={self.max_batch}")
        if max(nblk, default=0) > self.max_blocks:
            raise ValueError(f"a sequence needs {max(nblk)} blocks, more than max_model_len allows ({self.max_blocks})")
        host = np.zeros((rows, tk.META_BLOCKS + self.max_blocks), dtype=np.int32)
        host[:, tk.META_ROW_LOC] = -1
        n = pos.size
        host[:n, tk.META_SEQ_LEN] = pos + 1  # a query sees its own row and everything before it
        host[:n, tk.META_ROW_LOC] = loc
        host[:n, tk.META_BLOCKS : tk.META_BLOCKS + table.shape[1]] = table[seq_of]
        if rows:
            self._meta[:rows].copy_(torch.from_numpy(host), non_blocking=True)
        self._stage.forget()  # _meta's rows no longer hold what the staging slots remember

    def _begin_decode(self, batch: Sequence[SeqSlice], rows: int) -> None:
        """A decode step's metadata (one new row per sequence) as the paged decode writes its own:
        into a pinned staging slot, rewriting only the blocks a row did not have two steps ago, then
        one async copy. Every step pays this on the host before its graph replays, so the loop
        checks each row as it goes and collects the per-row columns for two slice writes."""
        if rows > self.max_batch:
            raise ValueError(f"{rows} rows exceed max_batch={self.max_batch}")
        bs, mb, n = self.layout.block_size, tk.META_BLOCKS, len(batch)
        host, known = self._stage.next_slot()
        del known[n:]
        lens: list[int] = []
        locs: list[int] = []
        for i, s in enumerate(batch):
            start, ids = s.start, s.block_ids
            if start <= 0:
                raise ValueError("the NPU decode cache is filled by KV transfer; prefill does not run here")
            need = start // bs + 1
            if len(ids) < need:
                raise ValueError(f"sequence needs {need} NPU blocks for {start + 1} tokens, has {len(ids)}")
            if need > self.max_blocks:
                raise ValueError(f"a sequence needs {need} blocks, more than max_model_len allows ({self.max_blocks})")
            done = 0
            if i < len(known):
                old, k, last = known[i]
                if old is ids and len(ids) >= k and ids[k - 1] == last:
                    done = k
            if need > done:
                host[i, mb + done : mb + need] = ids[done:need]
                if i < len(known):
                    known[i] = (ids, need, ids[need - 1])
                else:
                    known.append((ids, need, ids[need - 1]))
            lens.append(start + 1)
            locs.append(ids[need - 1] * bs + start % bs)
        if len(set(locs)) != n:
            raise ValueError("two new tokens map to the same cache row")
        host[:n, tk.META_SEQ_LEN] = lens
        host[:n, tk.META_ROW_LOC] = locs
        host[n:rows, tk.META_SEQ_LEN] = 0  # pad rows: no context, no row to write
        host[n:rows, tk.META_ROW_LOC] = -1
        self._stage.upload(rows)

    def _begin_torch(self, table: np.ndarray, nblk: list[int], blk: np.ndarray, pos: np.ndarray) -> None:
        """Byte offsets (from a tensor's base) of every new row's bytes and of every context tile."""
        lay = self.layout
        bs, wt, h = lay.block_size, lay.col_tiles, lay.num_kv_heads
        r = pos % bs
        heads = np.arange(h)[None, :, None]
        cols = np.arange(wt)[None, None, :]
        tile = self._tile_bytes(lay.page_index(blk[:, None, None], heads, (r // TILE)[:, None, None], cols))
        rr = r % TILE
        face = ((rr // 16) * 2)[:, None, None, None] + np.arange(2)  # [n, 1, 1, 2]
        ri = (rr % 16)[:, None, None, None]
        if lay.dtype == "bf16":
            elem = (face * 256 + ri * 16)[..., None] + np.arange(16)  # [n, 1, 1, 2, 16] elements
            off = tile[..., None, None] + 2 * elem
            off = off[..., None] + np.arange(2)  # both bytes of each value
            self._w_idx = (torch.from_numpy(off.reshape(-1)).to(self.device),)
        else:
            exp = tile[..., None] + face * 16 + ri
            val = tile[..., None, None] + 64 + (face * 256 + ri * 16)[..., None] + np.arange(16)
            self._w_idx = (torch.from_numpy(exp.reshape(-1)).to(self.device), torch.from_numpy(val.reshape(-1)).to(self.device))
        # context tiles: row tiles 0 .. ceil(len/32) of every sequence, concatenated
        ntiles = [-(-(s.start + s.q_len) // TILE) for s in self._batch]
        seq = np.repeat(np.arange(len(ntiles)), ntiles)
        rt = np.arange(sum(ntiles)) - np.repeat(np.cumsum([0] + ntiles)[:-1], ntiles)
        rpb = lay.row_tiles
        cblk = table[seq, rt // rpb] if seq.size else np.zeros(0, np.int64)
        pages = lay.page_index(cblk[:, None, None], heads, (rt % rpb)[:, None, None], cols)
        self._r_tiles = torch.from_numpy(self._tile_bytes(pages)).to(self.device)  # [Ntiles, H, Wt]
        self._r_first = np.cumsum([0] + ntiles)[:-1].tolist()

    def _tile_bytes(self, pages: np.ndarray) -> np.ndarray:
        """Pages -> byte offset of each page from its tensor's base (through the page map)."""
        pm = self.layout.page_map
        st = self.kv.pages(0).stride()
        return pm.bank(pages) * st[0] + pm.slot(pages) * st[1]

    # ---- the forward -------------------------------------------------------------------------

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != self._rows:
            raise ValueError(f"batch has {q.shape[0]} rows but begin() declared {self._rows}")
        if self._geom is not None:
            return self._call_triton(layer_idx, q, k, v)
        return self._call_torch(layer_idx, q, k, v)

    # ---- RoPE in the decode launch (attention.RotatingBackend) ----------------------------------

    def fuses_rope(self, num_heads: int, dtype: torch.dtype, device: torch.device) -> bool:
        """True when the forward ``begin`` declared rotates q and k in its decode launch (a decode
        batch, the register kernel writing the rows, ``DecodeConfig.fused_rope``): the layer then calls
        :meth:`attend_unrotated` and runs no RoPE kernel."""
        g = self._geom
        if g is None or not self._decode_only or dtype != torch.bfloat16 or torch.device(device) != self.device:
            return False
        return tk.fuses_rope(g, self.decode_config, self.generic, self.layout.head_dim, num_heads // g.num_kv_heads,
                             self.device)

    def attend_unrotated(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """As ``__call__``, with q and k before RoPE (only where :meth:`fuses_rope` said so):
        ``positions [rows]``, the tables ``cos, sin_signed [len, D]`` (the layer's)."""
        if q.shape[0] != self._rows:
            raise ValueError(f"batch has {q.shape[0]} rows but begin() declared {self._rows}")
        if not self.fuses_rope(q.shape[1], q.dtype, q.device):
            raise ValueError("this forward does not rotate in its decode launch (fuses_rope is False)")
        return self._call_triton(layer_idx, q, k, v, rope=(positions, cos, sin_signed))

    def _call_triton(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Two or three launches (one fewer when the decode config writes the rows itself: a decode
        batch with ``DecodeConfig.fused_write``), fixed grids for a given row count, no host sync."""
        g, rows = self._geom, self._rows
        assert g is not None
        if rows == 0:
            return torch.empty_like(q)
        dev = self.device
        qd, kd, vd = (x.to(dev) for x in (q, k, v))
        qd, kd, vd = (x if x.stride(-1) == 1 else x.contiguous() for x in (qd, kd, vd))
        # with several new rows per sequence a row's context holds its neighbours' new rows, which
        # another program writes: only decode batches may write in the decode launch
        fused = self._decode_only and tk.fuses_row_write(g, self.decode_config, self.generic)
        if not fused:
            tk.write_rows(g, layer, kd, vd, self._meta, rows)  # then read back, as the paged decode does
        splits = self.num_splits or tk.choose_splits(rows, g.num_kv_heads, dev, g, self.decode_config,
                                                     q.shape[2], q.shape[1] // g.num_kv_heads)
        ws = counters = None
        if splits > 1:
            key = (rows, q.shape[1], q.shape[2], splits)
            ws = self._ws.get(key)
            if ws is None:  # kept for reuse, so a captured graph keeps pointing at it
                n = rows * q.shape[1] * splits
                ws = (torch.empty(n * q.shape[2], dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev),
                      torch.zeros(rows * g.num_kv_heads, dtype=torch.int32, device=dev))  # every merging launch leaves them 0
                self._ws[key] = ws
            ws, counters = ws[:2], ws[2]
        return tk.decode_attention(g, layer, qd, self._meta, rows, splits, ws, self.decode_config, self.generic,
                                   new_kv=(kd, vd) if fused else None, counters=counters, rope=rope).to(q.device)

    def _call_torch(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tk_, tv = 2 * layer, 2 * layer + 1
        n = sum(s.q_len for s in self._batch)
        if n == 0:
            return torch.zeros_like(q)
        self._write_rows(tk_, k[:n].to(self.device))
        self._write_rows(tv, v[:n].to(self.device))
        kc = self._context(tk_, q.dtype)
        vc = self._context(tv, q.dtype)
        out, off = [], 0
        for s, f in zip(self._batch, self._r_first):
            c0, c1 = f * TILE, f * TILE + s.start + s.q_len
            out.append(attend(q[off : off + s.q_len], kc[c0:c1].to(q.device), vc[c0:c1].to(q.device)))
            off += s.q_len
        if self._rows > n:  # pad rows: finite, ignored
            out.append(torch.zeros(self._rows - n, *q.shape[1:], dtype=q.dtype, device=q.device))
        return torch.cat(out)

    def _write_rows(self, t: int, values: torch.Tensor) -> None:
        """Scatter the new rows ``[n, H, D]`` of tensor ``t``: only their own bytes change."""
        if values.shape[0] == 0:
            return
        base = self._bases[t]
        n, h, d = values.shape
        if self.layout.dtype == "bf16":
            data = values.to(torch.float32).to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
            self._flat[self._w_idx[0] + base] = data
            return
        bits = values.to(torch.float32).contiguous().view(torch.int32).reshape(n, h, d // 16, 16)
        exps, vals = pack_bfp8_rows(bits)
        self._flat[self._w_idx[0] + base] = exps.reshape(-1)
        self._flat[self._w_idx[1] + base] = vals.reshape(-1)

    def _context(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """All context row tiles of the batch decoded to ``[tiles*32, H, D]`` in ``dtype``."""
        lay = self.layout
        view = self.kv.pages(t)
        idx = self._r_tiles  # [N, H, Wt] byte offsets
        n, h, wt = idx.shape
        ap = view.stride(1)
        if ap % 8 == 0 and view.storage_offset() % 8 == 0 and view.stride(0) % 8 == 0:
            # gather whole pages as int64 words: 8x fewer index operations than bytes
            words = self._flat.view(torch.int64)
            rows = words.as_strided((words.numel() - ap // 8 + 1, ap // 8), (1, 1))
            raw = torch.index_select(rows, 0, (idx.reshape(-1) + view.storage_offset()) // 8).view(torch.uint8)[:, : lay.page_size]
        else:
            raw = torch.stack([self._flat[view.storage_offset() + o : view.storage_offset() + o + lay.page_size] for o in idx.reshape(-1).tolist()])
        if lay.dtype == "bf16":
            tiles = raw.contiguous().view(torch.bfloat16).reshape(n, h, wt, 2, 2, 16, 16).to(dtype)
        else:
            scale = self._scale[raw[:, :64].to(torch.int64)]  # [N*H*Wt, 64]
            vals = self._mag[raw[:, 64:].to(torch.int64)].reshape(-1, 64, 16)
            tiles = (vals * scale[..., None]).reshape(n, h, wt, 2, 2, 16, 16).to(dtype)
        # (tile, head, col_tile, face_row, face_col, r, c) -> (tile, face_row, r, head, col_tile, face_col, c)
        return tiles.permute(0, 3, 5, 1, 2, 4, 6).reshape(n * TILE, h, wt * TILE)


class _MetaStage:
    """The decode metadata rows' :class:`~hawk.devices.staging.HostStaging` (two pinned slots on CUDA;
    on the host the buffer itself), with what each slot's rows last held: ``(block list, blocks
    written, last block)`` per row, so a step rewrites only a row's new blocks."""

    def __init__(self, meta: torch.Tensor):
        self.meta = meta
        self.staging = HostStaging([meta], slots=2)
        self.known: list[list[tuple[Sequence[int], int, int]]] = [[] for _ in range(2)]

    def next_slot(self) -> tuple[np.ndarray, list[tuple[Sequence[int], int, int]]]:
        (host,) = self.staging.next()
        return host, self.known[self.staging.slot]

    def upload(self, rows: int) -> None:
        if rows:
            self.staging.upload((rows * self.meta.shape[1],))

    def forget(self) -> None:
        """Another writer filled ``meta``: every row is rewritten whole next time."""
        for k in self.known:
            k.clear()
