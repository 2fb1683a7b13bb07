"""A static kernel on torch quantized tensors, built from a hand-made context and tested alone."""

import torch
from torch import nn

from qplug_core.plugin_api import KernelContext, QParams, int_values, quantized_from_int


def quint8(scale: float, zero_point: int) -> QParams:
    return QParams(torch.tensor(scale), torch.tensor(zero_point), torch.quint8, 0, 255)


class QuantizedReLU(nn.Module):
    """Static kernel: a per-tensor quint8 tensor in, one with the output's qparams out."""

    def __init__(self, ctx: KernelContext):
        super().__init__()
        self.scale, self.zero_point = float(ctx.output_qparams.scale), int(ctx.output_qparams.zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, scale, zero_point = int_values(x)  # integers, and x == (q - zero_point) * scale
        real = (q.double() - zero_point).clamp(min=0) * scale
        return quantized_from_int(real / self.scale + self.zero_point, self.scale, self.zero_point)


# What lowering would hand `build`: the calibrated module and the qparams around it.
ctx = KernelContext(pattern=nn.ReLU, module=nn.ReLU(), target=None,
                    input_qparams=(quint8(0.05, 128),), output_qparams=quint8(0.025, 0))
kernel = QuantizedReLU(ctx)

x = quantized_from_int(torch.round(torch.linspace(-6, 6, 9) / 0.05) + 128, 0.05, 128)
y = kernel(x)
expected = torch.relu(x.dequantize()).clamp(max=255 * 0.025)  # the output range saturates at 6.375
assert (y.q_scale(), y.q_zero_point(), y.dtype) == (kernel.scale, 0, torch.quint8)
assert torch.allclose(y.dequantize(), expected, atol=0.025 / 2)
print("input ", x.dequantize().tolist())
print("output", y.dequantize().tolist())
