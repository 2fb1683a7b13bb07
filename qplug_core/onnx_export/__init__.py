"""ONNX QDQ export of the reference form (needs the ``onnx`` extra: onnx, onnxscript)."""

from __future__ import annotations

from qplug_core.onnx_export.api import export_onnx, reference_form, to_onnx_proto

__all__ = ["export_onnx", "reference_form", "to_onnx_proto"]
