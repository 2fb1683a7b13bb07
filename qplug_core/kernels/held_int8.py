"""Reference forms held with their weights as int8 values, read back in float bit-exactly.

A converted model keeps reference forms it rarely runs: the snapshot ``qp.save`` writes
(``flows/snapshot.py``), and each compiled partition's own (serialized again for an input
signature its runtime's model does not take, run where one is refused, compared by
``qp.compare``). Their weights lie on the int8 grid, so holding them as their int8 values keeps a
quarter of the bytes; the float form is rebuilt, a model of its own, each time it is read. One
float module held by several forms gets one int8 copy, shared by all of them (``copies``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.ir.copying import deepcopy_graph
from qplug_core.kernels.reference import ReferenceWeighted, weight_of

#: module path -> the float dtype and ``requires_grad`` of the weight held as int8 values there
Int8Weights = dict[str, tuple[torch.dtype, bool]]
#: id of a float ``ReferenceWeighted`` module -> its int8 copy (None: its weight stays float)
Copies = dict[int, "ReferenceWeighted | None"]


@dataclass(frozen=True, eq=False)
class Int8HeldForm:
    """A reference form ``held`` with the weights of the modules ``int8_weights`` names as int8."""

    held: fx.GraphModule
    int8_weights: Int8Weights

    @property
    def graph_module(self) -> fx.GraphModule:
        return float_form(self.held, self.int8_weights)


def float_form(held: fx.GraphModule, int8_weights: Int8Weights) -> fx.GraphModule:
    """A copy of ``held`` whose int8-held weights are float again, bit-exactly the weights convert
    rounded (callers may rewrite it)."""
    memo = {}
    for path, (dtype, requires_grad) in int8_weights.items():
        module = held.get_submodule(path)
        values = weight_of(module.module, module.weight_name)
        float_weight = from_int8(values, module, dtype)
        memo[id(values)] = nn.Parameter(float_weight, requires_grad=requires_grad)
    return deepcopy_graph(held, memo)


def hold_as_int8(gm: fx.GraphModule, copies: Copies, keep_float: Collection[int] = ()) -> Int8Weights:
    """Swap each ``ReferenceWeighted`` module ``gm`` calls for its int8 copy, in place (but those in
    ``keep_float``, by id: something still runs them, and those whose weight gives no exact int8
    copy); returns what was swapped."""
    swapped: Int8Weights = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and id(gm.get_submodule(node.target)) not in keep_float:
            held = hold_module_as_int8(gm, node.target, copies)
            if held is not None:
                swapped[node.target] = held
    return swapped


def hold_module_as_int8(gm: fx.GraphModule, path: str, copies: Copies) -> tuple[torch.dtype, bool] | None:
    """Swap the ``ReferenceWeighted`` module at ``path`` for its int8 copy, in place; the float
    dtype and ``requires_grad`` of the weight it held, or None where nothing was swapped (not
    such a module, held as int8 already, or no exact int8 copy)."""
    module = gm.get_submodule(path)
    if not isinstance(module, ReferenceWeighted):
        return None
    weight = weight_of(module.module, module.weight_name)
    if not weight.is_floating_point():  # held as int8 already
        return None
    if id(module) not in copies:
        copies[id(module)] = _with_int8_weight(module, weight)
    held = copies[id(module)]
    if held is None:  # no copy: whatever still runs the float module keeps it
        return None
    gm.set_submodule(path, held)
    return weight.dtype, weight.requires_grad


def int8_form(gm: fx.GraphModule, copies: Copies, keep_float: Collection[int] = ()) -> Int8HeldForm:
    """``gm`` held with int8 weights (see :func:`hold_as_int8`); ``gm`` itself is left as it is."""
    held = fx.GraphModule(gm, deepcopy_graph(gm.graph), class_name=type(gm).__name__)
    held.meta = dict(gm.meta)
    held.train(gm.training)
    return Int8HeldForm(held, hold_as_int8(held, copies, keep_float))


def _with_int8_weight(module: ReferenceWeighted, weight: torch.Tensor) -> ReferenceWeighted | None:
    """A copy of ``module`` holding ``weight`` as its int8 values, or None where they would not give
    it back bit-exactly (a float16 weight, one changed after convert)."""
    values = exact_int8(module, weight) if isinstance(weight, nn.Parameter) else None
    if values is None:
        return None
    return copy.deepcopy(module, {id(weight): nn.Parameter(values, requires_grad=False)})


def exact_int8(module: ReferenceWeighted, weight: torch.Tensor) -> torch.Tensor | None:
    """``module``'s ``weight`` as its integer values on the module's grid, or None where they would
    not give it back bit-exactly (:func:`from_int8`): a float16 weight, one changed after convert."""
    qparams = module.weight_qparams
    if qparams.dtype not in Q.STORAGE_DTYPE or not weight.is_floating_point():
        return None
    values = Q.quantize_in_slices(weight, qparams)
    for part, float_part in zip(Q.slices(values, qparams), Q.slices(weight.detach(), qparams)):
        if not torch.equal(Q.dequantize(part, qparams).to(weight.dtype), float_part):
            return None
    return values


def from_int8(values: torch.Tensor, module: ReferenceWeighted, dtype: torch.dtype) -> torch.Tensor:
    """The float weight :func:`exact_int8` gave ``values`` of, bit-exactly."""
    return Q.dequantize(values, module.weight_qparams).to(dtype)
