"""What a plugin pass may ask of an observed model: which observers watch which values.

Passes at the ``post_prepare`` stage tune observers (7-bit ranges for some inputs, say). They ask
here instead of reading qplug's node annotations, which are internal and guarded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from qplug_core.flows.tags import OBSERVER, VALUE_KIND


@dataclass(frozen=True)
class ObservedValue:
    """One observed value: the observer node, the node whose output it watches, and its module."""

    node: fx.Node
    value: fx.Node
    observer: nn.Module


def _observed(gm: fx.GraphModule, node: object) -> ObservedValue | None:
    if not (isinstance(node, fx.Node) and node.op == "call_module" and OBSERVER in node.meta):
        return None
    value = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else node
    return ObservedValue(node, value, gm.get_submodule(str(node.target)))


def observed_values(gm: fx.GraphModule) -> list[ObservedValue]:
    """Every observer (or fake-quant) the prepare step inserted, in graph order."""
    return [found for node in gm.graph.nodes if (found := _observed(gm, node)) is not None]


def observed_inputs(gm: fx.GraphModule, node: fx.Node) -> list[ObservedValue]:
    """The observed values feeding ``node``, in the order of its arguments (unobserved ones left out)."""
    return [found for arg in node.all_input_nodes if (found := _observed(gm, arg)) is not None]


__all__ = ["ObservedValue", "observed_inputs", "observed_values"]


def computes_tensor(node: fx.Node) -> bool:
    """Whether ``node``'s value on the example inputs was a tensor (not a tuple, int or None)."""
    return node.meta.get(VALUE_KIND) in ("float_tensor", "tensor")
