"""Observers (calibration statistics -> qparams) and fake-quant modules (QAT)."""

from __future__ import annotations

from qplug_core.observers import defaults as _defaults
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.clipping import MSEObserver, PercentileObserver
from qplug_core.observers.defaults import *  # noqa: F401,F403  (torch.ao-named factories)
from qplug_core.observers.factory import FactoryMixin, ObserverFactory
from qplug_core.observers.fake_quantize import (
    FakeQuantize,
    FakeQuantizeBase,
    FixedQParamsFakeQuantize,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
)
from qplug_core.observers.fixed import FixedQParamsObserver, PlaceholderObserver
from qplug_core.observers.histogram import HistogramObserver
from qplug_core.observers.learnable import LearnableFakeQuantize
from qplug_core.observers.minmax import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

__all__ = [
    "FactoryMixin", "ObserverFactory", "ObserverBase",
    "MinMaxObserver", "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver", "HistogramObserver", "PercentileObserver",
    "MSEObserver", "FixedQParamsObserver", "PlaceholderObserver",
    "FakeQuantizeBase", "FakeQuantize", "FixedQParamsFakeQuantize", "LearnableFakeQuantize",
    "enable_fake_quant", "disable_fake_quant", "enable_observer", "disable_observer",
    *_defaults.__all__,
]
