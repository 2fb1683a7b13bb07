"""Output helpers shared by the commands: one JSON document on stdout, rich renderables, progress
and warnings on stderr."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import typer

from qplug_core.errors import ConfigError

#: the version of every JSON document the CLI prints (``--json``)
JSON_SCHEMA_VERSION = 1


class UsageError(ConfigError):
    """Options that do not go together on the command line: exit 2, like a command line the parser
    rejects, so a script can tell "my invocation is wrong" (2) from "the model or data is" (1)."""


def emit_json(document: dict[str, Any]) -> None:
    """One JSON document on stdout, with the CLI's ``schema_version``."""
    typer.echo(json.dumps({"schema_version": JSON_SCHEMA_VERSION, **document}, indent=2))


def number(value: float, digits: int = 4) -> float | str:
    """A float rounded for display and JSON; inf/nan become the strings ``float()`` reads back."""
    return round(value, digits) if math.isfinite(value) else str(value)


def say(text: str, *, err: bool = False) -> None:
    """One message for the terminal, with control characters escaped: messages carry strings
    from files and plugins, and an escape sequence in them must not reach the terminal."""
    from qplug_core.cli._table import escape_controls

    typer.echo(escape_controls(text), err=err)


def warn(message: str) -> None:
    """A loud one-line warning on stderr."""
    from qplug_core.cli._table import escape_controls

    typer.secho(f"qplug: warning: {escape_controls(message)}", err=True, fg=typer.colors.YELLOW,
                bold=True)


def progress() -> Any:
    """A transient rich progress display on stderr, shown only when stderr is a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                    disable=not sys.stderr.isatty())


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``; a usage error (exit 2) otherwise."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(size <= 0 for size in shape):
        raise typer.BadParameter(f"{text!r} is not a shape; write positive sizes separated by "
                                 "commas, batch first, e.g. 1,3,224,224")
    return shape


def example_tensor(shape: tuple[int, ...], generator: Any = None, dtype: Any = None) -> Any:
    """An example input of ``shape``: standard normal for float dtypes (float32 by default), ones
    for integer ones (a valid token id, an all-ones mask); a shape too large to allocate is a
    one-line error."""
    import torch

    from qplug_core.errors import InputMismatchError

    dtype = dtype or torch.float32
    try:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        return torch.ones(shape, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:
        size = torch.empty((), dtype=dtype).element_size()
        raise InputMismatchError(
            f"--example-shape {','.join(map(str, shape))} needs {math.prod(shape):,} "
            f"{str(dtype).removeprefix('torch.')} values ({size * math.prod(shape) / 2**30:,.1f} "
            f"GiB), which cannot be allocated here: {type(exc).__name__}; give the shape of one "
            "real input batch") from exc
