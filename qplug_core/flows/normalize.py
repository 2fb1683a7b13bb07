"""Turn functional linear/conv calls on constant weights into modules before fusion.

``F.linear(x, self.w, self.b)`` and ``F.conv2d(x, self.w, ...)`` (``w`` a parameter or a buffer) then
match, fuse, quantize and lower exactly like ``nn.Linear`` / ``nn.Conv2d``, so backends need one
kernel per op, not two. Each new module's float weight path is recorded (:data:`FUNCTIONAL_WEIGHTS`): the
float model has no module of that name, so ``qp.compare`` finds the call by its weight instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.flows.tags import FROM_FUNCTIONAL, FUNCTIONAL_WEIGHTS
from qplug_core.ir.attributes import fetch_attribute
from qplug_core.passes import PassResult

_CONV = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _attr(gm: fx.GraphModule, node, written: set[str]) -> torch.Tensor | None:
    """The constant float tensor a ``get_attr`` node reads: a parameter, or a buffer nothing writes."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    try:
        value = fetch_attribute(gm, node.target)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    if not isinstance(value, nn.Parameter) and node.target in written:
        return None
    return value


def _written_attributes(graph: fx.Graph) -> set[str]:
    """Attributes the graph writes in place (state such as a running average, not a weight)."""
    def in_place(user: fx.Node) -> bool:
        name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
        return user.op in ("call_method", "call_function") and str(name).endswith("_")
    return {n.target for n in graph.nodes
            if n.op == "get_attr" and any(in_place(u) and u.args[:1] == (n,) for u in n.users)}


def _bound_args(node: fx.Node, names: tuple[str, ...]) -> dict:
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def normalize_functionals(gm: fx.GraphModule) -> PassResult:
    """Replace eligible functional calls in place (a pass: modified when any was replaced)."""
    replaced = 0
    written = _written_attributes(gm.graph)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or (node.target is not F.linear and node.target not in _CONV):
            continue
        names = ("input", "weight", "bias") if node.target is F.linear else _CONV_ARGS
        args = _bound_args(node, names)
        weight, bias_node = _attr(gm, args.get("weight"), written), args.get("bias")
        bias = _attr(gm, bias_node, written)
        if weight is None or (bias_node is not None and bias is None):
            continue
        module = _module_for(node.target, weight, bias, args)
        if module is None:
            continue
        # beside the weight, in the mode of the module holding it (a fresh module starts in
        # training mode): a module-name qconfig for that module then reaches the new one too
        owner = args["weight"].target.rpartition(".")[0]
        module.train(gm.get_submodule(owner).training if owner else gm.training)
        name = f"{owner}.{node.name}_module" if owner else f"{node.name}_module"
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, args=(args["input"],))
        new.meta = {**node.meta, FROM_FUNCTIONAL: node.target}
        record_functional_weight(gm, name, str(args["weight"].target))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.delete_all_unused_submodules()
    return PassResult(gm, replaced > 0)


def record_functional_weight(gm: fx.GraphModule, layer: str, weight: str) -> None:
    """Note on ``gm`` that module ``layer`` computes a functional call on the float weight at ``weight``."""
    gm.meta.setdefault(FUNCTIONAL_WEIGHTS, {})[layer] = weight


def functional_weights(model: nn.Module) -> dict[str, str]:
    """Layer path -> float weight path of the layers made from functional calls, for a converted model."""
    meta = getattr(model, "meta", None)
    return dict(meta.get(FUNCTIONAL_WEIGHTS, {})) if isinstance(meta, dict) else {}


def _module_for(target, weight: torch.Tensor, bias: torch.Tensor | None, args: dict) -> nn.Module | None:
    if target is F.linear:
        module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    else:
        settings = {k: args.get(k, d) for k, d in
                    (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))}
        if any(isinstance(v, fx.Node) for v in settings.values()):
            return None
        groups = settings["groups"]
        module = _CONV[target](weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]),
                               bias=bias is not None, **settings)
    module.weight = _as_parameter(weight)
    if bias is not None:
        module.bias = _as_parameter(bias)
    return module


def _as_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """A buffer becomes a frozen parameter sharing its storage; a parameter stays itself."""
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)
