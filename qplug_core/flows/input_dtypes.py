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

The observed model checks the kinds only, so that a calibration batch with a float mask for a bool
one is refused naming the batch and the input, before the graph runs (whose failure torch prints
as generated code on stderr); a float16 batch is no concern of the int8 model's inputs there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import INPUT_SPEC, SPEC_DTYPES
from qplug_core.ir.call_inputs import MISSING, InputPath, input_paths
from qplug_core.ir.hooks import drop_pre_hooks, keep_in_copies

__all__ = ["guard_input_dtypes"]


def guard_input_dtypes(gm: fx.GraphModule, *, kinds_only: bool = False) -> None:
    """Check on every call of ``gm`` that each tensor input has a dtype its graph computes (with
    ``kinds_only``, the observed model's check: is bool, integer or float as at capture).

    The hook an observed model carried into its converted copy is replaced: it must run after the
    engine's (:func:`qplug_core.kernels.base.pin_engine`), and check float32 inputs too."""
    drop_pre_hooks(gm, lambda hook: isinstance(hook, _InputDtypes))
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    checked = tuple((path, SPEC_DTYPES[node.meta[INPUT_SPEC]["dtype"]], bool(node.users))
                    for path, node in zip(input_paths(gm), placeholders)
                    if path is not None and INPUT_SPEC in node.meta)
    if checked:
        gm.register_forward_pre_hook(_InputDtypes(checked, _kind_refusal if kinds_only else _refusal),
                                     with_kwargs=True)
        keep_in_copies(gm)


def _kind(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else "integer"


def _kind_refusal(name: str, given: torch.dtype, captured: torch.dtype) -> str:
    """Why input ``name`` of dtype ``given`` cannot run where a ``captured`` one of another kind was
    recorded ('' if the kinds are the same)."""
    if _kind(given) == _kind(captured):
        return ""
    given_name, captured_name = str(given).removeprefix("torch."), str(captured).removeprefix("torch.")
    return (f"input {name!r} is {given_name} where the int8 model was captured with {captured_name}: its "
            f"graph holds what the model computes for a {_kind(captured)} input only (the float model may "
            f"take other dtypes there). Pass {name} as {captured_name}, as when it was quantized, or "
            "quantize with example inputs of the dtypes you call the model with")


def _refusal(name: str, given: torch.dtype, captured: torch.dtype) -> str:
    """Why input ``name`` of dtype ``given`` cannot run where ``captured`` was recorded ('' if it can)."""
    if refusal := _kind_refusal(name, given, captured):
        return refusal
    if captured is torch.float32:
        return (f"input {name!r} is {str(given).removeprefix('torch.')}; the int8 model takes float32 inputs "
                f"(it was calibrated and converted for them): pass {name}.float()")
    return ""


def _none_refusal(name: str, captured: torch.dtype) -> str:
    """Why a used input captured as a tensor cannot be None (``mask=None`` after tracing with a mask)."""
    return (f"input {name!r} is None (or left out), but the model was captured with a "
            f"{str(captured).removeprefix('torch.')} tensor there: its graph computes with that tensor "
            f"(tracing kept the branch the example took). Pass {name} as a tensor, or quantize with "
            f"example inputs (and calibration batches) that leave {name} out")


class _InputDtypes:
    """Forward pre-hook: each ``(path, dtype, used)`` of ``checked`` is a tensor input (an argument,
    or one inside a dict or list argument) recorded with ``dtype`` at capture, ``used`` if the graph
    reads it; ``refusal`` says why a tensor of another dtype cannot run there ('' if it can)."""

    def __init__(self, checked: tuple[tuple[InputPath, torch.dtype, bool], ...],
                 refusal: Callable[[str, torch.dtype, torch.dtype], str]) -> None:
        self.checked, self.refusal = checked, refusal

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for path, captured, used in self.checked:
            value = path.value(args, kwargs)
            if (value is None or value is MISSING) and used:  # left out: forward()'s default None
                raise InputMismatchError(_none_refusal(path.label, captured))
            if isinstance(value, torch.Tensor) and value.dtype is not captured:
                refusal = self.refusal(path.label, value.dtype, captured)
                if refusal:
                    raise InputMismatchError(refusal)
