"""PagedAttention equals the torch reference ``attend`` on every path: torch fallback, Triton kernels.

Each case replays a few forwards over a shuffled paged cache: a ragged prefill, a mixed step
(chunked-prefill continuations beside single-token decodes), then padded decode steps, and checks
every output against ``attend`` over the sequence's whole K/V, and at the end every cache slot
(written ones hold the K/V, all others, the pads' included, still hold a sentinel).

The Triton kernels run on CPU through Triton's interpreter, which must be switched on before triton
is imported: those cases run in one subprocess (``python -m tests.test_paged_attention``) printing
a JSON verdict per case. ``gpu``-marked tests run them natively at the Llama-3.1-8B shape, and
capture / replay a decode step in a CUDA graph.

Every Triton case runs on both decode paths: fused (one launch per layer: KV write, split-K
attention and the split merge by the last split to finish) and the three-launch one. The
interpreter runs a launch's programs one after another, so the fused path's cross-program
ordering (partials visible before the counter's acq_rel atomic, the cache write beside other
splits' reads) is only really exercised by the ``gpu`` tests.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from hawk.engine.attention import PagedBackend, SeqSlice, attend
from hawk.engine.paged_attention import PagedAttention
from hawk.layouts.gpu import GpuKVLayout
from tests.interpreter import emit, run_interpreted

SENTINEL = 7.0
ATOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _case(name: str, order: str, kv: str, qd: str, hq: int, hkv: int, d: int, bs: int,
          prompts: list[int], chunk: int = 5, decode_steps: int = 2, pad: int = 2) -> dict:
    return dict(name=name, order=order, kv=kv, qd=qd, hq=hq, hkv=hkv, d=d, bs=bs, prompts=prompts,
                chunk=chunk, decode_steps=decode_steps, pad=pad)


CASES = [
    _case("nhd-bf16-g3", "NHD", "bf16", "fp32", 6, 2, 32, 4, [5, 13, 1]),
    _case("hnd-bf16-g3", "HND", "bf16", "fp32", 6, 2, 32, 4, [5, 13, 1]),
    _case("nhd-fp32-g1", "NHD", "fp32", "fp32", 2, 2, 64, 8, [17, 3]),
    _case("hnd-fp16-g4-onekv", "HND", "fp16", "fp32", 4, 1, 32, 16, [20, 2, 9], pad=1),
    _case("nhd-bf16kv-bf16q-g5", "NHD", "bf16", "bf16", 10, 2, 32, 4, [9, 4]),
    _case("nhd-fp32kv-fp16q-d96", "NHD", "fp32", "fp16", 4, 2, 96, 8, [6, 11], decode_steps=1, pad=0),
    # One KV head and a few rows: several splits per row, most of them non-empty (on CPU the
    # backend assumes 4 SMs and 16-key tiles), so the split merge really merges.
    _case("nhd-bf16-g8-splits", "NHD", "bf16", "fp32", 8, 1, 32, 4, [70, 33], decode_steps=3, pad=1),
]
#: The Triton decode paths every Triton case runs on (``PagedAttention(fused_decode=...)``): the
#: default (write+reduce at several splits, merged at one), merged always, three launches always.
DECODE_PATHS = {"auto": None, "fused": True, "3launch": False}


class _Ref:
    """Each sequence's whole K/V (as the cache stores them) for the reference."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def length(self, s: int) -> int:
        return 0 if s not in self.k else self.k[s].shape[0]


def _rand(shape: tuple[int, ...], g: torch.Generator, kv_dt: torch.dtype, q_dt: torch.dtype) -> torch.Tensor:
    """Values representable in both dtypes, so any rounding mode writes them exactly."""
    return torch.randn(shape, generator=g).to(kv_dt).to(q_dt)


def run_case(c: dict, device: str, use_triton: bool | None, num_layers: int = 1,
             fused_decode: bool | None = None) -> dict:
    """Replay the case's forwards; raise AssertionError on a mismatch, return the worst errors.

    After every forward the fused decode's split counters must be back at zero (else the next
    launch, or graph replay, would merge too early or never).
    """
    (res,) = run_case_paths(c, device, use_triton, [fused_decode], num_layers)
    if isinstance(res, Exception):
        raise res
    return res


def run_case_paths(c: dict, device: str, use_triton: bool | None, paths: list[bool | None],
                   num_layers: int = 1) -> list[dict | Exception]:
    """``run_case`` for each decode path (``fused_decode`` value) in ``paths``: its result, or what it raised.

    The prefill and the mixed step take no decode path (the same launches and bytes whichever is set), so
    they run once, on the first path's backend; each later path starts from their caches, references and
    random state, on a new backend whose ``begin`` has seen the same batches (their forwards change no
    other state of it), and replays the decode steps exactly as its own ``run_case`` would. Under the
    interpreter the prefill is most of a case's time.
    """
    kv_dt, q_dt = DTYPES[c["kv"]], DTYPES[c["qd"]]
    hq, hkv, d, bs = c["hq"], c["hkv"], c["d"], c["bs"]
    prompts = c["prompts"]
    n_seq = len(prompts)
    max_len = max(prompts) + c["chunk"] + c["decode_steps"] + 1
    per_seq = -(-max_len // bs)
    layout = GpuKVLayout(num_layers, per_seq * n_seq + 3, bs, hkv, d, c["kv"], c["order"])
    caches = layout.allocate(device)
    for cache in caches:
        cache.fill_(SENTINEL)
    attn = PagedAttention(layout, caches, max_batch=8, use_triton=use_triton, fused_decode=paths[0])
    g = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))
    perm = torch.randperm(layout.num_blocks, generator=g).tolist()
    blocks = {s: perm[s * per_seq : (s + 1) * per_seq] for s in range(n_seq)}
    refs = [_Ref() for _ in range(num_layers)]
    worst = 0.0

    def forward(items: list[tuple[int, int]], pad_to: int | None = None) -> None:
        nonlocal worst
        slices = [SeqSlice(blocks[s], refs[0].length(s), ql) for s, ql in items]
        t = sum(ql for _, ql in items) + ((pad_to or 0) - len(items) if pad_to else 0)
        attn.begin(slices, pad_to=pad_to)
        for layer in range(num_layers):
            q = _rand((t, hq, d), g, kv_dt, q_dt).to(device)
            k = _rand((t, hkv, d), g, kv_dt, q_dt).to(device)
            v = _rand((t, hkv, d), g, kv_dt, q_dt).to(device)
            out = attn(layer, q, k, v)
            assert out.shape == q.shape and out.dtype == q_dt
            assert torch.isfinite(out).all(), "non-finite output (pad rows included)"
            ref, off = refs[layer], 0
            for s, ql in items:
                sl = slice(off, off + ql)
                ref.k[s] = torch.cat([ref.k.get(s, k[:0]), k[sl]])
                ref.v[s] = torch.cat([ref.v.get(s, v[:0]), v[sl]])
                want = attend(q[sl].float(), ref.k[s].float(), ref.v[s].float())
                err = (out[sl].float() - want).abs().max().item()
                worst = max(worst, err)
                assert err < ATOL[q_dt], f"{c['name']} seq {s} items {items}: max err {err:.3g}"
                off += ql
            assert not attn._counters.any(), "split counters not reset after a forward"

    # 1) ragged prefill, 2) chunked-prefill continuations (start > 0, q_len > 1) beside decodes,
    # 3) a mixed step as the decode engine orders it: one-token rows first (the decode kernel takes
    # them), chunks after, 4) padded decode steps (the last one with a sequence left out).
    prefix = [[(s, p) for s, p in enumerate(prompts)], [(s, c["chunk"] if s % 2 == 0 else 1) for s in range(n_seq)],
              [(s, 1) for s in range(1, n_seq, 2)] + [(s, 2) for s in range(0, n_seq, 2)]]
    try:
        for items in prefix:
            forward(items)
    except Exception as e:  # noqa: BLE001 - every path fails with it
        return [e] * len(paths)
    saved = ([x.clone() for x in caches], [(dict(r.k), dict(r.v)) for r in refs], g.get_state(), worst)
    results: list[dict | Exception] = []
    for i, fused in enumerate(paths):
        try:
            if i:
                for x, x0 in zip(caches, saved[0]):
                    x.copy_(x0)
                for r, (k0, v0) in zip(refs, saved[1]):
                    r.k, r.v = dict(k0), dict(v0)
                g.set_state(saved[2])
                worst = saved[3]
                attn = PagedAttention(layout, caches, max_batch=8, use_triton=use_triton, fused_decode=fused)
                lengths = [0] * n_seq
                for items in prefix:
                    attn.begin([SeqSlice(blocks[s], lengths[s], ql) for s, ql in items])
                    for s, ql in items:
                        lengths[s] += ql
            for step in range(c["decode_steps"]):
                items = [(s, 1) for s in range(n_seq)]
                if step == c["decode_steps"] - 1 and n_seq > 1:
                    items = items[1:][::-1]  # another order, one fewer
                forward(items, pad_to=n_seq + c["pad"] if c["pad"] else None)
            _check_cache(layout, caches, refs, blocks)
            results.append({"worst": worst})
        except Exception as e:  # noqa: BLE001 - reported per path
            results.append(e)
    return results


def _check_cache(layout: GpuKVLayout, caches: list[torch.Tensor], refs: list[_Ref], blocks: dict[int, list[int]]) -> None:
    """Written slots hold the K/V; every other slot still holds the sentinel (pads wrote nothing)."""
    bs = layout.block_size
    for cache, ref in zip(caches, refs):
        nhd = cache if layout.order == "NHD" else cache.transpose(2, 3)  # [2, nb, bs, H, D]
        written = torch.zeros(layout.num_blocks * bs, dtype=torch.bool)
        for s, ids in blocks.items():
            n = ref.length(s)
            pos = torch.arange(n)
            blk = torch.tensor(ids)[pos // bs]
            for kv, want in ((0, ref.k[s]), (1, ref.v[s])):
                got = nhd[kv, blk.to(cache.device), (pos % bs).to(cache.device)]
                assert torch.equal(got.float(), want.to(cache.dtype).float()), f"seq {s} kv {kv} cache mismatch"
            written[blk * bs + pos % bs] = True
        flat = nhd.reshape(2, layout.num_blocks * bs, -1)
        untouched = flat[:, ~written.to(cache.device)]
        assert (untouched == SENTINEL).all(), "a slot outside every sequence was written (a pad row?)"


# ---- torch fallback (no triton needed) ------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_torch_path_matches_reference(case: dict) -> None:
    run_case(case, "cpu", use_triton=False, num_layers=2)


def test_is_a_paged_backend_and_keeps_the_two_arg_call() -> None:
    layout = GpuKVLayout(1, 8, 4, 1, 32, "fp32")
    attn = PagedAttention(layout, layout.allocate())
    assert isinstance(attn, PagedBackend)
    assert attn.graph_safe is False  # CPU caches


def test_begin_validates() -> None:
    layout = GpuKVLayout(1, 8, 4, 1, 32, "fp32")
    attn = PagedAttention(layout, layout.allocate(), max_batch=4, max_model_len=16)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        attn.begin([SeqSlice([0], 3, 2)])
    with pytest.raises(ValueError, match="max_model_len"):
        attn.begin([SeqSlice(list(range(8)), 16, 1)])
    with pytest.raises(ValueError, match="decode batches only"):
        attn.begin([SeqSlice([0, 1], 0, 5)], pad_to=2)
    with pytest.raises(ValueError, match="smaller"):
        attn.begin([SeqSlice([0], 0, 1), SeqSlice([1], 0, 1)], pad_to=1)
    with pytest.raises(ValueError, match="q_len"):
        attn.begin([SeqSlice([0], 0, 0)])
    attn.begin([SeqSlice([0, 1], 3, 2)])
    with pytest.raises(ValueError, match="declared 2"):
        attn(0, torch.randn(3, 1, 32), torch.randn(3, 1, 32), torch.randn(3, 1, 32))


def test_metadata_views_keep_their_addresses_per_padded_batch() -> None:
    layout = GpuKVLayout(1, 32, 4, 1, 32, "fp32")
    attn = PagedAttention(layout, layout.allocate(), max_batch=8)
    attn.begin([SeqSlice([0, 1, 2], 9, 1)], pad_to=4)
    first = {k: v.data_ptr() for k, v in attn._views.items()}
    attn.begin([SeqSlice([0, 1], 1, 7)])  # a prefill in between
    attn.begin([SeqSlice([5, 6], 4, 1), SeqSlice([9, 8, 7], 10, 1), SeqSlice([3], 2, 1)], pad_to=4)
    assert {k: v.data_ptr() for k, v in attn._views.items()} == first
    assert attn._views["slots"].tolist() == [6 * 4 + 0, 7 * 4 + 2, 3 * 4 + 2, -1]
    assert attn._views["seq_lens"].tolist() == [5, 11, 3, 0]
    # a batch beyond max_batch regrows the buffers and says so
    gen = attn.generation
    attn.begin([SeqSlice([i], 0, 1) for i in range(9)])
    assert attn.generation == gen + 1


# ---- Triton kernels under the interpreter ---------------------------------------------------


class _CountedKernel:
    """Stands in for a Triton kernel: logs each launch (``kernel[grid](...)``), then launches."""

    def __init__(self, kernel: Any, name: str, log: list[str]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid: Any) -> Any:
        self.log.append(self.name)
        return self.kernel[grid]


@contextmanager
def _logged_launches() -> Iterator[list[str]]:
    """Every kernel launch of :mod:`hawk.engine.triton_attention` inside the block, by kernel name."""
    from hawk.engine import triton_attention as ta

    names = ["_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel"]
    saved = {n: getattr(ta, n) for n in names}
    log: list[str] = []
    try:
        for n, k in saved.items():
            setattr(ta, n, _CountedKernel(k, n, log))
        yield log
    finally:
        for n, k in saved.items():
            setattr(ta, n, k)


def decode_layer_launches(device: str, fused_decode: bool | None) -> list[str]:
    """The launches of one padded decode layer with several splits (checked against attend too)."""
    layout = GpuKVLayout(1, 16, 16, 1, 32, "bf16")
    caches = layout.allocate(device)
    attn = PagedAttention(layout, caches, max_batch=2, use_triton=True, fused_decode=fused_decode)
    ctx = 40
    attn.begin([SeqSlice([3, 9, 4], ctx - 1, 1)], pad_to=2)
    assert attn._splits(2) > 1
    kc = torch.randn(ctx, 1, 32).to(torch.bfloat16)
    for pos in range(ctx - 1):  # the cached context, written directly
        caches[0][:, [3, 9, 4][pos // 16], pos % 16] = torch.stack([kc[pos], kc[pos]]).to(device)
    q, k, v = (torch.randn(2, h, 32, device=device) for h in (4, 1, 1))
    k[0], v[0] = kc[-1].float(), kc[-1].float()
    with _logged_launches() as log:
        out = attn(0, q, k, v)
    want = attend(q[:1].float().cpu(), kc.float(), kc.float())
    assert (out[:1].float().cpu() - want).abs().max() < 2e-2
    assert (out[1] == 0).all()
    return log


def split_tokens_decode(device: str, fused_decode: bool | None) -> dict:
    """Rows of 9, 40 and 150 tokens decoded with ``decode_split_tokens=32`` (a grid of 8 splits over a
    256-token model, two at least per row: the rows run in 2, 2 and 5 of them) against the reference,
    and the same rows without it; a merged launch leaves its counters zeroed for the next replay."""
    layout = GpuKVLayout(1, 40, 16, 2, 32, "fp32")
    g = torch.Generator().manual_seed(11)
    ctxs, blocks = [9, 40, 150], [[0], [1, 2, 3], list(range(4, 14))]
    kc = [torch.randn(c, 2, 32, generator=g) for c in ctxs]
    vc = [torch.randn(c, 2, 32, generator=g) for c in ctxs]
    q = torch.randn(3, 4, 32, generator=g)
    outs, grids = {}, {}
    for st in (0, 32):
        caches = layout.allocate(device)
        for kr, vr, bl in zip(kc, vc, blocks):
            for pos in range(kr.shape[0] - 1):  # the cached context; the new token comes in k, v
                caches[0][0, bl[pos // 16], pos % 16] = kr[pos].to(device)
                caches[0][1, bl[pos // 16], pos % 16] = vr[pos].to(device)
        attn = PagedAttention(layout, caches, max_batch=4, max_model_len=256, use_triton=True, fused_decode=fused_decode,
                              decode_split_tokens=st)
        attn.begin([SeqSlice(bl, c - 1, 1) for bl, c in zip(blocks, ctxs)])
        grids[st] = attn._split_counts(3)
        k = torch.stack([kr[-1] for kr in kc]).to(device)
        v = torch.stack([vr[-1] for vr in vc]).to(device)
        outs[st] = attn(0, q.to(device), k, v).float().cpu()
        assert not attn._counters.any(), "a launch left its split counters set"
    for i, c in enumerate(ctxs):
        want = attend(q[i : i + 1], kc[i], vc[i])
        for st, out in outs.items():
            err = float((out[i : i + 1] - want).abs().max())
            assert err < 1e-4, f"split_tokens {st}, row {i} ({c} tokens): {err}"
    return {"grids": {str(k): list(v) for k, v in grids.items()}}


def padded_prefill_matches(device: str, t: int = 48) -> dict:
    """A prefill batch (a fresh prompt, a continuation) padded to ``t`` tokens as a prefill graph pads
    it gives the unpadded outputs bit for bit, zeros on the pad rows, and writes nothing for the pads
    (a pad row longer than a key tile once read keys at negative positions on a GPU)."""
    layout = GpuKVLayout(1, 12, 4, 2, 32, "fp32")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(layout.allocate("cpu")[0].shape, generator=g)
    batch = [SeqSlice([0, 1, 2], 0, 10), SeqSlice([5, 6, 7, 8], 6, 7)]  # the second: 6 tokens cached
    t_real = 17
    q = torch.randn(t, 4, 32, generator=g).to(device)
    k, v = (torch.randn(t, 2, 32, generator=g).to(device) for _ in range(2))
    outs, caches = [], []
    for pad in (None, t):
        cache = base.clone().to(device)
        attn = PagedAttention(layout, [cache], max_batch=4, use_triton=True)
        if pad is None:
            attn.begin(batch)
            outs.append(attn(0, q[:t_real], k[:t_real], v[:t_real]))
        else:
            attn.begin(batch, pad_to=4, pad_tokens=pad)
            prog = attn._views["prog_seq"].tolist(), attn._views["prog_blk"].tolist()
            outs.append(attn(0, q, k, v))
        caches.append(cache)
    assert torch.equal(outs[1][:t_real], outs[0]), "padded outputs differ"
    assert not outs[1][t_real:].any(), "pad rows are not zero"
    assert torch.equal(caches[0], caches[1]), "the pads wrote to the cache"
    return {"programs": len(prog[0]), "prog_seq": prog[0], "prog_blk": prog[1]}


def padded_mixed_matches(device: str, use_triton: bool = True) -> dict:
    """A mixed batch (three decode rows, a fresh prompt, a continuation) padded as a mixed step's graph
    pads it (``pad_decode``: the decode kernel over 4 rows, then the chunks' rows and tokens) gives the
    unpadded outputs on its real tokens bit for bit, zeros on the pad tokens, and writes nothing for them."""
    layout = GpuKVLayout(1, 24, 4, 2, 32, "fp32")
    g = torch.Generator().manual_seed(5)
    base = torch.randn(layout.allocate("cpu")[0].shape, generator=g)
    batch = [SeqSlice([0, 1, 2], 9, 1), SeqSlice([3, 4], 4, 1), SeqSlice([5, 6, 7, 8], 14, 1),
             SeqSlice([9, 10, 11], 0, 10), SeqSlice([12, 13, 14, 15], 6, 7)]
    t_real, d, t = 20, 4, 40
    real = list(range(t_real))  # packed: the pads after them
    q = torch.randn(t, 4, 32, generator=g).to(device)
    k, v = (torch.randn(t, 2, 32, generator=g).to(device) for _ in range(2))
    outs, caches, views = [], [], {}
    for padded in (False, True):
        cache = base.clone().to(device)
        attn = PagedAttention(layout, [cache], max_batch=8, use_triton=use_triton)
        if padded:
            attn.begin(batch, pad_to=d + 2 + 2, pad_tokens=t, pad_decode=d)
            out = attn(0, q, k, v)
            pads = [i for i in range(t) if i not in real]
            assert not out[pads].any(), "pads are not zero"
            outs.append(out[real])
            if use_triton:
                views = {n: attn._views[n].tolist() for n in ("dec_seq_lens", "seq_lens", "q_start")}
                views["slots_set"] = (attn._views["slots"] >= 0).nonzero().flatten().tolist()
        else:
            attn.begin(batch)
            outs.append(attn(0, q[real], k[real], v[real]))
        caches.append(cache)
    assert torch.equal(outs[1], outs[0]), "padded outputs differ"
    assert torch.equal(caches[0], caches[1]), "the pads wrote to the cache"
    return views


def _run_all_interpreted() -> None:
    """Subprocess entry: every case through both Triton decode paths on CPU, one JSON line each."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"
    for c in CASES:
        t0 = time.perf_counter()
        outcomes = run_case_paths(c, "cpu", use_triton=True, paths=list(DECODE_PATHS.values()))
        for path, r in zip(DECODE_PATHS, outcomes):
            name = f"{c['name']}/{path}"
            if isinstance(r, Exception):
                res = {"name": name, "ok": False, "error": f"{type(r).__name__}: {r}"}
            else:
                res = {"name": name, "ok": True, **r}
            res["s"] = round(time.perf_counter() - t0, 2)  # the whole case's (its paths share the prefill)
            emit(res)
    for name, fn in (("padded_prefill", padded_prefill_matches), ("padded_mixed", padded_mixed_matches)):
        try:
            emit({"name": name, "ok": True, **fn("cpu")})
        except Exception as e:  # noqa: BLE001
            emit({"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    for path, fused in DECODE_PATHS.items():
        try:
            emit({"name": f"split_tokens/{path}", "ok": True, **split_tokens_decode("cpu", fused)})
        except Exception as e:  # noqa: BLE001
            emit({"name": f"split_tokens/{path}", "ok": False, "error": f"{type(e).__name__}: {e}"})
    for path, fused in DECODE_PATHS.items():
        name = f"launches/{path}"
        try:
            res = {"name": name, "ok": True, "launches": decode_layer_launches("cpu", fused)}
        except Exception as e:  # noqa: BLE001
            res = {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        emit(res)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return run_interpreted("tests.test_paged_attention", timeout_s=280)


@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_triton_path_matches_reference_interpreted(interpreted: dict[str, dict], case: str, path: str) -> None:
    r = interpreted.get(f"{case}/{path}")
    assert r is not None, f"case {case}/{path} did not run (subprocess crashed?)"
    assert r["ok"], r.get("error")


#: Launches per decode layer with splits: merged, one; auto, the attention (which writes the K/V) and
#: the reduce; else the KV write, attention and the reduce.
_DECODE_LAUNCHES = {
    "auto": ["_decode_kernel", "_decode_reduce_kernel"],
    "fused": ["_decode_kernel"],
    "3launch": ["_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel"],
}


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_decode_layer_launches_interpreted(interpreted: dict[str, dict], path: str) -> None:
    r = interpreted.get(f"launches/{path}")
    assert r is not None and r["ok"], r and r.get("error")
    assert r["launches"] == _DECODE_LAUNCHES[path]


@pytest.mark.parametrize("path", DECODE_PATHS)
def test_rows_split_by_length_interpreted(interpreted: dict[str, dict], path: str) -> None:
    """``decode_split_tokens``: each row in as many splits as its length needs, every decode path."""
    r = interpreted.get(f"split_tokens/{path}")
    assert r is not None and r["ok"], r and r.get("error")
    # 8 SMs on a CPU, 2 KV heads, 3 rows: 2 splits by the rows; 256 / 32 = 8 with split tokens
    assert r["grids"] == {"0": [2, 2], "32": [8, 2]}


@pytest.mark.parametrize("split_tokens", [0, 512])
def test_the_decode_kernels_compile_for_an_h100(split_tokens: int) -> None:
    """The interpreter runs the kernels' logic, not Triton's compiler: compile every decode launch form
    (attention alone, fused K/V write, fused merge) and the split reduce for sm_90 here, without a GPU,
    with rows split by length and without."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hawk.engine import triton_attention as ta

    ints = {"bt_ptr", "seq_lens_ptr", "slot_ptr", "count_ptr"}
    floats = {"part_out_ptr", "part_lse_ptr"}

    def compiled(fn: Any, const: dict) -> str:
        names = fn.arg_names
        sig = {n: "constexpr" if n in const else "*i32" if n in ints else "*fp32" if n in floats
               else "*bf16" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32" for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()})
        try:
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        except RuntimeError as e:  # no CUDA backend in this Triton build
            if "backend" in str(e).lower():
                pytest.skip(f"Triton cannot target CUDA here: {e}")
            raise

    for fused, merge in ((False, False), (True, False), (True, True)):
        ptx = compiled(ta._decode_kernel, dict(BLOCK_SIZE=16, BLOCK_H=4, BLOCK_N=64, BLOCK_D=128, BLOCK_S=8, DIRECT=False,
                                               FUSED=fused, MERGE=merge, SPLIT_TOKENS=split_tokens, DOT_PREC="tf32",
                                               INTERPRET=False))
        assert ".entry _decode_kernel" in ptx
    assert ".entry _decode_reduce_kernel" in compiled(ta._decode_reduce_kernel, dict(BLOCK_S=8, BLOCK_D=128, SPLIT_TOKENS=split_tokens))


def test_padded_prefill_matches_interpreted(interpreted: dict[str, dict]) -> None:
    r = interpreted.get("padded_prefill")
    assert r is not None and r["ok"], r and r.get("error")
    # block_m 16 on CPU: 2 + 1 real programs (10 and 7 rows), 2 for the 31 pad rows, fillers to 3 + 4
    assert r["programs"] == 7
    assert sorted(zip(r["prog_seq"][:2], r["prog_blk"][:2])) == [(0, 0), (1, 0)]
    assert list(zip(r["prog_seq"][2:], r["prog_blk"][2:])) == [(2, 0), (2, 1), (2, 2), (2, 2), (2, 2)]


def test_padded_mixed_matches_interpreted(interpreted: dict[str, dict]) -> None:
    r = interpreted.get("padded_mixed")
    assert r is not None and r["ok"], r and r.get("error")
    # decode rows of 10, 5 and 15 tokens of context and an empty row; the chunks' rows after them (their
    # tokens from 3 on), then their pad row (tokens 20..39) and an empty row; only real tokens have slots
    assert r["dec_seq_lens"] == [10, 5, 15, 0]
    assert r["seq_lens"] == [10, 13, 0, 0]
    assert r["q_start"] == [3, 13, 20, 40, 40]
    assert r["slots_set"] == list(range(20))


def test_padded_mixed_matches_on_the_torch_path() -> None:
    padded_mixed_matches("cpu", use_triton=False)


def test_padded_mixed_refuses_a_batch_its_bucket_cannot_hold() -> None:
    layout = GpuKVLayout(1, 12, 4, 2, 32, "fp32")
    attn = PagedAttention(layout, layout.allocate(), max_batch=8, use_triton=False)
    two_rows_and_a_chunk = [SeqSlice([0, 1], 4, 1), SeqSlice([2, 3], 6, 1), SeqSlice([4, 5], 0, 8)]
    for pad_to, pad_tokens, pad_decode in ((4, 16, 1), (3, 16, 2), (4, 9, 2), (None, 16, 2), (5, 10, 12)):
        with pytest.raises(ValueError, match="pad_decode|does not fit"):
            attn.begin(two_rows_and_a_chunk, pad_to=pad_to, pad_tokens=pad_tokens, pad_decode=pad_decode)


def test_padded_prefill_metadata() -> None:
    """The rows and slots a padded prefill declares (the kernels' view of the pads)."""
    pytest.importorskip("triton")
    layout = GpuKVLayout(1, 12, 4, 2, 32, "fp32")
    attn = PagedAttention(layout, layout.allocate(), max_batch=4, use_triton=True)
    attn.begin([SeqSlice([0, 1, 2], 0, 10), SeqSlice([5, 6, 7, 8], 6, 7)], pad_to=4, pad_tokens=48)
    vw = attn._views
    assert vw["seq_lens"].tolist() == [10, 13, 0, 0]
    assert vw["q_start"].tolist() == [0, 10, 17, 48, 48]
    assert vw["slots"].shape == (48,) and (vw["slots"][17:] == -1).all() and (vw["slots"][:17] >= 0).all()
    assert attn._tokens == 48
    with pytest.raises(ValueError, match="pad_to >"):
        attn.begin([SeqSlice([0, 1, 2], 0, 10)], pad_to=1, pad_tokens=16)
    with pytest.raises(ValueError, match="smaller"):
        attn.begin([SeqSlice([0, 1, 2], 0, 10)], pad_to=2, pad_tokens=8)
    # the torch path pads the same way: zeros on the pad rows, the real rows as unpadded
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(16, 4, 32, generator=g), torch.randn(16, 2, 32, generator=g), torch.randn(16, 2, 32, generator=g)
    outs = []
    for pad in (None, 16):
        torch_path = PagedAttention(layout, layout.allocate(), max_batch=4, use_triton=False)
        torch_path.begin([SeqSlice([0, 1, 2], 0, 10)], pad_to=None if pad is None else 2, pad_tokens=pad)
        n = 10 if pad is None else 16
        outs.append(torch_path(0, q[:n], k[:n], v[:n]))
    assert torch.equal(outs[1][:10], outs[0]) and not outs[1][10:].any()


# ---- GPU ------------------------------------------------------------------------------------

_8B = dict(hq=32, hkv=8, d=128, bs=16)


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_triton_small_cases_cuda(case: dict, path: str) -> None:
    _need_cuda()
    run_case(case, "cuda", use_triton=True, num_layers=2, fused_decode=DECODE_PATHS[path])


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_rows_split_by_length_cuda(path: str) -> None:
    _need_cuda()
    split_tokens_decode("cuda", DECODE_PATHS[path])


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_a_decode_graph_splits_rows_by_their_lengths_cuda(path: str) -> None:
    """8B-shaped rows, one long among short ones, under ``decode_split_tokens=512``: a captured decode
    graph keeps its grid (the batch's) while the rows' lengths change between replays, and every replay
    matches the reference."""
    _need_cuda()
    from hawk.engine.triton_attention import decode_splits

    torch.manual_seed(0)
    rows, bs, hq, hkv, d, max_len = 24, 16, 32, 8, 128, 4096
    per = max_len // bs
    layout = GpuKVLayout(1, rows * per, bs, hkv, d, "bf16")
    caches = layout.allocate("cuda")
    caches[0].normal_()
    attn = PagedAttention(layout, caches, max_batch=rows, max_model_len=max_len, fused_decode=DECODE_PATHS[path],
                          decode_split_tokens=512)
    grid, base = attn._split_counts(rows)
    assert (grid, base) == decode_splits(rows, hkv, torch.cuda.get_device_properties(0).multi_processor_count, max_len, 512)
    assert grid > base == 1
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16)

    def batch(lengths: list[int]) -> list[SeqSlice]:
        return [SeqSlice(list(range(i * per, (i + 1) * per)), n - 1, 1) for i, n in enumerate(lengths)]

    attn.begin(batch([64] * rows), pad_to=rows)
    attn(0, q, k, v)  # eager warm-up: compiles the kernels, allocates the split scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(0, q, k, v)
    for lengths in ([800] * (rows - 1) + [4000], [3000] + [300] * (rows - 1), [64] * rows):
        b = batch(lengths)
        attn.begin(b, pad_to=rows)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        for i, sl in enumerate(b):
            kc, vc = _gather(layout, caches[0], list(sl.block_ids), sl.start + 1)
            want = attend(q[i : i + 1].float(), kc.float(), vc.float())
            assert (out[i : i + 1].float() - want).abs().max() < 3e-2, (lengths[i], i)


@pytest.mark.gpu
def test_padded_mixed_matches_cuda() -> None:
    _need_cuda()
    padded_mixed_matches("cuda")


@pytest.mark.gpu
def test_padded_prefill_matches_cuda() -> None:
    _need_cuda()
    for t in (48, 700):  # block_m 128 on a GPU
        assert padded_prefill_matches("cuda", t)["programs"] == -(-t // 128) + 4


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_decode_layer_launches_cuda(path: str) -> None:
    _need_cuda()
    assert decode_layer_launches("cuda", DECODE_PATHS[path]) == _DECODE_LAUNCHES[path]


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_triton_8b_shape_cuda(order: str, kv: str, path: str) -> None:
    """Llama-3.1-8B heads, ragged prompts up to 2k (several query blocks), chunks, long decodes."""
    _need_cuda()
    c = _case(f"8b-{order}-{kv}", order, kv, "bf16", prompts=[2048, 700, 1, 130, 1500], chunk=77,
              decode_steps=3, pad=3, **_8B)
    run_case(c, "cuda", use_triton=True, fused_decode=DECODE_PATHS[path])


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (1, 1024), (64, 1024)])
def test_triton_decode_long_and_wide_cuda(batch: int, ctx: int, path: str) -> None:
    """Split-K decode at the benchmark shapes against attend, sequence by sequence (and the new
    token's K/V in the cache afterwards), twice: the second launch finds the counters reset."""
    _need_cuda()
    torch.manual_seed(0)
    bs = 16
    per = -(-ctx // bs)
    layout = GpuKVLayout(1, per * batch, bs, 8, 128, "bf16")
    caches = layout.allocate("cuda")
    caches[0].normal_()
    attn = PagedAttention(layout, caches, max_batch=64, max_model_len=ctx, fused_decode=DECODE_PATHS[path])
    ids = torch.randperm(layout.num_blocks).view(batch, per).tolist()
    lens = [ctx - (i * 37) % 300 for i in range(batch)]
    attn.begin([SeqSlice(ids[i], lens[i] - 1, 1) for i in range(batch)])
    for _ in range(2):
        q, k, v = (torch.randn(batch, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 8, 8))
        out = attn(0, q, k, v)
        for i in range(batch):
            kc, vc = _gather(layout, caches[0], ids[i], lens[i])
            assert torch.equal(kc[-1], k[i]) and torch.equal(vc[-1], v[i])
            want = attend(q[i : i + 1].float(), kc.float(), vc.float())
            assert (out[i : i + 1].float() - want).abs().max() < 3e-2
        assert not attn._counters.any()


def _gather(layout: GpuKVLayout, cache: torch.Tensor, ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(n, device=cache.device)
    blk = torch.tensor(ids, device=cache.device)[pos // layout.block_size]
    off = pos % layout.block_size
    if layout.order == "NHD":
        return cache[0, blk, off], cache[1, blk, off]
    return cache[0, blk, :, off], cache[1, blk, :, off]


@pytest.mark.gpu
@pytest.mark.parametrize("path", DECODE_PATHS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_decode_graph_replays_after_a_new_begin_cuda(order: str, path: str) -> None:
    """Capture one decode layer after begin(pad_to=B), replay after begin() of another batch."""
    _need_cuda()
    torch.manual_seed(0)
    B, bs, hq, hkv, d = 8, 16, 32, 8, 128
    layout = GpuKVLayout(1, 2048, bs, hkv, d, "bf16", order)
    caches = layout.allocate("cuda")
    caches[0].normal_()
    attn = PagedAttention(layout, caches, max_batch=B, max_model_len=4096, fused_decode=DECODE_PATHS[path])
    assert attn.graph_safe
    perm = torch.randperm(layout.num_blocks).tolist()
    seqs = [perm[i * 256 : (i + 1) * 256] for i in range(8)]
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, hkv, d, device="cuda", dtype=torch.bfloat16)

    def batch1() -> list[SeqSlice]:
        return [SeqSlice(seqs[i], 100 + 50 * i, 1) for i in range(5)]

    def batch2() -> list[SeqSlice]:  # other sequences, lengths and count; same padded size
        return [SeqSlice(seqs[7 - i], 3000 + 13 * i, 1) for i in range(7)]

    attn.begin(batch1(), pad_to=B)
    attn(0, q, k, v)  # eager warm-up: compiles the kernels, allocates the split scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn(0, q, k, v)

    for make in (batch2, batch1, batch2):
        batch = make()
        before = caches[0].clone()
        attn.begin(batch, pad_to=B)
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        for i, s in enumerate(batch):
            kc, vc = _gather(layout, caches[0], list(s.block_ids), s.start + 1)
            assert torch.equal(kc[-1], k[i]) and torch.equal(vc[-1], v[i])
            want = attend(q[i : i + 1].float(), kc.float(), vc.float())
            assert (out[i : i + 1].float() - want).abs().max() < 3e-2
        # only the real rows' slots changed (pads wrote nothing)
        changed = (caches[0] != before).reshape(2, layout.num_blocks, -1).any(-1).sum().item()
        assert changed <= 2 * len(batch)
        assert not attn._counters.any(), "split counters not reset after a replay"


if __name__ == "__main__":
    _run_all_interpreted()


def engine_mixed_step_matches(device: str, n_dec: int, chunks: list[tuple[int, int]], seed: int, hq: int = 32, hkv: int = 8,
                              d: int = 128, bs: int = 16) -> float:
    """One mixed step as the colocated engine builds it: ``n_dec`` decode rows of random contexts
    first, then prompt chunks ``(start, q_len)``; every row against :func:`attend` over what the cache
    holds. The rows' contexts are written through the backend itself (a prefill of each sequence), so
    the step reads exactly what an engine's cache would. Returns the worst error."""
    g = torch.Generator().manual_seed(seed)
    ctx = [int(x) for x in torch.randint(1, 900, (n_dec,), generator=g)]
    seqs = [(c - 1, 1) for c in ctx] + list(chunks)  # (tokens already cached, new tokens)
    per_seq = [-(-(s + q) // bs) for s, q in seqs]
    layout = GpuKVLayout(1, sum(per_seq) + 1, bs, hkv, d, "bf16")
    (cache,) = layout.allocate(device)
    attn = PagedAttention(layout, [cache], max_batch=n_dec + len(chunks) + 1, use_triton=True)
    perm = torch.randperm(layout.num_blocks, generator=g).tolist()
    blocks, off = [], 0
    for n in per_seq:
        blocks.append(perm[off : off + n])
        off += n
    kv = [(torch.randn((s + q, hkv, d), generator=g).to(torch.bfloat16).to(device),
           torch.randn((s + q, hkv, d), generator=g).to(torch.bfloat16).to(device)) for s, q in seqs]
    cached = [(b, s) for b, (s, _) in zip(blocks, seqs) if s > 0]
    if cached:  # the contexts, written by a prefill forward
        pre = [i for i, (s, _) in enumerate(seqs) if s > 0]
        attn.begin([SeqSlice(blocks[i], 0, seqs[i][0]) for i in pre])
        k = torch.cat([kv[i][0][: seqs[i][0]] for i in pre])
        v = torch.cat([kv[i][1][: seqs[i][0]] for i in pre])
        attn(0, torch.zeros((k.shape[0], hq, d), dtype=torch.bfloat16, device=device), k, v)
    attn.begin([SeqSlice(b, s, q) for b, (s, q) in zip(blocks, seqs)])
    t = sum(q for _, q in seqs)
    q_all = torch.randn((t, hq, d), generator=g).to(torch.bfloat16).to(device)
    k_new = torch.cat([kv[i][0][s:] for i, (s, _) in enumerate(seqs)])
    v_new = torch.cat([kv[i][1][s:] for i, (s, _) in enumerate(seqs)])
    out = attn(0, q_all, k_new, v_new)
    worst, row = 0.0, 0
    for i, (s, q) in enumerate(seqs):
        want = attend(q_all[row : row + q].float(), kv[i][0].float(), kv[i][1].float())
        err = (out[row : row + q].float() - want).abs().max().item()
        assert err < ATOL[torch.bfloat16], f"row group {i} ({'decode' if i < n_dec else 'chunk'}, start {s}, q_len {q}): max err {err:.3g}"
        worst, row = max(worst, err), row + q
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("n_dec", [1, 3, 17, 63, 130])
def test_engine_like_mixed_steps_cuda(n_dec: int) -> None:
    """Decode rows of random contexts (any count: the metadata views start at any offset) beside a
    fresh prompt chunk and continuing ones, at the 8B heads, as the colocated engine's mixed steps run."""
    _need_cuda()
    for seed, chunks in enumerate([[(0, 512)], [(640, 37), (0, 200), (128, 2)], [(1000, 300)]]):
        engine_mixed_step_matches("cuda", n_dec, chunks, seed=100 * n_dec + seed)
