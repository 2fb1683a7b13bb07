"""What a kernel library printed on stderr while qplug checked it, as part of the check's reason.

Native libraries explain a refusal on file descriptor 2 and raise something generic: QNNPACK
prints "failed to create add operator with 9.97e-06 A-to-output scale ratio: scale ratio must be
in [2**-14, 2**8) range" and torch then raises "INTERNAL ASSERT FAILED ... please report a bug to
PyTorch". The convert-time checks run a kernel inside :func:`native_stderr`, which redirects the
descriptor to a temporary file, so the printed line joins the warning that keeps the reference form
instead of appearing on the user's terminal without context. Whatever a kernel prints when its
check passes is written back to stderr unchanged.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["NativeOutput", "echo", "native_stderr", "raised"]


class NativeOutput:
    """The text written to file descriptor 2 inside :func:`native_stderr` ('' until it exits)."""

    text = ""


@contextlib.contextmanager
def native_stderr() -> Iterator[NativeOutput]:
    """Capture what native code writes to stderr while the block runs (Python's ``sys.stderr``
    is flushed first, so nothing of the caller's is taken)."""
    output = NativeOutput()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield output
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            output.text = sink.read().decode(errors="replace").strip()


def raised(error: BaseException, output: NativeOutput) -> str:
    """Why a checked kernel failed: what the library printed, which says why where its exception
    does not, and the exception."""
    reason = f"it raised {type(error).__name__}: {' '.join(str(error).split())[:160]}"
    printed = " ".join(output.text.split())
    return f"the kernel library printed {printed[:240]!r} and {reason}" if printed else reason


def echo(output: NativeOutput) -> None:
    """Write captured text back to stderr: a check that passed hides nothing the kernel said."""
    if output.text:
        print(output.text, file=sys.stderr)
