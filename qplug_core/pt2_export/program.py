"""``qp.export_program``: the ``torch.export`` of a converted model, whatever its backend.

``torch.export.export`` cannot take a lowered model: fbgemm's and qnnpack's packed weights are
torch script objects with no fake class (torch 2.13 registers none), and delegated partitions run
in other runtimes. What exports is the reference form the model keeps (``onnx_export.api``): with
int8 weights behind dequantize ops and float biases, it is what PT2E's ``convert_pt2e`` gives, so
``torch.compile``/AOTInductor's x86 int8 lowering and ExecuTorch can take it from here (not
XNNPACK's delegate from a qnnpack model: ``xnnpack_layout``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, ExportError
from qplug_core.flows.pipeline import as_input_tuple
from qplug_core.flows.tags import STATE
from qplug_core.onnx_export.api import recorded_inputs, reference_form
from qplug_core.onnx_export.weights import with_int8_weights
from qplug_core.pt2_export.decomposed import require_namespace, to_decomposed
from qplug_core.pt2_export.xnnpack_layout import warn_if_not_xnnpack_layout

#: what ``ops=`` takes
OPS = ("quantized_decomposed", "qplug")


def _export(model: nn.Module, inputs: tuple, dynamic_shapes: Any) -> torch.export.ExportedProgram:
    try:
        with torch.no_grad():
            return torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:
        raise ExportError(f"torch.export.export failed on the reference form: {type(exc).__name__}: "
                          f"{str(exc)[:800]}") from exc


def export_program(qmodel: nn.Module, example_inputs: Any = None, *, dynamic_shapes: Any = None,
                   ops: str = "quantized_decomposed") -> torch.export.ExportedProgram:
    """``qmodel`` (converted by qplug in graph mode, any backend) as an ``ExportedProgram`` of its
    reference form: int8 weights behind dequantize ops, float biases, quantize/dequantize pairs
    around float ops, as ``convert_pt2e`` writes them.

    ``ops="quantized_decomposed"`` (torch's namespace, which that namespace's consumers match on)
    needs it registered (``import torch.ao.quantization.fx._decomposed``: qplug does not import
    torch.ao); ``ops="qplug"`` keeps ``torch.ops.qplug.*`` (same schemas; ``import qplug_core.ir.qdq_ops``
    before ``torch.export.load``). ``example_inputs`` defaults to zeros shaped like the inputs the
    model was prepared with; ``dynamic_shapes`` goes to ``torch.export.export``. Dynamic int8
    layers become ``choose_qparams`` + quantize/dequantize, as in PT2E. Raises :class:`ExportError`.
    """
    if ops not in OPS:
        raise ConfigValidationError(f"ops must be one of {OPS}, got {ops!r}", field="ops", value=ops)
    if ops == "quantized_decomposed":
        require_namespace()
    gm = reference_form(qmodel, "export_program")
    inputs = recorded_inputs(gm) if example_inputs is None else as_input_tuple(example_inputs)
    weights = with_int8_weights(gm, int32_bias=False, dynamic_linears=False)
    program = _export(weights.eval(), inputs, dynamic_shapes)
    if ops == "quantized_decomposed":
        module = program.module()
        to_decomposed(module)
        program = _export(module, inputs, dynamic_shapes)
    warn_if_not_xnnpack_layout(program, qmodel.meta.get(STATE, {}).get("backend"))
    return program
