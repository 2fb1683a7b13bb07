"""The ``openvino`` backend (entry point ``qplug: openvino = qplug_openvino.plugin:plugin``).

OpenVINO compiles whole graphs, so this backend has no per-op kernels: it delegates. Convert
partitions the reference form, exports each int8 partition as ONNX QDQ (standard ops only) and
compiles it for OpenVINO's CPU plugin, whose low-precision transformations turn each
DequantizeLinear -> op -> QuantizeLinear group into an int8 oneDNN primitive with qplug's own
scales and zero points (nothing is calibrated again). The dtype configs say what those kernels
take: quint8 activations, symmetric per-channel qint8 weights. Without VNNI, oneDNN's u8 x s8
pair sums saturate at int16, so weights are kept in 7 bits there (what NNCF's overflow fix does),
in every layer.
Dynamic linears (``qp.quantize_dynamic(..., example_inputs=...)``, the ``"dynamic"`` mapping, and
the target search's fallback rung) go to OpenVINO as int8 weights into a float MatMul, whose
input OpenVINO quantizes at run time per group of 128 features
(``DYNAMIC_QUANTIZATION_GROUP_SIZE``): finer than the reference form's one scale per tensor, which
the check at convert compares it with. ONNX's ``DynamicQuantizeLinear`` + ``MatMulInteger`` runs
no faster than fp32 in OpenVINO. Recurrent layers have no int8 form here and stay float in PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

from qplug_core.plugin_api import (
    Availability,
    BackendPatternConfig,
    BackendPlugin,
    Delegate,
    Diagnostic,
    DTypeConfig,
    DTypeConfigSet,
    DTypeWithConstraints,
    Int8Arithmetic,
    default_op_quint8_dtype_config,
    input_output_only_quint8_dtype_config,
    packages_availability,
    weight_only_quint8_dtype_config,
)

from qplug_openvino.compiled import OpenVinoPartition, settings
from qplug_openvino.runtime import import_openvino
from qplug_openvino.support import OpenVinoSupport, partition_to_onnx

#: symmetric int8 weights (zero point 0: no weight compensation in oneDNN's int8 convolutions);
#: on CPUs without VNNI the core narrows them to 7 bits from the declared arithmetic
WEIGHT_RANGE = (-127, 127)
_REQUIRED = ("openvino", "onnx", "onnxscript")

_weight = DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=WEIGHT_RANGE[0],
                               quant_max_upper_bound=WEIGHT_RANGE[1])
weighted_op_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                                       weight_dtype=_weight, bias_dtype=torch.float)
#: dynamic linear: the reference form quantizes the input per tensor to uint8 [0, 255] (what the
#: accuracy decisions measure); OpenVINO runs it per group of features (see the module docstring)
dynamic_int8_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.float,
                                        weight_dtype=_weight, bias_dtype=torch.float, is_dynamic=True)


def compile_partition(partition, example_inputs) -> OpenVinoPartition:
    return OpenVinoPartition(partition, example_inputs, partition_to_onnx, settings())


class OpenVinoPlugin(BackendPlugin):
    name = "openvino"
    description = "int8 partitions compiled into OpenVINO CPU models (ONNX QDQ, oneDNN)"
    #: oneDNN's u8 x s8 kernels sum pairs with vpmaddubsw (int16, saturating) without VNNI
    int8_arithmetic = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI
    #: OpenVINO picks blocked/channels-last layouts (a linear after a flatten reads its input in
    #: the conv's layout), so the core cannot tell which products share a pair: with its AVX2
    #: kernels a digits-CNN linear given 8-bit weights by the per-layer choice was up to 11 output
    #: steps off on held-out inputs; 7-bit weights everywhere match the reference form exactly
    pairs_in_torch_order = False
    #: OpenVINO's low-precision transformations fuse a FullyConnected's or Convolution's
    #: dequantization into it (u8 in, f32 out): an output no int8 op reads stays float, as NNCF
    #: leaves it. Real all-MiniLM-L6-v2 with every linear static: worst held-out sentence cosine
    #: 0.9266 -> 0.9912 (the FFN outputs feed the residual add, values up to ~195)
    float_outputs = True
    dtype_configs = DTypeConfigSet(
        weighted_op=(weighted_op_dtype_config,), default_op=(default_op_quint8_dtype_config,),
        dynamic=(dynamic_int8_dtype_config,), rnn_op=(), embedding=(weight_only_quint8_dtype_config,),
        layer_norm=(input_output_only_quint8_dtype_config,))

    def is_available(self) -> Availability:
        return packages_availability(_REQUIRED, "qplug-openvino")

    def pattern_configs(self) -> list[BackendPatternConfig]:
        # the recurrent patterns have no dtype configs here: not claimed, they stay float layers
        # in PyTorch
        return [config for config in super().pattern_configs() if config.dtype_configs]

    def delegate(self) -> Delegate:
        return Delegate(operator_support=OpenVinoSupport(), compile=compile_partition)

    def qconfig_options(self, mode: str) -> dict[str, Any] | None:
        return {"reduce_range": False, "per_channel": True, "per_channel_conv_transpose": False,
                "weight_quant_min": WEIGHT_RANGE[0], "weight_quant_max": WEIGHT_RANGE[1]}

    def check_environment(self) -> list[Diagnostic]:
        availability = self.is_available()
        if not availability.ok:
            return [Diagnostic("error", availability.reason, hint="pip install qplug-openvino")]
        openvino = import_openvino()
        return [Diagnostic("ok", f"openvino {openvino.__version__}, devices "
                                 f"{openvino.Core().available_devices}")]


plugin = OpenVinoPlugin()
