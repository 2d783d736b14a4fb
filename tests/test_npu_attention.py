"""Tile-native NPU decode attention: the torch and Triton paths against the tile codecs (the oracle).

The oracle writes a new row by decoding its whole tile with ``hawk.layouts.tt``, replacing the row and
re-encoding it, and attends with ``attend`` over contexts decoded by the same codecs. The Triton kernels
run on the CPU under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before triton
is imported, and must not leak into other test files); GPU tests run on the device machine.
"""

from __future__ import annotations

import json
import traceback

import pytest
import torch

from hawk.devices.emulated import open_npu
from hawk.engine.attention import PagedBackend, SeqSlice, attend
from hawk.layouts.npu import NpuKVLayout
from hawk.layouts.tt import TILE, bytes_to_tiles, from_tiles, tiles_to_bytes, to_tiles
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from tests.interpreter import emit, run_interpreted



def _cache(dtype: str, shard: int, heads: int = 2, head_dim: int = 64, blocks: int = 12, device: str = "cpu", layers: int = 2,
           bank_capacity: int = 8 << 20, block_size: int = 64):
    """A small cache filled with random tiles (every byte defined, as after a KV transfer)."""
    npu = open_npu(f"npu-emu:{device}", bank_capacity=bank_capacity)
    lay = NpuKVLayout(npu.arch, layers, blocks, heads, block_size, head_dim, dtype, shard_pages=shard)
    kv = NpuKVCacheMemory(npu, lay)
    g = torch.Generator().manual_seed(0)
    pages = torch.arange(lay.pages_per_tensor, device=npu.torch_device)
    for t in range(lay.num_tensors):
        x = torch.randn(blocks, heads, block_size, head_dim, generator=g)
        kv.write_pages(t, pages, tiles_to_bytes(to_tiles(x), dtype).to(npu.torch_device))
    return npu, kv


def _oracle_write(kv: NpuKVCacheMemory, t: int, batch, values: torch.Tensor) -> None:
    """Codec read-modify-write of each new row's tiles, one token at a time."""
    lay = kv.layout
    bs = lay.block_size
    n = 0
    for s in batch:
        for p in range(s.start, s.start + s.q_len):
            blk, r = s.block_ids[p // bs], p % bs
            heads = torch.arange(lay.num_kv_heads)[:, None]
            cols = torch.arange(lay.col_tiles)[None, :]
            pages = torch.as_tensor(lay.page_index(blk, heads, r // TILE, cols)).reshape(-1)
            pm = lay.page_map
            raw = kv.pages(t)[pm.bank(pages), pm.slot(pages), : lay.page_size].cpu()
            tiles = from_tiles(bytes_to_tiles(raw, lay.dtype), (pages.numel(), TILE, TILE))
            tiles = tiles.view(lay.num_kv_heads, lay.col_tiles, TILE, TILE)
            tiles[:, :, r % TILE, :] = values[n].float().cpu().reshape(lay.num_kv_heads, lay.col_tiles, TILE)
            kv.write_pages(t, pages.to(kv.pages(t).device), tiles_to_bytes(to_tiles(tiles.reshape(-1, TILE, TILE)), lay.dtype).to(kv.pages(t).device))
            n += 1


def _oracle_attention(kv: NpuKVCacheMemory, layer: int, batch, q, k, v) -> torch.Tensor:
    """Write with the codecs, then ``attend`` over each context decoded with them."""
    _oracle_write(kv, 2 * layer, batch, k)
    _oracle_write(kv, 2 * layer + 1, batch, v)
    out, off = [], 0
    for s in batch:
        n = s.start + s.q_len
        nblk = -(-n // kv.layout.block_size)
        blocks = torch.as_tensor(list(s.block_ids[:nblk]), device=kv.pages(0).device)
        ctx = []
        for t in (2 * layer, 2 * layer + 1):
            x = kv.read_blocks(t, blocks)
            ctx.append(x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:n].to(q.device, q.dtype))
        out.append(attend(q[off : off + s.q_len], ctx[0], ctx[1]))
        off += s.q_len
    return torch.cat(out)


#: bfloat8_b decode configs the tests run beside the named variants (``BFP8_VARIANTS``): code paths no
#: variant takes yet (the fused row write and token-addressed loads with register prefetch instead of
#: the compiler's pipelining), so that a later variant built on them is already checked.
_TEST_CONFIGS = {
    "cfg:prefetch-fw": dict(bfp8="words", fused_write=True),
    "cfg:prefetch-tok-fw": dict(bfp8="words", token_loads=True, fused_write=True),
}


def _variant_config(name: str):
    """A bfloat8_b variant's ``DecodeConfig`` by name: ``BFP8_VARIANTS`` or ``_TEST_CONFIGS``."""
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS, DecodeConfig

    if name in _TEST_CONFIGS:
        return DecodeConfig(**_TEST_CONFIGS[name])
    return BFP8_VARIANTS[name]


BATCH = [SeqSlice([3, 7, 1], 100, 1), SeqSlice([0, 2], 40, 1), SeqSlice([5, 9, 10, 11], 200, 1)]
BATCH_MULTI = [SeqSlice([3, 7, 1], 100, 1), SeqSlice([0, 2], 40, 3)]  # 3 new rows in one tile


def _qkv(rows: int, hq: int, hkv: int, d: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))


def _compare(dtype: str, shard: int, batch, hq: int = 4, backend: str = "torch", splits: int | None = None,
             pad_to: int | None = None, atol: float = 1e-5, fast: bool = False, variant: str | None = None,
             q_dtype: torch.dtype = torch.float32, block_size: int = 64) -> None:
    """Backend vs oracle: every byte of memory after the writes, and the outputs, over two layers.

    ``fast``: give the Triton path an explicit launch shape, which routes bf16 to the chunked kernel too.
    ``variant``: a bfloat8_b decode variant by name (``BFP8_VARIANTS``), which must then be the kernel
    that runs (the page map is separable).
    """
    from hawk.engine.npu_attention import NpuTileAttention

    npu, kv = _cache(dtype, shard, block_size=block_size)
    try:
        n = sum(s.q_len for s in batch)
        rows = pad_to or n
        q, k, v = _qkv(rows, hq, 2, 64, seed=len(batch) + hq, dtype=q_dtype)
        mem0 = npu.memory.clone()
        want = [_oracle_attention(kv, layer, batch, q[:n], k[:n], v[:n]) for layer in range(2)]
        mem_want = npu.memory.clone()
        npu.memory.copy_(mem0)
        attn = NpuTileAttention(kv, max_batch=8, backend=backend, num_splits=splits)
        if fast:
            from hawk.engine.triton_npu_attention import DecodeConfig

            attn.decode_config = DecodeConfig()
        if variant is not None:
            from hawk.engine import triton_npu_attention as tk

            geom = tk.tile_geometry(kv)
            assert geom is not None and geom.separable and geom.bfp8, "the variant would not run on this cache"
            attn.decode_config = _variant_config(variant)
        attn.begin(batch, pad_to=pad_to)
        got = [attn(layer, q, k, v) for layer in range(2)]
        assert torch.equal(npu.memory, mem_want), "row writes differ from the codecs (or touched other bytes)"
        for w, o in zip(want, got):
            assert o.shape == (rows, hq, 64) and o.dtype == q.dtype
            assert torch.isfinite(o).all()
            assert torch.allclose(o[:n].float(), w.float(), atol=atol), float((o[:n].float() - w.float()).abs().max())
    finally:
        kv.close()


# ---- bitwise equality with the paged decode (the colocated reference) ----------------------

#: Paged decode paths to compare with: as the backend picks at this batch size, and both forced.
PAGED_PATHS = {"auto": None, "fused": True, "3launch": False}


def _paged_twin(kv: NpuKVCacheMemory, batch, q: torch.Tensor, fused: bool | None):
    """The paged decode over the NPU cache's current contents (codec-decoded, as bf16).

    NPU block ``b`` becomes GPU blocks ``4b .. 4b+3`` (16 tokens each, NHD); each new token's K/V
    input is the row the NPU write stored (decoded), and its cache slot holds NaN beforehand, so
    a path that read it before writing it would show. Returns ``(out, splits, the DecodePath's value)``.
    """
    from hawk.engine.paged_attention import PagedAttention
    from hawk.layouts.gpu import GpuKVLayout

    lay = kv.layout
    dev = kv.pages(0).device
    per = lay.block_size // 16
    glay = GpuKVLayout(1, lay.max_num_blocks * per, 16, lay.num_kv_heads, lay.head_dim, "bf16", "NHD")
    cache = glay.allocate(dev)[0]
    blocks = torch.arange(lay.max_num_blocks, device=dev)
    for t in range(2):
        x = kv.read_blocks(t, blocks)  # [nb, H, bs, D] fp32, the codec's values
        assert torch.equal(x.to(torch.bfloat16).float(), x), "codec values not representable in bf16"
        cache[t] = x.permute(0, 2, 1, 3).reshape(glay.num_blocks, 16, lay.num_kv_heads, lay.head_dim).to(torch.bfloat16)
    rows = q.shape[0]
    k_in = torch.zeros(rows, lay.num_kv_heads, lay.head_dim, dtype=torch.bfloat16, device=dev)
    v_in = torch.zeros_like(k_in)
    slices = []
    for i, s in enumerate(batch):
        p = s.start
        gb = s.block_ids[p // lay.block_size] * per + (p % lay.block_size) // 16
        k_in[i], v_in[i] = cache[0, gb, p % 16], cache[1, gb, p % 16]
        cache[:, gb, p % 16] = float("nan")
        slices.append(SeqSlice([b * per + j for b in s.block_ids for j in range(per)], s.start, 1))
    attn = PagedAttention(glay, [cache], max_batch=max(rows, 8), use_triton=True, fused_decode=fused)
    attn.begin(slices, pad_to=rows if rows > len(batch) else None)
    out = attn(0, q, k_in.to(q.dtype), v_in.to(q.dtype))
    assert not torch.isnan(cache).any(), "the paged decode did not store a new token"
    return out, attn._splits(rows), attn.decode_path(rows).value


def _bitwise_vs_paged(dtype: str, shard: int, batch, hq: int, hkv: int = 2, head_dim: int = 64,
                      pad_to: int | None = None, q_dtype: torch.dtype = torch.bfloat16, kernel: str = "default",
                      device: str = "cpu", blocks: int = 12, bank_capacity: int = 8 << 20,
                      paths: tuple[str, ...] = tuple(PAGED_PATHS)) -> list[tuple[str, int, bool]]:
    """NPU-tile decode (Triton) vs paged decode (Triton) on the same K/V values: ``torch.equal``.

    ``kernel``: "default" (as the backend picks), "generic" (whole-tile loads), "chunked", or a
    bfloat8_b variant's name (``BFP8_VARIANTS`` or ``_TEST_CONFIGS``). Returns ``(path, splits, decode path)``
    per compared paged path.
    """
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import DecodeConfig

    npu, kv = _cache(dtype, shard, heads=hkv, head_dim=head_dim, blocks=blocks, device=device, layers=1,
                     bank_capacity=bank_capacity)
    try:
        n = len(batch)
        rows = pad_to or n
        g = torch.Generator().manual_seed(rows + hq)
        q, k, v = (torch.randn(rows, h, head_dim, generator=g).to(torch.bfloat16).to(device, q_dtype)
                   for h in (hq, hkv, hkv))
        attn = NpuTileAttention(kv, max_batch=max(rows, 8), backend="triton")
        attn.generic = kernel == "generic"
        attn.decode_config = DecodeConfig() if kernel == "chunked" else (
            None if kernel in ("default", "generic") else _variant_config(kernel))
        attn.begin(batch, pad_to=pad_to)
        got = attn(0, q, k, v)
        done = []
        for path in paths:
            want, splits, how = _paged_twin(kv, batch, q, PAGED_PATHS[path])
            if device == "cuda":
                torch.cuda.synchronize()
            diff = (got.float() - want.float()).abs().max().item()
            assert torch.equal(got, want), f"{dtype} {kernel} vs paged {path} (splits {splits}, {how}): max diff {diff:.3g}"
            assert (got[n:] == 0).all()
            done.append((path, splits, how))
        return done
    finally:
        kv.close()


# ---- the torch path (CPU, always) ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "bfp8_b"])
@pytest.mark.parametrize("shard", [1, 2])
def test_torch_path_matches_codecs(dtype: str, shard: int) -> None:
    _compare(dtype, shard, BATCH)


@pytest.mark.parametrize("dtype", ["bf16", "bfp8_b"])
def test_torch_path_rows_sharing_a_tile_gqa_3_and_pad(dtype: str) -> None:
    _compare(dtype, 1, BATCH_MULTI, hq=6)
    _compare(dtype, 1, BATCH, pad_to=5)


def test_contract_and_validation() -> None:
    from hawk.engine.npu_attention import NpuTileAttention

    _, kv = _cache("bf16", 1)
    try:
        attn = NpuTileAttention(kv)
        assert isinstance(attn, PagedBackend) and attn.graph_safe is False
        with pytest.raises(ValueError, match="prefill"):
            attn.begin([SeqSlice([0], 0, 1)])
        with pytest.raises(ValueError, match="blocks"):
            attn.begin([SeqSlice([0], 64, 1)])
        with pytest.raises(ValueError, match="same cache row"):
            attn.begin([SeqSlice([0, 1], 70, 1), SeqSlice([0, 1], 70, 1)])
        with pytest.raises(ValueError, match="pad_to"):
            attn.begin([SeqSlice([0], 5, 2)], pad_to=4)
        with pytest.raises(ValueError, match="pad_to"):
            attn.begin(BATCH, pad_to=2)
        attn.begin(BATCH)
        with pytest.raises(ValueError, match="rows"):
            attn(0, *_qkv(4, 4, 2, 64, 0))
    finally:
        kv.close()


# ---- the Triton kernels under the interpreter (CPU, subprocess) ----------------------------

_INTERP_CASES = {
    "bf16-interleaved": dict(dtype="bf16", shard=1, batch="BATCH"),
    "bfp8-interleaved": dict(dtype="bfp8_b", shard=1, batch="BATCH"),
    "bf16-blockcyclic2-split4": dict(dtype="bf16", shard=2, batch="BATCH", splits=4),
    "bfp8-blockcyclic2-split2": dict(dtype="bfp8_b", shard=2, batch="BATCH", splits=2),
    "bf16-pad-gqa": dict(dtype="bf16", shard=1, batch="BATCH", pad_to=5, hq=8, splits=2),
    "bfp8-rows-sharing-a-tile-gqa3": dict(dtype="bfp8_b", shard=1, batch="BATCH_MULTI", hq=6),
    "bfp8-blockcyclic3-generic": dict(dtype="bfp8_b", shard=3, batch="BATCH", splits=2),
    "bf16-blockcyclic3-generic": dict(dtype="bf16", shard=3, batch="BATCH"),
    "bf16-chunked-kernel-split2": dict(dtype="bf16", shard=2, batch="BATCH", splits=2, fast=True),
    "bf16-chunked-kernel-pad-gqa": dict(dtype="bf16", shard=1, batch="BATCH", pad_to=5, hq=8, fast=True),
}


BATCH_ONE = [SeqSlice([5, 9, 10, 11], 200, 1)]
BATCH_EDGE = [SeqSlice([3, 7, 1], 127, 1), SeqSlice([0, 2], 63, 1), SeqSlice([4], 15, 1), SeqSlice([6, 8], 64, 1)]
#: NPU-tile vs paged, bitwise, under the interpreter (4 "SMs", 16-token chunks): splits =
#: ceil(8 / (rows * kv_heads)), so 1 row x 1 KV head gives 8 splits, 3 rows x 1 gives 3, 4 x 2 one.
_BITWISE_CASES = {
    "bf16-b1-hkv1-splits8": dict(dtype="bf16", shard=1, batch="BATCH_ONE", hq=4, hkv=1),
    "bf16-b1-hkv2-splits4-chunked": dict(dtype="bf16", shard=2, batch="BATCH_ONE", hq=8, hkv=2, kernel="chunked"),
    "bf16-b3-gqa8-splits3": dict(dtype="bf16", shard=1, batch="BATCH", hq=8, hkv=1),
    "bf16-b3-gqa8-splits3-chunked": dict(dtype="bf16", shard=1, batch="BATCH", hq=8, hkv=1, kernel="chunked"),
    "bf16-pad5-one-split": dict(dtype="bf16", shard=1, batch="BATCH", hq=6, hkv=2, pad_to=5),
    "bf16-edges-pad6-chunked": dict(dtype="bf16", shard=2, batch="BATCH_EDGE", hq=4, hkv=2, pad_to=6, kernel="chunked"),
    "bf16-edges-splits2-generic3": dict(dtype="bf16", shard=3, batch="BATCH_EDGE", hq=2, hkv=1),
    "bf16-fp32q-splits2": dict(dtype="bf16", shard=1, batch="BATCH_EDGE", hq=4, hkv=1, q_dtype=torch.float32),
    "bfp8-b1-hkv1-splits8": dict(dtype="bfp8_b", shard=1, batch="BATCH_ONE", hq=4, hkv=1),
    "bfp8-b3-gqa8-splits3": dict(dtype="bfp8_b", shard=2, batch="BATCH", hq=8, hkv=1),
    "bfp8-pad5-one-split": dict(dtype="bfp8_b", shard=1, batch="BATCH", hq=6, hkv=2, pad_to=5),
    "bfp8-edges-splits2-fp32q": dict(dtype="bfp8_b", shard=1, batch="BATCH_EDGE", hq=4, hkv=1, q_dtype=torch.float32),
    "bfp8-edges-pad6-generic": dict(dtype="bfp8_b", shard=1, batch="BATCH_EDGE", hq=4, hkv=2, pad_to=6, kernel="generic"),
    "bfp8-b3-generic3": dict(dtype="bfp8_b", shard=3, batch="BATCH", hq=4, hkv=1),
}


# ---- bfloat8_b decode variants (``BFP8_VARIANTS``) -----------------------------------------

BATCH_B32 = [SeqSlice([3, 7, 1, 11], 100, 1), SeqSlice([0, 2, 5], 70, 1), SeqSlice([4, 6, 8, 9, 10], 150, 1)]
#: Variants whose kernel paths the interpreter tells apart (register prefetch, loads in their own
#: iteration, 128-token chunks across two NPU blocks) get the cases below (128-token chunks the layout
#: ones); the others differ only in GPU launch knobs (register cap, warps, stages, PTX or integer
#: decode, all compiled out here) and get one case each, which checks their plumbing.
_VARIANTS_FULL = {"words": None,
                  # the register prefetch: its cases and the next two variants' together cover every case kind
                  "words-pipe2": ("interleaved", "pad5-gqa8-split4", "edges-fp16q-split2", "bitwise-edges-pad6-blockcyclic2"),
                  "words-t128w8": ("interleaved", "blockcyclic2-rows-sharing-a-tile-gqa3-split2", "block32-split3"),
                  # the fused row write (decode batches; BATCH_MULTI's three rows per sequence take the
                  # separate write) and token-addressed loads (tok-pipe3 runs as the CPU's tok-pipe2 here)
                  "words-pipe2-r128-fw": ("interleaved", "blockcyclic2-rows-sharing-a-tile-gqa3-split2", "edges-bf16q-pad6",
                                          "bitwise-b1-hkv1-splits8", "bitwise-edges-pad6-blockcyclic2"),
                  "tok-pipe3-r128-fw": ("interleaved", "block32-split3", "edges-fp16q-split2", "pad5-gqa8-split4",
                                        "bitwise-b1-hkv1-splits8", "bitwise-edges-splits2-fp32q"),
                  "cfg:prefetch-fw": ("interleaved", "edges-bf16q-pad6", "bitwise-b1-hkv1-splits8"),
                  "cfg:prefetch-tok-fw": ("block32-split3", "edges-fp16q-split2", "bitwise-edges-pad6-blockcyclic2")}
_VARIANT_COMPARE = {
    "interleaved": dict(shard=1, batch="BATCH"),
    "blockcyclic2-rows-sharing-a-tile-gqa3-split2": dict(shard=2, batch="BATCH_MULTI", hq=6, splits=2),
    "pad5-gqa8-split4": dict(shard=1, batch="BATCH", pad_to=5, hq=8, splits=4),
    "block32-split3": dict(shard=1, batch="BATCH_B32", splits=3, block_size=32),
    "edges-fp16q-split2": dict(shard=2, batch="BATCH_EDGE", splits=2, q_dtype=torch.float16, atol=2e-2),
    "edges-bf16q-pad6": dict(shard=1, batch="BATCH_EDGE", pad_to=6, q_dtype=torch.bfloat16, atol=3e-2),
}
_VARIANT_BITWISE = {
    "b1-hkv1-splits8": dict(shard=1, batch="BATCH_ONE", hq=4, hkv=1),
    "edges-pad6-blockcyclic2": dict(shard=2, batch="BATCH_EDGE", hq=4, hkv=2, pad_to=6),
    "edges-splits2-fp32q": dict(shard=1, batch="BATCH_EDGE", hq=4, hkv=1, q_dtype=torch.float32),
}


#: Probe variants the interpreter runs exactly as another case does (warps, stages and register caps are
#: compiled out there, and its chunks are 16 tokens unless a variant sets ``tokens``): no case of their own.
_SAME_UNDER_INTERPRETER = {"tok-w1-t16", "tok-w2-t64", "tok-w4-t32",  # = tok-pipe2-r128-fw, ditto, tok-w2-t32
                           # GPU-only kernel: the word kernel runs (regs-t32 and -fw check that)
                           "regs-t16-fw", "regs-fw", "regs-fw-s16", "regs-fw-s8", "regs-fw-early", "regs-fw-early-m",
                           "regs-fw-early-m4", "regs-fw-early-t16s64", "regs-fw-early-m4-nr", "regs-fw-early-m4-rope",
                           "regs-fw-early-m4-nr-rope"}


#: Variants whose interpreter run is a ``_VARIANTS_FULL`` variant's, kernel arguments and all (register caps,
#: warps, stages and the PTX/integer decode choice are compiled out there, and a ``"regs"`` config runs the
#: word kernel: ``decode_attention``), but whose names and configs still pass through the launch: their one
#: case checks that plumbing, so it is the cheapest (interleaved: two splits, merged); the kernel paths of
#: pad5-gqa8-split4 run under the variant named here.
_PLUMBING_ONLY = {"words-r168": "words", "words-r128": "words", "words-int": "words", "words-w8": "words",
                  "words-pipe2-r128": "words-pipe2", "words-pipe3-r128": "words-pipe2", "regs-t32": "words-pipe2",
                  "tok-pipe2-r128-fw": "tok-pipe3-r128-fw", "regs-t32-fw": "tok-pipe3-r128-fw"}


def _issue7_group(cfg) -> bool:
    """Variants on the fused row write or token loads: their interpreter cases run in their own (slow) batch."""
    return cfg.fused_write or cfg.token_loads


def _variant_cases(group: str = "main") -> dict[str, tuple[str, str, dict]]:
    """``{case: (kind, variant, kwargs)}``: kind "compare" (vs the codec oracle) or "bitwise" (vs paged).
    ``group``: "main" (the variants before issue 7's fused/token-load ones), "issue7" (those, and
    ``_TEST_CONFIGS``)."""
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    cases = {}
    names = list(BFP8_VARIANTS) + list(_TEST_CONFIGS)
    for name in names:
        cfg = _variant_config(name)
        if name == "bytes" or name in _SAME_UNDER_INTERPRETER:  # covered: the byte kernel's cases above, or another case
            continue
        if (group == "issue7") != (_issue7_group(cfg)):
            continue
        if name in _VARIANTS_FULL:
            for cname, kw in _VARIANT_COMPARE.items():
                if _VARIANTS_FULL[name] is None or cname in _VARIANTS_FULL[name]:
                    cases[f"{name}/{cname}"] = ("compare", name, kw)
            if cfg.tokens is None:  # 128-token chunks do not give the paged decode's bits
                for cname, kw in _VARIANT_BITWISE.items():
                    if _VARIANTS_FULL[name] is None or f"bitwise-{cname}" in _VARIANTS_FULL[name]:
                        cases[f"{name}/bitwise-{cname}"] = ("bitwise", name, kw)
        else:
            cname = "interleaved" if name in _PLUMBING_ONLY else "pad5-gqa8-split4"
            cases[f"{name}/{cname}"] = ("compare", name, _VARIANT_COMPARE[cname])
    return cases


#: Set (by the slow fixture) in the interpreter subprocess's environment: which case group to run.
_GROUP_ENV = "HAWK_TEST_NPU_GROUP"


def _interpreter_main() -> None:
    """Run every interpreter case of the group (TRITON_INTERPRET=1 set by the parent); print JSON."""
    import os

    group = os.environ.get(_GROUP_ENV, "main")
    results = {}
    for name, (kind, variant, case) in _variant_cases(group).items():
        case = dict(case)
        batch = globals()[case.pop("batch")]
        try:
            if kind == "compare":
                case.setdefault("atol", 1e-4)
                _compare("bfp8_b", batch=batch, backend="triton", variant=variant, **case)
                results["variant/" + name] = "ok"
            else:
                results["variant/" + name] = "ok " + json.dumps(_bitwise_vs_paged("bfp8_b", batch=batch, kernel=variant, **case))
        except Exception:  # noqa: BLE001 - reported to the parent test
            results["variant/" + name] = traceback.format_exc()
    if group != "main":
        for name, result in results.items():
            emit({"name": name, "result": result})
        return
    for name, case in _BITWISE_CASES.items():
        case = dict(case)
        batch = globals()[case.pop("batch")]
        try:
            results["bitwise/" + name] = "ok " + json.dumps(_bitwise_vs_paged(batch=batch, **case))
        except Exception:  # noqa: BLE001 - reported to the parent test
            results["bitwise/" + name] = traceback.format_exc()
    for name, case in _INTERP_CASES.items():
        case = dict(case)
        batch = globals()[case.pop("batch")]
        try:
            _compare(batch=batch, backend="triton", atol=1e-4, **case)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    for name, result in results.items():
        emit({"name": name, "result": result})


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    return {name: r["result"] for name, r in run_interpreted("tests.test_npu_attention", require_clean_exit=True).items()}


@pytest.fixture(scope="module")
def interpreter_results_issue7() -> dict[str, str]:
    mp = pytest.MonkeyPatch()
    mp.setenv(_GROUP_ENV, "issue7")
    try:
        return {name: r["result"] for name, r in run_interpreted("tests.test_npu_attention", require_clean_exit=True).items()}
    finally:
        mp.undo()


@pytest.mark.timeout(900)  # the first case waits for its group's whole interpreter run
@pytest.mark.parametrize("case", list(_INTERP_CASES))
def test_triton_kernels_under_interpreter(interpreter_results: dict[str, str], case: str) -> None:
    assert interpreter_results[case] == "ok", interpreter_results[case]


@pytest.mark.timeout(900)  # the first case waits for its group's whole interpreter run
@pytest.mark.parametrize("case", list(_BITWISE_CASES))
def test_triton_decode_bitwise_equals_paged_under_interpreter(interpreter_results: dict[str, str], case: str) -> None:
    """Same K/V values in -> the very bits of the paged decode out, on every paged path."""
    r = interpreter_results["bitwise/" + case]
    assert r.startswith("ok "), r


@pytest.mark.timeout(900)  # the first case waits for its group's whole interpreter run
@pytest.mark.parametrize("case", list(_variant_cases()))
def test_bfp8_variants_under_interpreter(interpreter_results: dict[str, str], case: str) -> None:
    """Each bfloat8_b decode variant against the codec oracle (outputs, and every byte the row writes
    touch), and, where it keeps the paged decode's bits, against the paged decode bit for bit."""
    r = interpreter_results["variant/" + case]
    assert r == "ok" or r.startswith("ok "), r


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case waits for its group's whole interpreter run
@pytest.mark.parametrize("case", list(_variant_cases("issue7")))
def test_bfp8_fused_write_and_token_load_variants_under_interpreter(interpreter_results_issue7: dict[str, str],
                                                                    case: str) -> None:
    """As ``test_bfp8_variants_under_interpreter``, for the variants that write the new rows in the decode
    launch (the oracle's memory check sees every byte they store; the bitwise cases read the rows back
    from the cache for the paged twin) or load through ``_words_chunk_tok``, and ``_TEST_CONFIGS``."""
    r = interpreter_results_issue7["variant/" + case]
    assert r == "ok" or r.startswith("ok "), r


def test_fused_row_write_launch_plumbing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which launches ``NpuTileAttention`` makes (kernels stubbed out): a fused-write config skips
    ``write_rows`` and hands the decode the new rows, only for decode batches (one new token per
    sequence); the default config, several new rows per sequence, or the generic kernel keep the
    separate write. ``decode_attention`` refuses ``new_kv`` for a config that does not fuse."""
    from hawk.engine import triton_npu_attention as tk
    from hawk.engine.npu_attention import NpuTileAttention

    pytest.importorskip("triton")
    monkeypatch.delenv("HAWK_NPU_BFP8_KERNEL", raising=False)
    real_decode = tk.decode_attention
    _, kv = _cache("bfp8_b", 1)
    try:
        g = tk.tile_geometry(kv)
        q, k, v = _qkv(3, 4, 2, 64, 0)
        meta = torch.zeros(3, tk.META_BLOCKS + 4, dtype=torch.int32)
        for cfg in (tk.BFP8_VARIANTS["words-pipe2-r128"], tk.BFP8_VARIANTS["bytes"]):
            with pytest.raises(ValueError, match="new_kv"):
                real_decode(g, 0, q, meta, 3, 1, None, cfg, new_kv=(k, v))
        with pytest.raises(ValueError, match="new_kv"):
            real_decode(g, 0, q, meta, 3, 1, None, tk.BFP8_VARIANTS["words-pipe2-r128-fw"], generic=True, new_kv=(k, v))
        with pytest.raises(ValueError, match="new_kv must be"):
            real_decode(g, 0, q, meta, 3, 1, None, tk.BFP8_VARIANTS["words-pipe2-r128-fw"], new_kv=(k[:2], v[:2]))
        calls: list[tuple] = []
        monkeypatch.setattr(tk, "write_rows", lambda *a, **k: calls.append(("write",)))

        def fake_decode(g, layer, q, meta, rows, splits, ws, config=None, generic=False, block_n=None, new_kv=None,
                        counters=None, rope=None):
            assert rope is None  # __call__ never rotates
            # with splits, the merge counters come with the partials: int32 zeros, one per (row, KV head)
            assert (counters is None) == (ws is None) and (counters is None or (
                counters.dtype == torch.int32 and counters.numel() >= rows * g.num_kv_heads and not counters.any()))
            calls.append(("decode", new_kv is not None))
            return torch.zeros_like(q)

        monkeypatch.setattr(tk, "decode_attention", fake_decode)
        attn = NpuTileAttention(kv, max_batch=8, backend="triton")
        for cfg, batch, generic, want in [
            (tk.BFP8_VARIANTS["words-pipe2-r128-fw"], BATCH, False, [("decode", True)]),
            (tk.BFP8_VARIANTS["tok-pipe3-r128-fw"], BATCH, False, [("decode", True)]),
            (tk.BFP8_VARIANTS["words-pipe2-r128-fw"], BATCH_MULTI, False, [("write",), ("decode", False)]),
            (tk.BFP8_VARIANTS["words-pipe2-r128-fw"], BATCH, True, [("write",), ("decode", False)]),
            (None, BATCH, False, [("decode", True)]),  # the default variant (regs-fw-early-m4-nr-rope) fuses
            (tk.BFP8_VARIANTS["regs-t32"], BATCH, False, [("write",), ("decode", False)]),  # this register one does not
            (tk.BFP8_VARIANTS["words-pipe2-r128"], BATCH, False, [("write",), ("decode", False)]),  # this one does not
        ]:
            calls.clear()
            attn.decode_config, attn.generic = cfg, generic
            attn.begin(batch)
            n = sum(s.q_len for s in batch)
            attn(0, *_qkv(n, 4, 2, 64, 0))
            assert calls == want, (cfg, generic, calls)
        assert not tk.fuses_row_write(tk.tile_geometry(kv), tk.BFP8_VARIANTS["words-pipe2-r128"])
    finally:
        kv.close()
    _, kv16 = _cache("bf16", 1)
    try:
        assert not tk.fuses_row_write(tk.tile_geometry(kv16), tk.BFP8_VARIANTS["words-pipe2-r128-fw"])
    finally:
        kv16.close()


def test_plumbing_only_variants_launch_as_their_partner_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_PLUMBING_ONLY``'s premise (kernel stubbed out, the interpreter's branch taken): each such variant
    launches the word kernel with its partner's grid and arguments, bar warps and stages, which the
    interpreter ignores; so their interpreter runs on the cheapest case lose none of pad5-gqa8-split4's."""
    from hawk.engine import triton_npu_attention as tk

    pytest.importorskip("triton")
    _, kv = _cache("bfp8_b", 1)
    try:
        g = tk.tile_geometry(kv)
        q, k, v = _qkv(3, 4, 2, 64, 0, dtype=torch.bfloat16)
        meta = torch.zeros(3, tk.META_BLOCKS + 4, dtype=torch.int32)
        launches: list[tuple] = []

        class Stub:
            def __getitem__(self, grid):
                return lambda *a, **kw: launches.append(
                    (grid, a, {n: x for n, x in kw.items() if n not in ("num_warps", "num_stages")}))

        monkeypatch.setattr(tk, "_decode_bfp8_kernel", Stub())
        monkeypatch.setattr(tk, "interpreting", lambda: True)

        def launch(name: str) -> tuple:
            cfg = _variant_config(name)
            launches.clear()
            tk.decode_attention(g, 0, q, meta, 3, 1, None, cfg, new_kv=(k, v) if tk.fuses_row_write(g, cfg) else None)
            (grid, args, kw), = launches
            return grid, [(x.shape, x.dtype, x.stride()) if isinstance(x, torch.Tensor) else x for x in args], kw

        for name, full in _PLUMBING_ONLY.items():
            assert full in _VARIANTS_FULL, full
            assert launch(name) == launch(full), (name, full)
    finally:
        kv.close()


def _decode_steps():
    """Decode batches whose metadata a step may partly reuse: the same lists growing at their end, a
    reordered batch, a sequence leaving, one replaced by a new list, pad rows; ``None`` stands for
    a multi-row batch (the generic begin) in between."""
    a, b, c = [0, 1], [2], [3, 4, 5]
    c2 = [7, 8, 9]
    yield [SeqSlice(a, 70, 1), SeqSlice(b, 10, 1), SeqSlice(c, 130, 1)], 4
    yield [SeqSlice(a, 71, 1), SeqSlice(b, 11, 1), SeqSlice(c, 131, 1)], 4
    b.append(6)
    yield [SeqSlice(a, 72, 1), SeqSlice(b, 64, 1), SeqSlice(c, 132, 1)], None
    yield [SeqSlice(c, 133, 1), SeqSlice(a, 73, 1), SeqSlice(b, 65, 1)], 4
    yield [SeqSlice(c, 134, 1), SeqSlice(b, 66, 1)], 4
    yield None, None
    yield [SeqSlice(c2, 135, 1), SeqSlice(b, 68, 1)], 2
    yield [SeqSlice(b, 69, 1), SeqSlice(c2, 136, 1), SeqSlice(a, 74, 1)], 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_decode_step_metadata_is_rewritten_only_where_it_changed_and_equals_the_batch(device: str) -> None:
    """The decode hot path (staging slots that remember each row's blocks) leaves, step after step,
    exactly each row's context length, new row and blocks in the device metadata, and pad rows empty."""
    pytest.importorskip("triton")
    from hawk.engine import triton_npu_attention as tk
    from hawk.engine.npu_attention import NpuTileAttention

    _, kv = _cache("bf16", 1, device=device)
    try:
        attn = NpuTileAttention(kv, max_batch=8, backend="triton")
        bs, mb = kv.layout.block_size, tk.META_BLOCKS
        for batch, pad in _decode_steps():
            if batch is None:
                attn.begin(BATCH_MULTI)
                continue
            attn.begin(batch, pad_to=pad)
            meta = attn._meta.cpu()
            rows = pad or len(batch)
            for i, s in enumerate(batch):
                need = s.start // bs + 1
                assert meta[i, tk.META_SEQ_LEN] == s.start + 1
                assert meta[i, tk.META_ROW_LOC] == s.block_ids[need - 1] * bs + s.start % bs
                assert meta[i, mb : mb + need].tolist() == s.block_ids[:need], (i, s)
            assert (meta[len(batch) : rows, tk.META_SEQ_LEN] == 0).all() and (meta[len(batch) : rows, tk.META_ROW_LOC] == -1).all()
        with pytest.raises(ValueError, match="same cache row"):
            attn.begin([SeqSlice([1], 5, 1), SeqSlice([1], 5, 1)])
    finally:
        kv.close()


def test_bfp8_variant_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tiles always get ``DecodeConfig()``; bfloat8_b gets ``DEFAULT_BFP8_VARIANT`` unless
    ``HAWK_NPU_BFP8_KERNEL`` names another variant (an unknown name is an error, not a silent default)."""
    from types import SimpleNamespace

    from hawk.engine import triton_npu_attention as tk

    bf16, bfp8 = SimpleNamespace(bfp8=False), SimpleNamespace(bfp8=True)
    monkeypatch.delenv("HAWK_NPU_BFP8_KERNEL", raising=False)
    assert tk.DEFAULT_BFP8_VARIANT in tk.BFP8_VARIANTS
    assert tk.default_config(bfp8) == tk.BFP8_VARIANTS[tk.DEFAULT_BFP8_VARIANT]
    assert tk.default_config(bf16) == tk.DecodeConfig()
    monkeypatch.setenv("HAWK_NPU_BFP8_KERNEL", "words-pipe2-r128")
    assert tk.default_config(bfp8) == tk.BFP8_VARIANTS["words-pipe2-r128"]
    assert tk.default_config(bf16) == tk.DecodeConfig()
    monkeypatch.setenv("HAWK_NPU_BFP8_KERNEL", "nope")
    with pytest.raises(ValueError, match="HAWK_NPU_BFP8_KERNEL"):
        tk.default_config(bfp8)
    assert tk.BFP8_VARIANTS["bytes"] == tk.DecodeConfig()  # the byte kernel is the plain config
    assert not tk.BFP8_VARIANTS["words-t128w8"].keeps_paged_bits and tk.BFP8_VARIANTS["words"].keeps_paged_bits
    # the issue 7 candidates keep the paged decode's chunks and warps (their row write and loads change no value)
    for name in ("words-pipe2-r128-fw", "tok-pipe3-r128-fw", "tok-pipe2-r128-fw"):
        assert tk.BFP8_VARIANTS[name].keeps_paged_bits, name
    # the register kernel: its own chunks, warps and splits (one-warp programs, ~8 per SM); GPU only
    from hawk.engine import gluon_npu_attention as gk

    assert not tk.BFP8_VARIANTS["regs-t32"].keeps_paged_bits
    assert not gk.supported(128, 4, torch.device("cpu"))
    assert [gk.num_splits(b, 8, 132) for b in (1, 8, 32, 64)] == [32, 17, 5, 3]
    assert [gk.auto_tokens(b, 8) for b in (1, 4, 8, 64)] == [32, 32, 16, 16]


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX ``prmt.b32 d, a, b, sel`` (default mode) on int64 tensors holding 32-bit words."""
    src = torch.stack([(x >> (8 * i)) & 0xFF for x in (a, b) for i in range(4)])
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _bf16_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 32-bit word (int64 tensor) -> its low and high bf16 halves as fp32 values."""
    lo = (x & 0xFFFF).to(torch.int32) << 16
    hi = ((x >> 16) & 0xFFFF).to(torch.int32) << 16
    return lo.view(torch.float32), hi.view(torch.float32)


def test_bfp8_word_decode_bit_tricks() -> None:
    """The word kernel's FAST decode, emulated bit for bit on the CPU (the interpreter cannot run it):
    both the PTX (two LOP3, two PRMT, then ``mul.bf16x2``) and the integer formulas turn a word of four
    value bytes into the codec's values times 2^-64, in value order, for shared exponents 64..191."""
    from hawk.layouts.tt import unpack_bfp8_rows

    g = torch.Generator().manual_seed(7)
    vals = torch.cat([torch.arange(256), torch.randint(0, 256, (4 * 4096,), generator=g)]).to(torch.uint8)
    vals = vals[: vals.numel() // 16 * 16].reshape(-1, 16)
    exps = torch.tensor([64, 65, 100, 127, 133, 150, 190, 191], dtype=torch.uint8).repeat(vals.shape[0] // 8 + 1)[: vals.shape[0]]
    want = unpack_bfp8_rows(exps, vals).double() * 2.0**-64  # [R, 16]
    w = vals.to(torch.int64).reshape(-1, 4, 4)
    words = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)  # [R, 4] little-endian
    sc = ((exps.to(torch.int64).clamp(max=191) + 63) << 7)[:, None]  # bf16 bits of 2^(E-64)
    scale = (sc.to(torch.int32) << 16).view(torch.float32).double()
    # PTX path: m = w & 0x7F7F7F7F, s = w & 0x80808080, a = prmt(m, s, 0x5140), b = prmt(m, s, 0x7362)
    m, s = words & 0x7F7F7F7F, words & 0x80808080
    ptx = (_prmt(m, s, 0x5140), _prmt(m, s, 0x7362))
    # integer path
    ints = ((words & 0x7F) | ((words & 0x7F80) << 8) | ((words & 0x8000) << 16),
            ((words >> 16) & 0x7F) | ((words >> 8) & 0x7F8000) | (words & 0x80000000))
    for lo, hi in (ptx, ints):
        v0, v1 = _bf16_halves(lo)
        v2, v3 = _bf16_halves(hi)
        got = torch.stack([v0, v1, v2, v3], dim=-1).reshape(-1, 16).double() * scale  # products are exact
        assert torch.equal(got.float().to(torch.bfloat16).double(), got), "a product is not a bf16 value"
        assert torch.equal(got, want), float((got - want).abs().max())


# ---- GPU (device machine) -------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_setup(dtype: str, shard: int = 1, blocks: int = 160):
    pytest.importorskip("triton")
    return _cache(dtype, shard, heads=8, head_dim=128, blocks=blocks, device="cuda", layers=2, bank_capacity=64 << 20)


def _long_batch(offset: int, n: int, ctx: int = 1000):
    """``n`` sequences of ~ctx tokens over disjoint NPU blocks (64 tokens each)."""
    per = -(-(ctx + 7 * n + 1) // 64)
    return [SeqSlice(list(range(offset + i * per, offset + (i + 1) * per))[::-1], ctx + 7 * i, 1) for i in range(n)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", ["bf16", "bfp8_b"])
def test_gpu_8b_shape_matches_codecs(dtype: str) -> None:
    from hawk.engine.npu_attention import NpuTileAttention

    npu, kv = _gpu_setup(dtype, shard=1 if dtype == "bf16" else 2)
    try:
        batch = _long_batch(0, 5)
        q, k, v = _qkv(8, 32, 8, 128, 3, torch.bfloat16, "cuda")
        mem0 = npu.memory.clone()
        want = _oracle_attention(kv, 0, batch, q[:5], k[:5], v[:5])
        mem_want = npu.memory.clone()
        npu.memory.copy_(mem0)
        attn = NpuTileAttention(kv, max_batch=16)
        assert attn.graph_safe
        attn.begin(batch, pad_to=8)
        got = attn(0, q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(npu.memory, mem_want)
        assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
        assert torch.allclose(got[:5].float(), want.float(), atol=2e-2), float((got[:5].float() - want.float()).abs().max())
    finally:
        kv.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["default", "words", "words-pipe2-r128", "words-pipe2-r128-fw", "tok-pipe3-r128-fw",
                                     "regs-t32", "regs-t32-fw", "regs-fw-early", "regs-fw-early-m", "regs-fw-early-m4",
                                     "regs-fw-early-t16s64", "regs-fw-early-m4-nr"])
def test_gpu_cuda_graph_replays_a_new_batch_of_the_same_padded_size(variant: str) -> None:
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    npu, kv = _gpu_setup("bfp8_b")
    try:
        b1, b2 = _long_batch(0, 3, 700), _long_batch(60, 5, 1000)
        q1, k1, v1 = _qkv(8, 32, 8, 128, 1, torch.bfloat16, "cuda")
        q2, k2, v2 = _qkv(8, 32, 8, 128, 2, torch.bfloat16, "cuda")
        mem0 = npu.memory.clone()
        want = _oracle_attention(kv, 1, b2, q2[:5], k2[:5], v2[:5])
        mem_want = npu.memory.clone()
        npu.memory.copy_(mem0)

        attn = NpuTileAttention(kv, max_batch=8)
        attn.decode_config = BFP8_VARIANTS.get(variant)
        sq, sk, sv = q1.clone(), k1.clone(), v1.clone()
        attn.begin(b1, pad_to=8)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up: compile, allocate the workspace
            attn(1, sq, sk, sv)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(1, sq, sk, sv)
        npu.memory.copy_(mem0)

        attn.begin(b2, pad_to=8)
        sq.copy_(q2), sk.copy_(k2), sv.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(npu.memory, mem_want)
        assert torch.isfinite(out).all()
        assert torch.allclose(out[:5].float(), want.float(), atol=2e-2), float((out[:5].float() - want.float()).abs().max())
    finally:
        kv.close()


def _gpu_batch(n: int, ctx: int = 1000):
    """``n`` sequences of ~ctx tokens over disjoint, shuffled NPU blocks (64 tokens each)."""
    per = -(-(ctx + 7 * n + 1) // 64)
    perm = torch.randperm(n * per, generator=torch.Generator().manual_seed(n)).tolist()
    return [SeqSlice(perm[i * per : (i + 1) * per], ctx + 7 * i, 1) for i in range(n)], n * per


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype,kernel", [("bf16", "default"), ("bf16", "chunked"), ("bfp8_b", "tok-pipe2-r128-fw")])
def test_gpu_8b_shape_bitwise_equals_paged(dtype: str, kernel: str, batch: int) -> None:
    """The 8B shape (32 q heads, 8 KV heads, head_dim 128), ~1k contexts: NPU-tile decode output ==
    paged decode output (torch.equal) as the backends pick paths (b1: 17 splits, b8 padded to 9: 2, both
    write+reduce; b64: one split, merged), and the three-launch path always; the merged path forced at
    several splits merges in-kernel, expected but not required to match."""
    pytest.importorskip("triton")
    slices, blocks = _gpu_batch(batch)
    paths = ("auto", "3launch") + (("fused",) if batch == 64 else ())
    done = _bitwise_vs_paged(dtype, 1 if dtype == "bf16" else 2, slices, hq=32, hkv=8, head_dim=128,
                             pad_to=batch + (1 if batch == 8 else 0), kernel=kernel, device="cuda",
                             blocks=blocks, bank_capacity=(-(-blocks * 8 * 8 * 2048 * 2 // 7 // (1 << 20)) + 16) << 20,
                             paths=paths)
    splits = dict((p, (s, f)) for p, s, f in done)
    if batch == 64:
        assert splits["auto"] == (1, "merged")
    else:
        assert splits["auto"][0] > 1 and splits["auto"][1] == "write+reduce"


def _bank_capacity(blocks: int) -> int:
    """Per-bank bytes for one layer of ``blocks`` 8B-shaped bfloat8_b/bf16 blocks, with headroom."""
    return (-(-blocks * 8 * 8 * 2048 * 2 // 7 // (1 << 20)) + 16) << 20


def _variant_names(bitwise: bool | None = None) -> list[str]:
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    return [n for n, c in BFP8_VARIANTS.items() if bitwise is None or c.keeps_paged_bits == bitwise]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("variant", _variant_names())
def test_gpu_bfp8_variant_matches_codecs(variant: str, batch: int) -> None:
    """Every bfloat8_b variant at the 8B shape, ~1k contexts over shuffled block-cyclic blocks: the
    codec oracle's outputs (bf16 tolerance) and its row writes byte for byte; pad rows give 0; and the
    bit-keeping reference variant's output on the same bytes (``PAGED_BITS_BFP8_VARIANT``): bit for bit
    when the variant keeps the paged decode's bits, else within bf16 tolerance. Batch 1 and 5 (padded
    to 8) run split-K (the register kernel at batch 1: one chunk a split), batch 64 one split (the
    register kernel: its own splits, several chunks each)."""
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS, PAGED_BITS_BFP8_VARIANT

    pytest.importorskip("triton")
    slices, blocks = _gpu_batch(batch)
    npu, kv = _cache("bfp8_b", 2, heads=8, head_dim=128, blocks=blocks, device="cuda", layers=1,
                     bank_capacity=_bank_capacity(blocks))
    try:
        rows = 8 if batch == 5 else batch
        q, k, v = _qkv(rows, 32, 8, 128, 3, torch.bfloat16, "cuda")
        mem0 = npu.memory.clone()
        want = _oracle_attention(kv, 0, slices, q[:batch], k[:batch], v[:batch])
        mem_want = npu.memory.clone()
        npu.memory.copy_(mem0)
        attn = NpuTileAttention(kv, max_batch=rows)
        attn.decode_config = BFP8_VARIANTS[PAGED_BITS_BFP8_VARIANT]
        attn.begin(slices, pad_to=rows)
        ref = attn(0, q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(npu.memory, mem_want), "the reference variant's row writes differ from the codecs"
        npu.memory.copy_(mem0)
        attn.decode_config = BFP8_VARIANTS[variant]
        got = attn(0, q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(npu.memory, mem_want)
        assert torch.isfinite(got).all() and got.dtype == torch.bfloat16
        assert (got[batch:] == 0).all()
        err = float((got[:batch].float() - want.float()).abs().max())
        assert torch.allclose(got[:batch].float(), want.float(), atol=2e-2), err
        if BFP8_VARIANTS[variant].keeps_paged_bits:
            diff = float((got.float() - ref.float()).abs().max())
            assert torch.equal(got, ref), f"{variant} vs {PAGED_BITS_BFP8_VARIANT}: max diff {diff:.3g}"
        else:
            assert torch.allclose(got.float(), ref.float(), atol=2e-2)
    finally:
        kv.close()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("variant", _variant_names(bitwise=True))
def test_gpu_bfp8_variant_bitwise_equals_paged(variant: str, batch: int) -> None:
    """The bfloat8_b variants that keep the paged decode's chunks and warps give its bits (as
    ``test_gpu_8b_shape_bitwise_equals_paged`` does for the default)."""
    pytest.importorskip("triton")
    slices, blocks = _gpu_batch(batch)
    paths = ("auto", "3launch") + (("fused",) if batch == 64 else ())
    _bitwise_vs_paged("bfp8_b", 2, slices, hq=32, hkv=8, head_dim=128, pad_to=batch + (1 if batch == 8 else 0),
                      kernel=variant, device="cuda", blocks=blocks, bank_capacity=_bank_capacity(blocks), paths=paths)


def _rope_case(rows: int, positions: list[int], device: str):
    """Un-rotated ``qkv [rows, (32 + 2 * 8) * 128]`` (bf16), ``positions [rows]`` and the 8B model's
    RoPE tables (Llama-3 theta) on ``device``."""
    from hawk.engine.model import RotaryTable, rope_inv_freq

    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 48 * 128, generator=g).to(device, torch.bfloat16)
    table = RotaryTable(rope_inv_freq(128, 500000.0, None))
    table.reserve(max(positions) + 1)
    cos, sin = table.table(torch.device(device), torch.bfloat16)
    return qkv, torch.tensor(positions, dtype=torch.int64, device=device), cos, sin


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("variant", ["regs-fw-early-m4-rope", "regs-fw-early-m4-nr-rope"])
def test_gpu_rope_in_the_decode_launch_is_the_rope_kernel_bit_for_bit(variant: str, batch: int) -> None:
    """A ``-rope`` variant given q and k before RoPE (``attend_unrotated``) gives the bits of the layer's
    RoPE kernel followed by the same variant without it: the same output and the same row bytes, pad
    rows included (batch 5 padded to 8; with ``-nr`` batch 1 and 5 put the new row in a program of its
    own, batch 64 has too few splits); also under a CUDA graph replaying a new batch."""
    from hawk.engine import triton_ops
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    slices, blocks = _gpu_batch(batch)
    npu, kv = _cache("bfp8_b", 2, heads=8, head_dim=128, blocks=blocks, device="cuda", layers=1,
                     bank_capacity=_bank_capacity(blocks))
    try:
        rows = 8 if batch == 5 else batch
        qkv, pos, cos, sin = _rope_case(rows, [s.start for s in slices] + [0] * (rows - batch), "cuda")
        mem0 = npu.memory.clone()
        attn = NpuTileAttention(kv, max_batch=rows)
        attn.decode_config = BFP8_VARIANTS[variant.removesuffix("-rope")]
        attn.begin(slices, pad_to=rows)
        assert not attn.fuses_rope(32, torch.bfloat16, qkv.device)
        ref = attn(0, *triton_ops.qkv_rope(qkv, pos, cos, sin, 32, 8))
        torch.cuda.synchronize()
        mem_ref = npu.memory.clone()
        assert not torch.equal(mem_ref, mem0)
        npu.memory.copy_(mem0)
        attn.decode_config = BFP8_VARIANTS[variant]
        assert attn.fuses_rope(32, torch.bfloat16, qkv.device) and not attn.fuses_rope(32, torch.float16, qkv.device)
        q, k, v = qkv.view(rows, 48, 128).split((32, 8, 8), dim=1)
        got = attn.attend_unrotated(0, q, k, v, pos, cos, sin)
        torch.cuda.synchronize()
        assert torch.equal(npu.memory, mem_ref)
        diff = float((got.float() - ref.float()).abs().max())
        assert torch.equal(got, ref), f"max diff {diff:.3g}"

        # a graph captured on a zero batch replays this one
        npu.memory.copy_(mem0)
        sqkv, spos = torch.zeros_like(qkv), torch.zeros_like(pos)
        sq, sk, sv = sqkv.view(rows, 48, 128).split((32, 8, 8), dim=1)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            attn.attend_unrotated(0, sq, sk, sv, spos, cos, sin)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn.attend_unrotated(0, sq, sk, sv, spos, cos, sin)
        npu.memory.copy_(mem0)
        sqkv.copy_(qkv), spos.copy_(pos)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(npu.memory, mem_ref)
    finally:
        kv.close()


@pytest.mark.gpu
@gpu
def test_gpu_model_decode_rotating_in_the_launch_gives_the_rope_kernels_logits() -> None:
    """Two layers of the 8B shape over random bfloat8_b tiles, a decode batch of 5 padded to 8: the model
    on ``regs-fw-early-m4-nr-rope`` (each layer hands q and k un-rotated to the backend and runs no RoPE
    kernel) gives the logits and cache bytes of the model on ``regs-fw-early-m4-nr`` (the RoPE kernel,
    then the same decode), bit for bit."""
    import dataclasses

    from hawk.engine.config import preset
    from hawk.engine.model import LlamaModel
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    pytest.importorskip("triton")
    model = LlamaModel.from_config(dataclasses.replace(preset("llama-3.1-8b"), num_layers=2), seed=0,
                                   dtype=torch.bfloat16, device="cuda")
    slices, blocks = _gpu_batch(5)
    npu, kv = _cache("bfp8_b", 2, heads=8, head_dim=128, blocks=blocks, device="cuda", layers=2,
                     bank_capacity=2 * _bank_capacity(blocks))
    try:
        attn = NpuTileAttention(kv, max_batch=8)
        ids = torch.tensor([11, 22, 33, 44, 55, 0, 0, 0], device="cuda")
        pos = torch.tensor([s.start for s in slices] + [0, 0, 0], device="cuda")
        model.reserve_positions(int(pos.max()) + 1)
        mem0 = npu.memory.clone()
        out = []
        for name in ("regs-fw-early-m4-nr", "regs-fw-early-m4-nr-rope"):
            npu.memory.copy_(mem0)
            attn.decode_config = BFP8_VARIANTS[name]
            attn.begin(slices, pad_to=8)
            rotates = attn.fuses_rope(32, torch.bfloat16, ids.device)
            logits = model.compute_logits(model(ids, pos, attn))
            torch.cuda.synchronize()
            out.append((rotates, logits, npu.memory.clone()))
        (r0, l0, m0), (r1, l1, m1) = out
        assert not r0 and r1
        assert torch.equal(m0, m1) and not torch.equal(m0, mem0)
        assert torch.isfinite(l0).all() and torch.equal(l0, l1)
    finally:
        kv.close()


def test_rope_in_the_decode_launch_needs_the_register_kernel() -> None:
    """Off the register kernel (here: no GPU, or the torch path) nothing rotates in the launch: the
    backend says so, and a call that asks anyway is refused before anything is written."""
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.triton_npu_attention import BFP8_VARIANTS

    npu, kv = _cache("bfp8_b", 1, heads=2, head_dim=128, blocks=8)
    try:
        attn = NpuTileAttention(kv, max_batch=2, backend="torch")
        attn.decode_config = BFP8_VARIANTS["regs-fw-early-m4-nr-rope"]
        attn.begin([SeqSlice([0, 1], 70, 1)])
        assert not attn.fuses_rope(4, torch.bfloat16, torch.device("cpu"))
        qkv, pos, cos, sin = _rope_case(1, [70], "cpu")
        q, k, v = qkv[:, : 8 * 128].view(1, 8, 128).split((4, 2, 2), dim=1)
        mem0 = npu.memory.clone()
        with pytest.raises(ValueError, match="fuses_rope"):
            attn.attend_unrotated(0, q, k, v, pos, cos, sin)
        assert torch.equal(npu.memory, mem0)
    finally:
        kv.close()


if __name__ == "__main__":
    _interpreter_main()
