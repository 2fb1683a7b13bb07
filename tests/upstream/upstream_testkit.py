"""Models and graph checks the ported PyTorch tests share.

The model classes are those of ``torch.testing._internal.common_quantization`` (same layers, sizes
and forward), defined here because that module needs PyTorch's own test dependencies.
``check_graph_module_nodes`` is ``QuantizationTestCase.checkGraphModuleNodes``: an ordered
subsequence of (op, target) and exact occurrence counts, where a module target is its class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn


def node_key(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Any] | None:
    if node.op == "call_module":
        return ("call_module", type(gm.get_submodule(node.target)))
    if node.op in ("call_function", "call_method"):
        return (node.op, node.target)
    return None


def check_graph_module_nodes(gm: fx.GraphModule, expected_node_list=(), expected_node_occurrence=None,
                             expected_node=None) -> None:
    keys = [k for k in (node_key(gm, n) for n in gm.graph.nodes) if k is not None]
    if expected_node is not None:
        assert expected_node in keys, f"{expected_node} not in {keys}"
    for key, count in (expected_node_occurrence or {}).items():
        assert keys.count(key) == count, f"{key}: {keys.count(key)} != {count} in {keys}"
    it = iter(keys)
    for key in expected_node_list:
        assert any(k == key for k in it), f"{key} missing or out of order in {keys}"


def call_module(cls: type) -> tuple[str, type]:
    return ("call_module", cls)


class LinearReluModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5).to(dtype=torch.float)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.fc(x))


class LinearReluLinearModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8).to(dtype=torch.float)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 5).to(dtype=torch.float)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


class ModelForConvTransposeBNFusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.ConvTranspose1d(3, 3, 1)
        self.bn1 = nn.BatchNorm1d(3)
        self.conv2 = nn.ConvTranspose2d(3, 3, 1)
        self.bn2 = nn.BatchNorm2d(3)
        self.conv3 = nn.ConvTranspose3d(3, 3, 1)
        self.bn3 = nn.BatchNorm3d(3)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        x = x.unsqueeze(2)
        x = self.bn2(self.conv2(x))
        x = x.unsqueeze(2)
        return self.bn3(self.conv3(x))


class ConvBnAddReluModel(nn.Module):
    def __init__(self, with_bn=True, with_relu=True, left_conv=True, two_conv=True,
                 use_torch_add=True):
        super().__init__()
        self.conv = nn.Conv2d(5, 5, (2, 2))
        self.conv2 = nn.Conv2d(5, 5, (2, 2))
        self.bn = nn.BatchNorm2d(5)
        self.relu = nn.ReLU()
        self.with_bn, self.with_relu, self.two_conv = with_bn, with_relu, two_conv
        self.left_conv, self.use_torch_add = left_conv, use_torch_add

    def forward(self, x1, x2):
        main = self.bn(self.conv(x1)) if self.with_bn else self.conv(x1)
        other = self.conv2(x1) if self.two_conv else x2
        if self.two_conv or self.left_conv:
            x = torch.add(main, other) if self.use_torch_add else main + other
        else:
            x = torch.add(other, main) if self.use_torch_add else other + main
        if self.with_relu:
            x = self.relu(x)
        return x

    def get_example_inputs(self):
        return (torch.rand(1, 5, 3, 3), torch.rand(1, 5, 2, 2))


class LinearBnLeakyReluModel(nn.Module):
    def __init__(self, with_bn=True):
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.bn1d = nn.BatchNorm1d(5)
        self.leaky_relu = nn.LeakyReLU(0.01)
        self.with_bn = with_bn

    def forward(self, x):
        x = self.linear(x)
        if self.with_bn:
            x = self.bn1d(x)
        return self.leaky_relu(x)


class LinearTanhModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.tanh = nn.Tanh()

    def forward(self, x):
        return self.tanh(self.linear(x))
