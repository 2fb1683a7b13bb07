"""Ready-made observer and fake-quant factories, named as in torch.ao.quantization.

Keeping torch.ao's names lets users move a qconfig over by changing the import. Each is an
:class:`ObserverFactory`, i.e. plain data that configs can serialise.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qplug_core.observers.factory import ObserverFactory
from qplug_core.observers.fake_quantize import FakeQuantize, FixedQParamsFakeQuantize
from qplug_core.observers.fixed import FixedQParamsObserver, PlaceholderObserver
from qplug_core.observers.histogram import HistogramObserver
from qplug_core.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

__all__ = [
    "default_observer",
    "default_placeholder_observer",
    "default_weight_observer",
    "weight_observer_range_neg_127_to_127",
    "default_histogram_observer",
    "default_per_channel_weight_observer",
    "per_channel_weight_observer_range_neg_127_to_127",
    "default_dynamic_quant_observer",
    "default_float_qparams_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_fixed_qparams_range_0to1_observer",
    "default_fake_quant",
    "default_weight_fake_quant",
    "default_dynamic_fake_quant",
    "default_per_channel_weight_fake_quant",
    "default_embedding_fake_quant",
    "default_histogram_fake_quant",
    "default_fused_act_fake_quant",
    "default_fused_wt_fake_quant",
    "default_fused_per_channel_wt_fake_quant",
    "default_fixed_qparams_range_neg1to1_fake_quant",
    "default_fixed_qparams_range_0to1_fake_quant",
    "FIXED_QPARAMS_OP_TO_OBSERVER",
]

# -- observers (post-training quantization) --------------------------------------------------------

#: activations restricted to [0, 127], as torch.ao's default (safe on non-VNNI x86)
default_observer = MinMaxObserver.with_args(quant_min=0, quant_max=127)
default_placeholder_observer = PlaceholderObserver.with_args()
default_weight_observer = MinMaxObserver.with_args(dtype=torch.qint8,
                                                   qscheme=torch.per_tensor_symmetric)
#: symmetric weights in [-127, 127] (no -128), as qnnpack/XNNPACK require
weight_observer_range_neg_127_to_127 = MinMaxObserver.with_args(
    dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-127, quant_max=127,
    eps=2**-12)
default_histogram_observer = HistogramObserver.with_args(quant_min=0, quant_max=127)
default_per_channel_weight_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
per_channel_weight_observer_range_neg_127_to_127 = PerChannelMinMaxObserver.with_args(
    dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127, quant_max=127,
    eps=2**-12)
default_dynamic_quant_observer = PlaceholderObserver.with_args(
    dtype=torch.quint8, quant_min=0, quant_max=255, is_dynamic=True)
default_float_qparams_observer = PerChannelMinMaxObserver.with_args(
    dtype=torch.quint8, qscheme=torch.per_channel_affine_float_qparams, ch_axis=0)

# -- fixed qparams (outputs with a known range) ----------------------------------------------------

#: outputs in [-1, 1] (tanh)
default_fixed_qparams_range_neg1to1_observer = FixedQParamsObserver.with_args(
    scale=2.0 / 256.0, zero_point=128, dtype=torch.quint8, quant_min=0, quant_max=255)
#: outputs in [0, 1] (sigmoid, hardsigmoid, softmax)
default_fixed_qparams_range_0to1_observer = FixedQParamsObserver.with_args(
    scale=1.0 / 256.0, zero_point=0, dtype=torch.quint8, quant_min=0, quant_max=255)

# -- fake quantization (QAT) -----------------------------------------------------------------------

default_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
    qscheme=torch.per_tensor_affine, reduce_range=True)
default_weight_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
    qscheme=torch.per_tensor_symmetric, reduce_range=False)
default_dynamic_fake_quant = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, is_dynamic=True,
    dtype=torch.quint8, averaging_constant=1)
default_per_channel_weight_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
    dtype=torch.qint8, qscheme=torch.per_channel_symmetric, reduce_range=False, ch_axis=0)
default_embedding_fake_quant = FakeQuantize.with_args(
    observer=MovingAveragePerChannelMinMaxObserver, qscheme=torch.per_channel_affine_float_qparams,
    dtype=torch.quint8, quant_min=0, quant_max=255, ch_axis=0, averaging_constant=1)
default_histogram_fake_quant = FakeQuantize.with_args(
    observer=HistogramObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
    qscheme=torch.per_tensor_affine, reduce_range=True)
#: torch.ao's "fused" variants are a speed detail of one kernel; here they are the plain ones
default_fused_act_fake_quant = default_fake_quant
default_fused_wt_fake_quant = default_weight_fake_quant
default_fused_per_channel_wt_fake_quant = default_per_channel_weight_fake_quant
default_fixed_qparams_range_neg1to1_fake_quant = FixedQParamsFakeQuantize.with_args(
    observer=default_fixed_qparams_range_neg1to1_observer)
default_fixed_qparams_range_0to1_fake_quant = FixedQParamsFakeQuantize.with_args(
    observer=default_fixed_qparams_range_0to1_observer)

#: the fixed-qparams observer of each op with a known output range (torch.ao's table)
FIXED_QPARAMS_OP_TO_OBSERVER: dict[Callable | str | type[nn.Module], ObserverFactory] = {
    nn.Hardsigmoid: default_fixed_qparams_range_0to1_observer,
    nn.functional.hardsigmoid: default_fixed_qparams_range_0to1_observer,
    "hardsigmoid": default_fixed_qparams_range_0to1_observer,
    "hardsigmoid_": default_fixed_qparams_range_0to1_observer,
    nn.Sigmoid: default_fixed_qparams_range_0to1_observer,
    torch.sigmoid: default_fixed_qparams_range_0to1_observer,
    "sigmoid": default_fixed_qparams_range_0to1_observer,
    "sigmoid_": default_fixed_qparams_range_0to1_observer,
    nn.Softmax: default_fixed_qparams_range_0to1_observer,
    nn.Tanh: default_fixed_qparams_range_neg1to1_observer,
    torch.tanh: default_fixed_qparams_range_neg1to1_observer,
    "tanh": default_fixed_qparams_range_neg1to1_observer,
    "tanh_": default_fixed_qparams_range_neg1to1_observer,
}
