"""Processes of a served system, read from ``/proc`` (Linux): who a launcher's children are, whether
one still runs, and how much CPU it has used. Benchmarks and tests that watch a running ``hawk
serve`` share these, so the one parsing of ``/proc/<pid>/stat`` lives here."""

from __future__ import annotations

import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and parens):
    [0] state, [1] parent pid, [11] user ticks, [12] system ticks."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (those that vanish meanwhile are skipped)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int(_stat(int(p.name))[1]) == pid:
                    out.append(int(p.name))
            except (OSError, ValueError, IndexError):
                continue
    return sorted(out)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: int) -> float:
    """User + system seconds of one process so far."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS
