"""A compiled partition's ONNX model as its runtime reads it: bytes, or a file when it is large.

One protobuf message cannot pass 2 GB, so a partition whose weights came near that failed in
``SerializeToString`` (some 2 billion int8 weights in one partition). Above :data:`PARTITION_FILE_BYTES`
of initializers the model is written to a temporary directory with its initializers as ONNX
external data beside it and checked from there; the runtime reads it from the path (ONNX Runtime
and OpenVINO both take one with external data) and the directory goes when the :class:`OnnxFile`
does, once the model is compiled. Nor does the serialized model then sit in memory beside the
runtime's own copy while it compiles.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qplug_core.errors import ExportError
from qplug_core.partition.source_file import SourceFile, temporary_directory

#: initializer bytes above which a partition's model is handed over as a file with external data
#: (patched lower by tests; protobuf's limit is 2 GB for the whole message)
PARTITION_FILE_BYTES = 2**30
_NAME = "partition.onnx"


class OnnxFile(SourceFile):
    """An ONNX model written to a temporary directory of its own (its external data beside it),
    removed when this object is collected."""

    def __init__(self, directory: Path):
        super().__init__(directory / _NAME, external_data=True)


def onnx_source(model) -> bytes | OnnxFile:
    """``model`` (an ``onnx.ModelProto``, checked with ``onnx.checker`` here) serialized, or written
    to an :class:`OnnxFile` when its initializers pass :data:`PARTITION_FILE_BYTES`."""
    import onnx

    if sum(t.ByteSize() for t in model.graph.initializer) <= PARTITION_FILE_BYTES:
        source = model.SerializeToString()
        _check(onnx, source)
        return source
    file = OnnxFile(temporary_directory())
    try:
        onnx.save_model(model, file.path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{_NAME}.data", size_threshold=1024)
    except Exception as exc:  # OSError, a full disk
        raise ExportError(f"cannot write the partition's ONNX model to {file.path}: {type(exc).__name__}: "
                          f"{exc}") from exc
    _check(onnx, file)
    return file


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


__all__ = ["PARTITION_FILE_BYTES", "OnnxFile", "onnx_input_shapes", "onnx_input_shapes_read", "onnx_source"]
