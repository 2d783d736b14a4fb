"""A request as the engines see it: token ids, sampling parameters, where its KV lives, its timeline."""

from __future__ import annotations

import enum
import math
import numbers
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. Greedy when ``temperature == 0`` (the default, and what equality tests use).

    ``seed`` is any integer (the sampler takes it modulo 2**64); temperatures below the
    sampler's ``GREEDY_BELOW`` (1e-5) are greedy. Invalid values raise ValueError (HTTP 400).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, numbers.Real) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, numbers.Real) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(
            max_tokens=int(d.get("max_tokens", 16)),
            temperature=float(d.get("temperature", 0.0)),
            top_p=float(d.get("top_p", 1.0)),
            seed=d.get("seed"),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
            ignore_eos=bool(d.get("ignore_eos", False)),
        )


class Status(enum.Enum):
    WAITING = "waiting"  # queued: for prefill, or for decode memory
    TRANSFERRING = "transferring"  # decode side: KV on its way
    RUNNING = "running"
    SWAPPED = "swapped"  # decode side: preempted, its KV on the host, queued to resume
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside an engine. ``num_tokens`` counts prompt + generated tokens with KV in the cache."""

    request_id: str
    prompt_len: int
    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    num_cached: int = 0  # tokens whose K/V are in the cache

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)
