"""Give a reference-form model int8 weights (and int32 biases) behind dequantize ops, for export.

``ReferenceWeighted`` runs a float module whose weights lie on the int8 grid: exported as is, they
would become float initializers (embedding tables: :mod:`qplug_core.onnx_export.tables`). :func:`with_int8_weights` swaps each one for
:class:`DequantizedWeights`, which holds the integer weight and dequantizes it in ``forward``
(one DequantizeLinear on an int8 initializer in ONNX). When the layer's input comes from a per-tensor
dequantize, the bias is stored as int32 with scale ``input_scale * weight_scale`` and zero point 0,
the form ONNX Runtime needs to fuse the group into QLinearConv / QGemm; the rounding of the bias
moves results by far less than one output step.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import fx, nn
from torch.func import functional_call

from qplug_core import qparams as Q
from qplug_core.flows.graph_utils import is_module_call
from qplug_core.ir.copying import deepcopy_sharing
from qplug_core.ir.qdq_ops import dequantize_op
from qplug_core.kernels.int32_bias import fit_bias
from qplug_core.kernels.reference import (
    Dequantize,
    DynamicQuantize,
    ReferenceRecurrent,
    ReferenceWeighted,
    _QParamsHolder,
    weight_of,
)
from qplug_core.nn.intrinsic import LinearReLU
from qplug_core.onnx_export.lstm import DynamicQuantizedLSTM, dynamic_lstm_problem
from qplug_core.onnx_export.per_token import with_per_token_ops
from qplug_core.onnx_export.tables import Int8Table, int8_table_problem

_INT32 = Q.quant_range(torch.qint32)
T = TypeVar("T", bound=nn.Module)


class DequantizedWeights(nn.Module):
    """A float module whose weight (and bias) are dequantized from stored integers on each call."""

    def __init__(self, reference: ReferenceWeighted, input_qparams: Q.QParams | None):
        super().__init__()
        self.module = _sharing_tensors(reference.module)  # the weight's float copy was dropped right away
        qp = reference.weight_qparams
        self.weight_name = reference.weight_name
        owner_path, _, _ = self.weight_name.rpartition(".")
        owner = self.module.get_submodule(owner_path) if owner_path else self.module
        self.register_buffer("qweight", Q.quantize_in_slices(weight_of(self.module, self.weight_name), qp))
        self.weight_qparams = _QParamsHolder(qp)
        # a bias int32 cannot hold next to the dot product (a model whose convert did not fit the
        # weight scales, ``kernels/int32_bias.py``) stays float: ORT then leaves the layer unfused
        int32_bias = input_qparams is not None and not fit_bias(owner, qp, input_qparams)[1]
        _placeholder(owner, "weight")
        self.bias_name = ""
        bias = getattr(owner, "bias", None)
        if isinstance(bias, torch.Tensor) and int32_bias:
            bias_qp = _bias_qparams(qp, input_qparams)
            self.register_buffer("qbias", Q.quantize(bias.detach(), bias_qp))
            self.bias_qparams = _QParamsHolder(bias_qp)
            self.bias_name = f"{owner_path}.bias" if owner_path else "bias"
            _placeholder(owner, "bias")

    def forward(self, *args, **kwargs):
        tensors = {self.weight_name: dequantize_op(self.qweight, self.weight_qparams.qparams)}
        if self.bias_name:
            tensors[self.bias_name] = dequantize_op(self.qbias, self.bias_qparams.qparams)
        return functional_call(self.module, tensors, args, kwargs)


class DynamicQuantizedLinear(nn.Module):
    """A dynamic int8 ``nn.Linear`` of the reference form (dynamic activation quantization
    followed by a linear on int8-grid weights) as one ``qplug::dynamic_quantized_linear`` call."""

    def __init__(self, reference: ReferenceWeighted):
        super().__init__()
        linear, qp = reference.module, reference.weight_qparams
        self.relu = isinstance(linear, LinearReLU)
        linear = linear[0] if self.relu else linear
        self.register_buffer("qweight_t", Q.quantize_in_slices(linear.weight, qp).t().contiguous())
        self.register_buffer("weight_scale", qp.scale.detach().to(torch.float32).clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.qplug.dynamic_quantized_linear(x, self.qweight_t, self.weight_scale, self.bias)
        return torch.relu(out) if self.relu else out


def _is_dynamic_linear(gm: fx.GraphModule, node: fx.Node, module: ReferenceWeighted) -> bool:
    """A symmetric-weight nn.Linear fed by uint8 [0, 255] dynamic activation quantization."""
    qp, source = module.weight_qparams, node.args[0] if node.args else None
    if type(module.module) not in (nn.Linear, LinearReLU) or qp.dtype != torch.qint8 or len(node.args) != 1:
        return False
    if bool((qp.zero_point != 0).any()) or (qp.axis not in (None, 0)):
        return False
    if not is_module_call(gm, source, DynamicQuantize):  # shared (q, k, v): each quantizes it alike
        return False
    dynamic = gm.get_submodule(source.target)
    return (dynamic.dtype, dynamic.quant_min, dynamic.quant_max) == (torch.quint8, 0, 255)


def _sharing_tensors(module: T) -> T:
    """A copy of ``module`` (a model or a layer) holding its parameters and buffers themselves: the
    export only reads them, and the layers it swaps for int8 ones drop their float weights from
    the copy. Copied, every float weight of a partition was alive twice while it was exported."""
    return deepcopy_sharing(module, [*module.parameters(), *module.buffers()])


def _placeholder(owner: nn.Module, name: str) -> None:
    """Drop a float parameter but keep its name, which ``functional_call`` fills on each call."""
    delattr(owner, name)
    owner.register_buffer(name, torch.empty(0), persistent=False)


def _bias_qparams(weight_qp: Q.QParams, input_qp: Q.QParams) -> Q.QParams:
    scale = (weight_qp.scale.to(torch.float32) * input_qp.scale.to(torch.float32)).reshape(-1)
    axis = 0 if weight_qp.axis is not None else None
    scale = scale if axis is not None else scale.reshape(())
    return Q.QParams(scale, torch.zeros_like(scale, dtype=torch.int64), torch.qint32, *_INT32, axis)


def _input_qparams(gm: fx.GraphModule, node: fx.Node) -> Q.QParams | None:
    """Per-tensor qparams of the value ``node`` reads first, when it comes from a Dequantize."""
    first = node.args[0] if node.args else None
    if not (isinstance(first, fx.Node) and is_module_call(gm, first, Dequantize)):
        return None
    qp = gm.get_submodule(first.target).qparams
    return qp if qp.axis is None else None


def with_int8_weights(gm: fx.GraphModule, *, onnxruntime_ops: bool = False,
                      int32_bias: bool = True, dynamic_linears: bool = True) -> fx.GraphModule:
    """A copy of the reference-form ``gm`` whose weighted modules hold integer weights.

    ``onnxruntime_ops``: dynamic int8 LSTMs become :class:`DynamicQuantizedLSTM` (ONNX Runtime's
    DynamicQuantizeLSTM, a contrib op); otherwise they stay float LSTMs behind
    DynamicQuantizeLinear, the closest standard ONNX has. ``int32_bias=False`` keeps every bias
    float, as PT2E's ``convert_pt2e`` does (the reference form's numbers, unrounded).
    ``dynamic_linears=False`` keeps a dynamic int8 linear's activation quantization a node of its
    own in front of int8 weights, as PT2E writes it, instead of one ``qplug::dynamic_quantized_linear``.
    Embedding tables with per-row qparams become :class:`~qplug_core.onnx_export.tables.Int8Table`.
    """
    out = _sharing_tensors(gm)
    with_per_token_ops(out)
    submodules = dict(out.named_modules())
    for node in out.graph.nodes:
        if node.op != "call_module":
            continue
        module = out.get_submodule(node.target)
        if onnxruntime_ops and isinstance(module, ReferenceRecurrent) \
                and dynamic_lstm_problem(submodules, node) is None:
            out.set_submodule(node.target, DynamicQuantizedLSTM(module.module))
            node.args = (node.args[0].args[0], *node.args[1:])  # the op quantizes its input itself
            continue
        qp = module.weight_qparams if isinstance(module, ReferenceWeighted) else None
        if qp is not None and dynamic_linears and _is_dynamic_linear(out, node, module):
            out.set_submodule(node.target, DynamicQuantizedLinear(module))
            node.args = (node.args[0].args[0],)  # the dynamic quantize is part of the op now
        elif qp is not None and int8_table_problem(module) is None:
            out.set_submodule(node.target, Int8Table(module))
        elif qp is not None and qp.dtype in Q.STORAGE_DTYPE and not qp.zero_point.is_floating_point():
            input_qparams = _input_qparams(out, node) if int32_bias else None
            out.set_submodule(node.target, DequantizedWeights(module, input_qparams))
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


__all__ = ["DequantizedWeights", "DynamicQuantizedLinear", "with_int8_weights"]
