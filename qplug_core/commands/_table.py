"""CLI tables that never split a word across lines.

rich folds a cell when its column is narrower than one of its words, which turns names such as
``quantized::conv2d_relu`` into two halves at 80 columns. Every column here is at least as wide as
its longest word, and the console grows past the terminal width only when even that cannot fit (a
long line is easier to read than a broken name).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

#: terminal width used when stdout is not a terminal and COLUMNS is unset
DEFAULT_WIDTH = 80


def new_table(*columns: str, title: str | None = None, show_header: bool = True,
              right: tuple[str, ...] = ()) -> Table:
    """A table with the given column headers (those in ``right`` right-justified)."""
    table = Table(title=title, title_justify="left", show_header=show_header,
                  box=None if not show_header else Table().box)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    return table


def _longest_word(text: Any) -> int:
    return max((len(word) for word in str(text).split()), default=0)


def _protect_words(table: Table) -> int:
    """Give every column a minimum width of its longest word; the table's minimum width."""
    total = 0
    for column in table.columns:
        cells = [column.header, *column._cells]  # rich keeps a column's cells there
        column.min_width = max(_longest_word(cell) for cell in cells)
        total += column.min_width + 2  # one space of padding each side
    borders = len(table.columns) + 1 if table.box is not None else 0
    return total + borders


def terminal_width() -> int:
    """``COLUMNS`` when set (as the shell exports it), else the terminal's width, else 80."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def show(*renderables: Any) -> None:
    """Print tables (words kept whole) and other rich renderables on stdout."""
    renderables = tuple(r.__rich__() if hasattr(r, "__rich__") else r for r in renderables)
    width = terminal_width()
    needed = [_protect_words(r) for r in renderables if isinstance(r, Table)]
    console = Console(file=sys.stdout, width=max([width, *needed]), soft_wrap=False)
    for renderable in renderables:
        console.print(renderable)
