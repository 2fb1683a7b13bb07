"""compile_untouched: a delegate's compile never leaves the partition it was handed changed."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from qplug_core.errors import PluginContractError
from qplug_core.flows.untouched_partition import compile_untouched


def _partition() -> fx.GraphModule:
    return fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def _erase_relu(partition: fx.GraphModule) -> None:
    relu = next(n for n in partition.graph.nodes if n.op == "call_module" and n.target == "1")
    relu.replace_all_uses_with(relu.args[0])
    partition.graph.erase_node(relu)
    partition.recompile()


def _edits_graph(partition: fx.GraphModule, inputs: tuple) -> nn.Module:
    """Erases the ReLU from the graph it was handed (folded into its own program)."""
    _erase_relu(partition)
    return nn.Identity()


def _rewrites_graph(partition: fx.GraphModule, inputs: tuple) -> nn.Module:
    """Erases the ReLU, then fails: a rewrite it could not finish."""
    _erase_relu(partition)
    raise RuntimeError("the SDK gave up halfway")


@pytest.mark.parametrize("compile", [_edits_graph, _rewrites_graph])
def test_a_compile_editing_the_graph_it_was_handed_leaves_it_as_it_was(compile):
    partition = _partition()
    x = -torch.ones(2, 4) * 10
    code, expected = partition.code, partition(x)
    with pytest.raises(PluginContractError if compile is _edits_graph else RuntimeError):
        compile_untouched(compile, partition, (x,), "backend 'npu'")
    assert partition.code == code
    assert torch.equal(partition(x), expected) and bool((expected >= 0).all())
