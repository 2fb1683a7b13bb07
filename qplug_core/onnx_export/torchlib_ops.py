"""Read onnxscript's torchlib functions once per process, not on every ``torch.onnx.export``.

Each export builds a fresh registry of ~550 torchlib functions, and onnxscript's
``get_torchlib_ops`` re-parses the Python source of ~500 of them to read one field (their ONNX
domain): ~1 s of every export, 70% of exporting a small partition (the digits CNN's one ONNX
Runtime partition: 3.5 s). The list depends only on the installed onnxscript, so it is kept after
the first call. Where torch's exporter no longer reads it from the same place (another torch
version), exports run as before.
"""

from __future__ import annotations

import functools
import threading

_LOCK = threading.Lock()
_MARK = "_qplug_once_per_process"


def read_torchlib_once() -> None:
    """Make torch's exporter read onnxscript's torchlib functions once per process (idempotent)."""
    try:
        from torch.onnx._internal import _lazy_import
        apis = _lazy_import.onnxscript_apis
        with _LOCK:
            original = apis.get_torchlib_ops
            if getattr(original, _MARK, False):
                return
            once = functools.lru_cache(maxsize=None)(original)
            setattr(once, _MARK, True)
            apis.get_torchlib_ops = once  # the exporter's own handle on the module (a lazy proxy)
    except (ImportError, AttributeError):  # another torch: the exporter reads it as it did
        return


__all__ = ["read_torchlib_once"]
