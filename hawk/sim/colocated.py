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
a cost per pair where the probe measured later chunks (``--chunk-offsets``), plus, with
:meth:`MixedStepCost.with_rows`, what the rows' own contexts add against the probe's (:class:`RowStreams`:
the decode kernel's longest program or its bytes). What a served step costs beyond that (several
prompts in a step, the client's and the router's share of a gap) is not in it: setting this model
beside a measured run at the same rate and policy measures that (``benchmarks/colocated_sim_check.py``).
Not modelled: KV memory (no request waits for blocks or is swapped out: the GPU runs it models hold
hundreds of thousands of tokens) and failures.
"""

from __future__ import annotations

import bisect
import json
import shlex
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hawk.config import GPU_BATCHED_TOKENS, ServeConfig
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
class RowStreams:
    """The decode rows' attention when their contexts differ, as the engine's decode kernel runs it.

    One program per (row, KV head, split) streams its share of the row's K and V, and the split count
    is a function of the rows alone (``decode_num_splits``: one split per row past 16 rows on 132 SMs),
    so a layer's decode attention lasts as long as its longest row's programs, or as every program's
    bytes at the device's bandwidth, whichever is longer. The probe table's rows all had one context
    (``probe_context``); a served batch's spread (log-normal prompts), and its longest row sets the
    step. ``extra_s`` is what a batch's contexts add to (or take from) the table's step of as many rows.
    Both rates come from the engine benchmark's decode steps at two contexts (:meth:`from_engine`)."""

    program_gb_s: float  # one program streaming its share alone
    device_gb_s: float  # all programs at once
    probe_context: int
    layers: int = 32  # the 8B shape
    kv_heads: int = 8
    head_dim: int = 128
    kv_bytes: int = 2  # bf16
    sms: int = 132  # an H100 / H200
    max_splits: int = 64  # ``decode_num_splits``' default
    #: 0: the engine's kernel as the probe ran it (splits by rows alone); N: ``--decode-split-tokens N``,
    #: each row in as many programs of at most N tokens as its length needs, within the launch's grid
    #: (``decode_splits``), against the probe's steps as they ran
    split_tokens: int = 0
    max_len: int = 131072  # the model's context length (Llama 3.1's), which sizes that grid
    split_grid: int = 8  # ``triton_attention.SPLIT_GRID``

    @property
    def token_bytes(self) -> int:
        """K and V of one token of one KV head of one layer."""
        return 2 * self.head_dim * self.kv_bytes

    def splits(self, rows: int) -> int:
        """``hawk.engine.triton_attention.decode_num_splits`` (restated: no torch here; a test holds them equal)."""
        return max(1, min(self.max_splits, -(-self.sms // (rows * self.kv_heads))))

    def grid(self, rows: int, split_tokens: int) -> int:
        """``triton_attention.decode_splits``' grid (restated likewise)."""
        base = self.splits(rows)
        if not split_tokens:
            return base
        return max(base, min(self.max_splits, self.split_grid, -(-self.max_len // split_tokens)))

    def layer_s(self, contexts: Sequence[int], split_tokens: int = 0) -> float:
        """One layer's decode attention over rows of these contexts: its slowest program or all its bytes."""
        longest, base = max(contexts), self.splits(len(contexts))
        row = min(self.grid(len(contexts), split_tokens), max(base, -(-longest // split_tokens))) if split_tokens else base
        share = -(-longest // row)
        slowest = share * self.token_bytes / (self.program_gb_s * 1e9)
        every = sum(contexts) * self.kv_heads * self.token_bytes / (self.device_gb_s * 1e9)
        return max(slowest, every)

    def extra_s(self, contexts: Sequence[int]) -> float:
        if not contexts:
            return 0.0
        return self.layers * (self.layer_s(contexts, self.split_tokens) - self.layer_s([self.probe_context] * len(contexts)))

    @classmethod
    def from_engine(cls, path: str | Path, probe_context: int, path_name: str = "gpu-paged", **shape: Any) -> RowStreams:
        """Both rates from ``hawk bench engine`` decode records (``batch``, ``context``, ``ms``) of one path
        at two contexts: the smallest batch's step grows with what each of its programs streams (the
        programs then fill a fraction of the device's bandwidth), the largest batch's with all its bytes."""
        recs = [r for r in json.loads(Path(path).read_text()) if r.get("kind") == "decode" and r.get("path") == path_name
                and r.get("kv_dtype", "bf16") == "bf16"]
        by_batch: dict[int, dict[int, float]] = {}
        for r in recs:
            by_batch.setdefault(r["batch"], {})[r["context"]] = r["ms"]
        pairs = {b: sorted(c.items()) for b, c in by_batch.items() if len(c) >= 2}
        if not pairs:
            raise ValueError(f"{path}: no {path_name} decode batch measured at two contexts")
        probe = cls(1.0, 1.0, probe_context, **shape)
        lo, hi = min(pairs), max(pairs)

        def rate(b: int, whole: bool) -> float:
            (c1, t1), (c2, t2) = pairs[b][0], pairs[b][-1]
            s = probe.splits(b)
            tokens = b * probe.kv_heads * (c2 - c1) if whole else -(-c2 // s) - -(-c1 // s)
            return tokens * probe.token_bytes / ((t2 - t1) / 1e3 / probe.layers) / 1e9

        return cls(rate(lo, False), rate(hi, True), probe_context, **shape)


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
    streams: RowStreams | None = None  # the rows' contexts, where they differ from the probe's
    probe_context: int = 0  # the probe's decode rows' context (0: not recorded)

    def __post_init__(self) -> None:
        if not self.batches or len(self.decode_ms) != len(self.batches) or len(self.extra_ms) != len(self.batches):
            raise ValueError("a step cost needs a decode time and a row of chunk costs for every batch")
        if any(len(row) != len(self.chunks) for row in self.extra_ms) or len(self.prefill_ms) != len(self.prefill_chunks):
            raise ValueError("every row of chunk costs needs one value per chunk size")
        if list(self.batches) != sorted(self.batches) or list(self.chunks) != sorted(self.chunks):
            raise ValueError("batches and chunks must ascend")

    def decode_s(self, rows: int) -> float:
        return interp(max(rows, self.batches[0]), self.batches, self.decode_ms) / 1e3

    def step_s(self, rows: int, tokens: int, pairs: int = 0, contexts: Sequence[int] | None = None) -> float:
        """One forward of ``rows`` decode rows and ``tokens`` prompt tokens whose chunks hold ``pairs``
        query-key pairs against their prompts' earlier tokens; ``contexts``: the rows' context
        lengths, which ``streams`` (when set) costs against the probe's."""
        rows_s = self.streams.extra_s(contexts) if self.streams is not None and contexts else 0.0
        if tokens <= 0:
            return max(self.decode_s(rows) + rows_s, 0.0) if rows else 0.0
        later = self.pair_ns * pairs / 1e9
        if not rows:
            return max(interp(tokens, self.prefill_chunks, self.prefill_ms), 0.0) / 1e3 + later
        r = min(max(rows, self.batches[0]), self.batches[-1])
        per_batch = [max(interp(tokens, self.chunks, row), 0.0) for row in self.extra_ms]
        return max(self.decode_s(rows) + rows_s, 0.0) + interp(r, self.batches, per_batch) / 1e3 + later

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
        # the table is the rows at the probe's one context (``--longest`` points measure the rows' spread)
        recs = [r for r in data[section] if r.get("kind") in ("decode", "mixed") and not r.get("longest")]
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
                   f"measured: {Path(path).name}, its {section} table, context {context}", pair_ns, probe_context=context or 0)

    def with_rows(self, engine_records: str | Path, split_tokens: int = 0) -> MixedStepCost:
        """This table with each step's rows costed by their contexts (:class:`RowStreams`, its rates from
        ``engine_records``, a ``hawk bench engine`` file), the decode split by ``split_tokens``
        (``--decode-split-tokens``)."""
        if not self.probe_context:
            raise ValueError(f"{self.source}: the probe's rows' context is not recorded, so theirs cannot be set beside it")
        streams = replace(RowStreams.from_engine(engine_records, self.probe_context), split_tokens=split_tokens)
        kernel = f"decode programs of at most {split_tokens} tokens" if split_tokens else "the decode split by rows"
        return replace(self, streams=streams, source=f"{self.source} + the rows' contexts ({Path(engine_records).name}, {kernel})")


def _median(xs: Sequence[float]) -> float:
    """The probe's repeated points (a decode batch beside each chunk, a chunk beside each batch): the middle one."""
    return sorted(xs)[len(xs) // 2]


@dataclass(frozen=True)
class MixedPolicy:
    """The engine's mixed-step settings (``ServeConfig``'s names; build one with :meth:`from_config`)."""

    max_num_batched_tokens: int = GPU_BATCHED_TOKENS
    step_token_target: int = 0
    step_target_backlog: int = 16
    max_batch: int = GPU_MAX_BATCH
    max_pieces: int = MAX_PIECES
    join_lag_steps: int = 1  # async scheduling; 0: a synchronous loop (a CPU)
    decode_split_tokens: int = 1024  # the decode kernel's splits (its cost, with the rows' contexts: MixedStepCost.with_rows)

    @classmethod
    def from_config(cls, cfg: ServeConfig, **kw: Any) -> MixedPolicy:
        return cls(cfg.max_num_batched_tokens or GPU_BATCHED_TOKENS, cfg.step_token_target, cfg.step_target_backlog, cfg.max_batch or GPU_MAX_BATCH,
                   **{"decode_split_tokens": cfg.decode_split_tokens, **kw})

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
    riders: list[int] = []  # the contexts of the rows that finished in the step before (they ride once more)
    t, step = 0.0, 0
    while arrivals or queue or active or joining or running:
        while arrivals and arrivals[0].spec.arrival_s <= t:
            queue.append(arrivals.popleft())
        nxt = step + 1
        running += [q for q in joining if q.join_at <= nxt]
        joining = [q for q in joining if q.join_at > nxt]
        rows = len(running) + len(riders)
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
        contexts = [_context(q) for q in running] + riders if cost.streams is not None else None
        dt = cost.step_s(rows, tokens, pairs, contexts)
        t += dt
        step = nxt
        if log is not None:
            log.record(rows, tokens, len(pieces), pairs, dt)
        running, finished = _tokens(running, t, done)
        riders = [_context(q) for q in finished] if policy.join_lag_steps else []
        for q, _ in pieces:
            if q.planned >= q.spec.input_len:
                active.remove(q)
                _first_token(q, t, step + 1 + policy.join_lag_steps, joining, done)
    return [q.result() for q in sorted(done, key=lambda q: q.spec.index)]


def _context(q: _Seq) -> int:
    """The tokens a decode row's new token attends to: its prompt and what it generated."""
    return q.spec.input_len + q.tokens


def _tokens(running: list[_Seq], t: float, done: list[_Seq]) -> tuple[list[_Seq], list[_Seq]]:
    """A step ended at ``t``: every row's token. Returns the rows still decoding and those that finished."""
    still, finished = [], []
    for q in running:
        q.tokens += 1
        q.itl_s.append(t - q.last_s)
        q.last_s = t
        (finished if q.tokens >= q.spec.output_len else still).append(q)
    done += finished
    return still, finished


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
