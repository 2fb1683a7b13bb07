"""Output helpers shared by the commands: one JSON document on stdout, rich renderables, progress
and warnings on stderr."""

from __future__ import annotations

import math
import sys
from typing import Any

import typer


def emit_json(document: dict[str, Any]) -> None:
    """One JSON document on stdout, with the CLI's ``schema_version``."""
    from qplug_core.cli import _emit_json  # at call time: cli imports the command modules

    _emit_json(document)


def number(value: float, digits: int = 4) -> float | str:
    """A float rounded for display and JSON; inf/nan become the strings ``float()`` reads back."""
    return round(value, digits) if math.isfinite(value) else str(value)


def show(*renderables: Any) -> None:
    """Print rich renderables (tables, reports) on stdout."""
    from rich.console import Console

    console = Console(file=sys.stdout)
    for renderable in renderables:
        console.print(renderable)


def warn(message: str) -> None:
    """A loud one-line warning on stderr."""
    typer.secho(f"qplug: warning: {message}", err=True, fg=typer.colors.YELLOW, bold=True)


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


def example_tensor(shape: tuple[int, ...], generator: Any = None) -> Any:
    """A standard-normal input of ``shape``; a shape too large to allocate is a one-line error."""
    import torch

    from qplug_core.errors import InputMismatchError

    try:
        return torch.randn(shape, generator=generator)
    except (RuntimeError, MemoryError) as exc:
        raise InputMismatchError(
            f"--example-shape {','.join(map(str, shape))} needs {math.prod(shape):,} float32 values "
            f"({4 * math.prod(shape) / 2**30:,.1f} GiB), which cannot be allocated here: "
            f"{type(exc).__name__}; give the shape of one real input batch") from exc
