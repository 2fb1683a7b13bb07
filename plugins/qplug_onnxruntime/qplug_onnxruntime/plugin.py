"""Hook implementations of the ``onnxruntime`` backend (entry point ``qplug: onnxruntime``).

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

import functools
import importlib.util
from typing import TYPE_CHECKING

import torch
from torch import nn

from qplug_core.plugin_api import (
    Availability,
    BackendSpec,
    Delegate,
    Diagnostic,
    DTypeConfig,
    DTypeWithConstraints,
    Gemm,
    Int8Arithmetic,
    backend_arithmetic,
    common_pattern_configs,
    cpu_diagnostic,
    default_op_quint8_dtype_config,
    default_qconfig_mapping,
    hookimpl,
    input_output_only_quint8_dtype_config,
    safe_qconfig_options,
    weight_only_quint8_dtype_config,
)

from qplug_onnxruntime.probe import matmul_integer
from qplug_onnxruntime.session import OrtPartition, settings
from qplug_onnxruntime.support import OrtSupport, partition_to_onnx
from qplug_onnxruntime.weight_only import MatMulNBitsKernel

if TYPE_CHECKING:
    from qplug_core.plugin_api import BackendPatternConfig, QConfigMapping, WeightOnlyKernel

NAME = "onnxruntime"
#: symmetric int8 weights: zero point 0 is what ORT's fastest conv/gemm kernels (MlasConvSym) take
WEIGHT_RANGE = (-127, 127)
_REQUIRED = ("onnxruntime", "onnx", "onnxscript")
#: MLAS's x86 U8S8 kernels: vpmaddubsw pair sums without VNNI
ARITHMETIC = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI
#: the weighted ops ORT runs on int8 inputs into a float output (MatMulIntegerToFloat; see above)
FLOAT_OUTPUTS = frozenset({"linear"})

_weight = DTypeWithConstraints(dtype=torch.qint8, quant_min_lower_bound=WEIGHT_RANGE[0],
                               quant_max_upper_bound=WEIGHT_RANGE[1])
weighted_op_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                                       weight_dtype=_weight, bias_dtype=torch.float)
#: dynamic linear: ORT's DynamicQuantizeLinear is uint8 [0, 255]; fused into DynamicQuantizeMatMul
dynamic_int8_dtype_config = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.float,
                                        weight_dtype=_weight, bias_dtype=torch.float, is_dynamic=True)


def is_available() -> Availability:
    missing = [name for name in _REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        return Availability(False, f"missing Python package(s) {', '.join(missing)}; "
                                   "pip install qplug-onnxruntime installs them")
    return Availability(True)


@functools.lru_cache(maxsize=None)
def _pattern_configs() -> tuple[BackendPatternConfig, ...]:
    static, default = [weighted_op_dtype_config], [default_op_quint8_dtype_config]
    configs = common_pattern_configs(
        weighted_op_dtype_configs=static, linear_dtype_configs=static + [dynamic_int8_dtype_config],
        default_op_dtype_configs=default, fixed_qparams_op_dtype_configs=default,
        share_qparams_op_dtype_configs=default, tensor_info_op_dtype_configs=default,
        rnn_op_dtype_configs=[], embedding_op_dtype_configs=[weight_only_quint8_dtype_config],
        layer_norm_op_dtype_configs=[input_output_only_quint8_dtype_config])
    for config in configs:  # of the recurrent modules only nn.LSTM: ORT's DynamicQuantizeLSTM
        if config.pattern is nn.LSTM:  # runs it; ORT has no quantized GRU or cell op
            config.set_dtype_configs([dynamic_int8_dtype_config])
    return tuple(configs)


def compile_partition(partition, example_inputs) -> OrtPartition:
    return OrtPartition(partition, example_inputs, partition_to_onnx, settings())


def int8_gemm() -> Gemm | None:
    """MLAS's u8 x s8 product (``MatMulInteger``), measured where the flags call it exact."""
    return matmul_integer if is_available().ok else None


@hookimpl
def qplug_register_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, "int8 partitions compiled into ONNX Runtime sessions (ONNX QDQ, MLAS)",
                        is_available=is_available, arithmetic=ARITHMETIC, int8_gemm=int8_gemm,
                        float_outputs=FLOAT_OUTPUTS)]


@hookimpl
def qplug_backend_pattern_configs(backend: str) -> list[BackendPatternConfig]:
    return list(_pattern_configs()) if backend == NAME else []


@hookimpl
def qplug_delegate(backend: str) -> Delegate | None:
    if backend != NAME:
        return None
    return Delegate(operator_support=OrtSupport(), compile=compile_partition)


@hookimpl
def qplug_weight_only_kernels(backend: str) -> list[WeightOnlyKernel]:
    return [MatMulNBitsKernel()] if backend == NAME and is_available().ok else []


@hookimpl
def qplug_default_qconfig_mapping(backend: str, mode: str) -> QConfigMapping | None:
    if backend != NAME:
        return None
    options = safe_qconfig_options(backend_arithmetic(NAME, ARITHMETIC, int8_gemm), {
        "reduce_range": False, "per_channel": True, "per_channel_conv_transpose": False,
        "weight_quant_min": WEIGHT_RANGE[0], "weight_quant_max": WEIGHT_RANGE[1]})
    return default_qconfig_mapping(mode, **options)


@hookimpl
def qplug_check_environment(backend: str) -> list[Diagnostic]:
    if backend != NAME:
        return []
    availability = is_available()
    if not availability.ok:
        return [Diagnostic("error", availability.reason, hint="pip install qplug-onnxruntime")]
    import onnxruntime

    return [Diagnostic("ok", f"onnxruntime {onnxruntime.__version__}, providers "
                             f"{onnxruntime.get_available_providers()}"),
            cpu_diagnostic(ARITHMETIC, compiles=True, gemm=matmul_integer)]
