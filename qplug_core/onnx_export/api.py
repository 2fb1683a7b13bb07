"""``qp.export_onnx``: a qplug-quantized model as an ONNX QDQ model.

The reference form is what is exported, whatever backend the model was lowered to (it is rebuilt
from the model's save artifact): QuantizeLinear/DequantizeLinear pairs around float ops, weights as
int8 initializers behind DequantizeLinear (per-channel where the model has it), int32 biases, so
ONNX Runtime, TensorRT or OpenVINO fuse them into their int8 kernels.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import ExportError
from qplug_core.flows.tags import INPUT_SPEC, KERNEL, SPEC_DTYPES, recorded_example_inputs
from qplug_core.ir.quiet import quiet_torch
from qplug_core.kernels.per_token import PerTokenDynamicLinear
from qplug_core.onnx_export import dynamic_axes as axes
from qplug_core.onnx_export.torchlib_ops import read_torchlib_once
from qplug_core.onnx_export.trace_release import forget_last_trace

#: ONNX opset the export targets (QuantizeLinear per-axis needs >= 13; ORT 1.17+ runs 21)
DEFAULT_OPSET = 21


def reference_form(qmodel: nn.Module, entry: str = "export_onnx") -> fx.GraphModule:
    """The reference form of a converted model: itself, or rebuilt from its save artifact
    (``entry``: the public function asking, which the error names)."""
    from qplug_core.serialization.api import rebuild_reference

    if not isinstance(qmodel, fx.GraphModule):
        raise ExportError(f"{entry} takes a model converted by qplug in graph mode (a GraphModule), got "
                          f"{type(qmodel).__name__}; quantize it with qp.quantize / qp.convert_fx first (for "
                          "dynamic int8, qp.convert_fx(qp.prepare_fx(model, qp.get_default_qconfig_mapping("
                          "backend, mode='dynamic'), example_inputs)) exports; qp.quantize_dynamic, "
                          "qp.quantize_weights and qp.quantize_w8a8 swap modules and give no graph to export)")
    if not any(KERNEL in n.meta for n in qmodel.graph.nodes):
        return qmodel
    gm = rebuild_reference(qmodel)
    # the layers an accuracy target moved to per-token dynamic are float linears in the recorded
    # form (as in a file): the ones the model runs go in their place, or the ONNX model would
    # answer unlike the model it came from
    for name, module in qmodel.named_modules():
        if isinstance(module, PerTokenDynamicLinear):
            gm.set_submodule(name, module)
    return gm


#: bytes recorded example inputs may take whatever the model's size (or the model's own, if more)
RECORDED_INPUT_FLOOR = 64 * 2**20


def recorded_inputs(gm: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    """Zeros shaped like the inputs ``gm`` was prepared with, once their size is checked.

    A loaded model's recorded shapes are whatever the file says: a 6.7 KB file may ask for
    gigabytes. They are refused (:class:`ExportError`, naming the input) when together they need
    more than :data:`RECORDED_INPUT_FLOOR` bytes or the bytes of the model's own tensors,
    whichever is more; pass ``example_inputs`` to export such a model.
    """
    specs = [(n.name, n.meta.get(INPUT_SPEC)) for n in gm.graph.nodes if n.op == "placeholder"]
    model_bytes = sum(t.numel() * t.element_size() for t in (*gm.parameters(), *gm.buffers()))
    limit = max(RECORDED_INPUT_FLOOR, model_bytes)
    total = 0
    for name, spec in specs:
        if spec is None:
            continue
        if any(not isinstance(size, int) or size < 0 for size in spec["shape"]):
            raise ExportError(f"input {name!r}: the recorded shape {spec['shape']} is not a shape")
        total += math.prod(spec["shape"]) * SPEC_DTYPES[spec["dtype"]].itemsize
        if total > limit:
            raise ExportError(f"the recorded example input shapes (input {name!r}: {spec['shape']}) need "
                              f"{total:,} bytes, more than the {limit:,} bytes allowed for a model of "
                              f"this size; pass example_inputs= (the CLI: --example-shape) to export it")
    return recorded_example_inputs(gm)


#: loggers of the exporter's stack whose warnings are not the user's news: torch.onnx's missing
#: torchvision ops, onnxscript's constant folder giving up on a node ("Evaluation failed: ..."),
#: which it then leaves unfolded, onnx_ir's passes ("Skipped deduplication of initializer
#: 'row_result' as it is a graph input or output", for each embedding bag)
_QUIET_LOGGERS = ("torch.onnx", "onnxscript", "onnx_ir")


def _exporter_quiet() -> contextlib.AbstractContextManager[None]:
    """torch.onnx prints progress on stdout, and it and onnxscript log notes on stderr."""
    return quiet_torch(_QUIET_LOGGERS, stdout=True)


def _program(gm: fx.GraphModule, example_inputs: tuple, *, opset: int, input_names: list[str] | None,
             output_names: list[str] | None, onnxruntime_ops: bool, dynamic: dict[int, str] | None,
             flexible: bool, dynamic_linears: str):
    """torch.onnx's ``ONNXProgram`` of ``gm`` (unserialized), with the inputs it was exported for."""
    from qplug_core.onnx_export.translation import translation_table
    from qplug_core.onnx_export.weights import with_int8_weights

    table = translation_table(dynamic_linears)
    model = with_int8_weights(gm, onnxruntime_ops=onnxruntime_ops).eval()
    shapes = None
    if dynamic:
        example_inputs, shapes = axes.prepare(example_inputs, dynamic)
    elif flexible:  # the axes the graph takes at other sizes, decided before the export
        shapes = axes.flexible_shapes(example_inputs, axes.free_axes(gm, example_inputs))
        shapes = shapes if any(shape is not None for shape in shapes) else None

    def export(dynamic_shapes):
        read_torchlib_once()
        try:
            with warnings.catch_warnings(), torch.no_grad(), _exporter_quiet():
                warnings.simplefilter("ignore")
                return torch.onnx.export(model, example_inputs, dynamo=True, opset_version=opset,
                                         custom_translation_table=table,
                                         input_names=input_names, output_names=output_names,
                                         dynamic_shapes=dynamic_shapes, external_data=False, verbose=False,
                                         report=False)
        except Exception as exc:
            if dynamic and axes.specialised(exc):
                raise axes.export_failure(exc, dynamic) from exc
            raise ExportError(f"torch.onnx.export failed on the reference form: {type(exc).__name__}: "
                              f"{axes.torch_message(exc, 800)}") from exc
        finally:
            forget_last_trace()

    if flexible and shapes is not None:  # symbolic sizes are an optimisation: static if they fail
        try:
            program = export(shapes)
        except ExportError:
            program = None
        if program is None or not axes.free_symbols_only(program.exported_program):
            program = export(None)
        return program, example_inputs, shapes is not None
    return export(shapes), example_inputs, False


def to_onnx_proto(gm: fx.GraphModule, example_inputs: tuple, *, opset: int = DEFAULT_OPSET,
                  input_names: list[str] | None = None, output_names: list[str] | None = None,
                  onnxruntime_ops: bool = False, dynamic: dict[int, str] | None = None,
                  flexible: bool = False, dynamic_linears: str = "matmul_integer", check: bool = True):
    """The ONNX ``ModelProto`` of a reference-form GraphModule (checked with ``onnx.checker``).

    ``check=False`` leaves the check to the caller: a compiled partition's
    :func:`~qplug_core.onnx_export.partition_source.onnx_source` checks the model it hands its
    runtime, from a file past 2 GB (protobuf's limit, which the check in memory has too);
    :func:`export_onnx` writes bigger models with external data. ``onnxruntime_ops=True`` also uses ONNX Runtime's
    contrib ops where standard ONNX has no
    quantized op: dynamic int8 LSTMs become ``com.microsoft.DynamicQuantizeLSTM``. ``dynamic``
    (``{axis: name}``, :mod:`~qplug_core.onnx_export.dynamic_axes`) makes those axes of every input
    symbolic, or raises :class:`ExportError`. ``flexible=True`` (a compiled partition) makes every
    axis of every input of size >= 2 symbolic where the graph leaves it free and keeps the rest
    static (:func:`~qplug_core.onnx_export.dynamic_axes.flexible_shapes`); a graph that ties or
    bounds those sizes, or that the exporter cannot take with symbolic sizes, is exported with the
    example's static shapes. ``dynamic_linears="dequantized_weights"`` exports dynamic int8
    linears as int8 weights into a float MatMul, for a runtime that quantizes their activations
    itself (OpenVINO); the default is ONNX Runtime's ``DynamicQuantizeLinear`` + ``MatMulInteger``.
    The exporter's notes for readers (node stack traces, ``value_info``) are left out unless
    ``QPLUG_DEBUG=1`` (:mod:`~qplug_core.onnx_export.annotations`).
    """
    import onnx

    from qplug_core.onnx_export import region_models
    from qplug_core.onnx_export.annotations import strip_annotations

    options = (opset, onnxruntime_ops, dynamic_linears)
    named = input_names is not None or output_names is not None or bool(dynamic)
    proto = None if named else region_models.cut(gm, example_inputs, options)  # a check graph's model
    if proto is None:
        program, example_inputs, symbolic = _program(
            gm, example_inputs, opset=opset, input_names=input_names, output_names=output_names,
            onnxruntime_ops=onnxruntime_ops, dynamic=dynamic, flexible=flexible, dynamic_linears=dynamic_linears)
        if dynamic:
            axes.untie(program.model, dynamic)
        proto = program.model_proto
        if symbolic:
            axes.pin(proto, program.exported_program)
        if dynamic:
            axes.check(program, example_inputs, dynamic)
        if not named:
            region_models.remember(gm, example_inputs, options, program.exported_program, proto)
        strip_annotations(proto)
    if check:
        try:
            onnx.checker.check_model(proto)
        except onnx.checker.ValidationError as exc:
            raise ExportError(f"the exported ONNX model does not pass onnx.checker: {exc}") from exc
    return proto


#: initializer bytes above which :func:`export_onnx` writes them to ``<path>.data`` beside the
#: model (ONNX external data): one protobuf message cannot pass 2 GB, graph included
EXTERNAL_DATA_BYTES = 2**30


def _initializer_bytes(program) -> int:
    return sum(value.const_value.nbytes for value in program.model.graph.initializers.values()
               if value.const_value is not None)


def _write(program, target: Path) -> None:
    """Write and check ``program`` at ``target``, its initializers in ``<target>.data`` when big.

    Without the exporter's notes for readers (:mod:`~qplug_core.onnx_export.annotations`): node
    stack traces name the quantizing machine's source paths, and were 24.8 of the digits CNN's
    55.0 kB. Checked from the file (``onnx.checker`` on a path takes external data and models past
    2 GB); whatever fails on the way is an :class:`ExportError`.
    """
    import onnx

    from qplug_core.onnx_export.annotations import strip_annotations

    external = _initializer_bytes(program) > EXTERNAL_DATA_BYTES
    data = target.with_name(target.name + ".data")
    try:
        program.save(str(target), external_data=external)
        header = onnx.load(str(target), load_external_data=False)  # initializers past 2 GB stay in the .data file
        strip_annotations(header)
        onnx.save(header, str(target))
    except Exception as exc:  # OSError, protobuf's EncodeError, onnx_ir's ValueError: all "not written"
        raise ExportError(f"cannot write {target}" + (f" and its external data {data}" if external else "")
                          + f": {type(exc).__name__}: {exc}") from exc
    try:
        onnx.checker.check_model(str(target))
    except Exception as exc:
        raise ExportError(f"the exported ONNX model {target} does not pass onnx.checker: {exc}") from exc


def export_onnx(qmodel: nn.Module, path: str | os.PathLike[str], example_inputs: Any = None, *,
                opset: int = DEFAULT_OPSET, input_names: list[str] | None = None,
                output_names: list[str] | None = None, dynamic_batch: bool = False,
                dynamic_sequence: bool = False, dynamic_axes: Mapping[int, str] | None = None) -> Path:
    """Write ``qmodel`` (converted by qplug, any backend) to ``path`` as an ONNX QDQ model.

    ``example_inputs`` defaults to tensors shaped like the ones the model was prepared with; the
    exported model has those static shapes, except axis 0 of every input with ``dynamic_batch``
    (ONNX dimension ``batch``), axis 1 of every input of rank >= 2 with ``dynamic_sequence``
    (``sequence``: token models) and the axes ``dynamic_axes`` names (``{axis: name}``, for every
    input of higher rank: ``{0: "batch", 2: "time"}`` for a ``(batch, channels, time)`` input). The recorded shapes may come from a file (a loaded model), so
    they are bounded before anything is allocated (:func:`recorded_inputs`). Raises
    :class:`ExportError` when an op cannot be expressed in ONNX, or the graph fixes an axis asked
    to be dynamic.
    """
    from qplug_core.flows.steps import as_input_tuple

    target = Path(path)
    if target.is_dir() or not target.parent.is_dir():  # said before the export's seconds, not after
        raise ExportError(f"cannot write {target}: " + ("it is a directory" if target.is_dir() else
                                                        f"the directory {target.parent} does not exist"))
    dynamic = axes.dynamic_axes(dynamic_batch, dynamic_sequence, dynamic_axes)
    gm = reference_form(qmodel)
    inputs = recorded_inputs(gm) if example_inputs is None else as_input_tuple(example_inputs)
    program, inputs, _ = _program(gm, inputs, opset=opset, input_names=input_names, output_names=output_names,
                                  onnxruntime_ops=False, dynamic=dynamic, flexible=False,
                                  dynamic_linears="matmul_integer")
    if dynamic:
        axes.check(program, inputs, dynamic)
        axes.untie(program.model, dynamic)
    _write(program, target)
    return target
