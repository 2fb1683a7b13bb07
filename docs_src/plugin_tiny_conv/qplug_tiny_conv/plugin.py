"""The ``tiny_conv`` backend: conv + relu fused into its own module, run by one integer kernel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.plugin_api import (
    RELU_FORMS,
    BackendPatternConfig,
    BackendPlugin,
    DTypeConfig,
    FusedModule,
    KernelSpec,
)

INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                   weight_dtype=torch.qint8, bias_dtype=torch.float)


class ConvReLU(FusedModule):
    """What the fuser builds: an nn.Sequential of exactly these children, the weighted one first."""

    CHILD_TYPES = (nn.Conv2d, nn.ReLU)


def fuse_conv_relu(is_qat: bool, conv: nn.Conv2d, relu: nn.ReLU) -> ConvReLU:
    """The matched modules in dataflow order; a relu written F.relu arrives as an nn.ReLU()."""
    return ConvReLU(conv, relu)


class TinyConv(nn.Module):
    """uint8 in, uint8 out: the conv of (x - x_zp) on the int8 weights (whole numbers, exact in
    float64), the relu when fused, requantized to the output's grid."""

    def __init__(self, ctx):
        super().__init__()
        conv, x, w, out = ctx.root, ctx.input_qparams[0], ctx.weight_qparams, ctx.output_qparams
        weight = torch.round(conv.weight.detach() / w.scale).clamp(w.quant_min, w.quant_max)
        bias = conv.bias.detach() if conv.bias is not None else torch.zeros(len(weight))
        self.register_buffer("weight", weight.double())
        self.register_buffer("bias", torch.round(bias / (x.scale * w.scale)).double())
        self.options = {"stride": conv.stride, "padding": conv.padding, "dilation": conv.dilation,
                        "groups": conv.groups}
        self.x_zero_point, self.out_zero_point = int(x.zero_point), int(out.zero_point)
        self.multiplier = float(x.scale * w.scale / out.scale)
        self.out_range, self.relu = (out.quant_min, out.quant_max), bool(ctx.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = F.conv2d(x.double() - self.x_zero_point, self.weight, self.bias, **self.options)
        acc = acc.clamp(min=0) if self.relu else acc
        return torch.round(acc * self.multiplier + self.out_zero_point).clamp(*self.out_range).to(torch.uint8)


class TinyConvPlugin(BackendPlugin):
    name = "tiny_conv"
    description = "int8 conv and conv + relu on one integer kernel (docs fusion example)"

    def pattern_configs(self) -> list[BackendPatternConfig]:
        return [
            BackendPatternConfig(nn.Conv2d).add_dtype_config(INT8).set_root_module(nn.Conv2d),
            # the fusion, once per way a model writes its relu (simple format: conv first)
            *(BackendPatternConfig((nn.Conv2d, relu)).add_dtype_config(INT8)
              .set_fuser_method(fuse_conv_relu).set_fused_module(ConvReLU) for relu in RELU_FORMS),
            # what the fused module itself quantizes as: the region of one int8 kernel
            BackendPatternConfig(ConvReLU).add_dtype_config(INT8).set_root_module(nn.Conv2d),
        ]

    def kernels(self) -> dict[Any, KernelSpec]:
        return {nn.Conv2d: KernelSpec("tiny_conv::conv2d", build=TinyConv),
                ConvReLU: KernelSpec("tiny_conv::conv2d_relu", build=TinyConv)}

    def qconfig_options(self, mode: str) -> dict[str, Any]:
        return {"per_channel": False}


plugin = TinyConvPlugin()
