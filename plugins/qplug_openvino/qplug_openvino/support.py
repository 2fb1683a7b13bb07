"""Which nodes of the reference form OpenVINO takes, and the ONNX model of a partition.

Every call node goes to OpenVINO (the exporter translates the reference form's ATen ops to
standard ONNX, and OpenVINO runs in float what it has no int8 kernel for, as the reference form
does), except:

* the recurrent layers: static mode leaves them float, and their tuple outputs cannot be a
  partition's outputs, so they and the nodes reading them stay in PyTorch;
* ``nn.EmbeddingBag``: the exporter writes the bags as a Loop of Slice and ReduceSum, which
  OpenVINO's ONNX frontend does not convert ("Unsupported input type dynamic"), and that failed the
  whole partition, the layers after the bag included. The bag stays in PyTorch (its 8-bit rows in
  reference form) and the rest of the partition compiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from qplug_core.plugin_api import DynamicQuantize, OperatorSupportBase, cpu_int8

if TYPE_CHECKING:
    from qplug_core.plugin_api import OnnxFile

_RECURRENT = (nn.RNNBase, nn.RNNCellBase)


class OpenVinoSupport(OperatorSupportBase):
    def is_node_supported(self, submodules: dict[str, nn.Module], node: fx.Node) -> bool:
        return self.unsupported_reason(submodules, node) is None

    def unsupported_reason(self, submodules: dict[str, nn.Module], node: fx.Node) -> str | None:
        if node.op == "call_module":
            module = getattr(submodules[str(node.target)], "module", submodules[str(node.target)])
            if isinstance(module, _RECURRENT):  # the reference form wraps the float module
                return f"a {type(module).__name__} stays a float layer in PyTorch (no static int8 RNN)"
            if isinstance(module, nn.EmbeddingBag):
                return ("OpenVINO does not convert its ONNX export (a Loop of Slice and ReduceSum over the "
                        "bags), so the bag stays in PyTorch in reference form")
            return None
        if any(self.unsupported_reason(submodules, a) for a in node.all_input_nodes if a.op == "call_module"):
            return "it reads a recurrent layer left in PyTorch"
        return None


def _flexible(partition: fx.GraphModule) -> bool:
    """Whether the partition is exported with dynamic dimensions. Not when it holds a dynamic
    linear and the CPU has no VNNI: OpenVINO's FullyConnected quantizing its input at run time,
    compiled with dynamic shapes for oneDNN held to AVX2, returned empty outputs (shape
    (0, 0, 256) for (4, 32, 256)). Nor when it concatenates and upsamples (:func:`_upsamples`).
    Such a partition is compiled per shape."""
    dynamic_linear = any(isinstance(m, DynamicQuantize) for m in partition.modules())
    return (cpu_int8().vnni or not dynamic_linear) and not (_upsamples(partition) and _concatenates(partition))


def _upsamples(partition: fx.GraphModule) -> bool:
    """Whether an interpolate is among ``partition``'s ops. OpenVINO 2026.4's CPU plugin computes
    a Concat wrong in a model with symbolic height and width that upsamples (an ONNX Resize to
    sizes read from a Shape): a UNet skip concat came out 6 dB from ONNX Runtime's on the same
    file (static shapes: 50 dB; the whole UNet 33 dB vs float, its reference form 53)."""
    return any(name == "interpolate" or name.startswith("upsample") for name in _op_names(partition))


def _concatenates(partition: fx.GraphModule) -> bool:
    return any(name in ("cat", "concat", "concatenate") for name in _op_names(partition))


def _op_names(partition: fx.GraphModule) -> set[str]:
    """The functions ``partition`` calls, by bare name (``cat`` for ``torch.cat`` and ``aten.cat``)."""
    return {target._opname if isinstance(target := node.target, torch._ops.OpOverload)
            else getattr(target, "__name__", "") for node in partition.graph.nodes if node.op == "call_function"}


def partition_to_onnx(partition: fx.GraphModule, example_inputs: tuple) -> bytes | OnnxFile:
    """The ONNX QDQ model (standard ops) of one reference-form partition, serialized or a file with
    external data when large (``onnx_source``), with every axis the graph leaves free symbolic
    (one compiled model for every size: :func:`_flexible`); a dynamic linear is its int8 weights
    into a float MatMul, whose input OpenVINO quantizes at run time
    (``DYNAMIC_QUANTIZATION_GROUP_SIZE``, :mod:`qplug_openvino.compiled`)."""
    from qplug_core.plugin_api import onnx_source, to_onnx_proto

    return onnx_source(to_onnx_proto(partition, example_inputs, flexible=_flexible(partition),
                                     dynamic_linears="dequantized_weights", check=False))
