"""The input sizes torch.export fixed, checked at every call of the converted model.

An export-captured graph holds the example's sizes wherever the model's Python read a size
(``if x.shape[0] > 1``, a ``view`` to ``[30, B * heads, 16]``), and torch.export guards them with a
forward pre-hook and a ``_guards_fn`` call. Neither survives qplug's rewriting (the raised graph
drops the guard call, convert builds a new module without the hook, ``qp.save`` stores the graph
only): a call with another sequence length ran into the middle of the graph and failed in a
``view``, and a loaded model called with batch 3 after a batch-1 example silently ran the batch-1
branch. Each tensor input's fixed dimensions (:func:`qplug_core.flows.tags.fixed_sizes`) are
recorded with its example shape; the model refuses other sizes there with
:class:`InputMismatchError` before it computes anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.errors import InputMismatchError
from qplug_core.flows.tags import INPUT_SPEC

__all__ = ["guard_fixed_sizes"]


def guard_fixed_sizes(gm: fx.GraphModule) -> None:
    """Check every call's positional inputs against the sizes their capture fixed."""
    if any(isinstance(hook, _SizeCheck) for hook in gm._forward_pre_hooks.values()):
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = [(i, n.name, n.meta[INPUT_SPEC]) for i, n in enumerate(placeholders)
             if n.meta.get(INPUT_SPEC, {}).get("fixed")]
    if fixed:
        gm.register_forward_pre_hook(_SizeCheck(fixed))


class _SizeCheck:
    """Forward pre-hook: each ``(position, name, spec)`` is an input whose ``spec["fixed"]``
    dimensions must have the example's sizes (``spec["shape"]``)."""

    def __init__(self, fixed: list[tuple[int, str, dict[str, Any]]]) -> None:
        self.fixed = fixed

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for index, name, spec in self.fixed:
            if index >= len(args) or not isinstance(args[index], torch.Tensor):
                continue
            shape, got = spec["shape"], args[index].shape
            if len(got) != len(shape):
                raise InputMismatchError(
                    f"input {name!r} has {len(got)} dimension(s) {tuple(got)}; the model was captured "
                    f"(torch.export) for {len(shape)} (its example was {tuple(shape)}). Call it with "
                    f"inputs shaped like the example")
            wrong = [d for d in spec["fixed"] if got[d] != shape[d]]
            if wrong:
                sizes = ", ".join(f"size {got[d]} at dim {d} (captured with {shape[d]})" for d in wrong)
                raise InputMismatchError(
                    f"input {name!r} has {sizes}: the model was captured (torch.export) with these sizes "
                    f"fixed to its example's {tuple(shape)}, because the model's code reads them (a "
                    "reshape or a branch on the size), so the graph takes no other. Call it with those "
                    "sizes (pad or crop), or quantize with an example of the sizes you call it with; "
                    "a size of 1 in the example is always fixed, so give dynamic axes at least 2")
