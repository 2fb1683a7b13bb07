"""A delegate's ``compile``, kept from changing the partition it is handed.

The partition is the reference form: the check compares the compiled module with it and
``qp.save`` writes it. A compiler that folds biases into its own constants and zeroes them in the
GraphModule it was given (graph-rewriting compilers do) made the convert-time check compare the
compiled module with the corrupted form, and the saved file wrong everywhere. So its tensors are
copied for the call (freed after it: the model keeps one copy), put back where the compile
changed them, and the plugin is named in a warning. A compile that changes its graph or modules
fails, as one that raises does, and both are put back first: the partition's modules are the
model's own (a ``ReferenceWeighted`` whose fused ReLU a compile swapped out, refused, still ran
without it in the reference form the model kept). A compile returning anything but a module fails
with that said.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import fx, nn

from qplug_core.errors import PluginContractError, warn_user

Compile = Callable[[fx.GraphModule, tuple], nn.Module]

#: the per-module dicts that make up a module tree and what it holds
_SLOTS = ("_modules", "_parameters", "_buffers")


def compile_untouched(compile: Compile, partition: fx.GraphModule, inputs: tuple, who: str) -> nn.Module:
    """``compile(partition, inputs)``, with ``partition`` as it was before (``who``: the plugin,
    for the messages)."""
    tensors = {key: value.detach().clone() for key, value in partition.state_dict().items()}
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
        changed = _put_back_values(partition, tensors)
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


def _put_back_values(partition: fx.GraphModule, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The values ``tensors`` held, put back where the compile changed them in place; the keys it
    changed."""
    now = partition.state_dict(keep_vars=True)
    changed = [key for key, value in tensors.items()
               if now[key].shape != value.shape or not torch.equal(now[key].detach(), value)]
    with torch.no_grad():
        for key in changed:
            if now[key].shape == tensors[key].shape:
                now[key].copy_(tensors[key])
            else:  # resized in place (``.data = ...``)
                now[key].data = tensors[key]
    return changed


__all__ = ["compile_untouched"]
