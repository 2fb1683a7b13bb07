"""A per-token dynamic int8 linear as plain tensors: its int8 weight ``[out, in]``, one float32
scale per output channel and its bias. One codec for the module-swap files
(``qp.quantize_dynamic(per_token=True)``, ``qp.quantize_w8a8``) and for the layers an accuracy
target moved to the per-token rung in a converted model's file
(:mod:`qplug_core.serialization.per_token_record`)."""

from __future__ import annotations

import torch

from qplug_core.kernels.per_token import PerTokenDynamicLinear

WEIGHT_FIELDS = ("weight_int8", "weight_scale")


def encode(module: PerTokenDynamicLinear) -> dict[str, torch.Tensor | None]:
    """The tensors that give ``module`` back exactly (on a CPU whose GEMM takes its weights)."""
    return {"weight_int8": module.weight_int8_t.t().contiguous(), "weight_scale": module.weight_scale,
            "bias": module.bias}


def tensor_problem(tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, layer: str,
                   field: str) -> str | None:
    """What is wrong with a layer's tensor read from a file, or ``None``."""
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = "missing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
        return f"layer {layer!r} {field} should be {dtype} {shape}, got {got}"
    return None


def weight_problem(values: dict[str, torch.Tensor | None], shape: tuple[int, int], layer: str) -> str | None:
    """What is wrong with a per-token layer's weight and scales read from a file, or ``None``."""
    scale = values.get("weight_scale")
    problem = (tensor_problem(values.get("weight_int8"), shape, torch.int8, layer, "weight_int8")
               or tensor_problem(scale, shape[:1], torch.float32, layer, "weight_scale"))
    if problem is None and scale is not None and not (bool(torch.isfinite(scale).all()) and bool((scale > 0).all())):
        return f"layer {layer!r} weight_scale has values that are not finite and positive"
    return problem
