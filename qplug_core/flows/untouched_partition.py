"""A delegate's ``compile``, kept from changing the partition it is handed.

The partition is the reference form: the check compares the compiled module with it and
``qp.save`` writes it. A compiler that folds biases into its own constants and zeroes them in the
GraphModule it was given (graph-rewriting compilers do) made the convert-time check compare the
compiled module with the corrupted form, and the saved file wrong everywhere. So its tensors are
copied for the call (freed after it: the model keeps one copy), put back where the compile
changed them, and the plugin is named in a warning. Weights on their layer's int8 grid are kept
as their int8 values (float again bit-exactly, :func:`~qplug_core.kernels.held_int8.exact_int8`):
copied in float, a whole-model partition (ViT, BERT) held every float weight twice while it was
exported and compiled. A compile that changes its graph or modules
fails, as one that raises does, and both are put back first: the partition's modules are the
model's own (a ``ReferenceWeighted`` whose fused ReLU a compile swapped out, refused, still ran
without it in the reference form the model kept). A compile returning anything but a module fails
with that said.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core.errors import PluginContractError, warn_user
from qplug_core.kernels.held_int8 import exact_int8, from_int8
from qplug_core.kernels.reference import ReferenceWeighted, weight_of

Compile = Callable[[fx.GraphModule, tuple], nn.Module]

#: the per-module dicts that make up a module tree and what it holds
_SLOTS = ("_modules", "_parameters", "_buffers")


def compile_untouched(compile: Compile, partition: fx.GraphModule, inputs: tuple, who: str) -> nn.Module:
    """``compile(partition, inputs)``, with ``partition`` as it was before (``who``: the plugin,
    for the messages)."""
    kept = _kept_values(partition)
    layout = repr(partition), partition.code
    tree = [(module, {slot: dict(getattr(module, slot)) for slot in _SLOTS}) for module in partition.modules()]
    graph = copy.deepcopy(partition.graph)
    try:
        module = compile(partition, inputs)
    finally:  # a compile that raises may have changed it too
        changed_layout = (repr(partition), partition.code) != layout
        replaced = _put_back_tree(tree)
        if partition.code != layout[1]:
            partition.graph = graph  # recompiles
        changed = _put_back_values(partition, kept)
    if replaced or changed_layout:
        raise PluginContractError(f"{who}'s compile changed the graph or modules of the partition it was given "
                                  "(qplug put them back); compile must not modify its partition (copy it to "
                                  "rewrite it)")
    if changed:
        warn_user(f"qplug: {who}'s compile modified the partition it was given ({', '.join(changed[:5])}"
                  + (f" and {len(changed) - 5} more" if len(changed) > 5 else "") + "); qplug put its values back, "
                  "so the reference form the model checks against and saves is the right one; compile must not "
                  "modify its partition (copy it to rewrite it)")
    if not isinstance(module, nn.Module):
        raise PluginContractError(f"{who}'s compile returned {type(module).__name__}, expected an nn.Module")
    return module


def _put_back_tree(tree: list[tuple[nn.Module, dict[str, dict]]]) -> bool:
    """The submodules, parameters and buffers (the objects) each module held; whether any was not."""
    replaced = False
    for module, slots in tree:
        for slot, held in slots.items():
            now = getattr(module, slot)
            if len(now) != len(held) or any(key not in held or value is not held[key] for key, value in now.items()):
                replaced = True
                now.clear()
                now.update(held)
    return replaced


def _put_back_values(partition: fx.GraphModule, kept: dict[str, _Kept]) -> list[str]:
    """The values ``kept`` holds, put back where the compile changed them in place; the keys it
    changed."""
    now = partition.state_dict(keep_vars=True)
    changed = [key for key, value in kept.items()
               if now[key].shape != value.shape or not torch.equal(now[key].detach(), value.values())]
    with torch.no_grad():
        for key in changed:
            if now[key].shape == kept[key].shape:
                now[key].copy_(kept[key].values())
            else:  # resized in place (``.data = ...``)
                now[key].data = kept[key].values()
    return changed


@dataclass(frozen=True)
class _Kept:
    """One tensor's values as they were (read back by ``values``)."""

    shape: torch.Size
    values: Callable[[], torch.Tensor]


def _kept(tensor: torch.Tensor, owner: ReferenceWeighted | None) -> _Kept:
    """``tensor``'s values: a weight on ``owner``'s int8 grid as its int8 values, the rest cloned."""
    int8 = exact_int8(owner, tensor) if owner is not None else None
    if int8 is not None and owner is not None:
        layer, dtype = owner, tensor.dtype
        return _Kept(tensor.shape, lambda: from_int8(int8, layer, dtype))
    clone = tensor.detach().clone()
    return _Kept(clone.shape, lambda: clone)


def _kept_values(partition: fx.GraphModule) -> dict[str, _Kept]:
    """The values of ``partition``'s tensors, by state-dict key."""
    owners = {id(weight_of(m.module, m.weight_name)): m for m in partition.modules()
              if isinstance(m, ReferenceWeighted)}
    return {key: _kept(value, owners.get(id(value))) for key, value in partition.state_dict(keep_vars=True).items()}


__all__ = ["compile_untouched"]
