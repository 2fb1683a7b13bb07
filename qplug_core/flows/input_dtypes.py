"""A converted model called with float inputs that are not float32 says so, the same on every backend.

The int8 model was calibrated with float32 inputs and its first quantize (a kernel, an ONNX Runtime
or OpenVINO session, the reference form) takes float32 only: a float16, bfloat16 or float64 input
met torch's "Quantize only works on Float Tensor", ONNX Runtime's "INVALID_GRAPH: This is an invalid
model", or OpenVINO running float16 but refusing the others. One forward pre-hook on the model checks
the inputs that were float32 at capture (integer inputs, token ids, are never looked at): a dtype
read and compared per such input, a fraction of a microsecond per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import INPUT_SPEC

__all__ = ["guard_float32_inputs"]


def guard_float32_inputs(gm: fx.GraphModule) -> None:
    """Check on every call of ``gm`` that the inputs recorded as float32 at capture still are."""
    if any(isinstance(hook, _Float32Inputs) for hook in gm._forward_pre_hooks.values()):
        return
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    checked = tuple((index, str(node.target)) for index, node in enumerate(placeholders)
                    if node.meta.get(INPUT_SPEC, {}).get("dtype") == "float32")
    if checked:
        gm.register_forward_pre_hook(_Float32Inputs(checked), with_kwargs=True)


_FLOAT32 = torch.float32


class _Float32Inputs:
    """Forward pre-hook: each ``(position, name)`` of ``checked`` is an input that must be float32
    (passed by position or by name)."""

    def __init__(self, checked: tuple[tuple[int, str], ...]) -> None:
        self.checked = checked

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for index, name in self.checked:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dtype is not _FLOAT32 and value.is_floating_point():
                dtype = str(value.dtype).removeprefix("torch.")
                raise InputMismatchError(f"input {name!r} is {dtype}; the int8 model takes float32 inputs (it "
                                         f"was calibrated and converted for them): pass {name}.float()")
