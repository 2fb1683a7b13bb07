"""CLI tables that never split a word across lines.

rich folds a cell when its column is narrower than one of its words, which turns names such as
``quantized::conv2d_relu`` into two halves at 80 columns. Every column here is at least as wide as
its longest word when the terminal has room for that; when it has not, the columns with the
longest words give up columns (their words fold) until the table fits: no line is ever wider than
the terminal.

Cells are plain text, never rich markup, with control characters shown escaped: their strings
come from files and plugins (a saved model's versions, a plugin's error), and ``"[/red]"`` or an
escape sequence setting the window title must print as what it is (see :func:`plain`).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

#: terminal width used when stdout is not a terminal and COLUMNS is unset
DEFAULT_WIDTH = 80
#: no column is folded narrower than this
MIN_COLUMN = 6


#: C0 and C1 control characters (but newline and tab), DEL, and bidirectional overrides
_CONTROL = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
            for c in (*range(0x20), 0x7f, *range(0x80, 0xa0), *range(0x202a, 0x202f),
                      *range(0x2066, 0x206a)) if c not in (0x0a, 0x09)}


def escape_controls(text: str) -> str:
    """``text`` with control characters written as ``\\x1b`` (escape sequences never reach the
    terminal, or a log that a terminal will show)."""
    return text.translate(_CONTROL)


def plain(value: Any) -> Any:
    """A cell as literal text: strings become :class:`~rich.text.Text` (no markup), escaped."""
    return Text(escape_controls(value)) if isinstance(value, str) else value


def _literal(renderable: Any) -> Any:
    """``renderable`` with every string in it (table cells and titles, group members) literal."""
    if isinstance(renderable, Table):
        if isinstance(renderable.title, str):
            renderable.title = plain(renderable.title)
        for column in renderable.columns:
            column._cells = [_literal(cell) for cell in column._cells]
        return renderable
    if isinstance(renderable, Group):
        renderable._renderables = [_literal(r) for r in renderable.renderables]
        return renderable
    return plain(renderable)


def new_table(*columns: str, title: str | None = None, show_header: bool = True,
              right: tuple[str, ...] = ()) -> Table:
    """A table with the given column headers (those in ``right`` right-justified)."""
    table = Table(title=title, title_justify="left", show_header=show_header,
                  box=None if not show_header else Table().box)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    return table


def _cell_lines(cell: Any) -> list[str]:
    return str(cell.plain if hasattr(cell, "plain") else cell).splitlines() or [""]


def _fit_columns(table: Table, width: int) -> int:
    """Fix each column's width: its widest line when everything fits in ``width``, otherwise its
    longest word plus a share of the room left. Returns the table's total width."""
    lows, highs = [], []
    for column in table.columns:
        lines = [line for cell in (column.header, *column._cells) for line in _cell_lines(cell)]
        lows.append(max((len(word) for line in lines for word in line.split()), default=1))
        highs.append(max(len(line) for line in lines))
    frame = 3 * len(table.columns) + 1 if table.box is not None else 2 * len(table.columns)
    _shrink_longest_words(table, lows, width - frame)
    room = width - frame - sum(lows)
    wanted = [high - low for low, high in zip(lows, highs)]
    if room >= sum(wanted):
        widths = highs
    else:  # share what is left in proportion to how much more each column would like
        share = max(room, 0)
        widths = [low + (share * extra // sum(wanted) if sum(wanted) else 0)
                  for low, extra in zip(lows, wanted)]
    for column, fixed in zip(table.columns, widths):
        column.width = max(fixed, 1)
    return sum(widths) + frame


def _shrink_longest_words(table: Table, lows: list[int], room: int) -> None:
    """Take columns from the widest minimum until ``lows`` fit in ``room``; those columns fold."""
    while sum(lows) > room and max(lows) > MIN_COLUMN:
        widest = lows.index(max(lows))
        lows[widest] -= 1
        table.columns[widest].overflow = "fold"


def terminal_width() -> int:
    """``COLUMNS`` when set (as the shell exports it), else the terminal's width, else 80."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def show(*renderables: Any) -> None:
    """Print tables (words kept whole) and other rich renderables on stdout."""
    renderables = tuple(_literal(r.__rich__() if hasattr(r, "__rich__") else r) for r in renderables)
    width = terminal_width()
    needed = [_fit_columns(r, width) for r in renderables if isinstance(r, Table)]
    console = Console(file=sys.stdout, width=max([width, *needed]))
    for renderable in renderables:
        console.print(renderable)
