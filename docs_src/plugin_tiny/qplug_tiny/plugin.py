"""The ``tiny`` backend: int8 ``nn.Linear`` on its own integer kernel (entry point ``tiny``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.plugin_api import BackendPatternConfig, BackendPlugin, DTypeConfig, KernelSpec

# What the kernel accepts: quint8 activations in and out, qint8 weights, float bias.
LINEAR_INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                          weight_dtype=torch.qint8, bias_dtype=torch.float)


class TinyLinear(nn.Module):
    """uint8 in, uint8 out: int32 products of (x - x_zp) and the int8 weights, requantized."""

    def __init__(self, ctx):  # ctx: a KernelContext, the calibrated nn.Linear and its qparams
        super().__init__()
        x, w, out = ctx.input_qparams[0], ctx.weight_qparams, ctx.output_qparams
        weight = torch.round(ctx.module.weight.detach() / w.scale).clamp(w.quant_min, w.quant_max)
        bias = ctx.module.bias.detach() if ctx.module.bias is not None else torch.zeros(len(weight))
        self.register_buffer("weight", weight.to(torch.int32).t().contiguous())
        self.register_buffer("bias", torch.round(bias / (x.scale * w.scale)).to(torch.int32))
        self.x_zero_point, self.out_zero_point = int(x.zero_point), int(out.zero_point)
        self.multiplier = float(x.scale * w.scale / out.scale)  # int32 accumulator -> output steps
        self.out_range = (out.quant_min, out.quant_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = (x.to(torch.int32) - self.x_zero_point) @ self.weight + self.bias
        return torch.round(acc * self.multiplier + self.out_zero_point).clamp(*self.out_range).to(torch.uint8)

    @staticmethod
    def self_test() -> None:
        """Raise if this machine's torch cannot run the kernel (lowering then keeps float ops)."""
        ones = torch.ones(2, 3, dtype=torch.int32)
        if not torch.equal(ones @ ones.t(), torch.full((2, 2), 3, dtype=torch.int32)):
            raise RuntimeError("int32 matmul gives wrong results on this torch build")


class TinyPlugin(BackendPlugin):
    name = "tiny"
    description = "int8 nn.Linear on its own integer kernel (docs tutorial)"

    def pattern_configs(self) -> list[BackendPatternConfig]:
        return [BackendPatternConfig(nn.Linear).add_dtype_config(LINEAR_INT8).set_root_module(nn.Linear)]

    def kernels(self) -> dict[Any, KernelSpec]:
        # keyed by the complex-format pattern of the config above
        return {nn.Linear: KernelSpec("tiny::linear", build=TinyLinear, self_test=TinyLinear.self_test)}

    def qconfig_options(self, mode: str) -> dict[str, Any]:
        return {"per_channel": False}  # per-tensor weights keep the kernel small


plugin = TinyPlugin()
