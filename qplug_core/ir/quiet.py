"""torch's exporters, one at a time and quietly.

They talk to the terminal: progress on stdout, notes and whole graphs on stderr. qplug calls them
where their failure is expected and handled (``capture="auto"`` trying torch.export before
symbolic tracing; the ONNX exporter), so what they print is noise to the user, who gets qplug's
own error or warning instead. And they are not thread-safe: a served model compiling partitions
for a new batch size in four threads at once failed in torch.export's internals ("Trying to pop
empty mode stack"), and overlapping ``redirect_stdout`` blocks left ``sys.stdout`` pointing at a
buffer for the rest of the process. So every block holds one process-wide lock.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Iterator, Sequence

_EXPORTING = threading.RLock()  # re-entrant: an export may capture, which exports


@contextlib.contextmanager
def quiet_torch(loggers: Sequence[str], *, stdout: bool = False, stderr: bool = False) -> Iterator[None]:
    """For the block, alone in the process: ``loggers`` at ERROR, what is printed on the chosen
    streams caught."""
    with _EXPORTING, _quieted(loggers, stdout=stdout, stderr=stderr):
        yield


@contextlib.contextmanager
def _quieted(loggers: Sequence[str], *, stdout: bool, stderr: bool) -> Iterator[None]:
    chosen = [logging.getLogger(name) for name in loggers]
    levels = [logger.level for logger in chosen]
    for logger in chosen:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.ExitStack() as stack:
            if stdout:
                stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            if stderr:
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            yield
    finally:
        for logger, level in zip(chosen, levels):
            logger.setLevel(level)
