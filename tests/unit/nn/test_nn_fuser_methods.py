"""Fuser methods: every DEFAULT_FUSER_METHODS entry in eval and QAT, types and numerics."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConfigValidationError, PatternError
from qplug_core.nn import fuser_methods as fm
from qplug_core.nn import intrinsic as nni

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {nn.BatchNorm1d: 1, nn.BatchNorm2d: 2, nn.BatchNorm3d: 3}
CONV_DIM = {cls: d for d, cls in CONV.items()}
CONVT_DIM = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}


def _instantiate(types: tuple[type, ...]) -> tuple[list[nn.Module], torch.Tensor]:
    """Modules for a forward-order type tuple, with non-trivial BN stats, and a matching input."""
    modules: list[nn.Module] = []
    channels, x = 3, None
    for t in types:
        if t in CONV_DIM or t in CONVT_DIM:
            dim = CONV_DIM.get(t) or CONVT_DIM[t]
            modules.append(t(3, 4, 3))
            x, channels = torch.randn(2, 3, *([6] * dim)), 4
        elif t is nn.Linear:
            modules.append(t(5, 4))
            x, channels = torch.randn(8, 5), 4
        elif t in BN:
            bn = t(channels)
            with torch.no_grad():
                bn.running_mean.copy_(torch.randn(channels))
                bn.running_var.copy_(torch.rand(channels) + 0.5)
                bn.weight.copy_(torch.randn(channels))
                bn.bias.copy_(torch.randn(channels))
            modules.append(bn)
            if x is None:
                x = torch.randn(2, channels, *([5] * BN[t]))
        else:
            modules.append(t())
    return modules, x


def _reference(modules: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


def _expected_types(types, is_qat):
    """The module type each default entry must produce."""
    fuser = fm.DEFAULT_FUSER_METHODS[types]
    root = types[0]
    if fuser is fm.fuse_linear_bn:
        return nni.LinearBn1d if is_qat else nn.Linear
    if fuser is fm.fuse_linear_relu:
        return nni.LinearReLU
    if fuser is fm.fuse_bn_relu:
        return getattr(nni, f"BNReLU{BN[root]}d")
    if fuser is fm.fuse_convtranspose_bn:
        return root
    dim = CONV_DIM[root]
    if fuser is fm.fuse_conv_bn:
        return getattr(nni, f"ConvBn{dim}d") if is_qat else root
    if fuser is fm.fuse_conv_bn_relu:
        return getattr(nni, f"ConvBnReLU{dim}d" if is_qat else f"ConvReLU{dim}d")
    return getattr(nni, f"ConvReLU{dim}d")


def test_linear_bn_relu_fuses_like_conv_bn_relu():
    """Graph mode's linear + bn1d + relu fusion (torch.ao has none; eager's table keeps torch.ao's):
    eval folds BN into a LinearReLU, QAT keeps it in a LinearBnReLU1d."""
    torch.manual_seed(0)
    modules, x = _instantiate((nn.Linear, nn.BatchNorm1d, nn.ReLU))
    for m in modules:
        m.eval()
    fused = fm.fuse_linear_bn_relu(False, *modules)
    assert type(fused) is nni.LinearReLU
    with torch.no_grad():
        assert torch.allclose(fused(x), _reference(modules, x), atol=1e-5)
    assert type(fm.fuse_linear_bn_relu(True, *modules)) is nni.LinearBnReLU1d
    assert type(fm.fuse_linear_bn_relu(False, modules[0], modules[1], F.relu)) is nni.LinearReLU


ENTRIES = list(fm.DEFAULT_FUSER_METHODS)
IDS = ["-".join(t.__name__ for t in key) for key in ENTRIES]


def test_default_table_mirrors_torch_ao():
    assert len(ENTRIES) == 16
    ao = pytest.importorskip("torch.ao.quantization.fuser_method_mappings")
    assert set(ENTRIES) == set(ao._DEFAULT_OP_LIST_TO_FUSER_METHOD)


@pytest.mark.parametrize("types", ENTRIES, ids=IDS)
def test_eval_fusion_type_and_numerics(types):
    torch.manual_seed(0)
    modules, x = _instantiate(types)
    for m in modules:
        m.eval()
    fused = fm.get_fuser_method(types)(False, *modules)
    assert type(fused) is _expected_types(types, is_qat=False)
    with torch.no_grad():
        expected = _reference(modules, x)
        assert torch.allclose(fused(x), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("types", ENTRIES, ids=IDS)
def test_qat_fusion_type_and_numerics(types):
    torch.manual_seed(0)
    modules, x = _instantiate(types)
    fuser = fm.get_fuser_method(types)
    if fuser is fm.fuse_convtranspose_bn:
        with pytest.raises(ConfigValidationError, match="not supported for QAT"):
            fuser(True, *modules)
        return
    fused = fuser(True, *modules)
    assert type(fused) is _expected_types(types, is_qat=True)
    assert all(a is b for a, b in zip(fused, modules))  # QAT keeps the very modules (train BN)
    assert torch.equal(fused(x), _reference(modules, x))


@pytest.mark.parametrize("relu", [F.relu, torch.relu, "relu", nn.ReLU()])
def test_relu_given_as_function_becomes_module(relu):
    conv = nn.Conv2d(3, 4, 3).eval()
    fused = fm.fuse_conv_relu(False, conv, relu)
    assert type(fused) is nni.ConvReLU2d and isinstance(fused[1], nn.ReLU)
    if not isinstance(relu, nn.Module):  # a fresh ReLU follows the root's mode
        assert fused[1].training is False


def test_eval_fusion_of_training_bn_explains_the_fix():
    conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
    with pytest.raises(ConfigValidationError, match=r"model\.eval\(\)"):
        fm.fuse_conv_bn(False, conv, bn)
    with pytest.raises(ConfigValidationError, match="prepare_qat"):
        fm.fuse_linear_bn(False, nn.Linear(3, 4), nn.BatchNorm1d(4))


@pytest.mark.parametrize("bn,match", [
    (nn.BatchNorm2d(5), "5 features"),
    (nn.BatchNorm2d(4, affine=False), "affine"),
    (nn.BatchNorm2d(4, track_running_stats=False), "track_running_stats"),
])
def test_qat_bn_requirements(bn, match):
    with pytest.raises(ConfigValidationError, match=match):
        fm.fuse_conv_bn(True, nn.Conv2d(3, 4, 3), bn)


def test_unknown_conv_type_is_reported():
    with pytest.raises(ConfigValidationError, match="ConvTranspose2d"):
        fm.fuse_conv_relu(False, nn.ConvTranspose2d(3, 4, 3), nn.ReLU())


@pytest.mark.parametrize("add", [operator.add, torch.add])
def test_conv_add_fusers(add):
    torch.manual_seed(0)
    conv, bn, relu = nn.Conv2d(3, 3, 3, padding=1).eval(), nn.BatchNorm2d(3).eval(), nn.ReLU()
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
    x1, x2 = torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        assert type(fm.fuse_conv_add(False, conv, add)) is nni.ConvAdd2d
        assert torch.equal(fm.fuse_conv_add_relu(True, conv, add, relu)(x1, x2),
                           torch.relu(conv(x1) + x2))
        out = fm.fuse_conv_bn_add(False, conv, bn, add)(x1, x2)
        assert torch.allclose(out, bn(conv(x1)) + x2, atol=1e-5)
        out = fm.fuse_conv_bn_add_relu(False, conv, bn, add, F.relu)(x1, x2)
        assert torch.allclose(out, torch.relu(bn(conv(x1)) + x2), atol=1e-5)
    with pytest.raises(ConfigValidationError, match="QAT"):
        fm.fuse_conv_bn_add(True, conv, bn, add)


def test_get_fuser_method_unknown_and_additional():
    with pytest.raises(PatternError, match="No fuser method for \\(Conv2d, ReLU6\\)"):
        fm.get_fuser_method((nn.Conv2d, nn.ReLU6))

    def custom(is_qat, conv, act):
        return nn.Sequential(conv, act)

    assert fm.get_fuser_method((nn.Conv2d, nn.ReLU6), {(nn.Conv2d, nn.ReLU6): custom}) is custom
    assert fm.get_fuser_method((nn.Conv2d, nn.ReLU), {(nn.Conv2d, nn.ReLU): custom}) is custom
