"""``hawk bench equivalence`` (and ``python -m hawk.bench.equivalence_cli``): the instance options come
from ``ServeConfig``, so they are spelt, defaulted and checked as ``hawk serve`` does; only the
benchmark's own three options are declared here. Kept apart from the benchmark so that building
the command line loads no torch."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Optional

import typer

from hawk.config import ServeConfig
from hawk.config_cli import config_command

#: Where the benchmark differs from ``hawk serve``: a smaller cache (the buffers size themselves to it).
EQUIVALENCE_DEFAULTS: dict[str, Any] = {"kv_tokens": 4096}


def _run(cfg: ServeConfig, configs: str, max_tokens: int, json_path: Optional[str]) -> None:
    """Disaggregated vs colocated: the same prompts through each configuration, token ids compared."""
    from hawk.bench.equivalence import equivalence

    equivalence(cfg, [c.strip() for c in configs.split(",") if c.strip()], max_tokens, json_path)


def _extra() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("configs", kw, default=typer.Option("gn-hawk,gg-direct", help="transfer configurations to compare with the colocated oracle"), annotation=str),
        inspect.Parameter("max_tokens", kw, default=typer.Option(24, min=1, help="tokens generated per prompt"), annotation=int),
        inspect.Parameter("json_path", kw, default=typer.Option(None, "--json", help="write the records here"), annotation=Optional[str]),
    ]


def equivalence_command() -> Callable[..., None]:
    return config_command(_run, "bench", overrides=EQUIVALENCE_DEFAULTS, extra=_extra())


if __name__ == "__main__":
    typer.run(equivalence_command())
