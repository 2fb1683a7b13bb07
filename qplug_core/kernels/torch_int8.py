"""int8 kernel modules over ``torch.ops.quantized``, generic over the engine (fbgemm, qnnpack).

One import point for backend plugins. Static kernels (``from_context``, usable as
``KernelSpec.build``) take and return torch quantized tensors; dynamic and weight-only ones
(``from_float``) take and return float tensors. Every class has ``self_test(engine)``.
"""

from __future__ import annotations

from qplug_core.kernels._common import MAX_REDUCTION_U8S8
from qplug_core.kernels.boundary import Dequantize, Quantize
from qplug_core.kernels.capabilities import EngineCapabilities, engine_capabilities
from qplug_core.kernels.dynamic import (
    DynamicGRU,
    DynamicLinear,
    DynamicLSTM,
    GRUCell,
    LSTMCell,
    RNNCell,
    symmetric_weight_qparams,
)
from qplug_core.kernels.elementwise import (
    ELU,
    FIXED_QPARAMS,
    Add,
    AddReLU,
    Bmm,
    Cat,
    Hardsigmoid,
    Hardswish,
    LeakyReLU,
    Matmul,
    Mm,
    Mul,
    MulReLU,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)
from qplug_core.kernels.embedding import Embedding, EmbeddingBag
from qplug_core.kernels.linear_conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Linear,
    fit_bias_scale,
)
from qplug_core.kernels.norm import BatchNorm2d, BatchNorm3d, GroupNorm, InstanceNorm, LayerNorm
from qplug_core.kernels.passthrough import PASSTHROUGH_OPS, passthrough_ops

#: the static kernels (quantized in, quantized out), by op name
STATIC_KERNELS = {
    "quantize": Quantize, "dequantize": Dequantize,
    "linear": Linear, "conv1d": Conv1d, "conv2d": Conv2d, "conv3d": Conv3d,
    "conv_transpose1d": ConvTranspose1d, "conv_transpose2d": ConvTranspose2d,
    "conv_transpose3d": ConvTranspose3d,
    "add": Add, "add_relu": AddReLU, "mul": Mul, "mul_relu": MulReLU, "matmul": Matmul, "bmm": Bmm, "mm": Mm,
    "cat": Cat,
    "batch_norm2d": BatchNorm2d, "batch_norm3d": BatchNorm3d, "layer_norm": LayerNorm,
    "group_norm": GroupNorm, "instance_norm": InstanceNorm,
    "hardswish": Hardswish, "silu": SiLU, "elu": ELU, "leaky_relu": LeakyReLU, "sigmoid": Sigmoid,
    "softmax": Softmax, "tanh": Tanh, "hardsigmoid": Hardsigmoid,
}

__all__ = [
    "MAX_REDUCTION_U8S8", "PASSTHROUGH_OPS", "FIXED_QPARAMS", "STATIC_KERNELS",
    "EngineCapabilities", "engine_capabilities", "passthrough_ops", "fit_bias_scale",
    "symmetric_weight_qparams",
    "Quantize", "Dequantize", "Linear", "Conv1d", "Conv2d", "Conv3d",
    "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "Add", "AddReLU", "Mul", "MulReLU", "Matmul", "Bmm", "Mm", "Cat", "BatchNorm2d", "BatchNorm3d", "LayerNorm",
    "GroupNorm", "InstanceNorm", "Hardswish", "SiLU", "ELU", "LeakyReLU", "Sigmoid", "Softmax", "Tanh",
    "Hardsigmoid",
    "DynamicLinear", "DynamicLSTM", "DynamicGRU", "LSTMCell", "GRUCell", "RNNCell",
    "Embedding", "EmbeddingBag",
]
