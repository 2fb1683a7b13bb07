"""Differential tests: qplug's matcher against torch.ao's on random small graphs and patterns.

A seeded generator builds graphs from a vocabulary chosen to hit every rule (module types with a
Conv2d subclass and a parametrized Conv2d, the four kinds of relu, two kinds of add, a method call,
getattr/getitem with literals, kwargs, multi-user nodes) and patterns half derived from the graph
(so that many match) and half random. Every node x pattern pair must get the same answer.
"""

from __future__ import annotations

import operator
import random
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from qplug_core.matcher import find_matches, is_match
from qplug_core.patterns import MatchAllNode, sort_patterns

match_utils = pytest.importorskip("torch.ao.quantization.fx.match_utils")
ao_fuse = pytest.importorskip("torch.ao.quantization.fx.fuse")
ao_utils = pytest.importorskip("torch.ao.quantization.utils")

SEED = 20240613
GRAPHS = 520


class MyConv(nn.Conv2d):
    """A subclass: must not match nn.Conv2d."""


class Double(nn.Module):
    def forward(self, weight):
        return weight * 2


def make_root() -> nn.Module:
    root = nn.Module()
    root.conv, root.bn, root.relu = nn.Conv2d(2, 2, 1), nn.BatchNorm2d(2), nn.ReLU()
    root.linear, root.myconv, root.pconv = nn.Linear(2, 2), MyConv(2, 2, 1), nn.Conv2d(2, 2, 1)
    parametrize.register_parametrization(root.pconv, "weight", Double())
    return root


MODULES = {"conv": nn.Conv2d, "bn": nn.BatchNorm2d, "relu": nn.ReLU, "linear": nn.Linear,
           "myconv": MyConv, "pconv": nn.Conv2d}
UNARY_FUNCTIONS = [F.relu, torch.relu]
BINARY_FUNCTIONS = [operator.add, torch.add]
ANCHORS = [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Linear, MyConv, F.relu, torch.relu,
           operator.add, torch.add, "relu", operator.getitem]


def random_graph(rng: random.Random, literal_args: bool) -> fx.Graph:
    graph = fx.Graph()
    values = [graph.placeholder("x"), graph.placeholder("y")]
    shapes: list[fx.Node] = []
    size = rng.randint(3, 12)
    while len(values) < size + 2:
        # prefer recent values (chains) but sometimes reuse old ones (multi-user nodes)
        pick = lambda: values[-1] if rng.random() < 0.6 else rng.choice(values)  # noqa: E731
        kind = rng.random()
        if kind < 0.35:
            node = graph.call_module(rng.choice(list(MODULES)), (pick(),))
        elif kind < 0.5:
            fn = rng.choice(UNARY_FUNCTIONS)
            kwargs = {"inplace": False} if fn is F.relu and rng.random() < 0.5 else {}
            node = graph.call_function(fn, (pick(),), kwargs)
        elif kind < 0.7:
            literals = [1, 2.0] if literal_args else []
            other = rng.choice(values + literals) if rng.random() < 0.7 else pick()
            node = graph.call_function(rng.choice(BINARY_FUNCTIONS), (pick(), other))
        elif kind < 0.8:
            node = graph.call_method("relu", (pick(),))
        elif not literal_args:
            continue  # shape ops carry literal arguments
        elif kind < 0.9:
            shapes.append(graph.call_function(getattr, (pick(), rng.choice(["shape", "dtype"]))))
            continue
        elif shapes:
            node = graph.call_function(operator.getitem, (rng.choice(shapes), rng.randint(0, 1)))
        else:
            continue
        values.append(node)
    graph.output(tuple(values[-rng.randint(1, 2):]))
    return graph


def pattern_from_node(rng: random.Random, node, modules: dict, depth: int):
    """A pattern that matches ``node`` or nearly does (random wildcards, arities and ops)."""
    if not isinstance(node, fx.Node):
        return node if rng.random() < 0.8 else rng.choice([0, 1, 2.0])
    if depth == 0 or rng.random() < 0.2 or node.op == "placeholder":
        return MatchAllNode if rng.random() < 0.7 else rng.choice(ANCHORS)
    if node.op == "call_module":
        anchor = type(modules[node.target]) if node.target != "pconv" else nn.Conv2d
    elif node.target is getattr:
        return (getattr, node.args[1] if rng.random() < 0.8 else "shape")
    else:
        anchor = node.target
    if rng.random() < 0.15:
        anchor = rng.choice(ANCHORS)
    args = [pattern_from_node(rng, arg, modules, depth - 1) for arg in node.args]
    roll = rng.random()
    if roll < 0.1:
        args = args[:-1]
    elif roll < 0.15:
        args.append(MatchAllNode)
    elif roll < 0.25:
        return anchor
    return (anchor, *args)


def random_pattern(rng: random.Random, depth: int):
    anchor = rng.choice(ANCHORS)
    if depth == 0 or rng.random() < 0.3:
        return anchor
    arity = 2 if anchor in BINARY_FUNCTIONS or anchor is operator.getitem else 1
    return (anchor, *(rng.choice([MatchAllNode, random_pattern(rng, depth - 1), 0, 1])
                      for _ in range(arity)))


def to_ao(pattern):
    """The same pattern with torch.ao's MatchAllNode."""
    if pattern is MatchAllNode:
        return ao_utils.MatchAllNode
    if isinstance(pattern, tuple):
        return tuple(to_ao(p) for p in pattern)
    return pattern


def cases(literal_args: bool = True):
    rng = random.Random(SEED)
    root = make_root()
    modules = dict(root.named_modules())
    for _ in range(GRAPHS):
        graph = random_graph(rng, literal_args)
        nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        patterns = {pattern_from_node(rng, rng.choice(nodes), modules, 3) for _ in range(6)}
        patterns |= {random_pattern(rng, 2) for _ in range(4)}
        patterns.discard(MatchAllNode)
        yield fx.GraphModule(root, graph), modules, sorted(patterns, key=repr)


def test_is_match_agrees_with_torch_ao_on_random_graphs():
    pairs = agreed_true = 0
    disagreements = []
    for gm, modules, patterns in cases():
        for node in gm.graph.nodes:
            for pattern in patterns:
                expected = match_utils._is_match(modules, node, to_ao(pattern))
                actual = is_match(modules, node, pattern)
                pairs += 1
                agreed_true += expected and actual
                if expected != actual:
                    disagreements.append((node.format_node(), pattern, expected))
    assert disagreements == []
    assert pairs > 40_000
    assert agreed_true > 1_500  # the generator really exercises the matching paths


def fuse_patterns(patterns):
    """Patterns torch.ao's fuse matcher can record: no literals, no getattr, anchors not bare."""
    def ok(p):
        if isinstance(p, tuple):
            return p[0] is not getattr and all(ok(q) for q in p)
        return p is MatchAllNode or isinstance(p, (type, str)) or callable(p)
    return [p for p in patterns if ok(p) and p is not MatchAllNode]


def test_find_matches_agrees_with_torch_ao_fuse_matcher():
    """Same anchors, members and patterns as torch.ao's fuse matcher.

    Where the two cannot be compared: torch.ao's fuse matcher crashes (AttributeError) when a
    MatchAllNode matches a literal argument, and it records a getattr pattern's input as a member;
    qplug lists the literal in ``Match.inputs`` and keeps getattr inputs out. So this comparison
    uses graphs without literal arguments (so without shape ops) and no getattr patterns.
    """
    compared = 0
    for gm, _, patterns in cases(literal_args=False):
        usable = sort_patterns(fuse_patterns(patterns))
        expected = ao_fuse._find_matches(gm, gm.graph, {to_ao(p): (lambda n: None) for p in usable})
        actual = find_matches(gm, usable)
        assert set(actual) == set(expected)
        members = defaultdict(set)
        for name, (anchor, *_rest) in expected.items():
            members[anchor.name].add(name)
        for name, match in actual.items():
            assert match.anchor.name == expected[name][0].name
            assert {n.name for n in match.nodes} == members[match.anchor.name]
            assert to_ao(match.pattern) == expected[name][1]
        compared += len(actual)
    assert compared > 1_000
