"""A compiled partition's serialized model in a file of its own, removed with the last object holding it.

A model past protobuf's 2 GB limit is handed to the runtime as a file with its weights as external
data beside it (``onnx_export``'s ``OnnxFile``); and a partition keeps each model's source for
rebuilds and ``qp.save`` (``partition/compiled.py``), in a file once the bytes every partition of
the process keeps in memory would pass a budget (:class:`InMemory`; OpenVINO does not keep the
bytes it compiled, so a kept source is a second copy of its weights: 24 partitions under a
per-partition cap kept 97 MiB beside 96 MiB of int8 weights) (:func:`kept_file`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

from qplug_core.errors import ExportError

#: the name of a kept model: OpenVINO picks its reader by the suffix, and every serializer qplug's
#: plugins use writes ONNX
_KEPT_NAME = "partition.onnx"


class SourceFile(os.PathLike):
    """A serialized model at ``path``, in a temporary directory of its own (its tensors in a file
    beside it where ``external_data``), removed when this object is collected."""

    def __init__(self, path: Path, *, external_data: bool):
        self.path = path
        self.external_data = external_data
        self._cleanup = weakref.finalize(self, shutil.rmtree, path.parent, True)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"


_LOCK = threading.Lock()
_IN_MEMORY = [0]  # bytes of kept sources every InMemory of the process counts


class InMemory:
    """The kept sources' bytes one holder (a compiled partition) counts against the process-wide
    budget, given back as it lets them go or when it is collected."""

    def __init__(self) -> None:
        self._held = [0]
        weakref.finalize(self, _give_back, self._held, [])

    def take(self, size: int, budget: int) -> bool:
        """Count ``size`` bytes if every holder's stay within ``budget``; whether they were counted."""
        with _LOCK:
            if _IN_MEMORY[0] + size > budget:
                return False
            _IN_MEMORY[0] += size
            self._held[0] += size
            return True

    def hold(self, size: int) -> None:
        """Count ``size`` bytes, past the budget or not (a deep copy's share of its original's)."""
        with _LOCK:
            _IN_MEMORY[0] += size
            self._held[0] += size

    def give(self, size: int) -> None:
        _give_back(self._held, [size])


def _give_back(held: list[int], part: list[int]) -> None:
    """Give back ``part[0]`` of ``held``'s bytes (all of them where ``part`` is empty)."""
    with _LOCK:
        size = part[0] if part else held[0]
        held[0] -= size
        _IN_MEMORY[0] -= size


def in_memory() -> int:
    """Bytes of kept sources held in memory in this process."""
    return _IN_MEMORY[0]


def temporary_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="qplug-partition-"))


def kept_file(source: bytes) -> SourceFile:
    """``source`` (a serialized model) written whole to a :class:`SourceFile`; :class:`ExportError`
    where it cannot be written (a full disk)."""
    try:
        file = SourceFile(temporary_directory() / _KEPT_NAME, external_data=False)
        file.path.write_bytes(source)
    except OSError as exc:
        raise ExportError(f"cannot write the partition's serialized model to {tempfile.gettempdir()}: {exc}") from exc
    return file


def whole_model(source: bytes | os.PathLike) -> bytes | None:
    """``source`` as one serialized message (what ``qp.save`` stores): bytes as they are, a file
    holding the whole model read back; None for a model with external data (past protobuf's limit)."""
    if isinstance(source, bytes):
        return source
    if isinstance(source, SourceFile) and not source.external_data:
        return source.path.read_bytes()
    return None


__all__ = ["InMemory", "SourceFile", "in_memory", "kept_file", "temporary_directory", "whole_model"]
