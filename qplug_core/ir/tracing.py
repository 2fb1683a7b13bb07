"""``torch.jit.trace`` and modules that compute outside PyTorch.

A compiled partition (ONNX Runtime, OpenVINO) or a weight-only kernel running in ONNX Runtime
hands numpy arrays to its runtime: the tracer records no op for that, only the result it saw, so a
traced onnxruntime model answered every input with its output for the trace's example (SQNR
-1.7 dB on a new input) beside torch's generic tracer warnings. Such modules refuse the tracer.
"""

from __future__ import annotations

import torch

from qplug_core.errors import ModelStateError


def refuse_tracing(what: str) -> None:
    """Raise :class:`ModelStateError` when ``torch.jit.trace`` is recording (``what`` runs outside
    PyTorch, so the trace would hold its answer to the example as a constant)."""
    if torch.jit.is_tracing():
        raise ModelStateError(
            f"torch.jit.trace cannot record {what}: it computes outside PyTorch, so the trace would "
            "return its answer for the example input whatever the input. Ship the model with "
            "qp.save / qp.load, or as ONNX with qp.export_onnx")
