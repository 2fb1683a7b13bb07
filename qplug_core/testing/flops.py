"""How much of a model's matmul/conv work a quantized version runs on int8 kernels.

Counting int8 *regions* says little: a model can have a hundred int8 adds and its one big matmul in
float. This measures FLOPs instead. ``torch.utils.flop_counter.FlopCounterMode`` counts the float
model's matmul and conv FLOPs per module (attention included: CPU's fused attention op has no
formula in torch, so one is supplied). The int8 share is the FLOPs of the float modules whose
counterpart in the quantized model (same qualified name, which the flows keep) runs a backend
kernel, over the float model's total. FLOPs between activations (attention) that stay float count
in the total and not in the int8 part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from qplug_core.fx.tags import KERNEL

__all__ = ["FlopShare", "int8_flop_share", "kernel_module_names"]

aten = torch.ops.aten


def _attention_flops(query_shape, key_shape, value_shape, *args: Any, out_shape=None,
                     **kwargs: Any) -> int:
    """``softmax(q k^T) v``: two batched matmuls, 2 FLOPs per multiply-add."""
    *batch, q_len, head_dim = query_shape
    k_len, v_dim = key_shape[-2], value_shape[-1]
    heads = 1
    for size in batch:
        heads *= size
    return 2 * heads * q_len * k_len * head_dim + 2 * heads * q_len * k_len * v_dim


_CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}


@dataclass
class FlopShare:
    """Matmul/conv FLOPs of one forward: in total, and in modules lowered to int8 kernels."""

    total: int
    int8: int
    by_module: dict[str, int] = field(default_factory=dict)  # int8 module path -> its FLOPs

    @property
    def share(self) -> float:
        return self.int8 / self.total if self.total else 0.0


def kernel_module_names(quantized: fx.GraphModule) -> list[str]:
    """Qualified names of the modules of ``quantized`` that run a backend kernel."""
    return [n.target for n in quantized.graph.nodes
            if n.op == "call_module" and n.meta.get(KERNEL)]


def _flops_by_module(model: nn.Module, inputs: tuple) -> tuple[int, dict[str, int]]:
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)
    with torch.no_grad(), counter:
        model(*inputs)
    root = type(model).__name__
    per_module = {}
    for name, ops in counter.get_flop_counts().items():
        if name == root:
            per_module[""] = sum(ops.values())
        elif name.startswith(root + "."):
            per_module[name[len(root) + 1:]] = sum(ops.values())
    return counter.get_total_flops(), per_module


def int8_flop_share(float_model: nn.Module, quantized: fx.GraphModule, inputs: tuple) -> FlopShare:
    """The :class:`FlopShare` of ``quantized`` measured on ``float_model`` run on ``inputs``."""
    total, per_module = _flops_by_module(float_model, inputs)
    counted: dict[str, int] = {}
    for name in sorted(set(kernel_module_names(quantized))):
        if any(name.startswith(outer + ".") for outer in counted):
            continue  # a kernel inside a counted module is already in that module's FLOPs
        counted[name] = per_module.get(name, 0)
    return FlopShare(total=total, int8=sum(counted.values()), by_module=counted)
