"""A rich renderable as ``print(report)`` shows it: the table on 80 columns, not a dataclass's fields."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console


def plain_text(renderable: Any, width: int = 80) -> str:
    """``renderable`` rendered without colours on ``width`` columns, trailing newline dropped."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue().rstrip("\n")
