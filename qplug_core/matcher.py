"""Find fusion/quantization patterns in a torch.fx graph.

:func:`is_match` is the single-node predicate with exactly the semantics of torch.ao's
``_is_match`` (see ``matching-rules.md``, rules 4-12), so backend configs written for PyTorch match
the same nodes here. :func:`find_matches` walks a graph from its last node backwards and records,
for each node, the first pattern (in :func:`~qplug_core.patterns.sort_patterns` order) that
matches there, like torch.ao's fuse matcher. Patterns are bucketed by what their anchor can match,
so a node only tries the few patterns that could match it and the walk stays linear in the graph
size whatever the number of patterns.

The graph-level matcher for pattern *graphs* (used by subgraph rewriting) lives in
:mod:`qplug_core.ir.subgraph_matcher` and is re-exported here.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import fx, nn
from torch.nn.utils import parametrize

from qplug_core.errors import GraphError, PatternError
from qplug_core.ir.subgraph_matcher import InternalMatch, SubgraphMatcher
from qplug_core.patterns import Pattern, describe, is_match_all, sort_patterns, validate_pattern

__all__ = [
    "InternalMatch",
    "Match",
    "PatternIndex",
    "SubgraphMatcher",
    "build_match",
    "find_matches",
    "is_match",
    "type_before_parametrizations",
]


def type_before_parametrizations(module: nn.Module) -> type:
    """The class a module had before ``torch.nn.utils.parametrize`` swapped in a subclass.

    Registering a parametrization replaces ``module.__class__`` by a generated subclass whose
    first base is the original class; patterns must still match the original class. The
    registration keeps its ``ModuleDict`` under ``parametrizations`` in ``_modules``: a module
    without that entry is not parametrized, which is known without torch's check (a failed
    attribute lookup through ``nn.Module.__getattr__``, one per node per matcher run).
    """
    if "parametrizations" in module._modules and parametrize.is_parametrized(module):
        return type(module).__bases__[0]
    return type(module)


def _module_of(modules: Mapping[str, nn.Module], node: fx.Node) -> nn.Module:
    try:
        return modules[node.target]  # type: ignore[index]
    except KeyError:
        raise GraphError(
            f"Node {node.name!r} calls module {node.target!r}, which is not in the `modules` "
            "mapping; pass dict(graph_module.named_modules()) of the module owning the graph",
            node=node.name) from None


def is_match(modules: Mapping[str, nn.Module], node: Any, pattern: Pattern,
             max_uses: int = sys.maxsize) -> bool:
    """True if ``node`` (an ``fx.Node`` or a literal argument) matches the complex ``pattern``.

    Semantics are exactly torch.ao's: module classes compare the type before parametrizations
    (subclasses do not match), functions compare ``node.target is f``, strings are method names,
    literals compare with ``==``, kwargs are ignored, the number of positional args must equal the
    number of sub-patterns, and nested nodes may have at most one user (``max_uses=1``) so that a
    value used elsewhere is never absorbed into a fusion.
    """
    if isinstance(pattern, tuple):
        if not pattern:
            raise PatternError("Empty tuple pattern; validate patterns with validate_pattern()",
                               pattern=pattern, position=())
        self_match, arg_matches = pattern[0], pattern[1:]
        if self_match is getattr:
            if len(pattern) != 2:
                raise PatternError(f"A getattr pattern needs exactly one attribute name, got "
                                   f"{describe(pattern)}; write (getattr, 'shape')",
                                   pattern=pattern, position=())
            arg_matches = ()
    else:
        if pattern is getattr:
            raise PatternError("A bare getattr pattern cannot say which attribute to match; "
                               "write (getattr, 'shape')", pattern=pattern, position=())
        self_match, arg_matches = pattern, ()

    if is_match_all(self_match):
        return True
    if node == pattern:
        return True
    if not isinstance(node, fx.Node) or len(node.users) > max_uses:
        return False

    if isinstance(self_match, type) and issubclass(self_match, nn.Module):
        if node.op != "call_module":
            return False
        if type_before_parametrizations(_module_of(modules, node)) != self_match:
            return False
    elif callable(self_match):
        if node.op != "call_function" or node.target is not self_match:
            return False
        if node.target is getattr and node.args[1] != pattern[1]:
            return False
    elif isinstance(self_match, str):
        if node.op != "call_method" or node.target != self_match:
            return False
    elif node.target != self_match:
        return False

    if not arg_matches:
        return True
    if len(arg_matches) != len(node.args):
        return False
    return all(is_match(modules, arg, sub, max_uses=1) for arg, sub in zip(node.args, arg_matches))


@dataclass(eq=False)
class Match:
    """One occurrence of a pattern in a graph.

    ``node_pattern`` mirrors the pattern: a tuple pattern gives ``(anchor, *sub_results)`` and a
    leaf gives what it matched (a member node, a MatchAllNode input, or a literal). ``nodes`` are
    the members, anchor first in pattern order; MatchAllNode inputs are not members and are listed
    in ``inputs`` instead.

    ``root`` is the node a fuser builds on (e.g. the conv of conv-bn-relu): descend the last
    sub-pattern that matched a member, to its deepest last member. Unlike torch.ao's default root
    getter this skips MatchAllNode inputs, so ``(ReLU, (add, (BN, Conv), MatchAllNode))`` and
    ``(ReLU, (add, MatchAllNode, (BN, Conv)))`` both root at the conv instead of at the residual
    input. A pattern whose arguments are all inputs roots at its anchor.
    """

    anchor: fx.Node
    pattern: Pattern
    config: Any
    node_pattern: Any
    nodes: tuple[fx.Node, ...]
    inputs: tuple[Any, ...]
    root: fx.Node


def _record(pattern: Pattern, value: Any, members: list[fx.Node], inputs: list[Any]
            ) -> tuple[Any, fx.Node | None]:
    """Node pattern and root of an already verified match; collects members and inputs.

    The root of a subtree is its deepest last member (``None`` for inputs and literals).
    """
    head = pattern[0] if isinstance(pattern, tuple) else pattern
    if is_match_all(head):
        inputs.append(value)
        return value, None
    if not isinstance(value, fx.Node):  # a literal argument equal to the pattern (rule 6)
        return value, None
    if value not in members:
        members.append(value)
    if not isinstance(pattern, tuple) or head is getattr:
        return value, value
    recorded = [_record(sub, arg, members, inputs) for sub, arg in zip(pattern[1:], value.args)]
    roots = [root for _, root in recorded if root is not None]
    return (value, *(sub for sub, _ in recorded)), (roots[-1] if roots else value)


def build_match(node: fx.Node, pattern: Pattern, config: Any = None) -> Match:
    """Describe the match of ``pattern`` anchored at ``node``; call only after :func:`is_match`."""
    members: list[fx.Node] = []
    inputs: list[Any] = []
    node_pattern, root = _record(pattern, node, members, inputs)
    if root is None:
        raise PatternError("A pattern whose anchor is MatchAllNode has no member nodes to match; "
                           "give the anchor an operator", pattern=pattern, position=(0,))
    return Match(anchor=node, pattern=pattern, config=config, node_pattern=node_pattern,
                 nodes=tuple(members), inputs=tuple(inputs), root=root)


def _anchor_key(pattern: Pattern) -> Hashable:
    """The :func:`_node_key` of the nodes a validated pattern's anchor can match (rules 8-10)."""
    head = pattern[0] if isinstance(pattern, tuple) else pattern
    if isinstance(head, type) and issubclass(head, nn.Module):
        return ("call_module", head)
    if isinstance(head, str):
        return ("call_method", head)
    return ("call_function", id(head))


def _node_key(node: fx.Node, modules: Mapping[str, nn.Module]) -> Hashable:
    if node.op == "call_module":
        return ("call_module", type_before_parametrizations(_module_of(modules, node)))
    if node.op == "call_function":
        return ("call_function", id(node.target))
    if node.op == "call_method":
        return ("call_method", node.target)
    return None  # placeholders, get_attr and output are never anchors


class PatternIndex:
    """Validated patterns in priority order, bucketed by the kind of node their anchor matches.

    An anchor is never MatchAllNode (validation rejects a pattern matching every node), so a
    module-class anchor can only match ``call_module`` nodes of exactly that class, a function only
    ``call_function`` nodes with that very target, and a method name only ``call_method`` nodes of
    that name. Each bucket keeps the global priority order. Build an index once per pattern set and
    reuse it for many graphs.
    """

    def __init__(self, patterns: Mapping[Pattern, Any] | Iterable[Pattern]):
        configs = dict(patterns) if isinstance(patterns, Mapping) else dict.fromkeys(patterns)
        for pattern in configs:
            validate_pattern(pattern)
        self.ordered: list[tuple[Pattern, Any]] = [(p, configs[p]) for p in sort_patterns(configs)]
        self._buckets: dict[Hashable, list[tuple[Pattern, Any]]] = {}
        for pattern, config in self.ordered:
            self._buckets.setdefault(_anchor_key(pattern), []).append((pattern, config))

    def __len__(self) -> int:
        return len(self.ordered)

    def candidates(self, node: fx.Node, modules: Mapping[str, nn.Module]
                   ) -> list[tuple[Pattern, Any]]:
        """``(pattern, config)`` pairs whose anchor may match ``node``, best first."""
        return self._buckets.get(_node_key(node, modules), [])


def find_matches(gm: fx.GraphModule, patterns: Mapping[Pattern, Any] | Iterable[Pattern]
                 | PatternIndex, *, modules: Mapping[str, nn.Module] | None = None
                 ) -> dict[str, Match]:
    """Match ``patterns`` (pattern -> config, or just patterns) against the graph of ``gm``.

    Nodes are visited from the last to the first; a node already in a match is skipped, otherwise
    the first pattern (in priority order) that matches there wins, with no backtracking. The result
    maps the name of every member node to its :class:`Match`.

    Two decisions (torch.ao's behaviour is in ``matching-rules.md``, rules 16 and 22):

    * MatchAllNode inputs are not members, so they stay available to their own patterns (as in
      torch.ao's fuse matcher; its prepare matcher instead marks them as matched).
    * A pattern is rejected if one of its members already belongs to another match, and the next
      pattern is tried. torch.ao's fuse matcher records such a pattern anyway, silently leaving the
      taken node out. With a topologically ordered graph this cannot happen (inner nodes have one
      user, which is in the same match); it guards graphs whose node order was edited by hand.
    """
    index = patterns if isinstance(patterns, PatternIndex) else PatternIndex(patterns)
    if modules is None:
        modules = dict(gm.named_modules())
    matches: dict[str, Match] = {}
    for node in reversed(gm.graph.nodes):
        if node.name in matches:
            continue
        for pattern, config in index.candidates(node, modules):
            if not is_match(modules, node, pattern):
                continue
            match = build_match(node, pattern, config)
            if any(member.name in matches for member in match.nodes):
                continue
            for member in match.nodes:
                matches[member.name] = match
            break
    return matches
