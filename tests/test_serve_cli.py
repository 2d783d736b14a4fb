"""``hawk serve`` / ``hawk demo`` refuse bad options up front: one clear line on stderr, exit code 2
(as a usage error), no traceback, and nothing started."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hawk.cli import app


def _refused(args: list[str], *needles: str) -> str:
    r = CliRunner().invoke(app, args)
    out = r.output
    assert r.exit_code == 2, (r.exit_code, out, r.exception)
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    for n in needles:
        assert n in out, out
    return out


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--port", "99999"], ["--port", "0..65535", "99999"]),
        (["--port", "-5"], ["--port"]),
        (["--model", "no-such-model"], ["--model", "no-such-model", "smollm2-135m"]),
        (["--model", "/tmp"], ["--model", "config.json"]),
        (["--threads", "0"], ["--threads", "at least 1"]),
        (["--host", "0.0.0.0"], ["not a loopback", "--allow-remote"]),
        (["--kv-host", "0.0.0.0"], ["--kv-host", "--allow-remote"]),
        (["--cluster-secret-file", "/nonexistent/secret"], ["--cluster-secret-file"]),
        (["--max-body-mb", "0"], ["--max-body-mb"]),
        (["--role", "chef"], ["unknown role"]),
    ],
)
def test_serve_refuses_bad_options_in_one_line(args, needles):
    _refused(["serve", *args], *needles)


def test_demo_refuses_a_bad_model():
    _refused(["demo", "--model", "no-such-model"], "--model")


def test_threads_zero_never_reaches_openmp():
    """As its own process: libgomp would print its complaint at import, before Python sees it."""
    r = subprocess.run([sys.executable, "-m", "hawk", "serve", "--threads", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "libgomp" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["error: --threads must be at least 1, got 0"]


def test_launcher_module_uses_the_same_checks():
    r = subprocess.run([sys.executable, "-m", "hawk.serve.launcher", "--port", "99999"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--port" in r.stderr, r.stderr
