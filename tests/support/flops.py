"""How much of a model's matmul/conv work a quantized version runs on int8 kernels.

Counting int8 *regions* says little: a model can have a hundred int8 adds and its one big matmul in
float. This measures FLOPs instead. ``torch.utils.flop_counter.FlopCounterMode`` counts the float
matmul and conv FLOPs (mm, addmm, bmm, conv, attention: CPU's fused attention op has no formula in
torch, so one is supplied) of the float model and of the quantized model on the same inputs. Int8
kernels (``quantized::*`` ops) have no float formula, so whatever the quantized model still counts
is float work; the int8 share is ``1 - float FLOPs left / float model's FLOPs``. Reference-form
fallbacks and attention between activations stay float and count against the share.
``by_module`` says where the int8 FLOPs are: the float model's FLOPs per module whose counterpart
(same qualified name, which the flows keep) runs a backend kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from qplug_core.flows.tags import KERNEL

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


def _no_flops(*args: Any, **kwargs: Any) -> int:
    return 0


#: FlopCounterMode runs an overload it has no formula for through torch's Python decomposition,
#: which refuses quantized inputs ("Invalid dtype!": fbgemm keeps F.interpolate int8). Resampling
#: does no matmul/conv work: its overloads get a formula of 0 so that they run as they are.
_RESAMPLING = {getattr(packet, overload): _no_flops for packet in (
    aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
    aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d,
    aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_bicubic2d, aten.upsample_trilinear3d)
    for overload in packet.overloads()}
_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops, **_RESAMPLING}


@dataclass
class FlopShare:
    """Matmul/conv FLOPs of one forward of the float model, and those the quantized one does in float."""

    total: int
    float_left: int
    by_module: dict[str, int] = field(default_factory=dict)  # int8 module path -> its float FLOPs

    @property
    def int8(self) -> int:
        return self.total - self.float_left

    @property
    def share(self) -> float:
        return self.int8 / self.total if self.total else 0.0


def kernel_module_names(quantized: fx.GraphModule) -> list[str]:
    """Qualified names of the modules of ``quantized`` that run a backend kernel."""
    return [n.target for n in quantized.graph.nodes
            if n.op == "call_module" and n.meta.get(KERNEL)]


def _flops_by_module(model: nn.Module, inputs: tuple) -> tuple[int, dict[str, int]]:
    counter = FlopCounterMode(display=False, custom_mapping=_FORMULAS)
    # grad mode on: without it nn.TransformerEncoderLayer takes a fused fast path whose FLOPs
    # FlopCounterMode cannot see (the computation is the same)
    with torch.enable_grad(), counter:
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
    float_left, _ = _flops_by_module(quantized, inputs)
    where = {name: per_module.get(name, 0) for name in sorted(set(kernel_module_names(quantized)))}
    return FlopShare(total=total, float_left=float_left, by_module=where)
