"""Observers turn calibration statistics into scale / zero_point; FakeQuantize simulates int8."""

import torch

from qplug_core.errors import NonFiniteCalibrationError, UncalibratedObserverError
from qplug_core.observers import (
    FakeQuantize,
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    PerChannelMinMaxObserver,
)

torch.manual_seed(0)
x = torch.randn(64, 8) * torch.linspace(0.1, 4.0, 8)  # channels of very different ranges

# Affine per-tensor quint8: scale = (max - min) / (qmax - qmin), zero point maps 0.0 exactly.
affine = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
affine(x)
print(affine.calculate_qparams())

# Symmetric per-channel qint8 (the usual weight observer): one scale per output channel.
per_channel = PerChannelMinMaxObserver(ch_axis=1, dtype=torch.qint8,
                                       qscheme=torch.per_channel_symmetric)
per_channel(x)
scales, zero_points = per_channel.calculate_qparams()
assert scales.shape == (8,) and not zero_points.any()

# Histogram: searches its histogram for the range with the least L2 quantization error.
histogram = HistogramObserver(dtype=torch.quint8)
histogram(torch.cat([x.flatten(), torch.tensor([100.0])]))
print(histogram.calculate_qparams())

# Configs take factories, not instances: with_args binds keyword arguments for later.
factory = MovingAverageMinMaxObserver.with_args(averaging_constant=0.1, dtype=torch.quint8)
observer = factory()

# No data and bad data are errors, never scale=1 / zero_point=0 or NaN qparams.
try:
    observer.calculate_qparams()
except UncalibratedObserverError as error:
    print(error)
try:
    MinMaxObserver()(torch.tensor([1.0, float("nan")]))
except NonFiniteCalibrationError as error:
    print(error)

# FakeQuantize (QAT): observe, then quantize-dequantize in forward; gradients pass straight through.
fq = FakeQuantize(observer=MovingAverageMinMaxObserver, dtype=torch.quint8, quant_min=0, quant_max=255)
y = torch.randn(4, 8, requires_grad=True)
fq(y).sum().backward()
assert torch.equal(y.grad, torch.ones_like(y))  # inside the range the gradient is 1
