"""Which cores a CPU engine computes on, and which the serving threads (router, HTTP) get.

Why: on a CPU host the engine's OpenMP region waits for its slowest thread, and a thread that shares
its core with the router, the instance's HTTP server or the client is descheduled mid-step. Measured
on the 2-core box (SmolLM2-135M bf16, docs/throughput.md): two unbound OpenMP threads served a
decode step at 2-4x their speed alone, worse than one thread alone. vLLM's CPU build binds its
engine's OpenMP threads to cores of their own (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``) and
leaves a core to its API server; ``--cpu-bind`` does the same here:

* ``auto`` (the default): where every engine computes on the CPU and the host has a core to spare
  for each engine plus one, the highest allowed core serves (the launcher, the router and each
  engine process's HTTP threads; vLLM's CPU build reserves its last core the same way) and the
  rest are split evenly, one contiguous run per engine;
  the default ``--threads`` is then the engine's cores. Elsewhere (a GPU engine, a tensor-parallel
  instance, too few cores) nothing is bound and nothing changes.
* ``nobind``: nothing is bound (vLLM's word).
* a core list, ``1-3`` or ``2,3`` (and ``1|2`` for two engines, in launch order, as vLLM writes its
  ranks): those cores compute, the other allowed cores serve.

Binding an engine process (:func:`bind_engine_process`): before the model loads, every thread of the
process goes on the compute cores, so the threads the build makes (the engine loop, its OpenMP
workers) inherit them; once built, the process's Python threads other than the engine loops move to
the serving cores, and every thread made afterwards by them (uvicorn's) inherits those.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hawk.config import ConfigError


class BindMode(enum.Enum):
    """What ``--cpu-bind`` asked for."""

    AUTO = "auto"
    NOBIND = "nobind"
    LIST = "list"


class CpuBindError(ConfigError):
    """A ``--cpu-bind`` value that names no usable cores; refused before anything starts."""


@dataclass(frozen=True)
class CorePlan:
    """Cores per engine process (launch order) and the cores left to serving; ``why`` is printed."""

    engines: tuple[tuple[int, ...], ...]
    serving: tuple[int, ...]
    why: str

    def describe(self) -> str:
        """The start-up line: who computes where."""
        eng = " | ".join(_ranges(c) for c in self.engines)
        serve = _ranges(self.serving) if self.serving else "unbound"
        return f"engine compute on cores {eng}, serving threads on {serve} ({self.why})"


def mode_of(text: str) -> BindMode:
    """``auto`` / ``nobind`` by name, anything else a core list."""
    for m in (BindMode.AUTO, BindMode.NOBIND):
        if text == m.value:
            return m
    return BindMode.LIST


def parse_cores(text: str) -> tuple[int, ...]:
    """``"1-3,5"`` -> (1, 2, 3, 5): sorted, no duplicates; raises CpuBindError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise CpuBindError(f"--cpu-bind: {text!r} is not auto, nobind or a core list such as 1-3 or 2,3") from None
        if a < 0 or b < a:
            raise CpuBindError(f"--cpu-bind: bad core range {part.strip()!r} in {text!r}")
        cores.update(range(a, b + 1))
    return tuple(sorted(cores))


def plan_cores(text: str, engines: int, available: Sequence[int], on_cpu: bool, tensor_parallel: bool = False) -> CorePlan | None:
    """The binding for ``engines`` engine processes on the ``available`` cores, or None (nothing is
    bound). A core list may name only available cores, one group per engine (or one group shared)."""
    avail = tuple(sorted(available))
    mode = mode_of(text)
    if mode is BindMode.NOBIND:
        return None
    if mode is BindMode.LIST:
        groups = [parse_cores(g) for g in text.split("|")]
        if len(groups) == 1 and engines > 1:
            groups = groups * engines
        if len(groups) != engines:
            raise CpuBindError(f"--cpu-bind {text!r} names {len(groups)} core groups for {engines} engine processes")
        missing = sorted({c for g in groups for c in g} - set(avail))
        if missing:
            raise CpuBindError(f"--cpu-bind {text!r}: cores {missing} are not among this process's cores {_ranges(avail)}")
        used = {c for g in groups for c in g}
        return CorePlan(tuple(groups), tuple(c for c in avail if c not in used), "--cpu-bind")
    if not on_cpu or tensor_parallel:
        return None  # a GPU engine's host threads, or TP ranks (processes of their own): unchanged
    if len(avail) < engines + 1:
        return None  # no core to spare for serving: sharing every core is all there is
    rest, serving = avail[:-1], avail[-1:]
    share = len(rest) // engines
    groups = tuple(rest[i * share:(i + 1) * share] for i in range(engines))
    return CorePlan(groups, serving, f"auto: {len(avail)} cores, one left to serving as vLLM's CPU build does")


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on (a container's or taskset's limit, not the host's count)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def engines_on_cpu(devices: Iterable[str]) -> bool:
    """Whether every engine's math runs on the host CPU (the emulated NPU on cpu counts)."""
    return all(str(d) == "cpu" for d in devices)


def set_thread_cores(native_ids: Iterable[int], cores: Sequence[int]) -> None:
    """Move the given threads (Linux thread ids) onto ``cores``; a thread gone meanwhile is skipped."""
    for tid in native_ids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            pass


def process_threads() -> list[int]:
    """Every thread of this process, Python's and native (OpenMP's, libraries')."""
    return [int(t) for t in os.listdir("/proc/self/task")]


def bind_before_build(compute: Sequence[int]) -> None:
    """Every thread of this process onto the compute cores, so the engine's threads made while it
    builds (its loop, the OpenMP workers that loop's first parallel region starts) inherit them."""
    set_thread_cores(process_threads(), compute)


def bind_after_build(engine_threads: Sequence[threading.Thread], serving: Sequence[int], compute: Sequence[int] = ()) -> None:
    """The process's Python threads other than the engine loops (the main thread, which serves
    HTTP, and the helpers) onto the serving cores; threads they start later inherit them. The engine
    loops onto ``compute`` where given (they were built on more cores, to borrow them). Native
    threads stay: the OpenMP workers compute, each where OpenMP put it."""
    keep = {t.native_id for t in engine_threads if t.native_id is not None}
    others = [t.native_id for t in threading.enumerate() if t.native_id is not None and t.native_id not in keep]
    if serving:
        set_thread_cores(others, serving)
    if compute:
        set_thread_cores(keep, compute)


def _ranges(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
