"""The ``onnxruntime`` backend (entry point ``qplug: onnxruntime = qplug_onnxruntime.plugin:plugin``).

ONNX Runtime compiles whole graphs, so this backend has no per-op kernels: it delegates
(``qplug_delegate``). Convert partitions the reference form, exports each int8 partition as ONNX
QDQ and builds one ``InferenceSession`` for it; ORT fuses the QDQ groups into its MLAS int8
kernels. The pattern and dtype configs say what those fusions take: U8S8 (quint8 activations,
symmetric qint8 weights in [-127, 127], per-channel), which ORT runs fastest on x86 with VNNI.
Without VNNI, MLAS's U8S8 kernels sum pairs of products in int16 with saturation, so the default
qconfig mapping takes the core's safe qparams for that arithmetic there (7-bit weights, ORT's own
``reduce_range`` convention). Clamps after convs are folded into the output range by the core, so
no Clip blocks a fusion. ORT fuses a dequantized matmul whose output no QuantizeLinear takes
into MatMulIntegerToFloat (int8 inputs, float output), so a static linear whose output only float
ops read (a transformer's FFN output feeding the residual add) keeps it float
(``float_outputs={"linear"}``): no grid to lose resolution on, no Quantize/DequantizeLinear pair to
run. ORT has no int8 convolution with a float output (such a conv would run in float), so convs
keep their output grids.
Dynamic mode (``qp.quantize_dynamic`` with ``example_inputs``, which captures the model and runs
the graph flow, or ``prepare_fx`` with the ``"dynamic"`` mapping) runs linears as ORT's DynamicQuantizeMatMul and
``nn.LSTM`` as ORT's DynamicQuantizeLSTM, fed qplug's own int8 weights (per-channel, symmetric).
ORT has no int8 GRU or RNN cell op: those stay float in PyTorch, and the report says so, as it
does for an LSTM ORT cannot take (its tuple output leaving the model, ``proj_size``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.plugin_api import (
    Availability,
    BackendPatternConfig,
    BackendPlugin,
    Delegate,
    Diagnostic,
    DTypeConfig,
    DTypeConfigSet,
    DTypeWithConstraints,
    Gemm,
    Int8Arithmetic,
    WeightOnlyKernel,
    default_op_quint8_dtype_config,
    input_output_only_quint8_dtype_config,
    packages_availability,
    weight_only_quint8_dtype_config,
)

from qplug_onnxruntime.probe import matmul_integer
from qplug_onnxruntime.session import OrtPartition, settings
from qplug_onnxruntime.support import OrtSupport, partition_to_onnx
from qplug_onnxruntime.weight_only import MatMulNBitsKernel

NAME = "onnxruntime"
#: symmetric int8 weights: zero point 0 is what ORT's fastest conv/gemm kernels (MlasConvSym) take
WEIGHT_RANGE = (-127, 127)
_REQUIRED = ("onnxruntime", "onnx", "onnxscript")

_weight = DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=WEIGHT_RANGE[0],
                               quant_max_upper_bound=WEIGHT_RANGE[1])
weighted_op_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                                       weight_dtype=_weight, bias_dtype=torch.float)
#: dynamic linear: ORT's DynamicQuantizeLinear is uint8 [0, 255]; fused into DynamicQuantizeMatMul
dynamic_int8_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.float,
                                        weight_dtype=_weight, bias_dtype=torch.float, is_dynamic=True)


def compile_partition(partition, example_inputs) -> OrtPartition:
    return OrtPartition(partition, example_inputs, partition_to_onnx, settings())


class OrtPlugin(BackendPlugin):
    name = NAME
    description = "int8 partitions compiled into ONNX Runtime sessions (ONNX QDQ, MLAS)"
    #: MLAS's x86 U8S8 kernels: vpmaddubsw pair sums without VNNI
    int8_arithmetic = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI
    #: the weighted ops ORT runs on int8 inputs into a float output (MatMulIntegerToFloat; see above)
    float_outputs = frozenset({"linear"})
    dtype_configs = DTypeConfigSet(
        weighted_op=(weighted_op_dtype_config,), default_op=(default_op_quint8_dtype_config,),
        dynamic=(dynamic_int8_dtype_config,), rnn_op=(), embedding=(weight_only_quint8_dtype_config,),
        layer_norm=(input_output_only_quint8_dtype_config,))

    def is_available(self) -> Availability:
        return packages_availability(_REQUIRED, "qplug-onnxruntime")

    def pattern_configs(self) -> list[BackendPatternConfig]:
        configs = super().pattern_configs()
        for config in configs:  # of the recurrent modules only nn.LSTM: ORT's DynamicQuantizeLSTM
            if config.pattern is nn.LSTM:  # runs it; ORT has no quantized GRU or cell op
                config.set_dtype_configs([dynamic_int8_dtype_config])
        return configs

    def delegate(self) -> Delegate:
        return Delegate(operator_support=OrtSupport(), compile=compile_partition)

    def weight_only_kernels(self) -> list[WeightOnlyKernel]:
        return [MatMulNBitsKernel()] if self.is_available().ok else []

    def qconfig_options(self, mode: str) -> dict[str, Any] | None:
        return {"reduce_range": False, "per_channel": True, "per_channel_conv_transpose": False,
                "weight_quant_min": WEIGHT_RANGE[0], "weight_quant_max": WEIGHT_RANGE[1]}

    def int8_gemm(self) -> Gemm | None:
        """MLAS's u8 x s8 product (``MatMulInteger``), measured where the flags call it exact."""
        return matmul_integer if self.is_available().ok else None

    def check_environment(self) -> list[Diagnostic]:
        availability = self.is_available()
        if not availability.ok:
            return [Diagnostic("error", availability.reason, hint="pip install qplug-onnxruntime")]
        import onnxruntime  # only here: ~0.07 s that loading the plugin does not pay

        return [Diagnostic("ok", f"onnxruntime {onnxruntime.__version__}, providers "
                                 f"{onnxruntime.get_available_providers()}")]


plugin = OrtPlugin()
