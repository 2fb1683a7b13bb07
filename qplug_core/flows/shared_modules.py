"""Give every call of a leaf module its own copy before fusion and observation.

One ``nn.Linear`` called twice in ``forward`` is one ``call_module`` target used by two nodes. Fusing
the first call with the ReLU after it replaced the module both calls share (the second call then
ran the ReLU too), and lowering found the module already replaced by the first call's kernel. Each
extra call of a module with parameters or buffers gets a copy (``fc`` stays, ``fc_call1`` is
added; ``tower.0`` in a Sequential gets ``tower_0_call1``), so it is fused, observed and lowered on its own; the copies hold equal int8 weights.
Stateless modules (a ``ReLU`` reused across a ResNet block) stay shared: they compute the same
either way, and torch.ao leaves them so.

Distinct modules may also hold the same tensors: ``torch.export`` of ALBERT (one layer's weights
used by every layer) raises each later use to a module of its own (``linear_1_module``) holding the
first use's very ``Parameter``. An algorithm that rescales one call's weights in place (SmoothQuant,
bias correction, equalization) then rescaled every call's: ALBERT with 2 layers fell from cosine
0.9999 to 0.89 under ``qp.quantize``'s defaults, 0.12 with 4 layers. So a call whose module holds a
tensor an earlier call's module holds gets a copy of its module too.
"""

from __future__ import annotations

import copy
from collections import defaultdict

from torch import fx, nn

from qplug_core.flows.tags import CALLED_AS
from qplug_core.passes import PassResult


def _free_name(existing: set[str], base: str, index: int) -> str:
    """``fc_call1`` beside ``fc``. A module inside a Sequential (``tower.0``) gets its copy beside
    the container, ``tower_0_call1``: ``tower.0_call1`` would be no attribute path ``qp.save``
    accepts (a part must be an identifier or an index)."""
    parts = base.split(".")
    tail = len(parts)
    while tail > 0 and parts[tail - 1].isdigit():
        tail -= 1
    if tail == len(parts):
        stem = base
    else:
        owner = parts[tail - 1] if tail else "module"
        stem = ".".join([*parts[:max(tail - 1, 0)], "_".join([owner, *parts[tail:]])])
    name = f"{stem}_call{index}"
    while name in existing:
        index += 1
        name = f"{stem}_call{index}"
    existing.add(name)
    return name


def _has_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def untie_shared_modules(gm: fx.GraphModule) -> PassResult:
    """Point the second and later calls of each leaf module at copies of it, and give a module
    holding tensors an earlier call's module holds copies of them (see the module docstring)."""
    modules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not a lookup per node
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_module" and _has_state(modules[node.target]):
            calls[node.target].append(node)
    modified = False
    existing = set(modules)
    for target, nodes in calls.items():
        for index, node in enumerate(nodes[1:], start=1):
            name = _free_name(existing, target, index)
            modules[name] = copy.deepcopy(modules[target])
            gm.add_submodule(name, modules[name])
            node.meta[CALLED_AS] = target
            node.target = name
            modified = True
    return PassResult(gm, _untie_shared_tensors(gm, modules, calls) or modified)


def _tensors(module: nn.Module) -> set[int]:
    return {id(t) for t in (*module.parameters(), *module.buffers())}


def _untie_shared_tensors(gm: fx.GraphModule, modules: dict[str, nn.Module],
                          calls: dict[str, list[fx.Node]]) -> bool:
    """Copy the module of each stateful call that holds a tensor of an earlier call's module
    (each call has its own target by now)."""
    stateful = {node for nodes in calls.values() for node in nodes}
    seen: set[int] = set()
    modified = False
    for node in (n for n in gm.graph.nodes if n in stateful):
        held = _tensors(modules[node.target])
        if not seen.isdisjoint(held):
            parent, _, leaf = node.target.rpartition(".")
            modules[node.target] = copy.deepcopy(modules[node.target])
            setattr(modules[parent], leaf, modules[node.target])
            modified = True
        seen |= held
    return modified

