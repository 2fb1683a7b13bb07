"""Which nodes of the reference form ONNX Runtime takes, and compiling a partition for it.

Every call node goes to ORT: the exporter (torch.onnx, dynamo) translates the ATen ops of the
reference form, and ORT fuses each DequantizeLinear -> op -> QuantizeLinear group it has an int8
kernel for (QLinearConv, QGemm, QLinearAdd, QLinearConcat, ...) and runs the rest in float, as
the reference form does. A dynamically quantized ``nn.LSTM`` goes too, as ORT's
DynamicQuantizeLSTM (``dynamic_lstm_problem`` says when it cannot). What stays in PyTorch: every
other recurrent layer (ORT has no quantized GRU or cell op), and the nodes reading their tuple
outputs (a partition's inputs and outputs must be tensors); the report says why for each.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from torch import fx, nn

from qplug_core.plugin_api import OperatorSupportBase, computes_tensor

if TYPE_CHECKING:
    from qplug_core.plugin_api import OnnxFile

_RECURRENT = (nn.RNNBase, nn.RNNCellBase)


def _recurrent_module(submodules: dict[str, nn.Module], node: fx.Node) -> nn.Module | None:
    if node.op != "call_module":
        return None
    module = submodules[str(node.target)]
    inner = getattr(module, "module", module)  # the reference form wraps the float module
    return inner if isinstance(inner, _RECURRENT) else None


class OrtSupport(OperatorSupportBase):
    """Every call node but the recurrent layers ORT cannot run and what reads their (tuple)
    outputs: the exporter traces shape arithmetic (``size``, ``getattr``) along with the tensors,
    so those go in too."""

    def is_node_supported(self, submodules: dict[str, nn.Module], node: fx.Node) -> bool:
        if _recurrent_module(submodules, node) is not None:
            return self.unsupported_reason(submodules, node) is None
        if node.op == "call_module":
            return True
        if not computes_tensor(node) or node.target is operator.getitem:
            return all(self.is_node_supported(submodules, a) for a in node.all_input_nodes
                       if a.op != "placeholder")
        return True

    def unsupported_reason(self, submodules: dict[str, nn.Module], node: fx.Node) -> str | None:
        from qplug_core.plugin_api import dynamic_lstm_problem

        module = _recurrent_module(submodules, node)
        if module is None:
            return None if node.op == "call_module" else "it reads a recurrent layer left in PyTorch"
        if not isinstance(module, nn.LSTM):
            return (f"ONNX Runtime has no dynamic int8 {type(module).__name__} op (only "
                    "DynamicQuantizeLSTM); it stays a float layer in PyTorch")
        return dynamic_lstm_problem(submodules, node)


def partition_to_onnx(partition: fx.GraphModule, example_inputs: tuple) -> bytes | OnnxFile:
    """The ONNX QDQ model of one reference-form partition (dynamic int8 LSTMs as ORT's
    DynamicQuantizeLSTM, static linears on 3-D inputs as MatMulIntegerToFloat with their bias:
    :mod:`qplug_onnxruntime.bias`), batch and sequence axes symbolic where the graph leaves them
    free: serialized, or a file with external data when large (``onnx_source``)."""
    from qplug_core.plugin_api import onnx_source, to_onnx_proto

    from qplug_onnxruntime.bias import fuse_linear_biases

    model = to_onnx_proto(partition, example_inputs, onnxruntime_ops=True, flexible=True, check=False)
    fuse_linear_biases(model)
    return onnx_source(model)
