"""Map a backend's quantization patterns to the torch.ops.quantized kernels that run them.

fbgemm and qnnpack run the same ``torch.ops.quantized`` ops under different engines, so both
plugins build their kernel tables here from their own pattern configs and engine; what differs
(which ops an engine lacks) comes from probing the engine, not from two hand-kept lists.
A pattern that no kernel implements is simply absent: lowering keeps it in reference form.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from qplug_core.kernels import torch_int8 as K
from qplug_core.kernels.base import KernelContext, KernelSpec
from qplug_core.kernels.passthrough import PASSTHROUGH_CHECKS
from qplug_core.nn.intrinsic import FusedModule

_RELU = (nn.ReLU, F.relu, torch.relu, "relu", "relu_")
_ADD = (operator.add, torch.add, "add")
_MUL = (operator.mul, torch.mul, "mul")
_MATMUL = (torch.matmul, operator.matmul, "matmul")
_BMM = (torch.bmm, "bmm")
_MM = (torch.mm, "mm")
_WEIGHTED = {nn.Linear: K.Linear, nn.Conv1d: K.Conv1d, nn.Conv2d: K.Conv2d, nn.Conv3d: K.Conv3d,
             nn.ConvTranspose1d: K.ConvTranspose1d, nn.ConvTranspose2d: K.ConvTranspose2d,
             nn.ConvTranspose3d: K.ConvTranspose3d}
_FOLDABLE = (nn.ReLU, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_DYNAMIC = {nn.Linear: K.DynamicLinear, nn.LSTM: K.DynamicLSTM, nn.GRU: K.DynamicGRU,
            nn.LSTMCell: K.LSTMCell, nn.GRUCell: K.GRUCell, nn.RNNCell: K.RNNCell}
_NORMS = {nn.BatchNorm2d: K.BatchNorm2d, nn.BatchNorm3d: K.BatchNorm3d, nn.LayerNorm: K.LayerNorm,
          nn.GroupNorm: K.GroupNorm, nn.InstanceNorm1d: K.InstanceNorm,
          nn.InstanceNorm2d: K.InstanceNorm, nn.InstanceNorm3d: K.InstanceNorm}
_UNARY = {nn.Hardswish: K.Hardswish, F.hardswish: K.Hardswish, nn.SiLU: K.SiLU, F.silu: K.SiLU,
          nn.ELU: K.ELU, F.elu: K.ELU,
          nn.LeakyReLU: K.LeakyReLU, F.leaky_relu: K.LeakyReLU,
          nn.Sigmoid: K.Sigmoid, torch.sigmoid: K.Sigmoid, F.sigmoid: K.Sigmoid, "sigmoid": K.Sigmoid,
          nn.Tanh: K.Tanh, torch.tanh: K.Tanh, F.tanh: K.Tanh, "tanh": K.Tanh,
          nn.Hardsigmoid: K.Hardsigmoid, F.hardsigmoid: K.Hardsigmoid}


def _weighted_base(module_class: type) -> type | None:
    """The plain weighted class a (possibly fused or QAT) module class lowers as, if any."""
    if module_class in _WEIGHTED:
        return module_class
    float_module = getattr(module_class, "FLOAT_MODULE", None)  # QAT classes convert to this
    if float_module is not None and float_module is not module_class:
        return _weighted_base(float_module)
    if isinstance(module_class, type) and issubclass(module_class, FusedModule):
        first, *rest = module_class.CHILD_TYPES
        if first in _WEIGHTED and all(t in _FOLDABLE for t in rest):
            return first
    return None


#: weighted classes whose kernels some engines lack, by EngineCapabilities flag
_CAPABILITY = {nn.Conv1d: "conv1d", nn.Conv3d: "conv3d", nn.ConvTranspose1d: "conv_transpose1d",
               nn.ConvTranspose2d: "conv_transpose2d", nn.ConvTranspose3d: "conv_transpose3d"}


def _engine_runs(base: type, engine: str) -> bool:
    flag = _CAPABILITY.get(base)
    return flag is None or bool(getattr(K.engine_capabilities(engine), flag))


def _unwrap(module: nn.Module) -> type:
    """The class a kernel is chosen by: the first child of a fused Sequential, and the class before
    parametrizations (weight norm makes ``ParametrizedConv1d``), as the matcher compares."""
    return type_before_parametrizations(module[0] if isinstance(module, nn.Sequential) else module)


def build_weighted(ctx: KernelContext) -> nn.Module:
    """Static, dynamic or weight-only kernel for a weighted module, chosen from the context."""
    float16_weight = ctx.weight_qparams is not None and ctx.weight_qparams.dtype == torch.float16
    if float16_weight or (ctx.input_qparams and ctx.input_qparams[0].is_dynamic):
        return build_dynamic(ctx)  # float16 dynamic has no activation boundary at all
    return _WEIGHTED[_unwrap(ctx.module)].from_context(ctx)


def build_dynamic(ctx: KernelContext) -> nn.Module:
    """Float in, float out: weights quantized now, activations per call (int8 or float16)."""
    weight = ctx.weight_qparams
    dtype = weight.dtype if weight is not None else torch.qint8
    activation = ctx.input_qparams[0] if ctx.input_qparams else None
    qint8 = weight is not None and weight.dtype == torch.qint8
    return _DYNAMIC[_unwrap(ctx.module)].from_float(
        ctx.module, dtype=dtype, engine=ctx.engine,
        per_channel=weight is not None and weight.axis is not None,
        reduce_range=None if activation is None else activation.quant_max <= 127,
        weight_qparams=(ctx.recurrent_weight_qparams or weight) if qint8 else None)


def build_embedding(ctx: KernelContext) -> nn.Module:
    cls = K.EmbeddingBag if isinstance(ctx.module, nn.EmbeddingBag) else K.Embedding
    return cls.from_context(ctx)


def _spec(op: str, kernel: type, engine: str,
          build: Callable[[KernelContext], nn.Module] | None = None) -> KernelSpec:
    """A spec building ``kernel`` (or via ``build``) whose self-test runs ``kernel``'s for ``engine``."""
    return KernelSpec(op, build=build or kernel.from_context, self_test=lambda: kernel.self_test(engine))


#: the binary families' torch kernels
_BINARY = {"add": K.Add, "add_relu": K.AddReLU, "mul": K.Mul, "mul_relu": K.MulReLU}


def op_family(pattern: Any) -> str | None:
    """The family of a complex-format pattern, for keying kernels written once per family:
    ``"weighted"`` (Linear, the convs and their fused and QAT modules), ``"add"``, ``"mul"``,
    ``"add_relu"``, ``"mul_relu"`` (a relu of either spelling after one), ``"relu"`` alone; else None."""
    if isinstance(pattern, tuple):
        inner = op_family(pattern[1]) if len(pattern) == 2 and pattern[0] in _RELU else None
        return f"{inner}_relu" if inner in ("add", "mul") else None
    if pattern in _ADD:
        return "add"
    if pattern in _MUL:
        return "mul"
    if pattern in _RELU:
        return "relu"
    return "weighted" if isinstance(pattern, type) and _weighted_base(pattern) is not None else None


def kernel_table(configs: Iterable[Any], *,
                 weighted: KernelSpec | Mapping[type, KernelSpec] | None = None,
                 add: KernelSpec | None = None, add_relu: KernelSpec | None = None,
                 mul: KernelSpec | None = None, mul_relu: KernelSpec | None = None,
                 relu: KernelSpec | None = None) -> dict[Any, KernelSpec]:
    """A backend's kernels keyed by every pattern of ``configs`` (its ``BackendPatternConfig``
    objects) in their family (:func:`op_family`): the shared set spells each family many ways (four
    relus after ``operator.add`` or ``torch.add``, fused and QAT modules), and lowering finds a
    kernel by the exact pattern. ``weighted`` is one spec for every weighted class, or one per
    plain class (``{nn.Conv2d: ..., nn.Linear: ...}``)."""
    families = {"add": add, "add_relu": add_relu, "mul": mul, "mul_relu": mul_relu, "relu": relu}
    table: dict[Any, KernelSpec] = {}
    for config in configs:
        pattern = config.pattern_complex_format
        family = op_family(pattern)
        if family == "weighted" and isinstance(weighted, Mapping):
            spec = weighted.get(_weighted_base(pattern))
        else:
            spec = weighted if family == "weighted" else families.get(family or "")
        if spec is not None:
            table[pattern] = spec
    return table


def _kernel_for(pattern: Any, passthrough: tuple, engine: str) -> KernelSpec | None:
    family = op_family(pattern)
    if family in _BINARY:
        return _spec(f"quantized::{family}", _BINARY[family], engine)
    if isinstance(pattern, tuple):
        return None
    if pattern is torch.cat:
        return _spec("quantized::cat", K.Cat, engine)
    if pattern in _MATMUL:
        return _spec("quantized::matmul", K.Matmul, engine)
    if pattern in _BMM:
        return _spec("quantized::matmul", K.Bmm, engine)
    if pattern in _MM:
        return _spec("quantized::matmul", K.Mm, engine)
    if pattern in _UNARY:
        kernel = _UNARY[pattern]
        return _spec(f"quantized::{kernel.__name__.lower()}", kernel, engine)
    if pattern in passthrough:
        return KernelSpec("passthrough", passthrough=True, check=PASSTHROUGH_CHECKS.get(pattern))
    if not isinstance(pattern, type):
        return None
    base = _weighted_base(pattern)
    if base is not None and _engine_runs(base, engine):
        kernel = _WEIGHTED[base]
        return _spec(f"quantized::{kernel.__name__.lower()}", kernel, engine, build=build_weighted)
    if pattern in _DYNAMIC:
        return KernelSpec(f"quantized::{pattern.__name__.lower()}_dynamic", build=build_dynamic)
    if pattern in (nn.Embedding, nn.EmbeddingBag):
        return KernelSpec("quantized::embedding_bag_byte", build=build_embedding)
    if pattern in _NORMS:
        kernel = _NORMS[pattern]
        return _spec(f"quantized::{kernel.__name__.lower()}", kernel, engine)
    if isinstance(pattern, type) and issubclass(pattern, FusedModule) \
            and pattern.CHILD_TYPES[0] in (nn.BatchNorm2d, nn.BatchNorm3d):
        kernel = _NORMS[pattern.CHILD_TYPES[0]]
        return _spec(f"quantized::{kernel.__name__.lower()}_relu", kernel, engine)
    return None


def torch_int8_kernels(patterns: Iterable[Any], engine: str) -> dict[Any, KernelSpec]:
    """Kernel table for ``engine``: every given (complex-format) pattern a kernel implements,
    plus the quantize/dequantize boundary modules."""
    passthrough = K.passthrough_ops(engine)
    table: dict[Any, KernelSpec] = {
        "quantize": _spec("quantize_per_tensor", K.Quantize, engine),
        "dequantize": _spec("dequantize", K.Dequantize, engine),
    }
    for pattern in patterns:
        spec = _kernel_for(pattern, passthrough, engine)
        if spec is not None:
            table[pattern] = spec
    return table
