"""Fused float modules: child validation and forward = the children run in sequence."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from qplug_core.errors import ConfigValidationError
from qplug_core.nn import intrinsic as nni

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _input(dim: int, channels: int = 3) -> torch.Tensor:
    return torch.randn(2, channels, *([6] * dim))


def _sequential_cases():
    for d in (1, 2, 3):
        yield getattr(nni, f"ConvReLU{d}d"), lambda d=d: (CONV[d](3, 4, 3), nn.ReLU()), d
        yield getattr(nni, f"ConvBn{d}d"), lambda d=d: (CONV[d](3, 4, 3), BN[d](4)), d
        yield (getattr(nni, f"ConvBnReLU{d}d"),
               lambda d=d: (CONV[d](3, 4, 3), BN[d](4), nn.ReLU()), d)
    for d in (2, 3):
        yield getattr(nni, f"BNReLU{d}d"), lambda d=d: (BN[d](3), nn.ReLU()), d
    yield nni.LinearReLU, lambda: (nn.Linear(6, 4), nn.ReLU()), 0
    yield nni.LinearBn1d, lambda: (nn.Linear(6, 4), nn.BatchNorm1d(4)), 0
    yield nni.LinearLeakyReLU, lambda: (nn.Linear(6, 4), nn.LeakyReLU(0.2)), 0
    yield nni.LinearTanh, lambda: (nn.Linear(6, 4), nn.Tanh()), 0


@pytest.mark.parametrize("cls,make,dim", list(_sequential_cases()),
                         ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_fused_module_runs_children_in_order(cls, make, dim):
    torch.manual_seed(0)
    children = make()
    fused = cls(*children)
    x = torch.randn(5, 6) if dim == 0 else _input(dim)
    expected = x
    for child in children:
        expected = child(expected)
    assert fused[0] is children[0]
    assert torch.equal(fused(x), expected)
    assert isinstance(fused, nni.FusedModule) and isinstance(fused, nn.Sequential)


@pytest.mark.parametrize("cls,args", [
    (nni.ConvReLU2d, (nn.Conv1d(3, 4, 3), nn.ReLU())),
    (nni.ConvBn2d, (nn.Conv2d(3, 4, 3), nn.BatchNorm1d(4))),
    (nni.LinearReLU, (nn.Linear(3, 4), nn.ReLU6())),
    (nni.ConvBnReLU3d, (nn.Conv3d(3, 4, 3), nn.BatchNorm3d(4))),
])
def test_wrong_children_are_rejected(cls, args):
    with pytest.raises(ConfigValidationError, match=cls.__name__):
        cls(*args)


def test_subclass_is_rejected_but_parametrized_module_is_accepted():
    class MyConv(nn.Conv2d):
        pass

    with pytest.raises(ConfigValidationError, match="exactly"):
        nni.ConvReLU2d(MyConv(3, 4, 3), nn.ReLU())

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    conv = nn.Conv2d(3, 4, 3)
    parametrize.register_parametrization(conv, "weight", Double())
    fused = nni.ConvReLU2d(conv, nn.ReLU())
    x = _input(2)
    assert torch.equal(fused(x), torch.relu(conv(x)))


@pytest.mark.parametrize("add", [operator.add, torch.add])
def test_conv_add_and_conv_add_relu(add):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 3, 3, padding=1)
    x1, x2 = _input(2), _input(2)
    assert torch.equal(nni.ConvAdd2d(conv, add)(x1, x2), conv(x1) + x2)
    fused = nni.ConvAddReLU2d(conv, add, nn.ReLU())
    assert torch.equal(fused(x1, x2), torch.relu(conv(x1) + x2))
    assert fused[0] is conv


def test_conv_add_validates_its_parts():
    with pytest.raises(ConfigValidationError, match="add function"):
        nni.ConvAdd2d(nn.Conv2d(3, 3, 1), operator.mul)
    with pytest.raises(ConfigValidationError, match="ConvAddReLU2d"):
        nni.ConvAddReLU2d(nn.Conv1d(3, 3, 1), operator.add, nn.ReLU())


def test_generated_classes_have_importable_names():
    for name in nni.__all__:
        cls = getattr(nni, name)
        assert cls.__module__ == "qplug_core.nn.intrinsic" and cls.__qualname__ == name
