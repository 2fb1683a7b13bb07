"""BatchNorm folding: exact maths against running conv/linear then BN, and torch.nn.utils.fusion."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from qplug_core.errors import ConfigValidationError
from qplug_core.nn.folding import fold_bn_into_conv, fold_bn_into_linear, fold_bn_weights

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def trained_bn(bn: nn.Module) -> nn.Module:
    """A BN with non-trivial affine params and running stats, in eval mode."""
    with torch.no_grad():
        n = bn.num_features
        bn.running_mean.copy_(torch.randn(n))
        bn.running_var.copy_(torch.rand(n) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.randn(n))
            bn.bias.copy_(torch.randn(n))
    return bn.eval()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("transposed", [False, True])
def test_fold_conv_matches_conv_then_bn(dim, bias, groups, transposed):
    torch.manual_seed(dim * 10 + groups)
    conv = (CONVT if transposed else CONV)[dim](4, 6, 3, groups=groups, bias=bias).eval()
    bn = trained_bn(BN[dim](6))
    x = torch.randn(2, 4, *([5] * dim))
    fused = fold_bn_into_conv(conv, bn)
    assert type(fused) is type(conv) and fused is not conv
    with torch.no_grad():
        assert close(fused(x), bn(conv(x)))
    if groups == 1:  # torch's transpose folding ignores groups; compare only where it is right
        ref = fuse_conv_bn_eval(conv, bn, transpose=transposed)
        # bit for bit, as torch.ao's fusion: one ulp of bias moved a histogram observer's scale
        assert torch.equal(fused.weight, ref.weight) and torch.equal(fused.bias, ref.bias)


def test_fold_leaves_inputs_untouched_and_keeps_requires_grad():
    conv, bn = nn.Conv2d(3, 4, 1).eval(), trained_bn(nn.BatchNorm2d(4))
    before = conv.weight.clone()
    fused = fold_bn_into_conv(conv, bn)
    assert torch.equal(conv.weight, before)
    assert isinstance(fused.weight, nn.Parameter) and fused.weight.requires_grad


def test_fold_non_affine_bn():
    conv, bn = nn.Conv2d(3, 4, 1).eval(), trained_bn(nn.BatchNorm2d(4, affine=False))
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        assert close(fold_bn_into_conv(conv, bn)(x), bn(conv(x)))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", [5, 1])
def test_fold_linear_matches_linear_then_bn(bias, features):
    torch.manual_seed(features)
    linear, bn = nn.Linear(7, 5, bias=bias).eval(), trained_bn(nn.BatchNorm1d(features))
    x = torch.randn(8, 7)
    fused = fold_bn_into_linear(linear, bn)
    with torch.no_grad():
        expected = bn(linear(x).unsqueeze(1)).squeeze(1) if features == 1 else bn(linear(x))
        assert close(fused(x), expected)
        ref = fuse_linear_bn_eval(linear, bn)
        # torch keeps a bias-free linear's bias at one element for a one-feature BN
        assert torch.equal(fused.weight, ref.weight) and torch.equal(fused.bias, ref.bias.expand(5))


def test_fold_weights_formula_by_hand():
    w, b = torch.tensor([[2.0], [3.0]]), torch.tensor([1.0, -1.0])
    mean, var = torch.tensor([0.5, 1.0]), torch.tensor([3.0, 0.0])
    gamma, beta = torch.tensor([2.0, 1.0]), torch.tensor([0.0, 4.0])
    new_w, new_b = fold_bn_weights(w, b, mean, var, 1.0, gamma, beta)
    assert torch.allclose(new_w, torch.tensor([[2.0], [3.0]]))  # s = [2/2, 1/1]
    assert torch.allclose(new_b, torch.tensor([0.5, 2.0]))  # (b - mean) * s + beta


def test_training_bn_is_rejected_with_a_fix():
    conv, bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)
    with pytest.raises(ConfigValidationError, match=r"model.eval\(\)|prepare_qat"):
        fold_bn_into_conv(conv, bn)


@pytest.mark.parametrize("bn,match", [
    (nn.BatchNorm2d(5), "5 features"),
    (nn.BatchNorm2d(4, track_running_stats=False), "track_running_stats"),
    (nn.LayerNorm(4), "BatchNorm"),
])
def test_bad_bn_is_rejected(bn, match):
    with pytest.raises(ConfigValidationError, match=match):
        fold_bn_into_conv(nn.Conv2d(3, 4, 1).eval(), bn.eval())


def test_non_conv_is_rejected():
    with pytest.raises(ConfigValidationError, match="Conv"):
        fold_bn_into_conv(nn.Linear(3, 4).eval(), nn.BatchNorm1d(4).eval())
    with pytest.raises(ConfigValidationError, match="Linear"):
        fold_bn_into_linear(nn.Conv1d(3, 4, 1).eval(), nn.BatchNorm1d(4).eval())
