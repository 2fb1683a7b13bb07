"""Which nodes of the reference form ONNX Runtime takes, and compiling a partition for it.

Every call node whose value is a tensor goes to ORT: the exporter (torch.onnx, dynamo) translates
the ATen ops of the reference form, and ORT fuses each DequantizeLinear -> op -> QuantizeLinear
group it has an int8 kernel for (QLinearConv, QGemm, QLinearAdd, QLinearConcat, ...) and runs the
rest in float, as the reference form does. What stays in PyTorch: nodes producing non-tensors
(shapes, tuples: ONNX values are tensors), recurrent layers (their tuple outputs), run-time
(dynamic) activation quantization, which the reference computes with data-dependent Python.
"""

from __future__ import annotations

from torch import fx, nn

from qplug_core.fx.tags import VALUE_KIND
from qplug_core.kernels.reference import DynamicQuantize
from qplug_core.partition import OperatorSupportBase

_STAY_IN_TORCH = (DynamicQuantize, nn.RNNBase, nn.RNNCellBase)


class OrtSupport(OperatorSupportBase):
    """Tensor-valued call nodes, except the module types in ``_STAY_IN_TORCH``."""

    def is_node_supported(self, submodules: dict[str, nn.Module], node: fx.Node) -> bool:
        if node.meta.get(VALUE_KIND) not in ("float_tensor", "tensor"):
            return False
        if node.op == "call_module":
            module = submodules[str(node.target)]
            inner = getattr(module, "module", module)  # ReferenceWeighted wraps the float module
            return not isinstance(module, _STAY_IN_TORCH) and not isinstance(inner, _STAY_IN_TORCH)
        return True


def partition_to_onnx(partition: fx.GraphModule, example_inputs: tuple) -> bytes:
    """The serialized ONNX QDQ model of one reference-form partition."""
    from qplug_core.onnx_export import to_onnx_proto

    return to_onnx_proto(partition, example_inputs).SerializeToString()
