"""A delegate's ``compile``, kept from changing the partition it is handed.

The partition is the reference form: the check compares the compiled module with it and
``qp.save`` writes it. A compiler that folds biases into its own constants and zeroes them in the
GraphModule it was given (graph-rewriting compilers do) made the convert-time check compare the
compiled module with the corrupted form, and the saved file wrong everywhere. So its tensors are
copied for the call (freed after it: the model keeps one copy), put back where the compile
changed them, and the plugin is named in a warning; a compile that changes its graph or modules
fails, as one that raises does. A compile returning anything but a module fails with that said.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn

from qplug_core.errors import PluginContractError, warn_user

Compile = Callable[[fx.GraphModule, tuple], nn.Module]


def compile_untouched(compile: Compile, partition: fx.GraphModule, inputs: tuple, who: str) -> nn.Module:
    """``compile(partition, inputs)``, with ``partition`` as it was before (``who``: the plugin,
    for the messages)."""
    tensors = {key: value.detach().clone() for key, value in partition.state_dict().items()}
    layout = repr(partition), partition.code
    module = compile(partition, inputs)
    if (repr(partition), partition.code) != layout:
        raise PluginContractError(f"{who}'s compile changed the graph or modules of the partition it was given; "
                                  "compile must not modify its partition (copy it to rewrite it)")
    now = partition.state_dict(keep_vars=True)
    changed = [key for key, value in tensors.items() if key not in now or now[key].shape != value.shape
               or not torch.equal(now[key].detach(), value)]
    if changed:
        with torch.no_grad():
            for key in changed:
                if key not in now or now[key].shape != tensors[key].shape:
                    raise PluginContractError(f"{who}'s compile replaced {key!r} of the partition it was given; "
                                              "compile must not modify its partition (copy it to rewrite it)")
                now[key].copy_(tensors[key])
        warn_user(f"qplug: {who}'s compile modified the partition it was given ({', '.join(changed[:5])}"
                  + (f" and {len(changed) - 5} more" if len(changed) > 5 else "") + "); qplug put its values back, "
                  "so the reference form the model checks against and saves is the right one; compile must not "
                  "modify its partition (copy it to rewrite it)")
    if not isinstance(module, nn.Module):
        raise PluginContractError(f"{who}'s compile returned {type(module).__name__}, expected an nn.Module")
    return module


__all__ = ["compile_untouched"]
