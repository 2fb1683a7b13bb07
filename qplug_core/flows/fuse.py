"""Fusion: replace matched subgraphs (conv -> bn -> relu, ...) by one fused module.

Semantics follow PyTorch's FX fuser (matching-rules.md rules 21–25) with two deliberate fixes:
the config's own fuser method is used as registered (so a backend that only registers
``(Conv2d, F.relu)`` works), and a root that is not a module call is a clear ``PatternError``
instead of an ``AssertionError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.errors import PatternError, PluginHookError, QplugError
from qplug_core.ir import module_stack
from qplug_core.matcher import Match, find_matches
from qplug_core.patterns import MatchAllNode, format_pattern
from qplug_core.registry.plugins import ENV_DISABLE, PluginRecord

_RELU_FUNCTIONS = (F.relu, torch.relu)


@dataclass(frozen=True)
class FusionRecord:
    """One fusion that happened: where, which pattern, and the module it produced."""

    module_name: str
    pattern: str
    fused_type: str
    nodes: tuple[str, ...]
    #: the float module whose forward ran the anchor (``act`` for a ReLU module that export captured
    #: as ``F.relu``); qp.compare knows that module is computed by the fused layer
    anchor_module: str = ""


@dataclass(frozen=True)
class _Fusion:
    """A fusable config, the fuser taking complex-order modules, and the plugin function behind it
    with the plugin that contributed it (a fuser that raises is named by both)."""

    config: Any
    fuser: Callable
    written: Callable
    owner: PluginRecord | None  # None for a Backend built by hand


def fusion_patterns(backend) -> dict[Any, _Fusion]:
    """complex pattern -> its :class:`_Fusion`, for every fusable config."""
    table = {}
    for config in backend.config.configs:
        pattern = config.pattern_complex_format
        if config.fuser_method is not None:
            table[pattern] = _Fusion(config, config.complex_fuser_method, config.fuser_method,
                                     backend.config_plugins.get(pattern))
        elif pattern in backend.fuser_methods:
            fuser = backend.fuser_methods[pattern]
            table[pattern] = _Fusion(config, fuser, fuser, backend.fuser_plugins.get(pattern))
    return table


def fuse_graph(gm: fx.GraphModule, backend, *, is_qat: bool) -> list[FusionRecord]:
    """Fuse ``gm`` in place with the backend's fusion patterns; return what was fused."""
    table = fusion_patterns(backend)
    if not table:
        return []
    modules = dict(gm.named_modules(remove_duplicate=False))
    matches = find_matches(gm, {p: entry for p, entry in table.items()}, modules=modules)
    records, absorbed = [], set()
    replaced: dict[fx.Node, fx.Node] = {}  # anchor of an applied fusion -> the node now standing for it
    for match in _unique_in_graph_order(gm, matches):
        absorbed.update(n.target for n in match.nodes if n.op == "call_module")
        records.append(_apply_fusion(gm, modules, match, match.config, is_qat, replaced))
    gm.graph.eliminate_dead_code()  # lints the fused graph first; erasing unused nodes keeps it valid
    _delete_fused_away_modules(gm, absorbed - {r.module_name for r in records})
    return records  # the PassManager recompiles after the pass


def _delete_fused_away_modules(gm: fx.GraphModule, candidates: set[str]) -> None:
    """Drop the submodules fusion made unreachable (bn, relu), as torch.ao's GraphModule does, so
    the state_dict carries no stale BatchNorm tensors and their hooks cannot fire."""
    reachable = set()  # every used target and each of its parents: one pass, not one per module
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr"):
            parts = node.target.split(".")
            reachable.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in sorted(candidates - reachable):
        gm.delete_submodule(name)


def _unique_in_graph_order(gm: fx.GraphModule, matches: Mapping[str, Match]) -> list[Match]:
    seen, ordered = set(), []
    for node in gm.graph.nodes:
        match = matches.get(node.name)
        if match is not None and id(match) not in seen and match.anchor is node:
            seen.add(id(match))
            ordered.append(match)
    return ordered


def _apply_fusion(gm, modules, match: Match, fusion: _Fusion, is_qat: bool,
                  replaced: dict[fx.Node, fx.Node]) -> FusionRecord:
    config = fusion.config
    root = config.root_node_getter(match.node_pattern) if config.root_node_getter else match.root
    if not isinstance(root, fx.Node) or root.op != "call_module":
        raise PatternError(
            f"fusion pattern {format_pattern(match.pattern)} has root node "
            f"{getattr(root, 'name', root)!r}, which is not a module call; fusion replaces the root "
            "module, so set a root node getter that returns the weighted module's node",
            pattern=match.pattern)
    root_module = modules[root.target]
    structured = _modules_for(match.node_pattern, modules, root_module)
    try:
        fused = fusion.fuser(is_qat, *structured) if isinstance(structured, tuple) \
            else fusion.fuser(is_qat, structured)
    except QplugError:
        raise  # already says what is wrong (a fused module given the wrong children)
    except Exception as error:  # plugin code: name whose, as for a hook that raises
        raise _fuser_failed(fusion, match.pattern, error) from error
    fused.train(root_module.training)  # a fused container starts in training mode: it takes its root's
    gm.set_submodule(root.target, fused)
    modules[root.target] = fused

    # an extra input matched by MatchAllNode may be the anchor of a fusion applied before this one
    extra = tuple(replaced.get(n, n) if isinstance(n, fx.Node) else n
                  for n in config.extra_inputs_getter(match.node_pattern)) \
        if config.extra_inputs_getter else ()
    graph = gm.graph
    if extra:  # extra inputs may be computed after the root: call the fused module at the anchor
        with graph.inserting_before(match.anchor):
            fused_node = graph.call_module(root.target, args=tuple(root.args) + extra,
                                           kwargs=dict(root.kwargs))
        fused_node.meta = dict(root.meta)
    else:  # the root node now calls the fused module, keeping its place and name
        fused_node = root
    match.anchor.replace_all_uses_with(fused_node)
    if match.anchor is not fused_node:
        replaced[match.anchor] = fused_node
    for node in match.nodes:  # pre-order, anchor first: every member's users inside the match go first
        if node is not fused_node and not node.users:
            graph.erase_node(node)
    anchor = match.anchor
    return FusionRecord(root.target, format_pattern(match.pattern), type(fused).__name__,
                        tuple(n.name for n in match.nodes),
                        str(anchor.target) if anchor.op == "call_module" else module_stack.innermost(anchor)[0])


def _fuser_failed(fusion: _Fusion, pattern: Any, error: Exception) -> PluginHookError:
    written = f"{getattr(fusion.written, '__module__', '?')}.{getattr(fusion.written, '__qualname__', '?')}"
    owner = fusion.owner
    who = f"plugin {owner.label}" if owner is not None else "a hand-built backend"
    fix = f"; fix it or disable the plugin with {ENV_DISABLE}={owner.name}" if owner is not None else ""
    return PluginHookError(f"{who}: fuser method {written} of pattern {format_pattern(pattern)} raised "
                           f"{type(error).__name__}: {error}{fix}",
                           **(owner.attribution() if owner is not None else {}))


def _modules_for(node_pattern, modules, root_module: nn.Module):
    """Map a matched node structure to the modules/targets a fuser method receives (rule 24)."""
    if isinstance(node_pattern, (tuple, list)):
        return tuple(_modules_for(p, modules, root_module) for p in node_pattern)
    node = node_pattern
    if not isinstance(node, fx.Node):
        return MatchAllNode
    if node.op == "call_module":
        return modules[node.target]
    if (node.op == "call_function" and node.target in _RELU_FUNCTIONS) or (
            node.op == "call_method" and node.target in ("relu", "relu_")):
        relu = nn.ReLU()
        relu.train(root_module.training)
        return relu
    if node.op in ("call_function", "call_method"):
        return node.target
    return MatchAllNode

