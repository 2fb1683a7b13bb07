"""What a plugin may not change for the rest of the process while it is imported or a hook runs.

A plugin is third-party code running inside the user's program and inside ``qplug --json``. Its
``print`` must not end up in a JSON document on stdout, the warning filters it sets for itself
must not turn another plugin's failure into a traceback, and an engine it selects at import must
not silently change how other backends pack their weights. :func:`plugin_import` and
:func:`plugin_call` fence one import or one hook call; the loader reports what they undid.

Output is fenced at the file-descriptor level too (a native library's ``printf`` writes to fd 1,
below ``sys.stdout``), and ``os._exit`` raises :class:`HardExit` inside a fence, so that a plugin
ending the process is reported as a failure of that plugin and hook instead of an exit 0 with no
output. Fault isolation, not a sandbox: a plugin can still reach the system call itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, TextIO

#: a plugin import slower than this is named in a warning (``qplug plugins`` shows every time)
SLOW_IMPORT_SECONDS = 2.0


class HardExit(SystemExit):
    """A plugin called ``os._exit`` inside a fence (caught where a ``SystemExit`` would be)."""


def _refuse_hard_exit(status: int) -> None:
    raise HardExit(f"os._exit({status}) was called; a plugin may not end the process")


def _flush_c_stdio() -> None:
    """Flush the C library's stdout buffer (``printf`` output not yet written to fd 1)."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)


class _StdoutToStderr:
    """Send ``sys.stdout`` (and fd 1) to ``sys.stderr`` (fd 2) while at least one fenced block
    runs, in any thread; ``os._exit`` raises :class:`HardExit` meanwhile.

    ``contextlib.redirect_stdout`` is not safe when two threads overlap (the one leaving last
    would restore the other's redirection), so the blocks are counted and the first one in saves
    the real stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: TextIO | None = None
        self._saved_fd: int | None = None
        self._saved_exit = os._exit

    def _enter(self) -> None:
        self._saved = sys.stdout
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout = sys.stderr
        _flush_c_stdio()
        try:
            self._saved_fd = os.dup(1)
            os.dup2(2, 1)
        except OSError:  # no usable fd 1 or 2 (a GUI process): sys.stdout is fenced all the same
            self._saved_fd = None
        self._saved_exit, os._exit = os._exit, _refuse_hard_exit

    def _leave(self) -> None:
        os._exit = self._saved_exit
        _flush_c_stdio()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if self._saved_fd is not None:
            os.dup2(self._saved_fd, 1)
            os.close(self._saved_fd)
            self._saved_fd = None
        sys.stdout = self._saved or sys.__stdout__
        self._saved = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._enter()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._leave()


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
