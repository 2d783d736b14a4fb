"""The model runner: eager ragged batches, decode buckets, and the CUDA-graph decode path.

The graph path is checked twice: on the CPU with a stand-in "graph" that replays the captured
step eagerly (everything but the CUDA capture itself: buckets, padding, static buffers, output
slices, recapture), and on a GPU (``@pytest.mark.gpu``) with real CUDA graphs against the eager
path, with a small graph-safe backend of this file and with the real PagedAttention once its
``begin`` takes ``pad_to``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from hawk.engine.attention import ContiguousKVAttention, SeqSlice, attend
from hawk.engine.config import ModelConfig, preset
from hawk.engine.model import LlamaModel
from hawk.engine.paged_attention import PagedAttention
from hawk.engine.piecewise import GraphPiece
from hawk.engine.runner import (
    GraphsUnavailable,
    ModelRunner,
    StepPath,
    _Graph,
    _PrefillGraph,
    decode_buckets,
    prefill_seq_buckets,
    prefill_token_buckets,
)
from hawk.engine.sampler import greedy_tokens, make_generator, sample_tokens
from hawk.engine.sequence import SamplingParams
from hawk.engine.token_fetch import TokenFetcher
from hawk.layouts.gpu import GpuKVLayout

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
BLOCK = 16


class SlotCacheAttention:
    """A minimal graph-safe ``PagedBackend`` for these tests.

    K/V per layer live in ``[slots + 1, Hkv, D]`` (slot = block * BLOCK + offset; the extra slot
    is where padding rows write). Decode metadata goes into fixed device buffers, and attention
    runs over a fixed ``max_ctx`` window with a length mask, so a graph replays any later batch.
    Prefill (``q_len > 1``) runs eagerly, sequence by sequence.
    """

    graph_safe = True

    def __init__(self, cfg: ModelConfig, num_blocks: int, max_batch: int, max_ctx: int,
                 device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        shape = (cfg.num_layers, num_blocks * BLOCK + 1, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.trash, self.max_ctx, self.device = num_blocks * BLOCK, max_ctx, torch.device(device)
        self.write = torch.full((max_batch,), self.trash, dtype=torch.int64, device=device)
        self.ctx = torch.full((max_batch, max_ctx), self.trash, dtype=torch.int64, device=device)
        self.ctx_len = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.cols = torch.arange(max_ctx, device=device)
        self._prefill: list[SeqSlice] | None = None
        self.begins: list[int | None] = []  # pad_to of every begin, for the tests

    @staticmethod
    def _slot(s: SeqSlice, p: int) -> int:
        return s.block_ids[p // BLOCK] * BLOCK + p % BLOCK

    def begin(self, batch: Sequence[SeqSlice], pad_to: int | None = None) -> None:
        self.begins.append(pad_to)
        if any(s.q_len != 1 for s in batch):
            if pad_to is not None:
                raise ValueError("pad_to is for decode batches only")
            self._prefill = list(batch)
            return
        self._prefill = None
        rows, pad = pad_to or len(batch), (pad_to or len(batch)) - len(batch)
        write = [self._slot(s, s.start) for s in batch] + [self.trash] * pad
        ctx = [[self._slot(s, p) for p in range(s.start + 1)] + [self.trash] * (self.max_ctx - s.start - 1)
               for s in batch] + [[self.trash] * self.max_ctx] * pad
        lens = [s.start + 1 for s in batch] + [1] * pad
        for buf, host in ((self.write, write), (self.ctx, ctx), (self.ctx_len, lens)):
            buf[:rows].copy_(torch.tensor(host, dtype=torch.int64), non_blocking=True)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._prefill is not None:
            return self._prefill_attend(layer, q, k, v)
        t = q.shape[0]
        self.k[layer].index_copy_(0, self.write[:t], k.to(self.k.dtype))
        self.v[layer].index_copy_(0, self.write[:t], v.to(self.v.dtype))
        kc = self.k[layer][self.ctx[:t]].transpose(1, 2).to(q.dtype)  # [t, Hkv, max_ctx, D]
        vc = self.v[layer][self.ctx[:t]].transpose(1, 2).to(q.dtype)
        mask = (self.cols[None, :] < self.ctx_len[:t, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q[:, :, None, :], kc, vc, attn_mask=mask, enable_gqa=True)
        return out[:, :, 0, :]

    def _prefill_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, off = [], 0
        for s in self._prefill or []:
            n = s.start + s.q_len
            new = torch.tensor([self._slot(s, p) for p in range(s.start, n)], device=self.device)
            self.k[layer].index_copy_(0, new, k[off : off + s.q_len].to(self.k.dtype))
            self.v[layer].index_copy_(0, new, v[off : off + s.q_len].to(self.v.dtype))
            ctx = torch.tensor([self._slot(s, p) for p in range(n)], device=self.device)
            out.append(attend(q[off : off + s.q_len], self.k[layer][ctx].to(q.dtype), self.v[layer][ctx].to(q.dtype)))
            off += s.q_len
        return torch.cat(out)


class _ReplayEagerly:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay runs the captured step again and
    writes into the outputs the "capture" returned, as a real replay does."""

    def __init__(self, body: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 outs: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.body, self.outs, self.replays = body, outs, 0

    def replay(self) -> None:
        for out, new in zip(self.outs, self.body()):
            out.copy_(new)
        self.replays += 1


class CpuGraphRunner(ModelRunner):
    """The runner's graph path with :class:`_ReplayEagerly` in place of CUDA graphs."""

    def _why_no_graphs(self) -> str | None:
        return None

    def _capture(self, b: int) -> _Graph:
        body = self._graph_body(b)
        logits, greedy = body()
        return _Graph(_ReplayEagerly(body, (logits, greedy)), logits, greedy)


class _PrefillReplay:
    """A prefill graph's stand-in: replay reruns the captured forward into the captured logits with
    the layer hook off (a real replay calls no Python between layers)."""

    def __init__(self, runner: ModelRunner, body: Callable[[], torch.Tensor], logits: torch.Tensor) -> None:
        self.runner, self.body, self.logits, self.replays = runner, body, logits, 0

    def replay(self) -> None:
        attn = self.runner.attn
        hook, attn.after_layer = attn.after_layer, None
        try:
            self.logits.copy_(self.body())
        finally:
            attn.after_layer = hook
        self.replays += 1


class CpuPrefillGraphRunner(ModelRunner):
    """The runner's prefill-graph path with :class:`_PrefillReplay` in place of CUDA graphs; each
    layer's "event" is a string naming it."""

    def _why_no_graphs(self) -> str | None:
        return None

    def _capture_prefill(self, t: int, rows: int) -> _PrefillGraph:
        body = self._prefill_body(t, rows)
        hook, self.attn.after_layer = self.attn.after_layer, None
        try:
            logits = body()
        finally:
            self.attn.after_layer = hook
        events = [f"layer {i}" for i in range(self.model.config.num_layers)]
        return _PrefillGraph(_PrefillReplay(self, body, logits), logits, events)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    torch.set_num_threads(1)
    return LlamaModel.from_config(preset("tiny"), seed=0)


# ---- buckets and options ----------------------------------------------------------------------


def test_decode_buckets() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert decode_buckets(1) == [1] and decode_buckets(3) == [1, 2, 3]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_prefill_buckets() -> None:
    assert prefill_token_buckets(2048) == [16, 32, 64, *range(128, 2049, 128)]
    assert prefill_token_buckets(300) == [16, 32, 64, 128, 256, 384]
    assert prefill_token_buckets(40, step=16) == [16, 32, 48]
    assert prefill_seq_buckets(16) == [1, 2, 4, 8, 16] and prefill_seq_buckets(5) == [1, 2, 4, 5]
    # a mixed step's token target is a bucket of its own; sizes past the largest or not positive are not
    assert prefill_token_buckets(640, extra=(192, 5000, 0)) == [16, 32, 64, 128, 192, 256, 384, 512, 640]
    with pytest.raises(ValueError):
        prefill_token_buckets(0)


def test_graphs_are_refused_where_they_cannot_run(tiny: LlamaModel) -> None:
    attn = ContiguousKVAttention(2)
    assert not ModelRunner(tiny, attn).use_graphs
    with pytest.raises(GraphsUnavailable, match="CUDA"):
        ModelRunner(tiny, attn, graphs=True)


# ---- the eager path ---------------------------------------------------------------------------


def _reference_logits(model: LlamaModel, seqs: list[list[int]]) -> torch.Tensor:
    out = []
    for toks in seqs:
        attn = ContiguousKVAttention(model.config.num_layers)
        attn.begin([0], [len(toks)])
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(toks), torch.arange(len(toks)), attn))[-1])
    return torch.stack(out)


def test_eager_ragged_prefill_then_decode_matches_the_reference(tiny: LlamaModel) -> None:
    cfg = tiny.config
    lay = GpuKVLayout(cfg.num_layers, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim, "fp32")
    runner = ModelRunner(tiny, PagedAttention(lay, lay.allocate("cpu")))
    a, b = [5, 17, 300, 42, 7], [256, 99, 98, 97, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    sa, sb = SeqSlice([0, 1], 0, len(a)), SeqSlice([2, 3, 4], 0, len(b))
    out = runner.step([a, b], [sa, sb])
    assert out.path is StepPath.EAGER and out.greedy is None and out.logits.shape == (2, cfg.vocab_size)
    assert torch.allclose(out.logits, _reference_logits(tiny, [a, b]), atol=1e-4)
    ta, tb = int(out.logits[0].argmax()), int(out.logits[1].argmax())
    dec = runner.forward([[ta], [tb]], [SeqSlice([0, 1], len(a), 1), SeqSlice([2, 3, 4], len(b), 1)])
    assert torch.allclose(dec, _reference_logits(tiny, [a + [ta], b + [tb]]), atol=1e-4)
    with pytest.raises(ValueError, match="tokens"):
        runner.forward([[1, 2]], [SeqSlice([0], 0, 3)])


def test_runner_grows_rope_for_long_contexts_without_reading_positions(tiny: LlamaModel) -> None:
    """Positions past the table are reserved from the slices' Python ints, not from the tensor."""
    cfg = tiny.config.replace(max_position_embeddings=4096)
    model = LlamaModel.from_config(cfg, seed=0)
    attn = SlotCacheAttention(cfg, num_blocks=200, max_batch=4, max_ctx=8, device="cpu")
    runner = ModelRunner(model, attn, max_model_len=16)
    assert len(model.rope) == 1024
    runner.forward([[3, 4]], [SeqSlice(list(range(200)), 3000, 2)])
    assert len(model.rope) >= 3002


# ---- the graph path, on the CPU ----------------------------------------------------------------


def _decode_script() -> list[list[int]]:
    """Which sequences (of 6) decode at each step: batch sizes 1, 3, 4, 6, 5, 2, 6 cross buckets."""
    return [[0], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [5, 3], [0, 1, 2, 3, 4, 5]]


def _run_script(runner: ModelRunner, prompts: list[list[int]], steps: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then decode the scripted batches greedily; tokens and logits per step."""
    blocks = [[4 * i + j for j in range(4)] for i in range(len(prompts))]
    first = runner.forward(prompts, [SeqSlice(blocks[i], 0, len(p)) for i, p in enumerate(prompts)])
    toks = [[int(t)] for t in first.argmax(-1)]
    lens = [len(p) for p in prompts]
    logits = []
    for rows in steps:
        slices = [SeqSlice(blocks[i], lens[i], 1) for i in rows]
        out = runner.step([[toks[i][-1]] for i in rows], slices)
        chosen = greedy_tokens(out.logits) if out.greedy is None else out.greedy
        logits.append(out.logits.clone())
        for i, t in zip(rows, chosen.tolist()):
            toks[i].append(t)
            lens[i] += 1
    return toks, logits


PROMPTS = [[(13 * i + 7 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]


def _pair(model: LlamaModel, device: str, graph_cls: type[ModelRunner]) -> tuple[ModelRunner, ModelRunner]:
    cfg = model.config
    mk = lambda: SlotCacheAttention(cfg, num_blocks=24, max_batch=8, max_ctx=64, device=device)  # noqa: E731
    return ModelRunner(model, mk(), max_batch=8, graphs=False), graph_cls(model, mk(), max_batch=8)


def test_graph_path_matches_eager_on_the_cpu(tiny: LlamaModel) -> None:
    eager, graphed = _pair(tiny, "cpu", CpuGraphRunner)
    assert graphed.use_graphs and graphed.buckets == [1, 2, 4, 8]
    toks_e, logits_e = _run_script(eager, PROMPTS, _decode_script())
    toks_g, logits_g = _run_script(graphed, PROMPTS, _decode_script())
    assert toks_g == toks_e
    for le, lg in zip(logits_e, logits_g):
        assert torch.allclose(le, lg, atol=1e-5)
    # one graph per bucket used (1, 4, 8, 2), each captured once and replayed after
    assert sorted(graphed._graphs) == [1, 2, 4, 8]
    assert sum(g.graph.replays for g in graphed._graphs.values()) == len(_decode_script())
    assert [p for p in graphed.attn.begins if p is not None] == [1, 4, 4, 8, 8, 2, 8]


def test_graph_outputs_are_sliced_and_forward_copies(tiny: LlamaModel) -> None:
    _, graphed = _pair(tiny, "cpu", CpuGraphRunner)
    blocks = [[0, 1], [2, 3], [4, 5]]
    graphed.forward([[1, 2, 3]] * 3, [SeqSlice(b, 0, 3) for b in blocks])
    slices = [SeqSlice(b, 3, 1) for b in blocks]
    out = graphed.step([[4], [5], [6]], slices)
    assert out.path is StepPath.GRAPH and out.logits.shape[0] == 3 and out.greedy.shape == (3,)
    assert out.logits.data_ptr() == graphed._graphs[4].logits.data_ptr()  # a view, no copy
    kept = graphed.forward([[7], [8], [9]], [SeqSlice(b, 4, 1) for b in blocks])
    assert kept.data_ptr() != graphed._graphs[4].logits.data_ptr()  # forward() hands out a copy


def test_graphs_are_recaptured_when_rope_grows(tiny: LlamaModel) -> None:
    cfg = tiny.config.replace(max_position_embeddings=4096)
    model = LlamaModel.from_config(cfg, seed=0)
    attn = SlotCacheAttention(cfg, num_blocks=80, max_batch=2, max_ctx=1100, device="cpu")
    runner = CpuGraphRunner(model, attn, max_batch=2, max_model_len=1024)
    blocks = list(range(80))
    runner.forward([[1] * 1000], [SeqSlice(blocks, 0, 1000)])
    runner.step([[2]], [SeqSlice(blocks, 1000, 1)])
    first = runner._graphs[1]
    for p in range(1001, 1030):  # crosses position 1024: the table doubles
        runner.step([[2]], [SeqSlice(blocks, p, 1)])
    assert len(model.rope) == 2048 and runner._graphs[1] is not first


def test_warmup_captures_every_bucket_with_padding_only(tiny: LlamaModel) -> None:
    _, graphed = _pair(tiny, "cpu", CpuGraphRunner)
    assert graphed.warmup() == [8, 4, 2, 1]
    assert sorted(graphed._graphs) == [1, 2, 4, 8]
    assert graphed.attn.k[:, : graphed.attn.trash].abs().sum() == 0  # no real slot written
    assert ModelRunner(tiny, ContiguousKVAttention(2)).warmup() == []


def _paged(model: LlamaModel, device: str = "cpu", blocks: int = 24) -> PagedAttention:
    cfg = model.config
    dt = "fp32" if model.dtype == torch.float32 else "bf16"
    lay = GpuKVLayout(cfg.num_layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, dt)
    return PagedAttention(lay, lay.allocate(device), max_batch=8)


#: Prefill iterations: one prompt, two prompts, a chunk continuing the first beside a fresh prompt
#: (a mixed batch), a batch past the graphs' token limit (eager), and one of 5 prompts (4 is the limit).
_PREFILLS = [
    [([0, 1], 0, 20)],
    [([2, 3], 0, 9), ([4, 5], 0, 30)],
    [([0, 1], 20, 12), ([6, 7], 0, 3)],
    [([8, 9, 10, 11, 12], 0, 70)],
    [([13 + i], 0, 2) for i in range(5)],
]


def _run_prefills(runner: ModelRunner, model: LlamaModel) -> tuple[list[torch.Tensor], list[StepPath], list[list]]:
    """Each iteration of ``_PREFILLS`` through ``runner``; the logits, paths and layer-hook calls."""
    g = torch.Generator().manual_seed(5)
    logits, paths, calls = [], [], []
    for batch in _PREFILLS:
        slices = [SeqSlice(b, start, q) for b, start, q in batch]
        toks = [torch.randint(0, model.config.vocab_size, (q,), generator=g).tolist() for _, _, q in batch]
        seen: list = []
        runner.attn.after_layer = lambda layer, marker, seen=seen: seen.append((layer, marker))
        try:
            out = runner.step(toks, slices)
        finally:
            runner.attn.after_layer = None
        logits.append(out.logits.clone())
        paths.append(out.path)
        calls.append(seen)
    return logits, paths, calls


def test_prefill_graphs_match_eager_on_the_cpu(tiny: LlamaModel) -> None:
    """Buckets, padding, the static ids / positions / last rows, the replay's logits and the layer
    hook's calls (after the replay, one per layer with its event) against the eager runner."""
    eager = ModelRunner(tiny, _paged(tiny), graphs=False)
    graphed = CpuPrefillGraphRunner(tiny, _paged(tiny), graphs=False, prefill_graph_tokens=64, prefill_graph_seqs=4)
    assert graphed.prefill_tokens == [16, 32, 64] and graphed.prefill_seqs == [1, 2, 4]
    le, pe, ce = _run_prefills(eager, tiny)
    lg, pg, cg = _run_prefills(graphed, tiny)
    assert pe == [StepPath.EAGER] * 5
    assert pg == [StepPath.GRAPH, StepPath.GRAPH, StepPath.GRAPH, StepPath.EAGER, StepPath.EAGER]
    for a, b in zip(le, lg):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    assert sorted(graphed._prefill_graphs) == [(16, 2), (32, 1), (64, 2)]
    n = tiny.config.num_layers
    assert ce[0] == [(i, None) for i in range(n)]  # eager: called between layers, no marker
    assert cg[0] == [(i, f"layer {i}") for i in range(n)]  # graph: after the replay, each layer's event
    assert cg[3] == ce[3]
    for a, b in zip(eager.attn.caches, graphed.attn.caches):
        assert torch.allclose(a, b, atol=1e-5)  # the same K/V in the same slots, nothing for the pads


def test_prefill_graph_warmup_writes_nothing_and_replays_after(tiny: LlamaModel) -> None:
    runner = CpuPrefillGraphRunner(tiny, _paged(tiny), graphs=False, prefill_graph_tokens=32, prefill_graph_seqs=2)
    assert runner.warmup_prefill() == [(32, 1), (16, 1)]
    assert all(not c.any() for c in runner.attn.caches)
    first = runner._prefill_graphs[(32, 1)]
    out = runner.step([[3] * 20], [SeqSlice([0, 1], 0, 20)])
    assert out.path is StepPath.GRAPH and runner._prefill_graphs[(32, 1)] is first and first.graph.replays == 1
    assert runner.attn.caches[0].any()
    # a regrown metadata buffer (a batch beyond max_batch) moves what the graphs read: recaptured
    runner.attn.begin([SeqSlice([i], 0, 1) for i in range(9)])
    runner.step([[3] * 20], [SeqSlice([0, 1], 0, 20)])
    assert runner._prefill_graphs[(32, 1)] is not first
    # no prefill graphs without a backend that pads a prefill, or with a step hook (tensor parallel)
    assert CpuPrefillGraphRunner(tiny, SlotCacheAttention(tiny.config, 8, 2, 8, "cpu"), prefill_graph_tokens=32).prefill_tokens == []
    tiny.step_hook = lambda ids, pos: None
    try:
        assert runner.step([[3] * 20], [SeqSlice([0, 1], 0, 20)]).path is StepPath.EAGER
    finally:
        tiny.step_hook = None


class CpuStepRunner(CpuGraphRunner, CpuPrefillGraphRunner):
    """Both stand-ins: decode graphs and prefill graphs (pieces need none: on a CPU they are called)."""


def _mixed_script() -> list[list[tuple[list[int], int, int]]]:
    """Five prompts prefilled, then steps of their five decode rows beside prompt chunks (blocks,
    start, q_len): a fresh prompt and a continuing chunk, then a chunk past the prefill graphs' token
    limit (eager)."""
    blocks = [[2 * i, 2 * i + 1] for i in range(5)]
    prompts = [(b, 0, 4 + i) for i, b in enumerate(blocks)]
    def dec(k: int) -> list[tuple[list[int], int, int]]:
        return [(b, 4 + i + k, 1) for i, b in enumerate(blocks)]

    return [prompts,
            dec(0) + [([10, 11], 0, 9), ([12, 13], 0, 20)],
            dec(1) + [([12, 13], 20, 12)],
            dec(2) + [([14, 15, 16, 17, 18], 0, 70)]]


def _run_mixed(runner: ModelRunner, model: LlamaModel, hook: bool = False
               ) -> tuple[list[torch.Tensor], list[StepPath], list[torch.Tensor | None], list[list]]:
    """Each step of ``_mixed_script``: logits, paths, greedy tokens and (``hook``) the layer hook's calls."""
    g = torch.Generator().manual_seed(11)
    logits, paths, greedy, calls = [], [], [], []
    for batch in _mixed_script():
        toks = [torch.randint(0, model.config.vocab_size, (q,), generator=g).tolist() for _, _, q in batch]
        seen: list = []
        if hook:
            runner.attn.after_layer = lambda layer, marker, seen=seen: seen.append((layer, marker))
        try:
            out = runner.step(toks, [SeqSlice(b, start, q) for b, start, q in batch])
        finally:
            runner.attn.after_layer = None
        logits.append(out.logits.clone())
        paths.append(out.path)
        greedy.append(None if out.greedy is None else out.greedy.clone())
        calls.append(seen)
    return logits, paths, greedy, calls


def test_mixed_batches_past_the_prefill_graphs_run_as_graph_pieces_on_the_cpu(tiny: LlamaModel) -> None:
    """Batches with more sequences than a prefill graph holds (five prompts; five decode rows beside
    chunks) run as one forward of pieces per token bucket with attention between them: the eager
    runner's logits, greedy tokens, layer-hook calls and cache (the pads write no KV); one whose tokens
    exceed the buckets stays eager. Each bucket's pieces are captured once and replayed after."""
    eager = ModelRunner(tiny, _paged(tiny), max_batch=8, graphs=False)
    pw = CpuStepRunner(tiny, _paged(tiny), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=2, piecewise_graphs=True)
    le, pe, _, ce = _run_mixed(eager, tiny, hook=True)
    lp, pp, gp, cp = _run_mixed(pw, tiny, hook=True)
    assert pe == [StepPath.EAGER] * 4
    assert pp == [StepPath.PIECEWISE, StepPath.PIECEWISE, StepPath.PIECEWISE, StepPath.EAGER]
    for a, b in zip(le, lp):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for logits, greedy in zip(lp[:3], gp[:3]):
        assert greedy is not None and torch.equal(greedy, greedy_tokens(logits))
    n = tiny.config.num_layers
    assert cp == ce and cp[1] == [(i, None) for i in range(n)]
    # tokens 30, 34, 17: buckets 32, 64, 32; L + 1 pieces each, every piece run once per step
    assert sorted(pw._piecewise) == [32, 64] and not pw._graphs and not pw._prefill_graphs
    assert [[p.replays for p in pw._piecewise[t].pieces] for t in (32, 64)] == [[2] * (n + 1), [1] * (n + 1)]
    for a, b in zip(eager.attn.caches, pw.attn.caches):
        assert torch.allclose(a, b, atol=1e-5)  # the same K/V in the same slots, nothing for the pads


def test_mixed_batches_past_the_prefill_graphs_replay_mixed_graphs_on_the_cpu(tiny: LlamaModel) -> None:
    """With mixed graphs, the steps of decode rows beside chunks replay one graph per (tokens, chunks)
    bucket: the eager runner's logits and cache (no pad writes KV), the layer hook told each layer's
    event after the replay; prompts alone past the prefill graphs' sequences stay graph pieces, and a
    step past the token buckets eager. A bucket's graph replays again, for another split of its tokens."""
    eager = ModelRunner(tiny, _paged(tiny), max_batch=8, graphs=False)
    mg = CpuStepRunner(tiny, _paged(tiny), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=2, mixed_graphs=True,
                       piecewise_graphs=True)
    assert mg.mixed_graphs
    le, pe, _, ce = _run_mixed(eager, tiny, hook=True)
    lm, pm, _, cm = _run_mixed(mg, tiny, hook=True)
    assert pm == [StepPath.PIECEWISE, StepPath.GRAPH, StepPath.GRAPH, StepPath.EAGER]
    for a, b in zip(le, lm):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    n = tiny.config.num_layers
    assert cm[1] == cm[2] == [(i, f"layer {i}") for i in range(n)] and cm[3] == ce[3]
    # five rows beside 9 + 20 tokens in two chunks (34 tokens), beside 12 in one (17): buckets (64, 2), (32, 1)
    assert sorted(mg._mixed_graphs) == [(32, 1), (64, 2)] and not mg._prefill_graphs
    for a, b in zip(eager.attn.caches, mg.attn.caches):
        assert torch.allclose(a, b, atol=1e-5)
    first = mg._mixed_graphs[(32, 1)]
    batch = [SeqSlice([2 * i, 2 * i + 1], 7 + i, 1) for i in range(5)] + [SeqSlice([19, 20], 0, 20)]  # 25 tokens
    want, got = (r.step([[3]] * 5 + [[4] * 20], batch).logits for r in (eager, mg))
    assert mg._mixed_graphs[(32, 1)] is first and first.graph.replays == 2
    assert torch.allclose(want, got, atol=1e-5)


def test_an_extra_token_bucket_takes_the_steps_that_fit_it(tiny: LlamaModel) -> None:
    """A token target between two buckets (48, between 32 and 64) is a bucket of its own, for mixed
    graphs and graph pieces alike: the 34-token mixed step pads to 48, not 64, and gives the eager
    runner's logits and cache."""
    eager = ModelRunner(tiny, _paged(tiny), max_batch=8, graphs=False)
    mg = CpuStepRunner(tiny, _paged(tiny), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=2, mixed_graphs=True,
                       piecewise_graphs=True, extra_token_buckets=(48,))
    assert mg.prefill_tokens == mg.piecewise_tokens == [16, 32, 48, 64]
    le, _, _, _ = _run_mixed(eager, tiny, hook=False)
    lm, pm, _, _ = _run_mixed(mg, tiny, hook=False)
    assert pm == [StepPath.PIECEWISE, StepPath.GRAPH, StepPath.GRAPH, StepPath.EAGER]
    assert sorted(mg._mixed_graphs) == [(32, 1), (48, 2)] and sorted(mg._piecewise) == [32]
    for a, b in zip(le, lm):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
    for a, b in zip(eager.attn.caches, mg.attn.caches):
        assert torch.allclose(a, b, atol=1e-5)


def test_mixed_graph_warmup_writes_nothing_and_its_graphs_replay_after(tiny: LlamaModel) -> None:
    runner = CpuStepRunner(tiny, _paged(tiny), max_batch=8, prefill_graph_tokens=32, prefill_graph_seqs=2, mixed_graphs=True)
    assert runner.warmup_mixed((1, 2)) == [(32, 2), (32, 1), (16, 2), (16, 1)]
    assert all(not c.any() for c in runner.attn.caches)
    ref = ModelRunner(tiny, _paged(tiny), max_batch=8, graphs=False)
    batch = [SeqSlice([i], 0, 1) for i in range(3)] + [SeqSlice([4, 5], 0, 20)]
    toks = [[1], [2], [3], list(range(5, 25))]
    got = runner.step(toks, batch)
    assert got.path is StepPath.GRAPH and runner._mixed_graphs[(32, 1)].graph.replays == 1
    assert torch.allclose(got.logits, ref.step(toks, batch).logits, atol=1e-5)
    # off where the backend cannot pad a mixed batch, and with a step hook (tensor parallel)
    assert CpuStepRunner(tiny, SlotCacheAttention(tiny.config, 8, 2, 8, "cpu"), prefill_graph_tokens=32, mixed_graphs=True).mixed_graphs is False
    tiny.step_hook = lambda ids, pos: None
    try:
        assert runner.warmup_mixed() == [] and runner.step(toks, batch).path is StepPath.EAGER
    finally:
        tiny.step_hook = None


def test_piecewise_buckets_share_their_buffers_and_recapture_when_rope_grows(tiny: LlamaModel) -> None:
    """Every bucket's pieces use the fronts of one set of static buffers (memory for the largest bucket,
    not per bucket); warming up captures each bucket once and writes no KV; a RoPE table that grows
    (the pieces read it) drops them, the next step captures again."""
    model = LlamaModel.from_config(preset("tiny"), seed=0)  # its RoPE table grows here
    runner = CpuStepRunner(model, _paged(model, blocks=80), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=1, piecewise_graphs=True)
    assert runner.warmup_piecewise() == [64, 32, 16]
    assert all(not c.any() for c in runner.attn.caches)
    fwds = runner._piecewise
    assert {f.q.data_ptr() for f in fwds.values()} == {runner._piece_bufs.qkv.data_ptr()}
    assert {f.hidden.data_ptr() for f in fwds.values()} == {runner._piece_bufs.hidden.data_ptr()}
    assert runner._piece_bufs.tokens == 64 and all(len(f.pieces) == model.config.num_layers + 1 for f in fwds.values())
    first = fwds[16]
    two = [SeqSlice([0, 1], 0, 3), SeqSlice([2, 3], 0, 4)]
    assert runner.step([[1, 2, 3], [4, 5, 6, 7]], two).path is StepPath.PIECEWISE
    assert runner._piecewise[16] is first and first.pieces[0].replays == 1  # (the failing steps below replay nothing)
    with pytest.raises(ValueError, match="2 tokens given for a slice of 3"):
        runner.step([[1, 2], [4, 5, 6, 7]], two)
    with pytest.raises(ValueError, match="one-token slice"):
        runner.step([[1, 2], [4, 5, 6, 7]], [SeqSlice([0, 1], 3, 1), two[1]])
    runner.model.reserve_positions(len(runner.model.rope) + 1)  # the table doubles
    assert runner.step([[1, 2, 3], [4, 5, 6, 7]], two).path is StepPath.PIECEWISE
    assert list(runner._piecewise) == [16] and runner._piecewise[16] is not first
    model.step_hook = lambda ids, pos: None  # tensor parallel: the other ranks run whole forwards
    assert runner.step([[1, 2, 3], [4, 5, 6, 7]], two).path is StepPath.EAGER and runner.warmup_piecewise() == []


def test_piecewise_pads_never_change_a_real_row(tiny: LlamaModel) -> None:
    """A batch in a bucket with one pad token, run after a larger batch left its rows in the static
    buffers (the pad row's attention output is that batch's): the eager runner's logits, and its K/V
    in the batch's blocks."""
    runner = CpuStepRunner(tiny, _paged(tiny, blocks=80), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=1, piecewise_graphs=True)
    ref = ModelRunner(tiny, _paged(tiny, blocks=80), max_batch=8, graphs=False)
    small = [SeqSlice([0, 1], 0, 15), SeqSlice([2, 3], 0, 16)]  # 31 tokens: bucket 32
    big = [SeqSlice([10 + i, 20 + i], 0, 12) for i in range(5)]  # 60 tokens: bucket 64
    toks_small = [list(range(3, 18)), list(range(40, 56))]
    toks_big = [[7 * i + j for j in range(12)] for i in range(5)]
    want = ref.step(toks_small, small).logits
    runner.step(toks_big, big)
    got = runner.step(toks_small, small)
    assert got.path is StepPath.PIECEWISE and torch.allclose(got.logits, want, atol=1e-5)
    for a, b in zip(ref.attn.caches, runner.attn.caches):
        assert torch.allclose(a[:, :4], b[:, :4], atol=1e-5)


@pytest.mark.parametrize("graphed", [False, True, "mixed"])
def test_device_ids_replace_the_tokens_of_a_batchs_leading_rows(tiny: LlamaModel, graphed: bool | str) -> None:
    """Async scheduling's steps: the first rows' ids come from the device (the previous step's
    tokens), the rest of the batch (rows that joined, prompt chunks) from the host; the same logits
    as host tokens throughout, on every path (decode graph, prefill graph, pieces, mixed graph, eager)."""
    def runner() -> ModelRunner:
        if graphed:
            return CpuStepRunner(tiny, _paged(tiny, blocks=40), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=4,
                                 piecewise_graphs=True, mixed_graphs=graphed == "mixed")
        return ModelRunner(tiny, _paged(tiny, blocks=40), max_batch=8, graphs=False)

    host, dev = runner(), runner()
    prompts = [SeqSlice([2 * i, 2 * i + 1], 0, 4) for i in range(5)]
    steps = [  # (rows, prompt chunks) after the prompts: decode only, then with a fresh prompt, then a larger one
        ([(i, 4) for i in range(5)], []),
        ([(i, 5) for i in range(3)], [([10, 11], 0, 9)]),
        ([(i, 6) for i in range(5)], [([12, 13], 0, 20)]),
    ]
    g = torch.Generator().manual_seed(3)
    paths = []
    for r in (host, dev):
        r.step([[5, 6, 7, 8]] * 5, prompts)
    for rows, chunks in steps:
        ids = torch.randint(0, tiny.config.vocab_size, (len(rows),), generator=g)
        chunk_toks = [torch.randint(0, tiny.config.vocab_size, (q,), generator=g).tolist() for _, _, q in chunks]
        slices = [SeqSlice([2 * i, 2 * i + 1], start, 1) for i, start in rows] + [SeqSlice(b, st, q) for b, st, q in chunks]
        want = host.step([[int(t)] for t in ids] + chunk_toks, slices).logits.clone()
        k = len(rows) - 1  # the last row "joined": its id is the host's
        got = dev.step([[0]] * k + [[int(ids[-1])]] + chunk_toks, slices, ids=ids[:k])
        paths.append(got.path)
        assert torch.allclose(want, got.logits, atol=1e-5)
    if graphed:
        assert paths == [StepPath.GRAPH, StepPath.GRAPH, StepPath.GRAPH if graphed == "mixed" else StepPath.PIECEWISE]
    with pytest.raises(ValueError, match="first rows"):
        dev.step([[1] * 9], [SeqSlice([10, 11], 0, 9)], ids=torch.tensor([1]))


# ---- the graph path, on a GPU ------------------------------------------------------------------


def _paged_supports_graphs() -> bool:
    return "pad_to" in inspect.signature(PagedAttention.begin).parameters


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_eager(dtype: torch.dtype) -> None:
    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=dtype, device="cuda")
    eager, graphed = _pair(model, "cuda", ModelRunner)
    assert graphed.use_graphs and not eager.use_graphs
    toks_e, logits_e = _run_script(eager, PROMPTS, _decode_script())
    toks_g, logits_g = _run_script(graphed, PROMPTS, _decode_script())
    assert toks_g == toks_e
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for le, lg in zip(logits_e, logits_g):
        assert torch.allclose(le, lg, atol=tol)
    # Not bit-identical even when a batch fills its bucket: cuBLAS may pick another algorithm
    # under capture (measured on an H200), so tokens and a tolerance are what hold.


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefill_graphs_match_eager(dtype: torch.dtype) -> None:
    """Real prefill graphs over the Triton paged attention against the eager runner: logits within
    tolerance, the same greedy tokens, the same cache; the hook gets each layer's CUDA event."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=dtype, device="cuda")
    eager = ModelRunner(model, _paged(model, "cuda"), graphs=False)
    graphed = ModelRunner(model, _paged(model, "cuda"), graphs=False, prefill_graph_tokens=64, prefill_graph_seqs=4)
    assert graphed.warmup_prefill() == [(64, 1), (32, 1), (16, 1)]
    warm = ModelRunner(model, _paged(model, "cuda"), graphs=False, prefill_graph_tokens=1024)
    assert len(warm.warmup_prefill()) == 11 and not any(c.any() for c in warm.attn.caches)  # all-pad, up to 1k
    le, _, _ = _run_prefills(eager, model)
    lg, pg, cg = _run_prefills(graphed, model)
    assert pg == [StepPath.GRAPH, StepPath.GRAPH, StepPath.GRAPH, StepPath.EAGER, StepPath.EAGER]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(le, lg):
        assert torch.allclose(a, b, atol=tol) and torch.equal(greedy_tokens(a), greedy_tokens(b))
    assert [layer for layer, _ in cg[0]] == list(range(model.config.num_layers))
    assert all(isinstance(ev, torch.cuda.Event) for _, ev in cg[0])
    for a, b in zip(eager.attn.caches, graphed.attn.caches):
        assert torch.allclose(a.float(), b.float(), atol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mixed_batches_run_as_graph_pieces(dtype: torch.dtype) -> None:
    """Real piece graphs over the Triton paged attention for batches past the prefill graphs'
    sequences, against the eager runner (whose mixed step splits its attention the same way): the
    logits, greedy tokens, layer-hook calls (between layers, no marker) and cache."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=dtype, device="cuda")
    eager = ModelRunner(model, _paged(model, "cuda"), max_batch=8, graphs=False)
    pw = ModelRunner(model, _paged(model, "cuda"), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=2, piecewise_graphs=True)
    le, _, _, ce = _run_mixed(eager, model, hook=True)
    lp, pp, gp, cp = _run_mixed(pw, model, hook=True)
    assert pp == [StepPath.PIECEWISE, StepPath.PIECEWISE, StepPath.PIECEWISE, StepPath.EAGER]
    assert sorted(pw._piecewise) == [32, 64]
    assert all(isinstance(p, GraphPiece) for f in pw._piecewise.values() for p in f.pieces)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(le, lp):
        assert torch.allclose(a, b, atol=tol) and torch.equal(greedy_tokens(a), greedy_tokens(b))
    for logits, greedy in zip(lp[:3], gp[:3]):
        assert greedy is not None and torch.equal(greedy, greedy_tokens(logits))
    assert cp == ce
    for a, b in zip(eager.attn.caches, pw.attn.caches):
        assert torch.allclose(a.float(), b.float(), atol=tol)


def _tokens_agree_but_near_ties(want: torch.Tensor, got: torch.Tensor, tol: float) -> bool:
    """Greedy tokens of ``got`` are ``want``'s wherever ``want``'s best two logits are more than ``tol`` apart."""
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > tol
    return bool(clear.float().mean() > 0.25) and torch.equal(greedy_tokens(want)[clear], greedy_tokens(got)[clear])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, chunk, extra", [(48, 512, ()), (256, 512, ()), (48, 128, (192,))])
@pytest.mark.parametrize("mixed", [False, True])
def test_cuda_piecewise_step_of_decode_rows_beside_a_prompt_chunk(rows: int, chunk: int, extra: tuple[int, ...], dtype: torch.dtype,
                                                                  mixed: bool) -> None:
    """Issue 31's step on the 8B layer shapes (two layers): ``rows`` decode rows at contexts of 100-900
    tokens beside a 512-token prompt chunk (or 128 with a 192-token bucket of its own, a step token
    target: the 176-token step pads to it, not to 256), as one forward of piece graphs (``mixed``: one mixed graph,
    its decode rows padded to their bucket) against the eager forward: the logits within tolerance, the
    same greedy tokens (but near ties), the same K/V written, the decode rows' ids from the device
    (async scheduling)."""
    cfg = preset("llama-3.1-8b").replace(num_layers=2)
    model = LlamaModel.from_config(cfg, seed=0, dtype=dtype, device="cuda")
    ctx = [100 + (37 * i) % 800 for i in range(rows)]
    first = list(itertools.accumulate([0] + [-(-(c + 1) // BLOCK) for c in ctx]))
    chunk_blocks = chunk // BLOCK
    lay = GpuKVLayout(cfg.num_layers, first[-1] + chunk_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                      "fp32" if dtype == torch.float32 else "bf16")
    assert lay.order == "NHD"  # caches [2, blocks, BLOCK, Hkv, D]
    caches = lay.allocate("cuda")
    for c in caches:  # the rows' contexts
        c.normal_()
    slices = [SeqSlice(list(range(first[i], first[i + 1])), ctx[i], 1) for i in range(rows)]
    slices.append(SeqSlice(list(range(first[-1], first[-1] + chunk_blocks)), 0, chunk))
    new_slots = torch.tensor([sl.block_ids[sl.start // BLOCK] * BLOCK + sl.start % BLOCK for sl in slices[:-1]]
                             + list(range(first[-1] * BLOCK, (first[-1] + chunk_blocks) * BLOCK)), device="cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (rows,), generator=g)
    prompt = torch.randint(0, cfg.vocab_size, (chunk,), generator=g).tolist()

    def paged() -> PagedAttention:  # both runners over the same cache: each step writes the new K/V before reading them
        return PagedAttention(lay, caches, max_batch=rows + 17, max_model_len=1024)

    def written() -> list[torch.Tensor]:  # [2, new tokens, Hkv, D] per layer
        return [c.flatten(1, 2)[:, new_slots].clone() for c in caches]

    eager = ModelRunner(model, paged(), max_batch=rows, graphs=False, max_model_len=1024)
    if mixed:
        pw = ModelRunner(model, paged(), max_batch=rows, max_model_len=1024, prefill_graph_tokens=rows + chunk, mixed_graphs=True,
                         extra_token_buckets=extra)
        assert (pw.prefill_tokens[-1], 1) in pw.warmup_mixed()
    else:
        pw = ModelRunner(model, paged(), max_batch=rows, max_model_len=1024, prefill_graph_tokens=rows + chunk, piecewise_graphs=True,
                         extra_token_buckets=extra)
        assert pw.warmup_piecewise() == list(reversed(pw.prefill_tokens))
        assert sum(len(f.pieces) for f in pw._piecewise.values()) == (cfg.num_layers + 1) * len(pw.prefill_tokens)
    want = eager.step([[int(t)] for t in ids] + [prompt], slices).logits.clone()
    kv_want = written()
    for c in caches:  # what the pieces' step does not write stays NaN, and reading it would show
        c.flatten(1, 2)[:, new_slots] = float("nan")
    out = pw.step([[0]] * rows + [prompt], slices, ids=ids.to("cuda"))
    assert out.path is (StepPath.GRAPH if mixed else StepPath.PIECEWISE) and out.logits.shape == want.shape
    if extra:
        assert next(b for b in pw.prefill_tokens if b >= rows + chunk) == extra[0]  # the bucket the step ran
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert torch.allclose(want, out.logits, atol=tol, rtol=tol), (want - out.logits).abs().max()
    assert mixed or (out.greedy is not None and torch.equal(out.greedy, greedy_tokens(out.logits)))
    assert _tokens_agree_but_near_ties(want, out.logits, tol)
    for a, b in zip(kv_want, written()):
        assert torch.allclose(a.float(), b.float(), atol=tol)


@gpu
@needs_cuda
def test_cuda_piecewise_step_does_not_sync() -> None:
    """Once a bucket's pieces are captured, a mixed step through them (metadata, ids from the device,
    replays, eager attention, the LM head and greedy tokens) runs with sync debugging set to error."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda")
    runner = ModelRunner(model, _paged(model, "cuda"), max_batch=8, prefill_graph_tokens=64, prefill_graph_seqs=2,
                         piecewise_graphs=True)
    rows = [SeqSlice([2 * i, 2 * i + 1], 0, 4) for i in range(5)]
    runner.step([[5, 6, 7, 8]] * 5, rows)
    slices = [SeqSlice(s.block_ids, 4, 1) for s in rows] + [SeqSlice([10, 11], 0, 9)]
    ids = torch.tensor([1, 2, 3, 4, 5], device="cuda")
    runner.step([[0]] * 5 + [[9] * 9], slices, ids=ids)  # captures bucket 16
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.step([[0]] * 5 + [[9] * 9], slices, ids=ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.path is StepPath.PIECEWISE and out.greedy is not None and out.greedy.shape == (6,)


@gpu
@needs_cuda
def test_cuda_prefill_graph_layer_events_order_another_stream() -> None:
    """A side stream that waits on a layer's event after the replay is launched reads that layer's
    K/V as written, though the replay itself waits behind a long sleep on its stream: the events are
    recorded inside the graph, not at launch."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, device="cuda")
    runner = ModelRunner(model, _paged(model, "cuda"), graphs=False, prefill_graph_tokens=64)
    slices = [SeqSlice([0, 1, 2, 3], 0, 60)]
    runner.step([[7] * 60], slices)  # captures the bucket's graph
    for c in runner.attn.caches:
        c.zero_()
    side = torch.cuda.Stream()
    seen: list[torch.Tensor] = []

    def copy_after(layer: int, event: torch.cuda.Event) -> None:
        side.wait_event(event)
        with torch.cuda.stream(side):
            seen.append(runner.attn.caches[layer].clone())

    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the replay on this stream
    runner.attn.after_layer = copy_after
    try:
        runner.step([[9] * 60], slices)
    finally:
        runner.attn.after_layer = None
    torch.cuda.synchronize()
    assert len(seen) == model.config.num_layers
    for layer, copy in enumerate(seen):
        assert copy.any() and torch.equal(copy, runner.attn.caches[layer]), layer


@gpu
@needs_cuda
def test_cuda_graph_step_and_sampling_do_not_sync() -> None:
    """After capture, a decode step plus device sampling run with sync debugging set to error."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, device="cuda")
    _, runner = _pair(model, "cuda", ModelRunner)
    runner.warmup()
    blocks = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    runner.forward([[1, 2, 3]] * 3, [SeqSlice(b, 0, 3) for b in blocks])
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2)]
    gens = [make_generator(p) for p in params]
    for g in gens:  # per-device generators are made (and seeded) on first use, outside the check
        if g is not None:
            g.generator(torch.device("cuda", torch.cuda.current_device()))
    fetcher = TokenFetcher(torch.device("cuda", torch.cuda.current_device()), 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.step([[4], [5], [6]], [SeqSlice(b, 3, 1) for b in blocks])
        toks = sample_tokens(out.logits, params, gens, out.greedy)
        first = fetcher.start(toks)  # the overlapped loop: the next step launches on these tokens
        nxt = runner.step(None, [SeqSlice(b, 4, 1) for b in blocks], ids=first.device)
        second = fetcher.start(sample_tokens(nxt.logits, params, gens, nxt.greedy))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.path is StepPath.GRAPH and nxt.path is StepPath.GRAPH
    assert first.result() == toks.tolist() and len(second.result()) == 3


@gpu
@needs_cuda
@pytest.mark.skipif(not _paged_supports_graphs(), reason="PagedAttention.begin takes no pad_to yet")
def test_cuda_graphs_over_the_real_paged_attention() -> None:
    model = LlamaModel.from_config(preset("tiny"), seed=0, device="cuda")
    cfg = model.config

    def paged() -> PagedAttention:
        lay = GpuKVLayout(cfg.num_layers, 24 * 4, BLOCK, cfg.num_kv_heads, cfg.head_dim, "fp32")
        return PagedAttention(lay, lay.allocate("cuda"))

    graphed = ModelRunner(model, paged(), max_batch=8)
    if not graphed.use_graphs:
        pytest.skip("PagedAttention is not graph-safe on this device")
    eager = ModelRunner(model, paged(), max_batch=8, graphs=False)
    assert graphed.warmup() == [8, 4, 2, 1]
    toks_e, logits_e = _run_script(eager, PROMPTS, _decode_script())
    toks_g, logits_g = _run_script(graphed, PROMPTS, _decode_script())
    assert toks_g == toks_e
    for le, lg in zip(logits_e, logits_g):
        assert torch.allclose(le, lg, atol=1e-4)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_the_second_gpu_runs_from_a_thread_whose_device_is_the_first() -> None:
    """An engine thread's current device is GPU 0; a decode model on GPU 1 must still capture its
    graphs and launch its Triton kernels there (the 8B run across two H200s failed without it)."""
    model = LlamaModel.from_config(preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda:1")
    cfg = model.config

    def paged() -> PagedAttention:
        lay = GpuKVLayout(cfg.num_layers, 24 * 4, BLOCK, cfg.num_kv_heads, cfg.head_dim, "bf16")
        return PagedAttention(lay, lay.allocate("cuda:1"))

    torch.cuda.set_device(0)
    first = LlamaModel.from_config(preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda:0")
    lay0 = GpuKVLayout(cfg.num_layers, 24 * 4, BLOCK, cfg.num_kv_heads, cfg.head_dim, "bf16")
    assert ModelRunner(first, PagedAttention(lay0, lay0.allocate("cuda:0")), max_batch=2).warmup() == [2, 1]  # GPU 0 captures first
    graphed, eager = ModelRunner(model, paged(), max_batch=8), ModelRunner(model, paged(), max_batch=8, graphs=False)
    assert graphed.use_graphs and graphed.warmup() == [8, 4, 2, 1]
    toks_e, _ = _run_script(eager, PROMPTS, _decode_script())
    toks_g, _ = _run_script(graphed, PROMPTS, _decode_script())
    assert toks_g == toks_e and torch.cuda.current_device() == 0


@gpu
@needs_cuda
def test_a_backend_without_pad_to_runs_eagerly_on_cuda() -> None:
    model = LlamaModel.from_config(preset("tiny"), seed=0, device="cuda")

    class NoPad(SlotCacheAttention):
        def begin(self, batch: Sequence[SeqSlice]) -> None:  # type: ignore[override]
            super().begin(batch)

    attn = NoPad(model.config, num_blocks=4, max_batch=4, max_ctx=16, device="cuda")
    runner = ModelRunner(model, attn, max_batch=4)
    assert not runner.use_graphs
    runner.forward([[1, 2]], [SeqSlice([0], 0, 2)])
    assert runner.step([[3]], [SeqSlice([0], 2, 1)]).path is StepPath.EAGER


# ---- host time per step ------------------------------------------------------------------------


def test_finite_argmax_is_greedy_tokens() -> None:
    from hawk.engine.runner import finite_argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4] = float("nan")
    logits[5, :] = 1.0  # ties: the first index
    logits[0, 10] = logits[0, 20] = 9.0
    assert torch.equal(finite_argmax(logits), greedy_tokens(logits))


def _paged_triton_on_cpu(fast: bool) -> PagedAttention:
    pytest.importorskip("triton")
    lay = GpuKVLayout(1, 64, 4, 2, 32, "fp32")
    attn = PagedAttention(lay, lay.allocate("cpu"), max_batch=4, max_model_len=64, use_triton=True)
    attn.fast_decode = fast
    return attn


def test_paged_decode_shortcut_writes_what_the_general_begin_does() -> None:
    """Rows cached per staging slot stay right when sequences grow, leave, join, get a new block
    list, or a prefill rewrites the table in between (begin on CPU with the Triton path's buffers)."""
    fast, slow = _paged_triton_on_cpu(True), _paged_triton_on_cpu(False)
    a, b, c = list(range(0, 8)), list(range(8, 16)), list(range(16, 24))
    refill = list(range(24, 32))
    steps: list[tuple[list[SeqSlice], int | None]] = [
        ([SeqSlice(a, 5, 1), SeqSlice(b, 3, 1)], 4),
        ([SeqSlice(a, 6, 1), SeqSlice(b, 4, 1)], 4),  # b crosses into its second block
        ([SeqSlice(a, 7, 1), SeqSlice(b, 5, 1)], 2),
        ([SeqSlice(b, 6, 1)], 1),  # a leaves: b moves to row 0
        ([SeqSlice(c, 0, 1), SeqSlice(b, 7, 1), SeqSlice(a, 8, 1)], 4),  # joins, other order
        ([SeqSlice(c, 1, 3), SeqSlice(b, 8, 1)], None),  # a prefill chunk: the general path
        ([SeqSlice(c, 4, 1), SeqSlice(b, 9, 1)], None),
        ([SeqSlice(c, 5, 1), SeqSlice(b, 10, 1)], 2),
        ([SeqSlice(refill, 9, 1), SeqSlice(b, 11, 1)], 2),  # a new list in row 0
        ([SeqSlice(refill, 13, 1), SeqSlice(b, 12, 1)], 2),
        ([], 4),  # padding only (capture)
        ([SeqSlice(b, 13, 1)], 2),
    ]
    for i, (batch, pad) in enumerate(steps):
        for attn in (fast, slow):
            attn.begin(batch, pad_to=pad)
        fv, sv = fast._views, slow._views
        for key in ("seq_lens", "q_start", "slots", "prog_seq", "prog_blk"):
            assert torch.equal(fv[key], sv[key]), (i, key)
        for row, s in enumerate(batch):
            need = (s.start + s.q_len + 3) // 4
            assert torch.equal(fv["block_tables"][row, :need], sv["block_tables"][row, :need]), (i, row)
        assert (fast._n, fast._n_real, fast._tokens, fast._decode) == (slow._n, slow._n_real, slow._tokens, slow._decode)
    with pytest.raises(ValueError, match="blocks"):
        fast.begin([SeqSlice([0], 4, 1)], pad_to=1)
    with pytest.raises(ValueError, match="pad_to"):
        fast.begin([SeqSlice(a, 1, 1), SeqSlice(b, 1, 1)], pad_to=1)
