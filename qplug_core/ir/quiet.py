"""torch's exporters talk to the terminal: progress on stdout, notes and whole graphs on stderr.

qplug calls them where their failure is expected and handled (``capture="auto"`` trying
torch.export before symbolic tracing; the ONNX exporter), so what they print is noise to the user,
who gets qplug's own error or warning instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def quiet_torch(loggers: Sequence[str], *, stdout: bool = False, stderr: bool = False) -> Iterator[None]:
    """``loggers`` at ERROR, and what is printed on the chosen streams caught, for the block."""
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
