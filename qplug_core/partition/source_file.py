"""A compiled partition's serialized model in a file of its own, removed with the last object holding it.

A model past protobuf's 2 GB limit is handed to the runtime as a file with its weights as external
data beside it (``onnx_export``'s ``OnnxFile``); and a partition keeps each model's source for
rebuilds and ``qp.save`` (``partition/compiled.py``), in a file once the bytes it keeps in memory
would hold a large model's weights once more beside the runtime's copy (:func:`kept_file`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
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


def temporary_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="qplug-partition-"))


def kept_file(source: bytes) -> SourceFile:
    """``source`` (a serialized model) written whole to a :class:`SourceFile`."""
    file = SourceFile(temporary_directory() / _KEPT_NAME, external_data=False)
    try:
        file.path.write_bytes(source)
    except OSError as exc:  # a full disk
        raise ExportError(f"cannot write the partition's serialized model to {file.path}: {exc}") from exc
    return file


def whole_model(source: bytes | os.PathLike) -> bytes | None:
    """``source`` as one serialized message (what ``qp.save`` stores): bytes as they are, a file
    holding the whole model read back; None for a model with external data (past protobuf's limit)."""
    if isinstance(source, bytes):
        return source
    if isinstance(source, SourceFile) and not source.external_data:
        return source.path.read_bytes()
    return None


__all__ = ["SourceFile", "kept_file", "temporary_directory", "whole_model"]
