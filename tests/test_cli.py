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
