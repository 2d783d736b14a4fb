"""Progress as plain lines, for a benchmark whose output is piped or logged.

Why: rich's progress bar draws only on a terminal; piped, a long benchmark printed nothing until
its tables came out at the end. A line every tenth of the way (and at the end) says it is alive
without flooding a log.
"""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressLines:
    """A ``progress()`` callback that prints ``what: done/total`` to ``out`` about ten times."""

    def __init__(self, what: str, total: int, out: TextIO | None = None, steps: int = 10):
        self.what, self.total, self.done = what, max(1, total), 0
        self.every = max(1, self.total // steps)
        self.out = out

    def __call__(self) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            print(f"{self.what}: {self.done}/{self.total}", file=self.out or sys.stderr, flush=True)
