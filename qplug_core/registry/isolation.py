"""What a plugin may not change for the rest of the process while it is imported or a hook runs.

A plugin is third-party code running inside the user's program and inside ``qplug --json``. Its
``print`` must not end up in a JSON document on stdout, the warning filters it sets for itself
must not turn another plugin's failure into a traceback, and an engine it selects at import must
not silently change how other backends pack their weights. :func:`plugin_import` and
:func:`plugin_call` fence one import or one hook call; the loader reports what they undid.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, TextIO

#: a plugin import slower than this is named in a warning (``qplug plugins`` shows every time)
SLOW_IMPORT_SECONDS = 2.0


class _StdoutToStderr:
    """Send ``sys.stdout`` to ``sys.stderr`` while at least one fenced block runs, in any thread.

    ``contextlib.redirect_stdout`` is not safe when two threads overlap (the one leaving last
    would restore the other's redirection), so the blocks are counted and the first one in saves
    the real stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: TextIO | None = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = sys.stdout
                sys.stdout = sys.stderr
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    sys.stdout = self._saved or sys.__stdout__
                    self._saved = None


stdout_to_stderr = _StdoutToStderr()


@dataclass
class ImportEffects:
    """What fencing one plugin import found: its duration and the engine change it undid."""

    seconds: float = 0.0
    engine_changed: tuple[str, str | None] | None = None  # (engine before, engine the plugin set)


def _quantized_engine() -> str | None:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.backends.quantized.engine


@contextlib.contextmanager
def plugin_import() -> Iterator[ImportEffects]:
    """Fence one plugin import: stdout to stderr, warning filters and quantized engine restored.

    Call it with torch already imported (the loader does), so that the engine before the import
    is known. Not thread-safe by itself: the loader holds its lock while importing.
    """
    effects = ImportEffects()
    engine = _quantized_engine()
    started = time.perf_counter()
    try:
        with stdout_to_stderr(), warnings.catch_warnings():
            yield effects
    finally:
        effects.seconds = time.perf_counter() - started
        now = _quantized_engine()
        if engine is not None and now != engine:
            sys.modules["torch"].backends.quantized.engine = engine
            effects.engine_changed = (engine, now)


@contextlib.contextmanager
def plugin_call() -> Iterator[None]:
    """Fence one hook call: whatever it prints goes to stderr."""
    with stdout_to_stderr():
        yield
