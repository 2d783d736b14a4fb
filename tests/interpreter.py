"""Run a test module's Triton cases on the CPU under Triton's interpreter, in a subprocess.

``TRITON_INTERPRET`` must be set before triton is first imported, and it must not leak into the other
test files of the pytest process: so the cases run in a child ``python -m <module>`` whose ``__main__``
prints one ``CASE <json>`` line per case, each JSON object carrying its ``name``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def emit(result: dict) -> None:
    """Child side: report one case (``result["name"]`` names it)."""
    print("CASE " + json.dumps(result), flush=True)


def run_interpreted(module: str, timeout_s: float = 600, require_clean_exit: bool = False) -> dict[str, dict]:
    """Parent side: ``{name: result}`` of every case the child reported; skips without triton."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[5:])
            results[r["name"]] = r
    if not results or (require_clean_exit and proc.returncode != 0):
        raise AssertionError(f"interpreter subprocess gave no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results
