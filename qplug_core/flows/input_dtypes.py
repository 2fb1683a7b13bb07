"""A converted model called with an input of a dtype it cannot take says so, the same on every backend.

The int8 model was calibrated with float32 inputs and its first quantize (a kernel, an ONNX Runtime
or OpenVINO session, the reference form) takes float32 only: a float16, bfloat16 or float64 input
met torch's "Quantize only works on Float Tensor", ONNX Runtime's "INVALID_GRAPH: This is an invalid
model", or OpenVINO running float16 but refusing the others. And a graph holds what the model
computed for its example's dtypes only: ``nn.TransformerEncoder`` captured with a bool padding mask
met a float (-inf) one in ``masked_fill`` ("only supports boolean masks"), deep inside the graph.
One forward pre-hook on the model compares each tensor input's dtype with the one recorded at
capture: the same dtype passes with one comparison; another integer dtype passes (token ids in
int32 or int64), as does any float where the example was another float than float32; a float32
input must stay float32, and no input may change between bool, integer and float.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import INPUT_SPEC, SPEC_DTYPES

__all__ = ["guard_input_dtypes"]


def guard_input_dtypes(gm: fx.GraphModule) -> None:
    """Check on every call of ``gm`` that each tensor input has a dtype its graph computes."""
    if any(isinstance(hook, _InputDtypes) for hook in gm._forward_pre_hooks.values()):
        return
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    checked = tuple((index, str(node.target), SPEC_DTYPES[node.meta[INPUT_SPEC]["dtype"]])
                    for index, node in enumerate(placeholders) if INPUT_SPEC in node.meta)
    if checked:
        gm.register_forward_pre_hook(_InputDtypes(checked), with_kwargs=True)


def _kind(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else "integer"


def _refusal(name: str, given: torch.dtype, captured: torch.dtype) -> str:
    """Why input ``name`` of dtype ``given`` cannot run where ``captured`` was recorded ('' if it can)."""
    given_name, captured_name = str(given).removeprefix("torch."), str(captured).removeprefix("torch.")
    if _kind(given) != _kind(captured):
        return (f"input {name!r} is {given_name} where the int8 model was captured with {captured_name}: its "
                f"graph holds what the model computes for a {_kind(captured)} input only (the float model may "
                f"take other dtypes there). Pass {name} as {captured_name}, as when it was quantized, or "
                "quantize with example inputs of the dtypes you call the model with")
    if captured is torch.float32:
        return (f"input {name!r} is {given_name}; the int8 model takes float32 inputs (it was calibrated and "
                f"converted for them): pass {name}.float()")
    return ""


class _InputDtypes:
    """Forward pre-hook: each ``(position, name, dtype)`` of ``checked`` is a tensor input (passed by
    position or by name) recorded with ``dtype`` at capture."""

    def __init__(self, checked: tuple[tuple[int, str, torch.dtype], ...]) -> None:
        self.checked = checked

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for index, name, captured in self.checked:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dtype is not captured:
                refusal = _refusal(name, value.dtype, captured)
                if refusal:
                    raise InputMismatchError(refusal)
