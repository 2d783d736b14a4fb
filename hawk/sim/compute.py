"""Compute-time models of prefill and decode instances, and their memory limits.

Prefill of a batch is compute-bound: a fixed launch cost, a cost per prompt token (the GEMMs),
and a cost per token pair (causal attention, ∝ Σ L²). A decode step is memory-bound: a fixed cost
(reading the weights once per step), a small cost per sequence, and a cost per context token
(reading its KV). These are the standard first-order shapes; the coefficients are inputs (see
``defaults.py`` for where each default comes from — they are assumptions unless calibrated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class PrefillModel:
    """Batch prefill time and the instance's limits."""

    base_s: float
    per_token_s: float
    per_token_sq_s: float = 0.0
    max_batch_tokens: int = 8192  # token budget of one prefill batch
    kv_capacity_tokens: int = 1 << 30  # KV the instance can hold until transfers drain it
    source: str = "assumption"
    #: chunked prefill (``PrefillEngine``'s ``max_prefill_chunk``): no iteration carries more than this
    #: many prompt tokens, a longer prompt runs over several; 0 = whole prompts (see ``prefill.py``)
    chunk_tokens: int = 0

    @property
    def budget(self) -> int:
        """Prompt tokens one iteration may carry."""
        return min(self.max_batch_tokens, self.chunk_tokens) if self.chunk_tokens > 0 else self.max_batch_tokens

    def batch_time(self, prompt_lens: Sequence[int]) -> float:
        """One iteration over these prompt tokens (with chunking: the pieces' lengths; a continuing
        piece's attention over its earlier chunks is not in the model, which is linear here)."""
        return self.base_s + self.per_token_s * sum(prompt_lens) + self.per_token_sq_s * sum(n * n for n in prompt_lens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DecodeModel:
    """Per-step decode time (continuous batching) and the instance's limits."""

    base_s: float
    per_seq_s: float
    per_ctx_token_s: float
    max_batch: int = 256
    kv_capacity_tokens: int = 1 << 30
    source: str = "assumption"
    #: timing emulation (``--npu-timing``): a real run's step never finishes before this model's
    #: time, so the simulated step is the larger of the two (hawk.devices.timing.StepModel)
    floor: Any = None

    def step_time(self, batch: int, context_tokens: int) -> float:
        t = self.base_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens
        return t if self.floor is None else max(t, self.floor.step_time(batch, context_tokens))

    def slowed(self, factor: float) -> DecodeModel:
        """Every step ``factor`` times longer (e.g. host intervention during staged transfers)."""
        return replace(self, base_s=self.base_s * factor, per_seq_s=self.per_seq_s * factor, per_ctx_token_s=self.per_ctx_token_s * factor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
