"""Default qconfig mappings, parameterised by what a backend's kernels need.

Backends call :func:`default_qconfig_mapping` with their hardware facts (7-bit activations on x86
without VNNI, per-channel weights when the kernels support them, qnnpack's [-127, 127] weights and
2^-12 minimum scale) instead of each writing its own table.

Choices beyond torch.ao's defaults, each measured on the model zoo:

* ``LayerNorm``/``GroupNorm``/``InstanceNorm`` and softmax stay float in static mode. Transformer
  residual streams carry outlier channels; one per-tensor scale for them destroys the small
  values (torch.ao's defaults take a BERT-style encoder's embedding cosine to 0.17). They cost
  little in float next to the int8 matmuls around them.
* Embeddings get 8-bit per-row weights (weight-only), which is lossless in practice and 4x smaller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.config import QConfig, QConfigMapping
from qplug_core.enums import MODES
from qplug_core.errors import ConfigError, did_you_mean
from qplug_core.observers import (
    FakeQuantize,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)

#: kept float in static mode by default (see the module docstring); the report quotes the reason
FLOAT_IN_STATIC = (nn.LayerNorm, F.layer_norm, nn.GroupNorm, F.group_norm, nn.InstanceNorm1d,
                    nn.InstanceNorm2d, nn.InstanceNorm3d, F.instance_norm, nn.Softmax, F.softmax,
                    torch.softmax, "softmax")
FLOAT_IN_STATIC_REASON = ("qconfig is None for this op type: qplug's default mapping keeps normalization and "
                          "softmax float in static mode (one per-tensor scale on a residual stream's outlier "
                          "channels loses its small values); set a qconfig for it to quantize it")
_DYNAMIC_MODULES = (nn.Linear, nn.LSTM, nn.GRU, nn.RNNCell, nn.LSTMCell, nn.GRUCell)
#: recurrent layers have int8 kernels only for dynamic quantization
_DYNAMIC_ONLY = (nn.LSTM, nn.GRU, nn.RNNCell, nn.LSTMCell, nn.GRUCell)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _weight_factory(*, per_channel: bool, qat: bool, weight_quant_min: int, weight_quant_max: int,
                    eps: float, ch_axis: int = 0):
    kwargs = dict(dtype=torch.qint8, quant_min=weight_quant_min, quant_max=weight_quant_max, eps=eps,
                  qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric)
    if per_channel:
        kwargs["ch_axis"] = ch_axis
    if qat:
        observer = MovingAveragePerChannelMinMaxObserver if per_channel else MovingAverageMinMaxObserver
        return FakeQuantize.with_args(observer=observer, **kwargs)
    return (PerChannelMinMaxObserver if per_channel else MinMaxObserver).with_args(**kwargs)


def grouped_transpose_qconfig(qconfig: QConfig, module: nn.Module) -> QConfig:
    """``qconfig`` as a default mapping means it for ``module``: a grouped transposed conv gets
    per-tensor weights of the same range and eps, since torch's quantized transposed convs take
    per-channel weights only with ``groups == 1`` (on every engine; the region would stay float);
    any other layer keeps ``qconfig``."""
    root = module[0] if isinstance(module, nn.Sequential) and len(module) else module
    if not (isinstance(root, nn.modules.conv._ConvTransposeNd) and root.groups != 1 and qconfig.weight is not None):
        return qconfig
    weight = qconfig.weight()
    inner = getattr(weight, "activation_post_process", weight)
    if getattr(inner, "qscheme", None) != torch.per_channel_symmetric:
        return qconfig
    return QConfig(activation=qconfig.activation, weight=_weight_factory(
        per_channel=False, qat=isinstance(weight, FakeQuantize), weight_quant_min=int(weight.quant_min),
        weight_quant_max=int(weight.quant_max), eps=float(inner.eps)))


def _activation_factory(*, qat: bool, reduce_range: bool, eps: float):
    quant_max = 127 if reduce_range else 255
    kwargs = dict(dtype=torch.quint8, quant_min=0, quant_max=quant_max, eps=eps)
    if qat:
        return FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, **kwargs)
    return HistogramObserver.with_args(**kwargs)


def embedding_qconfig(*, qat: bool = False) -> QConfig:
    """8-bit per-row weights with float qparams; activations (indices) untouched."""
    weight_kwargs = dict(dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0)
    if qat:
        weight = FakeQuantize.with_args(observer=MovingAveragePerChannelMinMaxObserver,
                                        quant_min=0, quant_max=255, averaging_constant=1, **weight_kwargs)
    else:
        weight = PerChannelMinMaxObserver.with_args(**weight_kwargs)
    return QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float32), weight=weight)


def dynamic_qconfig(*, per_channel: bool, reduce_range: bool, weight_quant_min: int = -128,
                    weight_quant_max: int = 127, eps: float = torch.finfo(torch.float32).eps) -> QConfig:
    """int8 weights ahead of time, activations quantized per batch at run time."""
    activation = PlaceholderObserver.with_args(dtype=torch.quint8, quant_min=0,
                                               quant_max=127 if reduce_range else 255, is_dynamic=True)
    weight = _weight_factory(per_channel=per_channel, qat=False, weight_quant_min=weight_quant_min,
                             weight_quant_max=weight_quant_max, eps=eps)
    return QConfig(activation=activation, weight=weight)


def float16_dynamic_qconfig() -> QConfig:
    return QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float16, is_dynamic=True),
                   weight=PlaceholderObserver.with_args(dtype=torch.float16))


def default_qconfig_mapping(mode: str = "static", *, reduce_range: bool = False, per_channel: bool = True,
                            per_channel_conv_transpose: bool = False, weight_quant_min: int = -128,
                            weight_quant_max: int = 127,
                            eps: float = torch.finfo(torch.float32).eps) -> QConfigMapping:
    """The mapping a backend with these properties should use for ``mode``.

    Transposed convs keep their output channels on weight axis 1, and not every engine has
    per-channel kernels for them, hence the separate switch.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown quantization mode {mode!r}{did_you_mean(mode, MODES)}; use one of "
                          f"{', '.join(MODES)}", field="mode", value=mode)
    if mode == "dynamic":
        qconfig = dynamic_qconfig(per_channel=per_channel, reduce_range=reduce_range,
                                  weight_quant_min=weight_quant_min, weight_quant_max=weight_quant_max,
                                  eps=eps)
        mapping = QConfigMapping()
        for module_type in _DYNAMIC_MODULES:
            mapping.set_object_type(module_type, qconfig)
        return mapping
    qat = mode == "qat"
    activation = _activation_factory(qat=qat, reduce_range=reduce_range, eps=eps)
    weight_range = dict(qat=qat, weight_quant_min=weight_quant_min, weight_quant_max=weight_quant_max,
                        eps=eps)
    mapping = QConfigMapping().set_global(QConfig(
        activation=activation, weight=_weight_factory(per_channel=per_channel, **weight_range)))
    transpose = QConfig(activation=activation, weight=_weight_factory(
        per_channel=per_channel and per_channel_conv_transpose, ch_axis=1, **weight_range))
    for conv_transpose in _CONV_TRANSPOSE:
        mapping.set_object_type(conv_transpose, transpose)
    for embedding in _EMBEDDINGS:
        mapping.set_object_type(embedding, embedding_qconfig(qat=qat))
    for op in FLOAT_IN_STATIC + _DYNAMIC_ONLY:
        mapping.set_object_type(op, None)
    return mapping
