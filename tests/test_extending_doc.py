"""``docs/extending.md`` runs: every fenced Python block executes in a fresh namespace, and every file
the guide names exists, so the guide cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "extending.md"
#: A block whose first line is this is illustrative and not run.
SKIP = "# not run"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(section heading, code)`` of every fenced ```python block, in order."""
    blocks, heading = [], ""
    for m in re.finditer(r"^(#{1,6} [^\n]*)$|^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        if m.group(1):
            heading = m.group(1).lstrip("#").strip()
        else:
            blocks.append((heading, m.group(2)))
    return blocks


BLOCKS = python_blocks(GUIDE.read_text())


def test_the_guide_has_its_examples():
    runnable = [code for _, code in BLOCKS if not code.startswith(SKIP)]
    assert len(runnable) >= 5, f"expected an example per section, found {len(runnable)}"
    assert all("assert " in code for code in runnable), "every example checks what it shows"


def _id(i: int, heading: str) -> str:
    return f"{i}-" + re.sub(r"\W+", "-", heading.lower()).strip("-")[:32]


@pytest.mark.parametrize("heading, code", BLOCKS, ids=[_id(i, h) for i, (h, _) in enumerate(BLOCKS)])
def test_example_runs(heading: str, code: str):
    if code.startswith(SKIP):
        pytest.skip("illustrative block")
    exec(compile(code, f"{GUIDE.name} ({heading})", "exec"), {"__name__": "extending_doc_example"})


def test_named_files_exist():
    named = set(re.findall(r"`((?:hawk|tests|docs)/[\w/.]+\.(?:py|md))`", GUIDE.read_text()))
    assert named, "no file paths found in the guide"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"the guide names files that do not exist: {missing}"
