"""The project's documents stay documents for users: no dated work logs, every benchmark script
indexed, timings that say what they were measured on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK_LOG = re.compile(r"session [0-9]+", re.IGNORECASE)


def _texts() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("docs", "hawk", "benchmarks", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".md", ".py", ".sh", ".txt")]
    return files


def test_no_dated_work_log_entries():
    """History lives in git; what a user reads says what holds now (the grep of the acceptance)."""
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _texts() for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if WORK_LOG.search(line)]
    assert not hits, "work-log mentions: " + ", ".join(hits[:20])


def test_every_benchmark_script_is_indexed():
    """``benchmarks/README.md`` lists every script in the folder, and only scripts that exist."""
    index = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    listed = set(re.findall(r"^\| `([\w.]+\.py)` \|", index, re.MULTILINE))
    assert scripts, "no scripts found"
    assert scripts - listed == set(), f"not in benchmarks/README.md: {sorted(scripts - listed)}"
    assert listed - scripts == set(), f"listed but missing: {sorted(listed - scripts)}"


def test_readme_timings_name_their_machine():
    """A timing without its machine is a promise nobody can check: every "about N s / minutes" in the
    README sits in a sentence that says what it was measured on."""
    text = " ".join((ROOT / "README.md").read_text().split())
    sentences = re.split(r"(?<=[.;])\s", text)
    timed = [s for s in sentences if re.search(r"about \d+(\.\d+)? ?(s|seconds|minutes|min)\b", s)]
    assert timed, "the README's timings were not found"
    for s in timed:
        assert re.search(r"measured on|on a \d+-core", s), s
