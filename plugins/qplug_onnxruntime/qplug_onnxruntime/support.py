"""Which nodes of the reference form ONNX Runtime takes, and compiling a partition for it.

Every call node goes to ORT: the exporter (torch.onnx, dynamo) translates
the ATen ops of the reference form, and ORT fuses each DequantizeLinear -> op -> QuantizeLinear
group it has an int8 kernel for (QLinearConv, QGemm, QLinearAdd, QLinearConcat, ...) and runs the
rest in float, as the reference form does. What stays in PyTorch: recurrent layers, and the nodes
reading their tuple outputs (a partition's inputs and outputs must be tensors).
"""

from __future__ import annotations

import operator

from torch import fx, nn

from qplug_core.plugin_api import OperatorSupportBase, computes_tensor

_STAY_IN_TORCH = (nn.RNNBase, nn.RNNCellBase)


class OrtSupport(OperatorSupportBase):
    """Every call node but recurrent layers and what reads their (tuple) outputs: the exporter
    traces shape arithmetic (``size``, ``getattr``) along with the tensors, so those go in too."""

    def is_node_supported(self, submodules: dict[str, nn.Module], node: fx.Node) -> bool:
        if node.op == "call_module":
            module = submodules[str(node.target)]
            inner = getattr(module, "module", module)  # ReferenceWeighted wraps the float module
            return not isinstance(module, _STAY_IN_TORCH) and not isinstance(inner, _STAY_IN_TORCH)
        if not computes_tensor(node) or node.target is operator.getitem:
            return all(self.is_node_supported(submodules, a) for a in node.all_input_nodes
                       if a.op != "placeholder")
        return True


def partition_to_onnx(partition: fx.GraphModule, example_inputs: tuple) -> bytes:
    """The serialized ONNX QDQ model of one reference-form partition."""
    from qplug_core.plugin_api import to_onnx_proto

    return to_onnx_proto(partition, example_inputs).SerializeToString()
