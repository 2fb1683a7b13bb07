"""Partitioner speed: ours vs torch.fx's CapabilityBasedPartitioner on the same graphs.

Graphs are random "transformer-like" DAGs: mostly chains with skip connections, 25% of the ops
unsupported (so partitions are many and separated). Also times the PassManager's deep copy.
torch's partitioner is quadratic (about 2 minutes at 1.4k nodes on 2 cores), so it is only run up
to ``--torch-max`` nodes. Run: ``python bench/bench_partition.py [--sizes ...] [--torch-max N]``.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch
from torch import fx

from qplug_core.partition import CapabilityBasedPartitioner, OperatorSupportBase

SUPPORTED = frozenset({torch.add, torch.mul, torch.relu})
OPS = (torch.add, torch.mul, torch.relu, torch.sigmoid)


def make_graph(n_ops: int, seed: int = 0) -> fx.GraphModule:
    rng = random.Random(seed)
    graph = fx.Graph()
    values = [graph.placeholder("x")]
    for _ in range(n_ops):
        target = rng.choice(OPS)
        a = values[-1]
        if target in (torch.add, torch.mul):
            b = values[max(0, len(values) - 1 - rng.randint(1, 8))]
            values.append(graph.call_function(target, (a, b)))
        else:
            values.append(graph.call_function(target, (a,)))
    graph.output(values[-1])
    return fx.GraphModule(torch.nn.Module(), graph)


class Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        return node.op == "call_function" and node.target in SUPPORTED


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 10000])
    parser.add_argument("--torch-max", type=int, default=2000,
                        help="skip torch's partitioner above this size")
    args = parser.parse_args()
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner as TorchCBP
    from torch.fx.passes.operator_support import OperatorSupportBase as TorchBase

    class TorchSupport(TorchBase):
        def is_node_supported(self, submodules, node):
            return node.op == "call_function" and node.target in SUPPORTED

    print(f"{'nodes':>7} {'ours propose s':>15} {'torch propose s':>16} {'partitions':>11} "
          f"{'same':>5} {'ours fuse s':>12} {'deepcopy s':>11}")
    for n in args.sizes:
        gm = make_graph(n)
        n_nodes = len(gm.graph.nodes)
        t_copy, _ = timed(lambda: copy.deepcopy(gm))
        t_ours, ours = timed(lambda: CapabilityBasedPartitioner(gm, Support()).propose_partitions())
        if n <= args.torch_max:
            t_torch, theirs = timed(
                lambda: TorchCBP(gm, TorchSupport()).propose_partitions())
            same = ({frozenset(p.nodes) for p in ours} == {frozenset(p.nodes) for p in theirs})
            torch_cell = f"{t_torch:16.2f}"
        else:
            torch_cell, same = f"{'skipped':>16}", "-"
        t_fuse, _ = timed(lambda: CapabilityBasedPartitioner(gm, Support()).fuse_partitions(ours))
        print(f"{n_nodes:7d} {t_ours:15.2f} {torch_cell} {len(ours):11d} "
              f"{str(same):>5} {t_fuse:12.2f} {t_copy:11.2f}", flush=True)


if __name__ == "__main__":
    main()
