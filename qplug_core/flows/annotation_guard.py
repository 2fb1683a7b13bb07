"""Plugin passes may annotate nodes, but not rewrite qplug's annotations or each other's.

Every ``node.meta`` key a plugin pass writes is attributed to that plugin (the record lives in
``GraphModule.meta`` so it spans the fuse, prepare and convert stages). A later pass from another
plugin that changes such a key, or any plugin pass that changes one of qplug's own keys, fails with
a :class:`PluginContractError` naming both sides: silently last-writer-wins annotations are how
composed quantizers produce models nobody asked for.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import fx

from qplug_core.errors import PluginContractError
from qplug_core.flows.tags import (
    ANNOTATION_OWNERS,
    BOUNDARY,
    KERNEL,
    LAYOUT,
    OBSERVER,
    REGION,
    ROOT,
    VALUE_KIND,
)

CORE_KEYS = frozenset({REGION, OBSERVER, BOUNDARY, KERNEL, VALUE_KIND, LAYOUT, ROOT})


def guard_plugin_pass(pass_: Callable[[fx.GraphModule], Any], plugin: str) -> Callable:
    """Wrap ``pass_`` so that its annotation edits are attributed to ``plugin`` and checked."""

    @functools.wraps(pass_)
    def guarded(gm: fx.GraphModule) -> Any:
        before = {node.name: dict(node.meta) for node in gm.graph.nodes}
        result = pass_(gm)
        out = getattr(result, "graph_module", None) or (result if isinstance(result, fx.GraphModule) else gm)
        owners = gm.meta.setdefault(ANNOTATION_OWNERS, {})
        out.meta[ANNOTATION_OWNERS] = owners
        for node in out.graph.nodes:
            _check_node(node, before.get(node.name, {}), owners, plugin)
        return result

    return guarded


def _check_node(node: fx.Node, before: dict[str, Any], owners: dict, plugin: str) -> None:
    for key, value in node.meta.items():
        if key in before and before[key] is value:
            continue
        if key in CORE_KEYS and key in before:
            raise PluginContractError(
                f"plugin {plugin} changed qplug's annotation {key!r} on node {node.name!r}; plugin "
                "passes may add their own node.meta keys but not edit qplug's", plugin=plugin)
        owner = owners.get((node.name, key))
        if owner is not None and owner != plugin:
            raise PluginContractError(
                f"plugin {plugin} changed annotation {key!r} on node {node.name!r}, which plugin "
                f"{owner} wrote; each plugin must keep to its own keys (prefix them with its name)",
                plugin=plugin)
        owners[(node.name, key)] = plugin
