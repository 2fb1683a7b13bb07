"""Give every call of a leaf module its own copy before fusion and observation.

One ``nn.Linear`` called twice in ``forward`` is one ``call_module`` target used by two nodes. Fusing
the first call with the ReLU after it replaced the module both calls share (the second call then
ran the ReLU too), and lowering found the module already replaced by the first call's kernel. Each
extra call of a module with parameters or buffers gets a copy (``fc`` stays, ``fc_call1`` is
added), so it is fused, observed and lowered on its own; the copies hold equal int8 weights.
Stateless modules (a ``ReLU`` reused across a ResNet block) stay shared: they compute the same
either way, and torch.ao leaves them so.
"""

from __future__ import annotations

import copy
from collections import defaultdict

from torch import fx, nn

from qplug_core.passes import PassResult


def _free_name(gm: fx.GraphModule, base: str, index: int) -> str:
    existing = {name for name, _ in gm.named_modules()}
    name = f"{base}_call{index}"
    while name in existing:
        index += 1
        name = f"{base}_call{index}"
    return name


def _has_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def untie_shared_modules(gm: fx.GraphModule) -> PassResult:
    """Point the second and later calls of each leaf module at copies of it."""
    calls: dict[str, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op == "call_module" and _has_state(gm.get_submodule(node.target)):
            calls[node.target].append(node)
    modified = False
    for target, nodes in calls.items():
        for index, node in enumerate(nodes[1:], start=1):
            name = _free_name(gm, target, index)
            gm.add_submodule(name, copy.deepcopy(gm.get_submodule(target)))
            node.target = name
            modified = True
    if modified:
        gm.recompile()
    return PassResult(gm, modified)
