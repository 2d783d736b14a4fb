"""Which prefill forwards replay a CUDA graph, and what a first use costs: the runner's rules as data.

Torch-free on purpose: the runner captures and replays by these rules (``hawk/engine/runner.py``),
and the simulator charges a bucket's first use by the same ones (``hawk/sim/prefill.py``) without
loading torch.
"""

from __future__ import annotations

#: Eager warm-up runs before a capture (cuBLAS workspaces, lazy inits), per torch's advice.
WARMUP_RUNS = 2
#: Sequences a prefill graph holds at most, by default (``ModelRunner``'s ``prefill_graph_seqs``).
PREFILL_GRAPH_SEQS = 16


def prefill_token_buckets(max_tokens: int, step: int = 128, extra: tuple[int, ...] = ()) -> list[int]:
    """Token counts a prefill graph is captured for: 16, 32, 64, then multiples of ``step`` (the
    prefill attention's query block) up to ``max_tokens`` rounded up. Padding costs under ``step``
    tokens, a few percent of a compute-bound forward that long. ``extra``: more sizes below the
    largest (a mixed step's token target: a step that fills it pads nothing, and padding a
    memory-bound step past the GEMMs' knee is what makes a small chunk expensive)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    top = -(-max_tokens // step) * step
    sizes = [b for b in (16, 32, 64) if b < step] + list(range(step, top + 1, step))
    sizes = sizes[: next(i for i, b in enumerate(sizes) if b >= max_tokens) + 1]
    return sorted(set(sizes) | {b for b in extra if 0 < b < sizes[-1]})


def prefill_seq_buckets(max_seqs: int) -> list[int]:
    """Sequences per prefill graph: 1, 2, 4, ... up to ``max_seqs`` (the metadata holds one more
    row, for the pad tokens)."""
    out, b = [], 1
    while b < max_seqs:
        out.append(b)
        b *= 2
    return [*out, max_seqs]
