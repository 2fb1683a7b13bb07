"""What each float module without a counterpart in the quantized model became.

``qp.compare`` lists them (``float_only``); its summary called them all "absent (fused?)", though
most were not fused: capture drops modules that do nothing in eval mode (``Identity``,
``Dropout``), export turns a module such as ``GELU`` into a function call, and a ``ReLU`` after an
add runs inside the int8 ``add_relu``. The quantized graph says which: each node keeps the float
module it was created in (``nn_module_stack``), and the fusion records name the fused modules.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx, nn

from qplug_core.flows.tags import BOUNDARY, FUSIONS
from qplug_core.ir import module_stack

#: modules that return their input in eval mode: capture leaves them out of the graph
NO_OP_AT_INFERENCE = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                      nn.FeatureAlphaDropout)
NO_OP = "no-op at inference"
FUNCTIONAL = "run as a function"
NOT_FOUND = "not found (fused?)"


def absent_kinds(float_model: nn.Module, quantized_model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Float module name -> what it became in ``quantized_model``: :data:`NO_OP`, ``"fused into
    <layer>"``, :data:`FUNCTIONAL` or :data:`NOT_FOUND`."""
    float_modules = dict(float_model.named_modules())
    graph = quantized_model.graph if isinstance(quantized_model, fx.GraphModule) else fx.Graph()
    meta = quantized_model.meta if isinstance(quantized_model, fx.GraphModule) else {}
    fused = {node: record.module_name for record in meta.get(FUSIONS, []) for node in record.nodes}
    computed_in: dict[str, fx.Node] = {}  # float module path -> the first quantized node it made
    for node in graph.nodes:
        if node.op in ("call_module", "call_function", "call_method") and BOUNDARY not in node.meta:
            computed_in.setdefault(module_stack.innermost(node)[0], node)
    kinds = {}
    for name in names:
        node = computed_in.get(name)
        if isinstance(float_modules.get(name), NO_OP_AT_INFERENCE):
            kinds[name] = NO_OP
        elif name.replace(".", "_") in fused:
            kinds[name] = f"fused into {fused[name.replace('.', '_')]}"
        elif node is not None and node.op == "call_module":
            kinds[name] = f"fused into {node.target}"
        else:
            kinds[name] = FUNCTIONAL if node is not None else NOT_FOUND
    return kinds


def summary(kinds: dict[str, str]) -> str:
    """``kinds`` grouped: ``"no-op at inference: drop, ident; fused into add_relu: act"``."""
    groups: dict[str, list[str]] = {}
    for name, kind in kinds.items():
        groups.setdefault(kind, []).append(name)
    return "; ".join(f"{kind}: {', '.join(names)}" for kind, names in groups.items())
