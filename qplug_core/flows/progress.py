"""Progress of convert's long steps on stderr, shown as calibration shows its batches.

``progress=None`` shows it on a terminal only, ``True`` always, ``False`` never; never on ranks
but 0. On a terminal it is a transient rich bar; where stderr is a file or a pipe (a job's log),
one line per step: a delegated convert compiles and checks its partitions for minutes on a big
model, and said nothing meanwhile.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

from qplug_core.observers import distributed


def shown(progress: bool | None) -> bool:
    """Whether to show progress (see the module docstring)."""
    return (sys.stderr.isatty() if progress is None else progress) and distributed.is_rank_zero()


class Steps:
    """Steps of one long task (``what``), their count growing as they are planned (:meth:`add`),
    each said when done (:meth:`done`)."""

    def __init__(self, what: str, progress: bool | None):
        self.what, self.total, self.finished = what, 0, 0
        self._bar: Any = None
        self._lines = shown(progress) and not sys.stderr.isatty()
        self._start = time.perf_counter()
        if shown(progress) and not self._lines:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task(what, total=0)

    def __enter__(self) -> Steps:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()

    def add(self, count: int) -> None:
        self.total += count
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def done(self, step: str) -> None:
        """``step`` is done."""
        self.finished += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.finished, description=f"{self.what}: {step} done")
        elif self._lines:
            print(f"qplug: {self.what}: {step} done ({self.finished} of {self.total}, "
                  f"{time.perf_counter() - self._start:.1f} s)", file=sys.stderr, flush=True)


__all__ = ["Steps", "shown"]
