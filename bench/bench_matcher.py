"""Benchmark of ``find_matches``: time vs graph size and vs number of patterns.

Run: ``python bench/bench_matcher.py`` from the repository root. Prints a table of seconds and
nodes/s for synthetic ResNet-like graphs of about 1k, 4k and 16k nodes, with a realistic set of
~190 patterns (built here from module/function vocabularies, like a backend config would) and with
a 5-pattern set, and with the 5 patterns plus ~150 whose anchors do not occur in the graph. The
16k/1k time ratio should stay near 16 (linear). Patterns are indexed by what their anchor can
match, so per-node cost depends on how many patterns share a node's anchor kind (the realistic set
has ~25 relu-anchored ones), not on the total number of patterns (the "small+unrel" row).
"""

from __future__ import annotations

import itertools
import operator
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import gc_paused_times  # noqa: E402

from qplug_core.matcher import find_matches  # noqa: E402
from qplug_core.patterns import MatchAllNode  # noqa: E402

RELUS = [nn.ReLU, F.relu, torch.relu, "relu"]
CONVS = {1: (nn.Conv1d, nn.ConvTranspose1d, nn.BatchNorm1d),
         2: (nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d),
         3: (nn.Conv3d, nn.ConvTranspose3d, nn.BatchNorm3d)}
BINARY = [operator.add, torch.add, operator.mul, torch.mul, "add", "mul"]
ACTIVATIONS = [nn.Hardswish, nn.GELU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU, nn.ReLU6, nn.ELU,
               nn.Hardtanh, F.hardtanh, F.gelu, F.hardswish, torch.sigmoid, torch.tanh,
               "sigmoid", "tanh"]
FUNCTIONAL_LINEAR = (F.linear, MatchAllNode, MatchAllNode, MatchAllNode)
SHAPE_METHODS = ["view", "reshape", "flatten", "size", "permute", "transpose", "contiguous",
                 "squeeze", "unsqueeze", "chunk"]


def realistic_patterns() -> list:
    """About 190 patterns shaped like a real backend config's."""
    patterns: list = []
    for conv, conv_t, bn in CONVS.values():
        for op in (conv, conv_t):
            patterns += [(relu, (bn, op)) for relu in RELUS]
            patterns += [(relu, op) for relu in RELUS]
            patterns += [(bn, op), op]
        patterns.append(bn)
        for add, relu in itertools.product([operator.add, torch.add], RELUS):
            patterns.append((relu, (add, MatchAllNode, (bn, conv))))
            patterns.append((relu, (add, (bn, conv), MatchAllNode)))
    for relu in RELUS:
        patterns += [(relu, nn.Linear), (relu, FUNCTIONAL_LINEAR),
                     (relu, (nn.BatchNorm1d, nn.Linear))]
    patterns += [nn.Linear, FUNCTIONAL_LINEAR]
    for op, relu in itertools.product(BINARY, RELUS):
        patterns.append((relu, (op, MatchAllNode, MatchAllNode)))
    patterns += [(op, MatchAllNode, MatchAllNode) for op in BINARY]
    patterns += [torch.cat, torch.flatten, (getattr, "shape"), operator.getitem]
    patterns += [(operator.getitem, (getattr, "shape"), i) for i in range(4)]
    patterns += SHAPE_METHODS + ACTIVATIONS + RELUS
    return patterns


SMALL_PATTERNS = [(nn.ReLU, (nn.BatchNorm2d, nn.Conv2d)), (nn.ReLU, nn.Conv2d),
                  (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d))),
                  (F.relu, nn.Linear), nn.ReLU]


def anchor(pattern):
    return pattern[0] if isinstance(pattern, tuple) else pattern


def small_plus_unrelated() -> list:
    """The small set plus every realistic pattern whose anchor never occurs in the graph."""
    in_graph = {nn.ReLU, F.relu, nn.Conv2d, nn.BatchNorm2d, operator.add, nn.Linear, getattr,
                operator.getitem, "view", "view_as", torch.mul}
    unrelated = [p for p in realistic_patterns() if not any(anchor(p) is a for a in in_graph)]
    return SMALL_PATTERNS + unrelated


def synthetic_graph(nodes: int) -> fx.GraphModule:
    """Residual conv-bn-relu blocks with a linear head and shape ops every few blocks."""
    root = nn.Module()
    root.conv, root.bn, root.relu = nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()
    root.linear = nn.Linear(4, 4)
    graph = fx.Graph()
    x = graph.placeholder("x")
    block = 0
    while len(graph.nodes) < nodes:
        y = graph.call_module("conv", (x,))
        y = graph.call_module("relu", (graph.call_module("bn", (y,)),))
        z = graph.call_module("bn", (graph.call_module("conv", (y,)),))
        x = graph.call_module("relu", (graph.call_function(operator.add, (x, z)),))
        if block % 4 == 3:
            batch = graph.call_function(operator.getitem,
                                        (graph.call_function(getattr, (x, "shape")), 0))
            flat = graph.call_method("view", (x, batch, -1))
            head = graph.call_function(F.relu, (graph.call_module("linear", (flat,)),))
            x = graph.call_method("view_as", (graph.call_function(torch.mul, (head, 0.5)), x))
        block += 1
    graph.output(x)
    return fx.GraphModule(root, graph)


def best_time(gm: fx.GraphModule, patterns: list, repeats: int = 5) -> float:
    """Best of ``repeats`` runs with the garbage collector paused, as ``timeit`` does."""
    return min(gc_paused_times(lambda: find_matches(gm, patterns), repeats))


def main() -> None:
    pattern_sets = {"realistic": realistic_patterns(), "small": SMALL_PATTERNS,
                    "small+unrel": small_plus_unrelated()}
    rows = []
    for size in (1_000, 4_000, 16_000):
        gm = synthetic_graph(size)
        for name, patterns in pattern_sets.items():
            seconds = best_time(gm, patterns)
            rows.append((len(gm.graph.nodes), name, len(patterns), seconds))
    print(f"{'nodes':>7} {'patterns':>11} {'count':>6} {'seconds':>9} {'nodes/s':>10} "
          f"{'us/node':>8}")
    for nodes, name, count, seconds in rows:
        print(f"{nodes:>7} {name:>11} {count:>6} {seconds:>9.4f} {nodes / seconds:>10.0f} "
              f"{1e6 * seconds / nodes:>8.2f}")
    by_key = {(nodes, name): seconds for nodes, name, _, seconds in rows}
    sizes = sorted({nodes for nodes, *_ in rows})
    for name in pattern_sets:
        ratio = by_key[(sizes[-1], name)] / by_key[(sizes[0], name)]
        print(f"{name}: time({sizes[-1]})/time({sizes[0]}) = {ratio:.1f}x "
              f"for {sizes[-1] / sizes[0]:.1f}x nodes (limit 20x)")
    small = by_key[(sizes[-1], "small")]
    for name in ("realistic", "small+unrel"):
        print(f"{name}/small time at {sizes[-1]} nodes: {by_key[(sizes[-1], name)] / small:.2f}x "
              f"for {len(pattern_sets[name]) / len(SMALL_PATTERNS):.0f}x patterns")


if __name__ == "__main__":
    main()
