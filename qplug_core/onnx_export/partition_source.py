"""A compiled partition's ONNX model as its runtime reads it: bytes, or a file when it is large.

One protobuf message cannot pass 2 GB, so a partition whose weights came near that failed in
``SerializeToString`` (some 2 billion int8 weights in one partition). Above :data:`PARTITION_FILE_BYTES`
of initializers the model is written to a temporary directory with its initializers as ONNX
external data beside it and checked from there; the runtime reads it from the path (ONNX Runtime
and OpenVINO both take one with external data) and the directory goes when the :class:`OnnxFile`
does, once the model is compiled. Nor does the serialized model then sit in memory beside the
runtime's own copy while it compiles. A compiled partition keeps its source for rebuilds and
``qp.save``; a large one in bytes is kept in a file of its own (:func:`kept_file`) for the same reason.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qplug_core.errors import ExportError

#: initializer bytes above which a partition's model is handed over as a file with external data
#: (patched lower by tests; protobuf's limit is 2 GB for the whole message)
PARTITION_FILE_BYTES = 2**30
_NAME = "partition.onnx"


class OnnxFile(os.PathLike):
    """An ONNX model written to a temporary directory of its own (its external data beside it,
    where ``external_data``), removed when this object is collected."""

    def __init__(self, directory: Path, *, external_data: bool = True):
        self.path = directory / _NAME
        self.external_data = external_data
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"OnnxFile({str(self.path)!r})"


def onnx_source(model) -> bytes | OnnxFile:
    """``model`` (an ``onnx.ModelProto``, checked with ``onnx.checker`` here) serialized, or written
    to an :class:`OnnxFile` when its initializers pass :data:`PARTITION_FILE_BYTES`."""
    import onnx

    if sum(t.ByteSize() for t in model.graph.initializer) <= PARTITION_FILE_BYTES:
        source = model.SerializeToString()
        _check(onnx, source)
        return source
    file = OnnxFile(_directory())
    try:
        onnx.save_model(model, file.path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{_NAME}.data", size_threshold=1024)
    except Exception as exc:  # OSError, a full disk
        raise ExportError(f"cannot write the partition's ONNX model to {file.path}: {type(exc).__name__}: "
                          f"{exc}") from exc
    _check(onnx, file)
    return file


def kept_file(source: bytes) -> OnnxFile:
    """``source`` (a serialized model) written to an :class:`OnnxFile` of its own, in one file."""
    file = OnnxFile(_directory(), external_data=False)
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
    if isinstance(source, OnnxFile) and not source.external_data:
        return source.path.read_bytes()
    return None


def _directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="qplug-partition-"))


def _check(onnx, source: bytes | OnnxFile) -> None:
    """``onnx.checker`` on the model as the runtime will read it (a file: its external data too)."""
    try:
        onnx.checker.check_model(source)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported ONNX model does not pass onnx.checker: {exc}") from exc


def onnx_input_shapes(source: bytes | os.PathLike) -> Any:
    """The input shapes (fixed or symbolic, with their smallest sizes) of a partition's ONNX model
    (bytes or an :class:`OnnxFile`): ``.fit([tensor, ...])`` says whether inputs fit it, for a
    runtime's ``CompiledPartition.serves``."""
    from qplug_core.onnx_export.dynamic_axes import InputShapes

    return InputShapes.of(source)


def onnx_input_shapes_read(inputs: Sequence[tuple[str, int, Sequence[int | str | None]]],
                           metadata: Mapping[str, str]) -> Any:
    """:func:`onnx_input_shapes` from what a runtime read of the model itself: (name, ONNX element
    type, sizes) per input (a size None or 0 where unknown) and the model's metadata properties,
    so the model is not parsed once more (for a whole-model partition, a copy of every weight)."""
    from qplug_core.onnx_export.dynamic_axes import InputShapes

    return InputShapes.described(inputs, metadata)


__all__ = ["PARTITION_FILE_BYTES", "OnnxFile", "kept_file", "onnx_input_shapes", "onnx_input_shapes_read", "onnx_source",
           "whole_model"]
