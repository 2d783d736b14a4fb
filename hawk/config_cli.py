"""Typer options generated from ``ServeConfig``'s fields, so no command spells an option again.

``config_command(run, "serve")`` makes a typer command whose options are the fields tagged for
``serve`` (flag, type, default, help and choices all from ``hawk/config.py``); it builds the
config, validates it, and calls ``run(cfg, **extra)``. Bad values leave as one line on stderr
with exit code 2, as a usage error should. Defaults are read when the command is built, so a
test that patches a field's default sees it in every generated command.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import typer
from typer.exceptions import TyperException

from hawk.config import ConfigError, ServeConfig, default_of, defaults, options

_HINTS = typing.get_type_hints(ServeConfig)


def fail(e: Exception) -> typing.NoReturn:
    """The one way a command reports a bad option or a failed start: one line, exit code 2."""
    if os.environ.get("HAWK_TRACEBACK"):  # where it failed, for whoever debugs a run they cannot repeat
        traceback.print_exception(e)
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _annotation(tp: Any) -> Any:
    """typer reads ``Optional[X]``; the dataclass says ``X | None``."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = next(a for a in args if a is not type(None))
        return Optional[inner]
    if typing.get_origin(tp) is list:
        return Optional[list[args[0]]]  # typer's repeatable option; None = not given
    return tp


def _help(f: dataclasses.Field) -> str:
    o = f.metadata["opt"]
    return f"{o.help} (one of: {', '.join(o.choices)})" if o.choices else o.help


def _parameter(f: dataclasses.Field, default: Any) -> inspect.Parameter:
    o = f.metadata["opt"]
    if isinstance(default, list):
        default = default or None
    option = typer.Option(default, *o.flags, help=_help(f), envvar=o.envvar, show_envvar=o.envvar is not None)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_annotation(_HINTS[f.name]))


def config_parameters(command: str, overrides: Mapping[str, Any] = {}) -> list[inspect.Parameter]:  # noqa: B006 - read only
    """One typer parameter per field ``command`` shows, defaults from the config (or ``overrides``)."""
    return [_parameter(f, overrides.get(f.name, default_of(f))) for f in options(command)]


def config_from(values: Mapping[str, Any], overrides: Mapping[str, Any] = {}) -> ServeConfig:  # noqa: B006
    """A validated config: the fields' defaults, then ``overrides``, then what was given."""
    cfg = defaults(**overrides)
    given = {k: [] if v is None and isinstance(getattr(cfg, k), list) else v for k, v in values.items()}
    return dataclasses.replace(cfg, **given).validate()


def _with_signature(fn: Callable[..., Any], params: Sequence[inspect.Parameter]) -> Callable[..., Any]:
    """``fn`` as typer sees a command of these keyword parameters."""
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn


def config_command(
    run: Callable[..., Any],
    command: str,
    overrides: Mapping[str, Any] = {},  # noqa: B006
    extra: Sequence[inspect.Parameter] = (),
    doc: str | None = None,
) -> Callable[..., Any]:
    """A function typer can register: the config's options for ``command`` plus ``extra`` ones.

    ``run(cfg, **extra_values)`` does the work; ``ValueError`` (``ConfigError`` included),
    ``OSError`` and ``RuntimeError`` from it are reported through :func:`fail`.
    """
    params = config_parameters(command, overrides)
    extra_names = [p.name for p in extra]

    def command_fn(**kw: Any) -> Any:
        try:
            cfg = config_from({k: v for k, v in kw.items() if k not in extra_names}, overrides)
            return run(cfg, **{k: kw[k] for k in extra_names})  # what a caller in-process gets back
        except (ValueError, OSError, RuntimeError) as e:  # ConfigError is a ValueError
            fail(e)

    _with_signature(command_fn, [*params, *extra])
    command_fn.__doc__ = doc or run.__doc__
    command_fn.__name__ = command
    return command_fn


def parse_config(command: str, argv: Sequence[str], overrides: Mapping[str, Any] = {}) -> ServeConfig:  # noqa: B006
    """The config ``hawk <command> ARGV`` would start with, read by the same generated options and
    validated, nothing started (a recorded run's ``serve_args`` back into its settings). A bad value
    or an unknown flag raises ``ConfigError``."""
    got: dict[str, Any] = {}

    def capture(**kw: Any) -> None:
        got.update(kw)

    app = typer.Typer()
    app.command()(_with_signature(capture, config_parameters(command, overrides)))
    try:
        typer.main.get_command(app).main(list(argv), prog_name=f"hawk {command}", standalone_mode=False)
    except TyperException as e:  # the parser's usage errors: an unknown flag, a value of the wrong type
        raise ConfigError(str(e)) from e
    return config_from(got, overrides)
