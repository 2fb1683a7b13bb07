"""The input sizes torch.export fixed, checked again on a loaded model.

An export-captured graph holds the branches its example took wherever the model's Python looked
at a size (``if x.shape[0] > 1``), and torch.export guards those sizes. ``qp.save`` keeps the graph
but not that guard: a loaded model called with batch 3 after a batch-1 example silently ran the
batch-1 branch (cosine 0.92 against float). Each tensor input's fixed dimensions (see
:func:`qplug_core.flows.tags.fixed_sizes`) are saved with its example shape; the loaded model
refuses other sizes there with :class:`InputMismatchError`, as the model before saving did.
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
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = [(i, n.name, n.meta[INPUT_SPEC]) for i, n in enumerate(placeholders)
             if n.meta.get(INPUT_SPEC, {}).get("fixed")]
    if fixed:
        gm.register_forward_pre_hook(_SizeCheck(fixed))


class _SizeCheck:
    def __init__(self, fixed: list[tuple[int, str, dict[str, Any]]]) -> None:
        self.fixed = fixed

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for index, name, spec in self.fixed:
            if index >= len(args) or not isinstance(args[index], torch.Tensor):
                continue
            shape, got = spec["shape"], args[index].shape
            wrong = [d for d in spec["fixed"] if len(got) != len(shape) or got[d] != shape[d]]
            if wrong:
                raise InputMismatchError(
                    f"input {name!r} has shape {tuple(got)}; torch.export captured this model for size(s) "
                    f"{', '.join(f'{shape[d]} at dim {d}' for d in wrong)} (its example was "
                    f"{tuple(shape)}: the model's code may branch on them, so the graph holds only the "
                    "example's branch). Quantize with an example of the sizes you call it with, or one "
                    "whose dynamic sizes are at least 2")
