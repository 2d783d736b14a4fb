"""Issue 10: the ~1 s first token of the paced H200 cross-validation (gn-hawk, summarization, 1 req/s).

Triton compiles one kernel per *specialization*: besides constexprs, every pointer argument is keyed
on whether its address is a multiple of 16 bytes and every int on whether it is 1 or a multiple of
16 (Triton 3.6, ``native_specialize_impl``). A launch whose key is new compiles on the serving path.
The prefill's paged attention passes int32 *views* of one metadata buffer
(``PagedAttention._set_views``: ``q_start`` at element n, ``prog_seq`` at 2n+1+t, ``prog_blk`` at
2n+1+t+p, for n sequences, t tokens, p programs), so their alignment, hence the kernel's key,
changes with the batch's shape. In the committed run the probes and the warm-up never produced the
key of the forward that batched requests 2 and 3 (1064 + 963 tokens: ``prog_seq`` aligned,
``prog_blk`` not), so that forward compiled ``_prefill_kernel`` (~1 s cold: gn-hawk ran first on
the machine; gg-direct and gn-host later found it in Triton's disk cache), and both requests' first
tokens left together about 1 s late: the P90 of 10 requests.

These tests compute the keys the launchers would hand Triton, on the CPU (the launches are
recorded, not run), and hold the fix: ``do_not_specialize_on_alignment`` for the metadata pointers
that are only read as scalars, and ``do_not_specialize`` for the rope kernel's token count.
"""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from hawk.engine import triton_attention as ta  # noqa: E402
from hawk.engine import triton_ops  # noqa: E402
from hawk.engine.attention import SeqSlice  # noqa: E402
from hawk.engine.paged_attention import PagedAttention  # noqa: E402
from hawk.layouts.gpu import GpuKVLayout  # noqa: E402

CHUNK = 2048  # PrefillEngine's default max_prefill_chunk

def spec_key(kernel, args, kwargs) -> tuple:
    """What Triton's dispatcher keys a launch of ``kernel`` on: constexpr values and, for the other
    parameters, type and specialization (honouring the kernel's do_not_specialize flags)."""
    bound = dict(zip([p.name for p in kernel.params], args))
    bound.update(kwargs)
    key = []
    for p in kernel.params:
        if p.is_constexpr:
            key.append((p.name, bound[p.name]))
        else:
            t, spec = native_specialize_impl(BaseBackend, bound[p.name], p.is_const, not p.do_not_specialize,
                                             not p.do_not_specialize_on_alignment)
            key.append((p.name, t, spec))
    return tuple(key)


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](...)`` records the launch's key instead of running."""

    def __init__(self, kernel):
        self.kernel, self.keys = kernel, []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.keys.append(spec_key(self.kernel, a, kw))


@pytest.fixture
def prefill(monkeypatch):
    """``forward(pieces)``: the keys of ``_prefill_kernel`` and ``_qkv_rope_kernel`` for one prefill
    forward of ``pieces`` = [(start, q_len), ...], built by the engine's own code (PagedAttention.begin
    and its launcher; positions as ModelRunner._eager uploads them), with the CUDA program size."""
    monkeypatch.setattr(ta, "prefill_block_m", lambda device, head_dim: 128)  # CUDA, head_dim <= 128
    rec = {"prefill": _Recorder(ta._prefill_kernel), "write": _Recorder(ta._write_kv_kernel), "rope": _Recorder(triton_ops._qkv_rope_kernel)}
    monkeypatch.setattr(ta, "_prefill_kernel", rec["prefill"])
    monkeypatch.setattr(ta, "_write_kv_kernel", rec["write"])
    monkeypatch.setattr(triton_ops, "_qkv_rope_kernel", rec["rope"])
    lay = GpuKVLayout(1, 1024, 16, 2, 16, "fp32")
    caches = lay.allocate("cpu")
    attn = PagedAttention(lay, caches, use_triton=True)
    hq, hkv, d = 4, 2, 16
    table = torch.zeros(8192, d)

    def forward(pieces):
        slices, nb = [], 0
        for start, q_len in pieces:
            need = -(-(start + q_len) // lay.block_size)
            slices.append(SeqSlice(list(range(nb, nb + need)), start, q_len))
            nb += need
        t = sum(q for _, q in pieces)
        if t == len(pieces):
            raise ValueError("one token per sequence is a decode batch (other kernels)")
        attn.begin(slices)
        io = torch.tensor([[1] * t, [p for s, q in pieces for p in range(s, s + q)]], dtype=torch.int64)
        q, k, v = triton_ops.qkv_rope(torch.zeros(t, (hq + 2 * hkv) * d), io[1].contiguous(), table, table, hq, hkv)
        attn._forward_triton(caches[0], q, k, v)
        return rec["prefill"].keys[-1], rec["rope"].keys[-1]

    def rope(t):
        io = torch.tensor([[1] * t, list(range(t))], dtype=torch.int64)
        triton_ops.qkv_rope(torch.zeros(t, (hq + 2 * hkv) * d), io[1].contiguous(), table, table, hq, hkv)
        return rec["rope"].keys[-1]

    forward.rope = rope
    return forward


def chunks(n: int) -> list[list[tuple[int, int]]]:
    """The forwards of one prompt alone: chunks of at most CHUNK tokens."""
    return [[(s, min(CHUNK, n - s))] for s in range(0, n, CHUNK)]


def _aligned(key, name) -> bool:
    return dict((k[0], k[2]) for k in key if len(k) == 3)[name] == "D"


def test_the_key_follows_the_metadata_views_alignment(prefill):
    """The audit sees what Triton sees (while the pointers are specialized on alignment)."""
    key, _ = prefill([(0, 1064), (0, 963)])  # prog_seq at 2*2+1+2027 = 2032 int32: 16-byte aligned
    if ta._prefill_kernel.kernel.params[5].do_not_specialize_on_alignment:
        pytest.skip("prog_seq_ptr is no longer specialized on alignment")
    assert _aligned(key, "prog_seq_ptr") and not _aligned(key, "prog_blk_ptr")  # prog_blk at 2049
    key, _ = prefill([(0, 256)])  # 3 + 256 = 259: not aligned
    assert not _aligned(key, "prog_seq_ptr")


def test_the_committed_runs_sweep_compiles_nothing_its_probes_did_not(prefill):
    """The prefill forwards of the committed run (benchmarks/results/crossval_h200/paced_summarization_gn-hawk.json):
    probes (256, 437, 1750, 3500 tokens, 3 each, then 48-token prompts 1..8 at a time), the sweep's
    warm-up (1046) and the 1 req/s sweep, where requests 2 and 3 (1064 and 963 tokens, sent 2.3 ms apart
    while request 1 prefilled) share one forward."""
    probes = [f for n in (256, 437, 1750, 3500) for _ in range(3) for f in chunks(n)]
    probes += [[(0, 48)] * b for b in range(1, 9)] + chunks(1046)
    sweep = chunks(1643) + chunks(985) + [[(0, 1064), (0, 963)]]
    for n in (1193, 3972, 1885, 1564, 442, 3918):
        sweep += chunks(n)
    seen = {prefill(f) for f in probes}
    new = [f for f in sweep if prefill(f) not in seen]
    assert not new, f"forwards that compile a kernel variant during the sweep: {new}"


def test_prefill_kernel_keys_do_not_depend_on_the_batch_shape(prefill):
    rng = np.random.default_rng(0)
    batches = [chunks(int(n))[0] for n in rng.integers(1, 4096, 40)]
    batches += [[(0, int(a)), (0, int(b))] for a, b in rng.integers(1, 1024, (20, 2))]
    batches += [[(2048, int(n))] for n in rng.integers(1, 2048, 10)]  # a prompt's later chunk
    keys = {prefill(b)[0] for b in batches}
    assert len(keys) == 1, f"{len(keys)} _prefill_kernel variants for {len(batches)} prefill forwards"


def test_qkv_rope_keys_do_not_depend_on_the_prompt_length(prefill):
    # T == 1 is a constexpr, T % 16 == 0 a divisibility; positions are row 1 of the [2, T] upload (8T bytes in)
    keys = {prefill.rope(n) for n in (1, 2, 3, 16, 437, 1750, 2048)}
    assert len(keys) == 1, f"{len(keys)} _qkv_rope_kernel variants for 7 prompt lengths"
