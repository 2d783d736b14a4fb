"""The ``hawk`` command: serve, demo, benchmarks, and what this machine offers."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # single-host runs stay on loopback unless told otherwise

app = typer.Typer(help="HAWK: GPU-prefill / NPU-decode disaggregated LLM serving with heterogeneity-aware KV transfer.", no_args_is_help=True, add_completion=False, rich_markup_mode=None)
bench_app = typer.Typer(help="Benchmarks (transfer latency, transform throughput, engine step times, serving).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


#: Commands whose options belong to another parser: everything, ``--help`` included, goes to it.
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@app.command()
def info() -> None:
    """List NPU architectures, transfer configurations, transports and what is available here."""
    from rich.console import Console
    from rich.table import Table

    from hawk.connector.configs import CONFIGS
    from hawk.layouts.npu import ARCHS
    from hawk.transport.registry import TRANSPORTS, available

    con = Console()
    t = Table(title="NPU architectures (emulated here)")
    for c in ("arch", "banks", "channels", "bank GiB", "alignment"):
        t.add_column(c)
    for a in ARCHS.values():
        t.add_row(a.name, str(a.num_banks), str(a.num_channels), f"{a.banks[0].capacity / 2**30:g}", str(a.alignment))
    con.print(t)
    t = Table(title="Transfer configurations")
    for c in ("name", "decode on", "prefill sends", "landing"):
        t.add_column(c)
    for c in CONFIGS.values():
        t.add_row(c.name, c.decode_on, c.send_format, c.landing)
    con.print(t)
    con.print("transports: " + ", ".join(f"{n} ({'available' if available(n) else 'not available'})" for n in TRANSPORTS))


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _serve_commands(app: typer.Typer, bench: typer.Typer) -> None:
    """``serve``, ``demo``, ``bench equivalence`` and ``bench ttft``: their options are generated from ``ServeConfig``.

    Without the HTTP stack (fastapi, uvicorn: a GPU box that carries only what a benchmark needs) the
    benchmarks still run, and ``serve``/``demo`` say what is missing instead of the whole command failing."""
    from hawk.bench.equivalence_cli import equivalence_command
    from hawk.bench.ttft_cli import ttft_command

    bench.command("equivalence")(equivalence_command())
    bench.command("ttft")(ttft_command())
    try:
        from hawk.serve.demo import demo_command
        from hawk.serve.launcher import serve_command
    except ImportError as e:
        missing = str(e)

        def unavailable(ctx: typer.Context) -> None:
            _fail(RuntimeError(f"the serving stack is not installed ({missing}); pip install 'fastapi' 'uvicorn' (see pyproject.toml)"))

        for name in ("serve", "demo"):
            app.command(name, context_settings=PASS_THROUGH, help="(needs the serving stack: fastapi, uvicorn)")(unavailable)
        return
    app.command("serve")(serve_command())
    app.command("demo")(demo_command())


_serve_commands(app, bench_app)


def build_app() -> typer.Typer:
    """A fresh ``hawk`` app whose generated commands read the config's defaults now (for tests)."""
    fresh = typer.Typer(help=app.info.help, no_args_is_help=True, add_completion=False, rich_markup_mode=None)
    bench = typer.Typer(help=bench_app.info.help, no_args_is_help=True)
    fresh.add_typer(bench, name="bench")
    _serve_commands(fresh, bench)
    return fresh


@bench_app.command("transfer")
def bench_transfer(
    sizes_mb: str = typer.Option("10,20,40,80,160,320,640,1280", help="KV sizes per transfer (MiB, Llama-3.1-70B TP4 rank shape)"),
    configs: str = typer.Option("gg-host,gn-host,gg-direct,gn-direct-single,gn-hawk", help="configurations; 'gn-hawk@direct' forces a landing mode"),
    transport: str = typer.Option("nixl", help="a transport of hawk/transport/registry.py: nixl | mooncake | cuda-ipc | local | auto (per peer: same process local, same host cuda-ipc, else nixl)"),
    repeats: int = typer.Option(5, min=1),
    warmup: int = typer.Option(1, min=0),
    prefill_device: str = typer.Option("cpu", help="cpu or cuda:N"),
    npu_device: str = typer.Option("npu-emu:cpu", help="emulated NPU memory: npu-emu:cpu or npu-emu:cuda:N"),
    gpu_decode_device: str = typer.Option("cpu", help="decode device of the gg-* configurations"),
    arch: str = typer.Option("blackhole-p150a"),
    kv_dtype: str = typer.Option("bf16", help="NPU KV dtype: bf16 | bfp8_b"),
    npu_shard_pages: int = typer.Option(1, min=1, help="NPU cache page map: 1 = interleaved, N = block-cyclic shards"),
    post: str = typer.Option("pull", help="who posts the batch: pull (decode READs) | push (prefill WRITEs)"),
    shuffle_blocks: bool = typer.Option(False, help="random block ids instead of contiguous"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write records here"),
    plot_path: Optional[str] = typer.Option(None, "--plot", help="write the Fig. 9 analogue (PNG) here"),
) -> None:
    """KV-transfer latency of the five configurations (paper Fig. 9), from decode request to KV in the cache pool."""
    from rich.progress import Progress

    from hawk.bench.progress import ProgressLines
    from hawk.bench.transfer import BenchSpec, plot, print_table, run_transfer_bench, save_json
    from hawk.layouts.device import parse_device

    spec = BenchSpec(
        sizes_mb=tuple(int(s) for s in _csv(sizes_mb)), configs=tuple(_csv(configs)), transport=transport,
        repeats=repeats, warmup=warmup, prefill_device=prefill_device, npu_device=npu_device,
        gpu_decode_device=gpu_decode_device, arch=arch, kv_dtype=kv_dtype, post=post, shuffle_blocks=shuffle_blocks,
        shard_pages=npu_shard_pages,
    )
    total = len(spec.configs) * len(spec.sizes_mb) * (spec.warmup + spec.repeats)
    if sys.stderr.isatty():
        with Progress() as prog:
            task = prog.add_task("transfers", total=total)
            records = run_transfer_bench(spec, progress=lambda: prog.advance(task))
    else:  # piped or logged: a rich progress bar would print nothing until the end
        records = run_transfer_bench(spec, progress=ProgressLines("transfers", total))
    print_table(records)
    if json_path:
        save_json(records, json_path)
    if plot_path:
        where = f"prefill {prefill_device}; NPU = {parse_device(npu_device).label(arch)}; {transport}"
        plot(records, plot_path, f"KV transfer latency ({where})")


@bench_app.command("transform", context_settings=PASS_THROUGH)
def bench_transform(ctx: typer.Context) -> None:
    """Transform throughput vs a plain device copy (options: hawk bench transform --help)."""
    from hawk.bench.transform import main

    main(ctx.args)


@bench_app.command("engine", context_settings=PASS_THROUGH)
def bench_engine(ctx: typer.Context) -> None:
    """Model-level decode and prefill times against read-bandwidth and GEMM ceilings measured in the same run.

    Options: hawk bench engine --help; e.g. hawk bench engine --device cuda:0 --model llama-3.1-8b --batches 1,64.
    """
    from hawk.bench.engine import main

    try:
        main(ctx.args)
    except ValueError as e:
        _fail(e)


@bench_app.command("serving", context_settings=PASS_THROUGH)
def bench_serving(ctx: typer.Context) -> None:
    """Online serving against a running router: TTFT, TPOT, SLO attainment, throughput vs request rate (paper Figs. 10-13).

    Options: hawk bench serving --help; e.g. hawk bench serving --url http://127.0.0.1:8000 --workload chatbot-tiny --rates 0.5,1,2.
    """
    from hawk.bench.serving_cli import main

    main(ctx.args)


@bench_app.command("vllm-pd", context_settings=PASS_THROUGH)
def bench_vllm_pd(ctx: typer.Context) -> None:
    """vLLM's own P/D (NixlConnector) beside HawkConnector in vLLM, vLLM -> HAWK NPU decode, one vLLM and HAWK colocated.

    Needs vLLM (``bash scripts/install.sh --with-vllm``). Options pass to ``python -m hawk.bench.vllm_pd``.
    """
    from hawk.bench.vllm_pd import main

    main(ctx.args)


@bench_app.command("efficiency", context_settings=PASS_THROUGH)
def bench_efficiency(ctx: typer.Context) -> None:
    """Power and cost efficiency at 90 % SLO attainment from serving or simulation records (paper Tables 8-9; options: hawk bench efficiency --help)."""
    from hawk.bench.efficiency import main

    main(ctx.args)


@app.command("sim", context_settings=PASS_THROUGH)
def sim(ctx: typer.Context) -> None:
    """Cluster-scale discrete-event simulation, calibrated by measured transfer curves (options: hawk sim --help)."""
    from hawk.sim.command import main

    main(ctx.args)


@app.command("report", context_settings=PASS_THROUGH)
def report(ctx: typer.Context) -> None:
    """One Markdown report (tables + plots) from result files, each recognised by its content (options: hawk report --help)."""
    from hawk.bench.report import main

    main(ctx.args)


@app.command("export-hf")
def export_hf(
    out: str = typer.Argument(..., help="Directory to write (config.json, model.safetensors, tokenizer files)."),
    model: str = typer.Option("smollm2-135m", help="Model spec: the embedded default, a .gguf path or a preset."),
    dtype: str = typer.Option("bf16", help="Weight dtype written: bf16, fp16 or fp32."),
) -> None:
    """Write a model as a Hugging Face checkpoint folder, e.g. the embedded SmolLM2 for a vLLM server.

    HAWK's loader reads the same folder, so vLLM and HAWK serve the same weights bit for bit."""
    import torch

    from hawk.engine.loader import load_model, save_hf_dir

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in dtypes:
        _fail(ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(dtypes)}"))
    try:
        save_hf_dir(load_model(model, dtype=dtypes[dtype]), out)
    except (ValueError, OSError) as e:
        _fail(e)
    typer.echo(out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
