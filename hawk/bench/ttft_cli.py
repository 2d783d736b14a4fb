"""``hawk bench ttft`` (and ``python -m hawk.bench.ttft_cli``): the instance options come from
``ServeConfig``, spelt, defaulted and checked as ``hawk serve`` does them; only the benchmark's own
options are declared here. Kept apart from the benchmark so that building the command line loads no
torch. ``--kv-tokens`` is a floor: every instance holds at least the longest prompt and 256 tokens more
(its staging and receive buffers size themselves to that)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Optional

import typer

from hawk.config import ServeConfig
from hawk.config_cli import config_command

#: Where the benchmark differs from ``hawk serve``: caches sized to the prompts (see the module docstring).
TTFT_DEFAULTS: dict[str, Any] = {"kv_tokens": 256}


def _run(cfg: ServeConfig, prompts: str, configs: str, kv_flows: Optional[str], repeats: int, warmup: int,
         settle_ms: float, json_path: Optional[str], profile_posts: Optional[str]) -> list[dict[str, Any]]:  # fmt: skip
    """TTFT of disaggregated configurations against colocated, per prompt length, in one run."""
    from hawk.bench.ttft import measure

    return measure(cfg, _ints(prompts), _names(configs), _names(kv_flows) if kv_flows else [cfg.kv_flow], repeats, warmup,
                   json_path, profile_posts, settle_ms / 1e3)  # fmt: skip


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompts takes comma-separated token counts, got {s!r}") from None


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _extra() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    opt = typer.Option
    return [
        inspect.Parameter("prompts", kw, default=opt("256,1024", help="prompt lengths in tokens, comma-separated"), annotation=str),
        inspect.Parameter("configs", kw, default=opt("gn-hawk,gg-direct", help="transfer configurations compared with colocated"), annotation=str),
        inspect.Parameter("kv_flows", kw, default=opt(None, help="KV flows compared, comma-separated: pull, layerwise (default: --kv-flow)"), annotation=Optional[str]),
        inspect.Parameter("repeats", kw, default=opt(3, min=1, help="measured runs per (configuration, prompt)"), annotation=int),
        inspect.Parameter("warmup", kw, default=opt(1, min=0, help="unmeasured runs first"), annotation=int),
        inspect.Parameter("settle_ms", kw, default=opt(50.0, min=0.0, help="idle time before each request (the devices synchronized), so none starts while the one before still releases and cleans up: concurrency 1 with think time"),
                          annotation=float),  # fmt: skip
        inspect.Parameter("json_path", kw, default=opt(None, "--json", help="write the records here"), annotation=Optional[str]),
        inspect.Parameter("profile_posts", kw, default=opt(None, help="write a cProfile of the layer-wise posts made on the forward's thread here"),
                          annotation=Optional[str]),  # fmt: skip
    ]


def ttft_command() -> Callable[..., Any]:
    return config_command(_run, "bench", overrides=TTFT_DEFAULTS, extra=_extra())


def main(argv: Sequence[str] | None = None) -> Any:
    """The command line (``--help`` lists every instance option ``hawk serve`` has, too). Given ``argv``,
    it returns instead of exiting: the records, or the exit code of an error or ``--help``."""
    app = typer.Typer(add_completion=False)
    app.command()(ttft_command())
    return typer.main.get_command(app).main(args=argv, prog_name="hawk bench ttft", standalone_mode=argv is None)


if __name__ == "__main__":
    main()
