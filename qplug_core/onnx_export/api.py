"""``qp.export_onnx``: a qplug-quantized model as an ONNX QDQ model.

The reference form is what is exported, whatever backend the model was lowered to (it is rebuilt
from the model's save artifact): QuantizeLinear/DequantizeLinear pairs around float ops, weights as
int8 initializers behind DequantizeLinear (per-channel where the model has it), int32 biases, so
ONNX Runtime, TensorRT or OpenVINO fuse them into their int8 kernels.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import ExportError
from qplug_core.flows.tags import KERNEL, recorded_example_inputs

#: ONNX opset the export targets (QuantizeLinear per-axis needs >= 13; ORT 1.17+ runs 21)
DEFAULT_OPSET = 21


def reference_form(qmodel: nn.Module) -> fx.GraphModule:
    """The reference form of a converted model: itself, or rebuilt from its save artifact."""
    from qplug_core.serialization.api import rebuild_reference

    if not isinstance(qmodel, fx.GraphModule):
        raise ExportError(f"export_onnx takes a model converted by qplug (a GraphModule), got "
                          f"{type(qmodel).__name__}; quantize it with qp.quantize / qp.convert_fx first")
    if not any(KERNEL in n.meta for n in qmodel.graph.nodes):
        return qmodel
    return rebuild_reference(qmodel)


@contextlib.contextmanager
def _exporter_quiet() -> Iterator[None]:
    """torch.onnx prints progress on stdout and logs missing torchvision ops: not our user's news."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def to_onnx_proto(gm: fx.GraphModule, example_inputs: tuple, *, opset: int = DEFAULT_OPSET,
                  input_names: list[str] | None = None, output_names: list[str] | None = None,
                  onnxruntime_ops: bool = False):
    """The ONNX ``ModelProto`` of a reference-form GraphModule (checked with ``onnx.checker``).

    ``onnxruntime_ops=True`` also uses ONNX Runtime's contrib ops where standard ONNX has no
    quantized op: dynamic int8 LSTMs become ``com.microsoft.DynamicQuantizeLSTM``.
    """
    import onnx

    from qplug_core.onnx_export.translation import translation_table
    from qplug_core.onnx_export.weights import with_int8_weights

    model = with_int8_weights(gm, onnxruntime_ops=onnxruntime_ops).eval()
    try:
        with warnings.catch_warnings(), torch.no_grad(), _exporter_quiet():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(model, example_inputs, dynamo=True, opset_version=opset,
                                        custom_translation_table=translation_table(),
                                        input_names=input_names, output_names=output_names,
                                        external_data=False, verbose=False, report=False)
    except Exception as exc:
        raise ExportError(f"torch.onnx.export failed on the reference form: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:800]}") from exc
    proto = program.model_proto
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported ONNX model does not pass onnx.checker: {exc}") from exc
    return proto


def export_onnx(qmodel: nn.Module, path: str | os.PathLike[str], example_inputs: Any = None, *,
                opset: int = DEFAULT_OPSET, input_names: list[str] | None = None,
                output_names: list[str] | None = None) -> Path:
    """Write ``qmodel`` (converted by qplug, any backend) to ``path`` as an ONNX QDQ model.

    ``example_inputs`` defaults to tensors shaped like the ones the model was prepared with; the
    exported model has those static shapes. Raises :class:`ExportError` when an op cannot be
    expressed in ONNX.
    """
    import onnx

    from qplug_core.flows.steps import as_input_tuple

    gm = reference_form(qmodel)
    inputs = recorded_example_inputs(gm) if example_inputs is None else as_input_tuple(example_inputs)
    proto = to_onnx_proto(gm, inputs, opset=opset, input_names=input_names, output_names=output_names)
    target = Path(path)
    onnx.save(proto, str(target))
    return target
