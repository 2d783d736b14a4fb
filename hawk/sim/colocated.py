"""A colocated engine's mixed steps, simulated: decode rows and prompt chunks share each forward.

Mirrors ``DecodeEngine`` stepping a ``PrefillEngine`` (``hawk serve --transfer colocated``, with the
async scheduling it runs on a GPU). One step:

1. **rows**: every decoding sequence, one token each, plus those that got their last token in the
   step before (that step was read after this one was launched, so they ride along once);
2. **budget** (``DecodeEngine._prefill_budget``): ``max_num_batched_tokens - rows``; with a
   ``step_token_target``, what the target leaves beside the rows, while the prompt tokens not yet
   planned fit in ``step_target_backlog`` such steps;
3. **chunks** (``PrefillEngine._take_batch``): part-prefilled prompts first, oldest first, then
   queued prompts while the budget lasts, the engine holds fewer than ``max_batch`` sequences and at
   most ``max_pieces`` prompts ride;
4. the step takes ``cost.step_s(rows, prompt tokens, pairs)``, ``pairs`` being its chunks' query-key
   pairs against their prompts' earlier tokens. At its end every row has a token, and a prompt
   whose last chunk ran has its first token (its TTFT); it decodes from the step after the next one
   (``join_lag_steps``: the next step was launched before this one was read).

The cost is a table measured on the device (:meth:`MixedStepCost.from_probe`:
``benchmarks/mixed_step_probe.py``, one chunk beside decode rows at one context), interpolated, plus
a cost per pair where the probe measured later chunks (``--chunk-offsets``). What a served step
costs beyond that (several prompts in a step, contexts other than the probe's) is not in it:
setting this model beside a measured run at the same rate and policy measures that
(``benchmarks/colocated_sim_check.py``). Not modelled: KV memory (no request waits for blocks or is
swapped out: the GPU runs it models hold hundreds of thousands of tokens) and failures.
"""

from __future__ import annotations

import bisect
import json
import shlex
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hawk.config import ServeConfig
from hawk.config_cli import parse_config
from hawk.sim.metrics import RequestResult, summarize
from hawk.sim.workload import RequestSource, RequestSpec, Workload, generate_requests, get_workload

#: ``DecodeEngine``'s ``MIXED_PREFILL_SEQS`` (prompts one step carries at most; a test keeps them equal)
MAX_PIECES = 16
#: the decode's ``--max-num-seqs`` where it computes on a GPU (``capacity.GPU_MAX_NUM_SEQS``, restated: the simulator imports no torch)
GPU_MAX_BATCH = 256


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through ``(xs, ys)`` (``xs`` ascending), extended along the end segments."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class MixedStepCost:
    """Step times measured on a device, by decode rows and prompt tokens.

    ``decode_ms[i]``: a decode-only step of ``batches[i]`` rows; ``extra_ms[i][j]``: what ``chunks[j]``
    prompt tokens add to it; ``prefill_ms[j]``: those tokens alone; ``pair_ns``: what each query-key
    pair of a chunk against its prompt's earlier tokens adds (a later chunk's attention over the
    chunks before it; the table's chunks are fresh). Rows below the smallest batch cost what it costs
    (a decode step is flat there); outside the grids the end segments extend, floored at zero."""

    batches: tuple[int, ...]
    decode_ms: tuple[float, ...]
    chunks: tuple[int, ...]
    extra_ms: tuple[tuple[float, ...], ...]
    prefill_chunks: tuple[int, ...]
    prefill_ms: tuple[float, ...]
    source: str = ""
    pair_ns: float = 0.0

    def __post_init__(self) -> None:
        if not self.batches or len(self.decode_ms) != len(self.batches) or len(self.extra_ms) != len(self.batches):
            raise ValueError("a step cost needs a decode time and a row of chunk costs for every batch")
        if any(len(row) != len(self.chunks) for row in self.extra_ms) or len(self.prefill_ms) != len(self.prefill_chunks):
            raise ValueError("every row of chunk costs needs one value per chunk size")
        if list(self.batches) != sorted(self.batches) or list(self.chunks) != sorted(self.chunks):
            raise ValueError("batches and chunks must ascend")

    def decode_s(self, rows: int) -> float:
        return interp(max(rows, self.batches[0]), self.batches, self.decode_ms) / 1e3

    def step_s(self, rows: int, tokens: int, pairs: int = 0) -> float:
        """One forward of ``rows`` decode rows and ``tokens`` prompt tokens whose chunks hold ``pairs``
        query-key pairs against their prompts' earlier tokens."""
        if tokens <= 0:
            return self.decode_s(rows) if rows else 0.0
        later = self.pair_ns * pairs / 1e9
        if not rows:
            return max(interp(tokens, self.prefill_chunks, self.prefill_ms), 0.0) / 1e3 + later
        r = min(max(rows, self.batches[0]), self.batches[-1])
        per_batch = [max(interp(tokens, self.chunks, row), 0.0) for row in self.extra_ms]
        return self.decode_s(rows) + interp(r, self.batches, per_batch) / 1e3 + later

    @classmethod
    def from_probe(cls, path: str | Path, section: str) -> MixedStepCost:
        """The table of one section of a ``mixed_step_probe.py`` file (records of kind ``decode``,
        ``mixed`` and ``prefill`` with ``batch``, ``chunk`` and ``gpu_ms``); the prompt-alone times
        come from whichever section has them (a prefill step runs the same graph either way). Mixed
        records of a later chunk (``offset`` > 0, ``--chunk-offsets``) set ``pair_ns``: the median
        over them of the time past the same chunk at offset 0, per query-key pair. A ``.jsonl`` file is
        the probe's lines as it prints them, one section."""
        text = Path(path).read_text()
        data = {section: [json.loads(x) for x in text.splitlines() if x.strip()]} if Path(path).suffix == ".jsonl" else json.loads(text)
        recs = [r for r in data[section] if r.get("kind") in ("decode", "mixed")]
        decode: dict[int, list[float]] = {}
        mixed: dict[tuple[int, int], float] = {}
        later: list[tuple[int, int, int, float]] = []
        for r in recs:
            if r["kind"] == "decode":
                decode.setdefault(r["batch"], []).append(r["gpu_ms"])
            elif r.get("offset", 0):
                later.append((r["batch"], r["chunk"], r["offset"], r["gpu_ms"]))
            else:
                mixed[(r["batch"], r["chunk"])] = r["gpu_ms"]
        pair_ns = _median([(ms - mixed[(b, c)]) * 1e6 / (c * o) for b, c, o, ms in later]) if later else 0.0
        batches = tuple(sorted({b for b, _ in mixed}))
        chunks = tuple(sorted({c for _, c in mixed}))
        dec = {b: _median(v) for b, v in decode.items()}
        extra = tuple(tuple(mixed[(b, c)] - dec[b] for c in chunks) for b in batches)
        prompts: dict[int, list[float]] = {}
        for sec in data.values():
            for r in sec if isinstance(sec, list) else ():
                if isinstance(r, dict) and r.get("kind") == "prefill":
                    prompts.setdefault(r["chunk"], []).append(r["gpu_ms"])
        pre = {c: _median(v) for c, v in prompts.items()}
        if not pre:
            raise ValueError(f"{path}: no prefill records to cost a step of prompt tokens alone")
        context = next((r.get("context") for r in recs), None)
        return cls(batches, tuple(dec[b] for b in batches), chunks, extra, tuple(sorted(pre)), tuple(pre[c] for c in sorted(pre)),
                   f"measured: {Path(path).name}, its {section} table, context {context}", pair_ns)


def _median(xs: Sequence[float]) -> float:
    """The probe's repeated points (a decode batch beside each chunk, a chunk beside each batch): the middle one."""
    return sorted(xs)[len(xs) // 2]


@dataclass(frozen=True)
class MixedPolicy:
    """The engine's mixed-step settings (``ServeConfig``'s names; build one with :meth:`from_config`)."""

    max_num_batched_tokens: int = 640
    step_token_target: int = 0
    step_target_backlog: int = 16
    max_batch: int = GPU_MAX_BATCH
    max_pieces: int = MAX_PIECES
    join_lag_steps: int = 1  # async scheduling; 0: a synchronous loop (a CPU)

    @classmethod
    def from_config(cls, cfg: ServeConfig, **kw: Any) -> MixedPolicy:
        return cls(cfg.max_num_batched_tokens, cfg.step_token_target, cfg.step_target_backlog, cfg.max_batch or GPU_MAX_BATCH, **kw)

    @classmethod
    def from_serve_args(cls, serve_args: str) -> tuple[MixedPolicy, str]:
        """The engine ``hawk serve --transfer colocated SERVE_ARGS`` runs, read by the generated options
        (a bad flag raises ``ConfigError``), and the probe table its steps take: ``mixed_graphs`` with
        ``--mixed-graphs``, else ``pieces``."""
        cfg = parse_config("serve", ["--transfer", "colocated", *shlex.split(serve_args)])
        return cls.from_config(cfg), "mixed_graphs" if cfg.mixed_graphs else "pieces"

    def budget(self, rows: int, backlog: int) -> int:
        """Prompt tokens this step may carry (``DecodeEngine._prefill_budget``)."""
        whole = self.max_num_batched_tokens - rows
        small = self.step_token_target - rows
        if self.step_token_target and 0 < small < whole and backlog <= self.step_target_backlog * small:
            return small
        return whole


@dataclass
class _Seq:
    spec: RequestSpec
    planned: int = 0  # prompt tokens in steps launched
    tokens: int = 0
    first_s: float | None = None
    last_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    join_at: int = 0  # the first step it decodes in

    def result(self) -> RequestResult:
        done = self.tokens >= self.spec.output_len
        return RequestResult(self.spec.index, self.spec.input_len, self.spec.output_len, self.spec.arrival_s, self.first_s,
                             self.last_s, self.tokens, ok=done, itl_s=list(self.itl_s))


@dataclass
class StepLog:
    """What the simulated engine did, step by step (for the same summaries a step trace gets)."""

    rows: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, rows: int, tokens: int, chunks: int, pairs: int, seconds: float) -> None:
        self.rows.append(rows)
        self.prompt_tokens.append(tokens)
        self.chunks.append(chunks)
        self.pairs.append(pairs)
        self.seconds.append(seconds)


def simulate_colocated(requests: Sequence[RequestSpec], cost: MixedStepCost, policy: MixedPolicy = MixedPolicy(),
                       log: StepLog | None = None) -> list[RequestResult]:
    """Serve ``requests`` on one colocated engine; every request finishes (no failures are modelled)."""
    arrivals = deque(sorted((_Seq(s) for s in requests), key=lambda q: q.spec.arrival_s))
    queue: deque[_Seq] = deque()
    active: list[_Seq] = []  # part-prefilled: planned < input_len
    joining: list[_Seq] = []  # prompt done, first token out, not decoding yet
    running: list[_Seq] = []
    done: list[_Seq] = []
    riders, t, step = 0, 0.0, 0
    while arrivals or queue or active or joining or running:
        while arrivals and arrivals[0].spec.arrival_s <= t:
            queue.append(arrivals.popleft())
        nxt = step + 1
        running += [q for q in joining if q.join_at <= nxt]
        joining = [q for q in joining if q.join_at > nxt]
        rows = len(running) + riders
        backlog = sum(q.spec.input_len - q.planned for q in active) + sum(q.spec.input_len for q in queue)
        pieces = _take(policy, policy.budget(rows, backlog), active, queue, len(running) + len(joining))
        if not rows and not pieces:
            if joining:  # nothing in flight: they join the next launch
                for q in joining:
                    q.join_at = nxt
                continue
            t = max(t, arrivals[0].spec.arrival_s) if arrivals else t
            continue
        tokens = sum(n for _, n in pieces)
        pairs = sum(n * (q.planned - n) for q, n in pieces)  # each chunk's queries against its prompt's earlier tokens
        dt = cost.step_s(rows, tokens, pairs)
        t += dt
        step = nxt
        if log is not None:
            log.record(rows, tokens, len(pieces), pairs, dt)
        running, finished = _tokens(running, t, done)
        riders = finished if policy.join_lag_steps else 0
        for q, _ in pieces:
            if q.planned >= q.spec.input_len:
                active.remove(q)
                _first_token(q, t, step + 1 + policy.join_lag_steps, joining, done)
    return [q.result() for q in sorted(done, key=lambda q: q.spec.index)]


def _tokens(running: list[_Seq], t: float, done: list[_Seq]) -> tuple[list[_Seq], int]:
    """A step ended at ``t``: every row's token. Returns the rows still decoding and how many finished."""
    still = []
    for q in running:
        q.tokens += 1
        q.itl_s.append(t - q.last_s)
        q.last_s = t
        (done if q.tokens >= q.spec.output_len else still).append(q)
    return still, len(running) - len(still)


def _first_token(q: _Seq, t: float, join_at: int, joining: list[_Seq], done: list[_Seq]) -> None:
    """The step that ran ``q``'s last chunk ended at ``t`` with its first token; it decodes from step ``join_at``."""
    q.first_s = q.last_s = t
    q.tokens = 1
    if q.tokens >= q.spec.output_len:
        done.append(q)
    else:
        q.join_at = join_at
        joining.append(q)


def _take(policy: MixedPolicy, budget: int, active: list[_Seq], queue: deque[_Seq], in_flight: int) -> list[tuple[_Seq, int]]:
    """This step's chunks (``PrefillEngine._take_batch``); their prompts' cursors move past them."""
    pieces: list[tuple[_Seq, int]] = []
    for q in active:
        if budget <= 0 or len(pieces) >= policy.max_pieces:
            return pieces
        n = min(q.spec.input_len - q.planned, budget)
        if n > 0:
            pieces.append((q, n))
            q.planned += n
            budget -= n
    while queue and budget > 0 and len(pieces) < policy.max_pieces and in_flight + len(active) < policy.max_batch:
        q = queue.popleft()
        n = min(q.spec.input_len, budget)
        q.planned = n
        active.append(q)
        pieces.append((q, n))
        budget -= n
    return pieces


def sweep_colocated(cost: MixedStepCost, policy: MixedPolicy, rates: Sequence[float], workload: str | Workload | RequestSource,
                    num_requests: int, seed: int = 0, *, config: str = "colocated", slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> list[dict[str, Any]]:
    """One engine at each rate (the same seeded requests, compressed in time): the serving records
    ``hawk sim`` and ``hawk bench serving`` share, marked simulated, with the step costs' source."""
    wl = get_workload(workload)
    ttft, tpot = slo_ttft_ms or wl.slo_ttft_ms, slo_tpot_ms or wl.slo_tpot_ms
    records = []
    for rate in rates:
        results = simulate_colocated(generate_requests(wl, num_requests, rate, seed), cost, policy)
        records.append({"config": config, "workload": wl.name, "rate": rate, "seed": seed, "simulated": True,
                        "step_costs": cost.source, "policy": asdict(policy), **summarize(results, ttft, tpot)})
    return records
