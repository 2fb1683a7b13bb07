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


def default_qconfig():
    """torch.ao's ``default_qconfig``: min/max activations, per-tensor symmetric weights."""
    import qplug_core as qp
    from qplug_core.observers import default_observer, default_weight_observer
    return qp.QConfig(activation=default_observer, weight=default_weight_observer)


def default_qat_qconfig():
    """torch.ao's ``default_qat_qconfig`` (``default_fake_quant``, ``default_weight_fake_quant``)."""
    import qplug_core as qp
    from qplug_core.observers import FakeQuantize, MovingAverageMinMaxObserver
    return qp.QConfig(
        activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0,
                                          quant_max=255, dtype=torch.quint8,
                                          qscheme=torch.per_tensor_affine, reduce_range=True),
        weight=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=-128,
                                      quant_max=127, dtype=torch.qint8,
                                      qscheme=torch.per_tensor_symmetric, reduce_range=False))


class LinearRelu(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(5, 5), nn.ReLU())


class LinReluLin(nn.Module):
    """``test_problematic_fuse_example`` / ``test_qconfig_qat_module_type``'s model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin_relu = LinearRelu()
        self.linear = nn.Linear(5, 5)

    def forward(self, x):
        return self.linear(self.lin_relu(x))


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


# -- eager-mode models (torch.testing._internal.common_quantization) -------------------------------


def _stubs():
    from qplug_core.eager import DeQuantStub, QuantStub
    return QuantStub(), DeQuantStub()


class SubModelForFusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1, bias=None).to(dtype=torch.float)
        self.bn = nn.BatchNorm2d(2).to(dtype=torch.float)

    def forward(self, x):
        return self.bn(self.conv(x))


class SubModelWithoutFusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1, bias=None).to(dtype=torch.float)
        self.relu = nn.ReLU(inplace=False).to(dtype=torch.float)

    def forward(self, x):
        return self.relu(self.conv(x))


class ModelForFusion(nn.Module):
    def __init__(self, qconfig):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 1, bias=None).to(dtype=torch.float)
        self.bn1 = nn.BatchNorm2d(2).to(dtype=torch.float)
        self.relu1 = nn.ReLU(inplace=True).to(dtype=torch.float)
        self.sub1 = SubModelForFusion()
        self.sub2 = SubModelWithoutFusion()
        self.fc = nn.Linear(36, 10).to(dtype=torch.float)
        self.quant, self.dequant = _stubs()
        self.qconfig = qconfig
        self.conv2 = nn.Conv3d(3, 2, (1, 1, 1), bias=None).to(dtype=torch.float)
        self.relu2 = nn.ReLU(inplace=False).to(dtype=torch.float)
        self.bn2 = nn.BatchNorm3d(2).to(dtype=torch.float)
        self.relu3 = nn.ReLU(inplace=True).to(dtype=torch.float)
        self.conv3 = nn.Conv1d(3, 3, 2).to(dtype=torch.float)
        self.bn3 = nn.BatchNorm1d(3).to(dtype=torch.float)
        self.relu4 = nn.ReLU(inplace=True).to(dtype=torch.float)
        # don't quantize sub2
        self.sub2.qconfig = None
        self.fc.qconfig = None

    def forward(self, x):
        x = x.squeeze(2)
        x = self.quant(x)
        x = self.conv3(x)
        x = self.bn3(x)
        x = self.relu4(x)
        x = x.unsqueeze(2)
        y = x.unsqueeze(2)
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu1(x)
        x = self.sub1(x)
        x = self.dequant(x)
        x = self.sub2(x)
        x = x.reshape(-1, 36).contiguous()
        x = self.fc(x)
        y = self.conv2(y)
        y = self.relu2(y)
        y = self.bn2(y)
        y = self.relu3(y)
        y = self.dequant(y)
        return x


class ConvBNReLU(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, 3, 1, 1, bias=False), nn.BatchNorm2d(3), nn.ReLU(inplace=False))


class ModelWithSequentialFusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 1)
        self.relu1 = nn.ReLU(inplace=False)
        self.features = nn.Sequential(*[ConvBNReLU() for _ in range(3)])
        self.classifier = nn.Sequential(nn.Linear(300, 10), nn.ReLU(inplace=False))
        self.seq = nn.Sequential()
        self.quant, self.dequant = _stubs()

    def forward(self, x):
        x = self.quant(x)
        x = self.conv1(x)
        x = self.relu1(x)
        x = self.features(x)
        x = torch.reshape(x, (-1, 3 * 10 * 10))
        x = self.classifier(x)
        x = self.seq(x)
        return self.dequant(x)


class ModelForLinearBNFusion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(20, 10)
        self.bn = nn.BatchNorm1d(10)
        nn.init.uniform_(self.bn.weight)
        nn.init.uniform_(self.bn.bias)

    def forward(self, x):
        return self.bn(self.fc(x))


class ModelForFusionWithBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 2, 5, bias=True).to(dtype=torch.float)
        self.bn1 = nn.BatchNorm2d(2).to(dtype=torch.float)
        self.relu1 = nn.ReLU(inplace=True).to(dtype=torch.float)
        self.conv2 = nn.Conv2d(2, 2, 1, bias=True).to(dtype=torch.float)
        self.bn2 = nn.BatchNorm2d(2).to(dtype=torch.float)
        self.quant, self.dequant = _stubs()

    def forward(self, x):
        x = self.quant(x)
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.dequant(x)


def img_data_1d(n: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.rand(2, 3, 10, generator=gen)] for _ in range(n)]


def img_data_2d(n: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.rand(1, 3, 10, 10, generator=gen)] for _ in range(n)]


def eval_fn(model, calib_data):
    """Upstream's ``test_only_eval_fn``."""
    for inp in calib_data:
        model(*inp)


def train_fn(model, train_data):
    """Upstream's ``test_only_train_fn``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for data, target in train_data:
        output = model(data)
        loss = nn.CrossEntropyLoss()(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def check_no_qconfig(module: nn.Module) -> None:
    """QuantizationTestCase.checkNoQconfig."""
    assert not hasattr(module, "qconfig")
    for child in module.children():
        check_no_qconfig(child)
