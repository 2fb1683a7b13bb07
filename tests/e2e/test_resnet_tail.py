"""Exact structure of the fused and prepared graphs for a ResNet BasicBlock tail (graph mode).

The model is a stem (conv-bn-relu, max-pool), one torchvision BasicBlock with an identity residual
(conv-bn-relu, conv-bn, ``out += identity``, the *shared* ``self.relu`` module called again), then
flatten and a Linear head. What must come out (matching-rules.md rules 13-25, design.md):

* fuse: conv-bn-relu -> ``ConvReLU2d`` with BN folded (eval), conv-bn -> plain ``Conv2d``;
* prepare: add + relu form ONE quantized region; the residual value (the max-pool output) gets one
  observer that both of its int8 consumers use; max-pool and flatten share their input's observer;
* convert on fbgemm: the add-relu region runs as one ``add_relu`` kernel.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.flows.tags import OBSERVER, REGION
from qplug_core.nn.intrinsic import ConvReLU2d
from qplug_core.zoo.resnet import BasicBlock


class BlockTail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.block = BasicBlock(16, 16)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.block(x)
        return self.fc(torch.flatten(x, 1))


def _model() -> BlockTail:
    torch.manual_seed(0)
    model = BlockTail()
    with torch.no_grad():  # non-trivial BN statistics so that folding is visible
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.eval()


def _inputs(seed: int, batch: int = 4) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed)),)


@pytest.fixture(scope="module")
def model() -> BlockTail:
    return _model()


@pytest.fixture(scope="module")
def fused(model):
    return qp.fuse_fx(model, _inputs(0), backend="reference")


@pytest.fixture(scope="module")
def observed(model):
    return qp.prepare_fx(model, None, _inputs(0), backend="reference")


def _called_modules(gm) -> dict[str, type]:
    return {n.target: type(gm.get_submodule(n.target)) for n in gm.graph.nodes
            if n.op == "call_module" and OBSERVER not in n.meta}


def _observer_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_module" and OBSERVER in n.meta]


def test_fuse_gives_convrelu_with_folded_bn_and_plain_conv_for_conv_bn(model, fused):
    called = _called_modules(fused)
    assert called == {
        "conv1": ConvReLU2d, "maxpool": nn.MaxPool2d, "block.conv1": ConvReLU2d,
        "block.conv2": nn.Conv2d, "block.relu": nn.ReLU, "fc": nn.Linear,
    }
    # no BatchNorm is called any more, and the fused graph computes what the float model does
    assert not any(isinstance(fused.get_submodule(t), nn.BatchNorm2d) for t in called)
    x = _inputs(1)
    torch.testing.assert_close(fused(*x), model(*x), rtol=1e-4, atol=1e-5)
    # the BN was folded into the conv: weight rescaled per channel, bias appeared
    bn, conv = model.block.bn1, model.block.conv1
    folded = fused.get_submodule("block.conv1")[0]
    factor = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    torch.testing.assert_close(folded.weight, conv.weight * factor[:, None, None, None])
    torch.testing.assert_close(folded.bias, bn.bias - bn.running_mean * factor)
    records = {r.module_name: (r.pattern, r.fused_type) for r in fused.meta["qplug_fusions"]}
    assert records == {
        "conv1": ("ReLU <- BatchNorm2d <- Conv2d", "ConvReLU2d"),
        "block.conv1": ("ReLU <- BatchNorm2d <- Conv2d", "ConvReLU2d"),
        "block.conv2": ("BatchNorm2d <- Conv2d", "Conv2d"),
    }


def test_add_relu_is_one_quantized_region(observed):
    nodes = {n.name: n for n in observed.graph.nodes}
    add, relu = nodes["add"], nodes["block_relu_1"]
    add_tag, relu_tag = add.meta[REGION], relu.meta[REGION]
    assert add_tag.region_id == relu_tag.region_id
    assert relu_tag.is_anchor and not add_tag.is_anchor and relu_tag.quantized
    # nothing observes the value between add and relu: it never exists as int8
    assert list(add.users) == [relu]


def test_observers_one_per_value_and_residual_observed_once(observed):
    observers = _observer_nodes(observed)
    watched = [(o.args[0].name, o.meta[OBSERVER]) for o in observers]
    assert watched == [
        ("x", "input"), ("conv1", "output"), ("maxpool", "shared"), ("block_conv1", "output"),
        ("block_conv2", "output"), ("block_relu_1", "output"), ("flatten", "shared"), ("fc", "output"),
    ]
    by_value = {o.args[0].name: o for o in observers}
    # the residual (max-pool output) is observed once, and both int8 consumers read that observer
    residual = by_value["maxpool"]
    assert {u.name for u in residual.users} == {"block_conv1", "add"}
    assert sum(o.args[0].name == "maxpool" for o in observers) == 1
    # max-pool and flatten share the observer *module* of their input; everything else has its own
    assert residual.target == by_value["conv1"].target
    assert by_value["flatten"].target == by_value["block_relu_1"].target
    distinct = {o.target for o in observers}
    assert len(observers) == 8 and len(distinct) == 6


@pytest.mark.usefixtures("plugin_autoload")
def test_fbgemm_runs_add_relu_as_one_kernel(model):
    quantized = qp.quantize(model, _inputs(0), [_inputs(s) for s in range(1, 4)], backend="fbgemm")
    report = qp.quantization_report(quantized)
    assert report.skipped == []
    # the block's relu module is called twice; its first call was fused into conv1, so the
    # add-relu region is named after the module (what get_submodule takes)
    assert report.kernels["block.relu"] == "quantized::add_relu"
    assert "add" not in report.kernels  # the add is inside the region, not a kernel of its own
    x = _inputs(9)
    with torch.no_grad():
        reference, out = model(*x), quantized(*x)
    assert sqnr(reference, out) > 25.0
