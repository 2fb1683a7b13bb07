"""Who reads qplug's messages: Python code or a shell user of the ``qplug`` command.

An error that suggests a fix names the fix the reader can type: ``backend=...`` in Python,
``--backend NAME`` in the shell. The CLI switches the audience for the duration of a command.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_CLI = contextvars.ContextVar("cli_audience", default=False)


def spelled(python: str, cli: str) -> str:
    """``python`` for library users, ``cli`` while a ``qplug`` command runs."""
    return cli if _CLI.get() else python


@contextlib.contextmanager
def cli_audience() -> Iterator[None]:
    """Messages raised inside speak the command line's language."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)
