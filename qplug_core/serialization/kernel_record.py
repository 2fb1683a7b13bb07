"""The weight-only kernel a saved linear ran, as data in its file entry.

Kernels are chosen by timing (:mod:`qplug_core.weight_only.selection`), and they round differently
(ONNX Runtime's ``MatMulNBits`` quantizes activations per block, torch's ``_weight_int8pack_mm`` does
not): choosing again at every load made two processes loading one file answer differently. The
record is the kernel's name and the most rows it takes (``null``: all; the reference takes the
rest); ``qp.load`` looks the name up among the kernels installed there, nothing in it is imported
or run.
"""

from __future__ import annotations

from typing import Any

from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.errors import ConfigError
from qplug_core.kernels.weight_only import WeightOnlyKernel
from qplug_core.weight_only.selection import recorded_as

KEY = "kernel"
_FIELDS = ("name", "max_rows")
_MAX_NAME = 200


def to_document(kernel: WeightOnlyKernel) -> dict[str, Any]:
    name, max_rows = recorded_as(kernel)
    return {"name": name, "max_rows": max_rows}


def from_document(doc: Any, path: str) -> tuple[str, int | None]:
    """The checked record (name, most rows); raises :class:`ConfigError` naming the bad field."""
    read_fields(doc, path, _FIELDS, required=_FIELDS)
    name = expect(doc["name"], str, child(path, "name"), "a kernel name")
    if not 0 < len(name) <= _MAX_NAME or not name.isprintable():
        raise ConfigError(f"{where(child(path, 'name'))}: {name[:_MAX_NAME]!r} is not a kernel name",
                          field=child(path, "name"), value=name[:_MAX_NAME])
    max_rows = doc["max_rows"]
    if max_rows is not None and not (expect(max_rows, int, child(path, "max_rows"), "a row count or null") > 0):
        raise ConfigError(f"{where(child(path, 'max_rows'))}: {max_rows} rows is not a positive count",
                          field=child(path, "max_rows"), value=max_rows)
    return name, max_rows
