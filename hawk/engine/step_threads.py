"""How many OpenMP threads a CPU engine's step computes on, chosen step by step.

Why: on a CPU host the engine computes on cores of its own and leaves one to serving (the router,
HTTP threads: ``--cpu-bind auto``, as vLLM's CPU build reserves one). That core is mostly idle between
the tokens it relays, and a step that carries prompt tokens is GEMM-bound and long: on the 2-core
box, SmolLM2-135M, a mixed step of one decode row and a 256-token chunk took 399 ms on one thread and
234 ms on two, one per core (``benchmarks/cpu_step_probe.py``, docs/throughput.md). So such a step
borrows the serving core; a decode-only step, short and latency-bound, does not, because a parallel
region waits for its slowest thread and the serving threads preempt the borrowed one.

Bits: vLLM's CPU attention kernel splits a long context's keys by thread, so the attention kernel
always runs with the engine's own count (:func:`attention_threads`). A norm's and an elementwise op's
results do not depend on the thread count, nor do the GEMMs of the small shapes the tests compare
(whole forwards at one and two threads, ``tests/test_step_threads.py``), nor SmolLM2's on an AVX-512
CPU; but on a CPU with AMX tiles oneDNN's bf16 GEMMs of a long prompt round otherwise in a process
whose OpenMP pool is two threads (a 256-token SmolLM2 prompt's first token, a near-tie, flipped). So
a prompt step's tokens are a vLLM instance's with ``--threads`` threads only where borrowing is off
(``--prompt-threads`` equal to ``--threads``), which the vLLM identity tests and benchmark set.

Who sets what: the engine's step loop calls :meth:`StepThreads.enter` before each forward on its
own thread; the count is that thread's OpenMP setting and nothing else changes. The process must
have been started with enough OpenMP places for the larger count (``OMP_PLACES``, one core each),
and its GEMM primitives made with it (oneDNN fixes a primitive's threads when it is created), which
the launcher does (``hawk/serve/launcher.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_local = threading.local()


@dataclass(frozen=True)
class StepThreads:
    """``base`` threads for a decode-only step and for the attention kernel; ``prompt`` for a step
    that carries prompt tokens (``prompt >= base``)."""

    base: int
    prompt: int

    def __post_init__(self) -> None:
        if not 1 <= self.base <= self.prompt:
            raise ValueError(f"step threads need 1 <= base ({self.base}) <= prompt ({self.prompt})")

    @property
    def borrows(self) -> bool:
        """Whether a prompt step runs on more threads than the engine's own."""
        return self.prompt > self.base

    def count(self, prompt_tokens: int) -> int:
        """Threads for a step carrying ``prompt_tokens`` prompt tokens."""
        return self.prompt if prompt_tokens > 0 else self.base

    def enter(self, prompt_tokens: int) -> int:
        """Set this thread's count for the next step (and the attention kernel's); returns it."""
        n = self.count(prompt_tokens)
        _local.attention = self.base
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


def attention_threads() -> int | None:
    """The attention kernel's thread count on this thread, where an engine's step set one."""
    return getattr(_local, "attention", None)


class KernelThreads:
    """``with KernelThreads():`` runs a kernel at :func:`attention_threads` and restores the step's
    count after (a no-op on a thread no engine step set)."""

    def __enter__(self) -> None:
        want = attention_threads()
        self._restore = None
        if want is not None:
            have = torch.get_num_threads()
            if have != want:
                torch.set_num_threads(want)
                self._restore = have

    def __exit__(self, *exc: object) -> None:
        if self._restore is not None:
            torch.set_num_threads(self._restore)
