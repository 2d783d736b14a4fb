"""The ``hawk`` command line itself (the generated serve options are tested in test_serve_cli.py)."""

from __future__ import annotations


def test_benchmarks_run_without_the_serving_stack():
    """A GPU box may carry only what a benchmark needs: ``hawk bench`` works without uvicorn, and
    ``hawk serve`` says what is missing (exit 2) instead of every command failing at import."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['uvicorn'] = None\n"
        "from typer.testing import CliRunner\n"
        "from hawk.cli import app\n"
        "r = CliRunner().invoke(app, ['bench', 'transfer', '--help'])\n"
        "assert r.exit_code == 0 and 'sizes-mb' in r.output, r.output\n"
        "r = CliRunner().invoke(app, ['serve', '--port', '1'])\n"
        "assert r.exit_code == 2 and 'serving stack' in r.output, r.output\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


COMMANDS = {"info", "serve", "demo", "sim", "report", "bench"}  # at least these
BENCH = {"equivalence", "ttft", "transfer", "transform", "engine", "serving", "efficiency"}


def _help(args: list[str]) -> str:
    from typer.testing import CliRunner

    from hawk.cli import app

    r = CliRunner(env={"COLUMNS": "80"}).invoke(app, [*args, "--help"])
    assert r.exit_code == 0, (args, r.output)
    return r.output


def _commands() -> tuple[list[str], list[str]]:
    """Every command of ``hawk`` and of ``hawk bench``, as the app registers them."""
    import typer

    from hawk.cli import app

    group = typer.main.get_command(app)
    top = sorted(group.commands)  # type: ignore[attr-defined]
    bench = sorted(group.commands["bench"].commands)  # type: ignore[attr-defined]
    return top, bench


def test_help_lists_every_command_and_each_command_its_options():
    """What the README promises: ``hawk --help`` lists every command, ``hawk COMMAND --help`` every
    option of it (the pass-through benchmarks show their own parser's options), in plain text
    (no reStructuredText quotes) that fits 80 columns."""
    top_names, bench_names = _commands()
    assert COMMANDS <= set(top_names) and BENCH <= set(bench_names), (top_names, bench_names)
    top, bench = _help([]), _help(["bench"])
    assert all(c in top for c in top_names), top
    assert all(b in bench for b in bench_names), bench
    for args in [[c] for c in top_names if c != "bench"] + [["bench", b] for b in bench_names]:
        out = _help(args)
        assert "--help" in out and (args == ["info"] or out.count("--") >= 2), (args, out)  # info has no options
        assert "``" not in out, (args, out)
    assert "``" not in top + bench


def test_bench_transfer_help_shows_whole_option_names_in_80_columns():
    import typer

    from hawk.cli import app

    out = _help(["bench", "transfer"])
    assert max(len(line) for line in out.splitlines()) <= 80, out
    command = typer.main.get_command(app).commands["bench"].commands["transfer"]  # type: ignore[attr-defined]
    names = [o for p in command.params for o in [*p.opts, *p.secondary_opts] if o.startswith("--")]
    assert "--gpu-decode-device" in names and "--npu-shard-pages" in names
    for name in names:
        assert name in out, f"{name} is cut in: {out}"


def test_piped_bench_transfer_prints_progress_and_tables_that_fit():
    """Piped (a log, a CI job), rich's progress bar prints nothing until the end and a forced-wide
    console makes 190-column tables: progress comes as lines, tables at the pipe's 80 columns."""
    import os
    import subprocess
    import sys

    from hawk.transport.registry import available

    if not available("nixl"):
        import pytest

        pytest.skip("NIXL is not installed (the benchmark's prefill runs in its own process)")
    cmd = [sys.executable, "-m", "hawk", "bench", "transfer", "--sizes-mb", "1", "--configs", "gg-direct,gn-host",
           "--transport", "nixl", "--repeats", "1", "--warmup", "1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env, "UCX_NET_DEVICES": "lo"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transfers: 4/4" in out.stderr, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any("gn-host" in line for line in lines), out.stdout
    assert max(len(line) for line in lines) <= 100, out.stdout
