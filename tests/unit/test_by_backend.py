"""by_backend: the flows' own decisions, grouped into acyclic int8 partitions."""

from __future__ import annotations

import torch
from torch import nn

from qplug_core.analysis import by_backend


class _ConvThenSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        y = self.conv2(self.relu(self.conv1(x)))
        return self.softmax(torch.flatten(y, 1))


def test_int8_nodes_form_one_partition_and_float_nodes_say_why():
    model = _ConvThenSoftmax().eval()
    split = by_backend(model, "reference", (torch.randn(1, 3, 8, 8),), fuse=True)
    assert split.int8_nodes[:2] == ["conv1", "conv2"]
    assert len(split.partitions) == 1
    assert "qconfig is None" in split.float_nodes["softmax"]
    assert "feeds no int8 op" in split.float_nodes["flatten"]
    calls = [n.target for n in split.graph_module.graph.nodes if n.op == "call_module"]
    assert calls == ["int8_0", "softmax"]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(split.graph_module(x), model(x))


def test_model_is_not_modified():
    model = _ConvThenSoftmax().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    by_backend(model, "reference", (torch.randn(1, 3, 8, 8),), fuse=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.relu, nn.ReLU)
