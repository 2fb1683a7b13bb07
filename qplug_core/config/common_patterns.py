"""Pattern configs shared by every backend (the torch.ao "native" set, built from vocabularies).

Each builder takes the dtype configs a backend supports for one family of ops and returns that
family's :class:`BackendPatternConfig` s; :func:`common_pattern_configs` assembles them all. The
patterns, observation types, root/QAT/fused modules and fuser methods mirror
``torch.ao.quantization.backend_config._common_operator_config_utils``, with these differences:

* ``reference_quantized_module`` is left unset: qplug's convert uses one generic reference wrapper;
* every pattern appears once (torch.ao registers the fused ConvReLU and its QAT module twice and
  the second registration silently wins; here both registrations' fields are merged);
* linear and conv (+ bn) + relu are also fused / observed when the relu is written ``torch.relu`` or
  ``x.relu()``, and ``torch.relu`` alone shares its input's qparams as ``F.relu`` does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.config import BackendPatternConfig, DTypeConfig, DTypeWithConstraints, ObservationType
from qplug_core.errors import ConfigValidationError
from qplug_core.nn import fuser_methods as fm
from qplug_core.nn import intrinsic as nni
from qplug_core.nn import qat

__all__ = [
    "FIXED_QPARAMS_CONSTRAINTS",
    "RELU_FORMS",
    "binary_op_configs",
    "bn_configs",
    "cat_config",
    "common_pattern_configs",
    "conv_configs",
    "default_op_configs",
    "embedding_op_configs",
    "fixed_qparams_dtype_configs",
    "fixed_qparams_op_configs",
    "ln_configs",
    "linear_configs",
    "rnn_op_configs",
    "share_qparams_op_configs",
    "tensor_info_op_configs",
]

_OWN_OBSERVER = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT
_SHARED_OBSERVER = ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
_NOT_OBSERVED = ObservationType.INPUT_OUTPUT_NOT_OBSERVED
_WEIGHT_BIAS_AT_1_2 = {"weight": 1, "bias": 2}


def _config(pattern: Any, dtype_configs: Sequence[DTypeConfig], *,
            observation_type: ObservationType = _OWN_OBSERVER, root: type[nn.Module] | None = None,
            qat_module: type[nn.Module] | None = None, fused: type[nn.Module] | None = None,
            fuser: Callable[..., nn.Module] | None = None,
            input_type_to_index: dict[str, int] | None = None) -> BackendPatternConfig:
    """One config from a simple-format pattern; unset fields keep the builder's defaults."""
    config = (BackendPatternConfig(pattern).set_observation_type(observation_type)
              .set_dtype_configs(list(dtype_configs)))
    if root is not None:
        config.set_root_module(root)
    if qat_module is not None:
        config.set_qat_module(qat_module)
    if fused is not None:
        config.set_fused_module(fused)
    if fuser is not None:
        config.set_fuser_method(fuser)
    if input_type_to_index is not None:
        config.set_input_type_to_index(input_type_to_index)
    return config


# -- conv ------------------------------------------------------------------------------------------

_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE_FUNCTIONS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_CONV_TRANSPOSE = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
RELU_FORMS = (nn.ReLU, F.relu, torch.relu, "relu")
"""How a relu after a weighted module is written: torch.ao's fusion patterns have the first two
(conv + ``torch.relu`` is a TODO there, leaving a float island between two int8 convs). A fusion
declares each: under ``torch.export`` capture an ``nn.ReLU`` is no module call any more."""


def conv_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Conv 1d/2d/3d: modules, functionals, relu and bn(+relu) fusions, their fused and QAT
    modules, and conv transpose (+ bn folding)."""
    configs: list[BackendPatternConfig] = []
    for d in (1, 2, 3):
        conv, bn, func = nni.CONV_BY_DIM[d], nni.BN_BY_DIM[d], _CONV_FUNCTIONS[d]
        fused_relu, fused_bn, fused_bn_relu = (
            getattr(nni, f"{name}{d}d") for name in ("ConvReLU", "ConvBn", "ConvBnReLU"))
        qat_conv, qat_relu, qat_bn, qat_bn_relu = (
            getattr(qat, f"{name}{d}d") for name in ("Conv", "ConvReLU", "ConvBn", "ConvBnReLU"))
        convt = _CONV_TRANSPOSE[d]
        configs += [
            _config(conv, dtype_configs, root=conv, qat_module=qat_conv),
            _config(qat_conv, dtype_configs, root=conv),
            _config(func, dtype_configs, input_type_to_index=_WEIGHT_BIAS_AT_1_2),
            *(_config((conv, relu), dtype_configs, fuser=fm.fuse_conv_relu, fused=fused_relu)
              for relu in RELU_FORMS),
            _config(fused_relu, dtype_configs, root=conv, qat_module=qat_relu),
            _config(qat_relu, dtype_configs, root=conv),
            *(_config((func, relu), dtype_configs) for relu in RELU_FORMS),
            _config((conv, bn), dtype_configs, fuser=fm.fuse_conv_bn, fused=fused_bn),
            _config((conv, bn, nn.ReLU), dtype_configs, fuser=fm.fuse_conv_bn_relu,
                    fused=fused_bn_relu),
            *(_config((conv, bn, relu), dtype_configs, root=conv, fuser=fm.fuse_conv_bn_relu,
                      fused=fused_bn_relu) for relu in RELU_FORMS[1:]),
            # Fused float ConvBn* only exist after QAT fusion; prepare_qat swaps them right away.
            _config(fused_bn, dtype_configs, qat_module=qat_bn),
            _config(fused_bn_relu, dtype_configs, qat_module=qat_bn_relu),
            _config(qat_bn, dtype_configs, root=conv),
            _config(qat_bn_relu, dtype_configs, root=conv),
            _config(convt, dtype_configs, root=convt),
            _config((convt, bn), dtype_configs, root=convt, fuser=fm.fuse_convtranspose_bn),
            _config(_CONV_TRANSPOSE_FUNCTIONS[d], dtype_configs,
                    input_type_to_index=_WEIGHT_BIAS_AT_1_2),
        ]
    return configs


# -- linear ----------------------------------------------------------------------------------------


def linear_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Linear: module, F.linear, relu fusions (module and functional relus), linear + bn1d (+ relu:
    torch.ao has no linear + bn1d + relu fusion, which leaves its relu to run after the int8 op)."""
    return [
        _config(nn.Linear, dtype_configs, root=nn.Linear, qat_module=qat.Linear),
        _config(qat.Linear, dtype_configs, root=nn.Linear),
        _config(F.linear, dtype_configs, input_type_to_index=_WEIGHT_BIAS_AT_1_2),
        *(_config((nn.Linear, relu), dtype_configs, fuser=fm.fuse_linear_relu,
                  fused=nni.LinearReLU) for relu in RELU_FORMS),
        _config(nni.LinearReLU, dtype_configs, root=nn.Linear, qat_module=qat.LinearReLU),
        _config(qat.LinearReLU, dtype_configs, root=nn.Linear),
        *(_config((F.linear, relu), dtype_configs) for relu in RELU_FORMS),
        _config((nn.Linear, nn.BatchNorm1d), dtype_configs, fuser=fm.fuse_linear_bn,
                fused=nni.LinearBn1d),
        _config(nni.LinearBn1d, dtype_configs, root=nn.Linear, qat_module=qat.LinearBn1d),
        _config(qat.LinearBn1d, dtype_configs, root=nn.Linear),
        *(_config((nn.Linear, nn.BatchNorm1d, relu), dtype_configs, root=nn.Linear,
                  fuser=fm.fuse_linear_bn_relu, fused=nni.LinearBnReLU1d) for relu in RELU_FORMS),
        _config(nni.LinearBnReLU1d, dtype_configs, root=nn.Linear, qat_module=qat.LinearBnReLU1d),
        _config(qat.LinearBnReLU1d, dtype_configs, root=nn.Linear),
    ]


# -- binary ops, cat -------------------------------------------------------------------------------

_BINARY_OPS = (operator.add, torch.add, operator.mul, torch.mul)
_MATMUL_OPS = (torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm", torch.mm, "mm")
_RELU_FORMS = (nn.ReLU, F.relu, torch.relu)
_BINARY_OBSERVATION = {
    0: _OWN_OBSERVER,  # two scalars: not a tensor op, left to dtype inference in prepare
    1: _SHARED_OBSERVER,  # tensor (+|*) scalar: the quantized kernel reuses the input's qparams
    2: _OWN_OBSERVER,
}


def binary_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """add/mul (operator and torch forms), each alone and followed by a relu; plus matmul, bmm and
    mm in each spelling symbolic capture records: ``torch.matmul``, ``a @ b`` (``operator.matmul``),
    ``a.matmul(b)``, ``torch.bmm``, ``a.bmm(b)``, ``torch.mm`` and ``a.mm(b)`` (torch.ao has a
    pattern for ``torch.matmul`` only and leaves the others float; torch.export records
    ``torch.matmul``, ``torch.bmm`` or ``torch.mm``, so every spelling is quantized alike at both
    capture levels)."""
    configs = [
        _config(pattern, dtype_configs).set_num_tensor_args_to_observation_type(_BINARY_OBSERVATION)
        for op in _BINARY_OPS
        for pattern in (*((op, relu) for relu in _RELU_FORMS), op)
    ]
    configs.extend(_config(op, dtype_configs) for op in _MATMUL_OPS)
    return configs


def cat_config(dtype_configs: Sequence[DTypeConfig]) -> BackendPatternConfig:
    """torch.cat: the output shares its inputs' observer (one qparams for all pieces)."""
    return _config(torch.cat, dtype_configs, observation_type=_SHARED_OBSERVER)


# -- single ops ------------------------------------------------------------------------------------

_DEFAULT_OPS: tuple[Any, ...] = (
    nn.ELU, nn.LeakyReLU, nn.Hardswish, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.Dropout, nn.PReLU, F.elu, F.hardswish, F.leaky_relu, F.dropout,
    # beyond torch.ao's list: without them every Conv-BN-SiLU (YOLO, EfficientNet, diffusion
    # UNets) dequantizes and the cat/pool/add behind it stay float; the GroupNorm module has a
    # kernel like F.group_norm (the default mapping still keeps norms float by qconfig None)
    nn.SiLU, F.silu, nn.GroupNorm,
)


def default_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Ops with their own output observer: elu, hardswish, silu, leaky relu, instance/group norm, ..."""
    return [
        *(_config(op, dtype_configs) for op in _DEFAULT_OPS),
        _config(F.group_norm, dtype_configs, input_type_to_index={"weight": 2, "bias": 3}),
        _config(F.instance_norm, dtype_configs, input_type_to_index={"weight": 3, "bias": 4}),
    ]


def ln_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """LayerNorm module and function (float affine weights at args 2 and 3)."""
    return [
        _config(nn.LayerNorm, dtype_configs),
        _config(F.layer_norm, dtype_configs, input_type_to_index={"weight": 2, "bias": 3}),
    ]


_SHARE_QPARAMS_OPS: tuple[Any, ...] = (
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.Hardtanh, nn.Identity,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.PixelShuffle, nn.PixelUnshuffle, nn.ReLU, nn.ReLU6,
    torch.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.hardtanh,
    F.hardtanh_, F.interpolate, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.pixel_shuffle,
    F.pixel_unshuffle, F.relu, F.relu6, torch.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    torch.clamp, torch.flatten, torch.mean, torch.narrow, torch.repeat_interleave, torch.transpose,
    torch.squeeze, torch.stack, torch.unsqueeze, operator.floordiv,
    "contiguous", "clamp", "detach", "detach_", "mean", "permute", "repeat", "repeat_interleave",
    "reshape", "resize_", "relu", "relu_", "squeeze", "squeeze_", "transpose", "unsqueeze",
    "unsqueeze_", "view",
    # beyond torch.ao's list: common in real models (decoders, classifier heads), and each runs
    # unchanged on quantized tensors, so leaving them out would break int8 chains for nothing
    nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d, nn.Flatten, "flatten", torch.relu,
    torch.clip, "clip",  # clamp's alias: left out, it was a float island between two int8 layers
    # a causal conv's zero padding and a TCN's chomp: the pad value 0 quantizes to the zero point
    # exactly (torch pads a quantized tensor with it); only constant-zero pads and basic slices of
    # a tensor match (flows/exact_share.py), others stay float with the reason
    F.pad, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d,
    nn.ZeroPad3d, operator.getitem,
    # CSP / C2f blocks (YOLO): the pieces are views of the int8 values, read with getitem
    torch.chunk, torch.split, "chunk", "split",
)
"""Ops that work on quantized tensors without changing their qparams (pooling, reshapes, relu)."""


def share_qparams_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Ops whose output reuses the input's observer: ``observer_0 - maxpool - observer_0``."""
    return [_config(op, dtype_configs, observation_type=_SHARED_OBSERVER)
            for op in _SHARE_QPARAMS_OPS]


def tensor_info_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """``x.shape`` / ``x.size()``: read metadata of any tensor, return non-tensors; not observed."""
    return [_config(op, dtype_configs, observation_type=_NOT_OBSERVED) for op in ("shape", "size")]


# -- fixed qparams ---------------------------------------------------------------------------------

_UNIT_RANGE = DTypeWithConstraints(dtype=torch.quint8, quant_min_lower_bound=0,
                                   quant_max_upper_bound=255, scale_exact_match=1.0 / 256.0,
                                   zero_point_exact_match=0)
_SIGNED_UNIT_RANGE = DTypeWithConstraints(dtype=torch.quint8, quant_min_lower_bound=0,
                                          quant_max_upper_bound=255,
                                          scale_exact_match=2.0 / 256.0, zero_point_exact_match=128)
_ZERO_TO_ONE_OPS: tuple[Any, ...] = (nn.Hardsigmoid, F.hardsigmoid, "hardsigmoid", "hardsigmoid_",
                                     nn.Sigmoid, torch.sigmoid, "sigmoid", "sigmoid_", nn.Softmax)
_MINUS_ONE_TO_ONE_OPS: tuple[Any, ...] = (nn.Tanh, torch.tanh, "tanh", "tanh_")

FIXED_QPARAMS_CONSTRAINTS: dict[Any, DTypeWithConstraints] = {
    **{op: _UNIT_RANGE for op in _ZERO_TO_ONE_OPS},
    **{op: _SIGNED_UNIT_RANGE for op in _MINUS_ONE_TO_ONE_OPS},
}
"""Output ranges are known in advance ([0, 1] for sigmoid, [-1, 1] for tanh), so quint8 qparams are
fixed: scale 1/256, zero point 0, or scale 2/256, zero point 128."""


def fixed_qparams_dtype_configs(dtype_configs: Iterable[DTypeConfig],
                                constraints: DTypeWithConstraints) -> list[DTypeConfig]:
    """Copies of ``dtype_configs`` whose activations of ``constraints.dtype`` get its fixed qparams;
    activations of other dtypes are left alone."""
    result = []
    for index, dtype_config in enumerate(dtype_configs):
        fixed = [_fix_activation(getattr(dtype_config, f"{name}_dtype_with_constraints"),
                                 constraints, f"dtype_configs[{index}].{name}_dtype")
                 for name in ("input", "output")]
        result.append(DTypeConfig(input_dtype=fixed[0], output_dtype=fixed[1],
                                  weight_dtype=dtype_config.weight_dtype_with_constraints,
                                  bias_dtype=dtype_config.bias_dtype,
                                  is_dynamic=dtype_config.is_dynamic))
    return result


def _fix_activation(current: DTypeWithConstraints, constraints: DTypeWithConstraints,
                    path: str) -> DTypeWithConstraints:
    if current.dtype != constraints.dtype:
        return current
    for bound in ("scale_min_lower_bound", "scale_max_upper_bound"):
        if getattr(current, bound) is not None:
            raise ConfigValidationError(
                f"{path}.{bound} cannot apply to fixed-qparams ops (sigmoid, tanh, ...), whose "
                "scale is fixed; give these ops dtype configs without scale bounds",
                field=f"{path}.{bound}", value=getattr(current, bound))
    return replace(current, quant_min_lower_bound=constraints.quant_min_lower_bound,
                   quant_max_upper_bound=constraints.quant_max_upper_bound,
                   scale_exact_match=constraints.scale_exact_match,
                   zero_point_exact_match=constraints.zero_point_exact_match)


def fixed_qparams_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """hardsigmoid, sigmoid, softmax, tanh (module, function and method forms) with fixed qparams."""
    return [_config(op, fixed_qparams_dtype_configs(dtype_configs, constraints))
            for op, constraints in FIXED_QPARAMS_CONSTRAINTS.items()]


# -- batch norm, rnn, embedding --------------------------------------------------------------------

_BN_RELU = {nn.BatchNorm2d: nni.BNReLU2d, nn.BatchNorm3d: nni.BNReLU3d}


def bn_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """BatchNorm2d/3d alone and fused with a following relu (module or F.relu)."""
    configs = []
    for bn, fused in _BN_RELU.items():
        configs += [_config((bn, relu), dtype_configs, fuser=fm.fuse_bn_relu, fused=fused)
                    for relu in RELU_FORMS]
        configs.append(_config(bn, dtype_configs))
    configs += [_config(fused, dtype_configs) for fused in _BN_RELU.values()]
    return configs


_RNN_MODULES = (nn.GRUCell, nn.LSTMCell, nn.RNNCell, nn.LSTM, nn.GRU)


def rnn_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Recurrent modules (dynamic quantization in practice)."""
    return [_config(rnn, dtype_configs, root=rnn) for rnn in _RNN_MODULES]


def embedding_op_configs(dtype_configs: Sequence[DTypeConfig]) -> list[BackendPatternConfig]:
    """Embedding and EmbeddingBag (weight-only) and their QAT modules."""
    configs = []
    for float_module, qat_module in ((nn.Embedding, qat.Embedding),
                                     (nn.EmbeddingBag, qat.EmbeddingBag)):
        configs += [_config(float_module, dtype_configs, root=float_module, qat_module=qat_module),
                    _config(qat_module, dtype_configs, root=float_module)]
    return configs


# -- everything ------------------------------------------------------------------------------------


def common_pattern_configs(
    *,
    weighted_op_dtype_configs: Sequence[DTypeConfig],
    default_op_dtype_configs: Sequence[DTypeConfig],
    fixed_qparams_op_dtype_configs: Sequence[DTypeConfig],
    share_qparams_op_dtype_configs: Sequence[DTypeConfig],
    tensor_info_op_dtype_configs: Sequence[DTypeConfig],
    rnn_op_dtype_configs: Sequence[DTypeConfig],
    embedding_op_dtype_configs: Sequence[DTypeConfig],
    layer_norm_op_dtype_configs: Sequence[DTypeConfig],
    linear_dtype_configs: Sequence[DTypeConfig] | None = None,
    binary_op_dtype_configs: Sequence[DTypeConfig] | None = None,
) -> list[BackendPatternConfig]:
    """All shared pattern configs, in torch.ao's native order, one per pattern.

    ``linear_dtype_configs`` defaults to ``weighted_op_dtype_configs`` (pass it to add dynamic
    linear); ``binary_op_dtype_configs`` defaults to ``default_op_dtype_configs``.
    """
    linear = weighted_op_dtype_configs if linear_dtype_configs is None else linear_dtype_configs
    binary = default_op_dtype_configs if binary_op_dtype_configs is None else binary_op_dtype_configs
    return [
        *conv_configs(weighted_op_dtype_configs),
        *linear_configs(linear),
        *binary_op_configs(binary),
        cat_config(default_op_dtype_configs),
        *default_op_configs(default_op_dtype_configs),
        *fixed_qparams_op_configs(fixed_qparams_op_dtype_configs),
        *share_qparams_op_configs(share_qparams_op_dtype_configs),
        *tensor_info_op_configs(tensor_info_op_dtype_configs),
        *bn_configs(default_op_dtype_configs),
        *ln_configs(layer_norm_op_dtype_configs),
        *rnn_op_configs(rnn_op_dtype_configs),
        *embedding_op_configs(embedding_op_dtype_configs),
    ]
