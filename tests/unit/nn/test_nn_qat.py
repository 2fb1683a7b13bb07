"""QAT modules: equal to the fused float forward without fake quant, BN statistics, gradients,
from_float/to_float, and the fake-quant path against torch.ao's QAT modules as an oracle."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from nn_test_helpers import SwitchableFakeQuant
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.nn import intrinsic as nni
from qplug_core.nn import qat

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
DIMS = [1, 2, 3]


def _bn(dim: int, n: int) -> nn.Module:
    bn = BN[dim](n)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)  # the QAT algorithm divides by gamma, as upstream
        bn.bias.normal_()
    return bn


def _float_module(kind: str, dim: int, bias: bool = True) -> nn.Module:
    conv = CONV[dim](3, 4, 3, padding=1, bias=bias)
    if kind == "Conv":
        return conv
    parts = {"ConvReLU": (conv, nn.ReLU()), "ConvBn": (conv, _bn(dim, 4)),
             "ConvBnReLU": (conv, _bn(dim, 4), nn.ReLU())}[kind]
    return getattr(nni, f"{kind}{dim}d")(*parts)


def _x(dim: int) -> torch.Tensor:
    return torch.randn(4, 3, *([5] * dim))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.detach().abs().max()))


KINDS = ["Conv", "ConvReLU", "ConvBn", "ConvBnReLU"]


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_family_equals_float_in_train_mode(no_fake_quant, kind, dim, bias):
    torch.manual_seed(dim)
    float_mod = _float_module(kind, dim, bias)
    reference = copy.deepcopy(float_mod)
    module = getattr(qat, f"{kind}{dim}d").from_float(float_mod, no_fake_quant)
    assert type(module).__name__ == f"{kind}{dim}d" and isinstance(module, CONV[dim])
    root = float_mod[0] if isinstance(float_mod, nn.Sequential) else float_mod
    assert module.weight is root.weight  # parameters are shared, not copied
    for _ in range(3):  # several steps: running statistics must evolve identically
        x = _x(dim)
        assert _close(module(x), reference(x))
    if "Bn" in kind:
        assert torch.allclose(module.bn.running_mean, reference[1].running_mean, atol=1e-6)
        assert torch.allclose(module.bn.running_var, reference[1].running_var, atol=1e-6)
        assert module.bn.num_batches_tracked == reference[1].num_batches_tracked == 3


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("kind", KINDS)
def test_conv_family_eval_and_to_float(no_fake_quant, kind, dim):
    torch.manual_seed(dim)
    float_mod = _float_module(kind, dim).eval()
    module = getattr(qat, f"{kind}{dim}d").from_float(copy.deepcopy(float_mod), no_fake_quant)
    assert not module.training
    x = _x(dim)
    with torch.no_grad():
        assert _close(module(x), float_mod(x))
        back = module.to_float()
        expected_type = (getattr(nni, f"ConvReLU{dim}d") if kind.endswith("ReLU") else CONV[dim])
        assert type(back) is expected_type and not back.training
        assert _close(back(x), float_mod(x))  # BN folded with the running statistics


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_flow(qconfig, kind):
    torch.manual_seed(0)
    module = getattr(qat, f"{kind}2d").from_float(_float_module(kind, 2), qconfig)
    module(_x(2)).square().sum().backward()
    params = [module.weight, module.bias] + ([module.bn.weight, module.bn.bias] if "Bn" in kind else [])
    for p in params:
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert module.weight_fake_quant.calls == 1


def test_fake_quant_is_applied_to_the_weight(qconfig):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    module = qat.Conv2d.from_float(conv, qconfig)
    x = _x(2)
    expected = F.conv2d(x, SwitchableFakeQuant()(conv.weight), conv.bias)
    assert torch.equal(module(x), expected)
    assert not torch.allclose(module(x), conv(x), rtol=0, atol=1e-7)


def test_conv_bn_train_mode_with_fake_quant_matches_torch_ao(qconfig):
    """The whole BN-in-the-loop algorithm with rounding on, against torch.ao's implementation."""
    ao_qat = pytest.importorskip("torch.ao.nn.intrinsic.qat")
    torch.manual_seed(0)
    float_mod = _float_module("ConvBnReLU", 2)
    ours = qat.ConvBnReLU2d.from_float(copy.deepcopy(float_mod), qconfig)
    theirs = ao_qat.ConvBnReLU2d(3, 4, 3, padding=1, bias=True, qconfig=qconfig)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    for _ in range(2):
        x = _x(2)
        assert _close(ours(x), theirs(x))
    assert torch.allclose(ours.bn.running_var, theirs.bn.running_var)


def test_linear_bn_with_fake_quant_matches_torch_ao(qconfig):
    ao_qat = pytest.importorskip("torch.ao.nn.intrinsic.qat")
    torch.manual_seed(0)
    ours = qat.LinearBn1d.from_float(nni.LinearBn1d(nn.Linear(6, 4), _bn(1, 4)), qconfig)
    theirs = ao_qat.LinearBn1d(6, 4, qconfig=qconfig)
    theirs.load_state_dict(ours.state_dict(), strict=False)
    x = torch.randn(8, 6)
    assert _close(ours(x), theirs(x))


def test_freeze_and_update_bn_stats(no_fake_quant):
    module = qat.ConvBn2d.from_float(_float_module("ConvBn", 2), no_fake_quant)
    module.apply(qat.freeze_bn_stats)
    frozen_mean = module.bn.running_mean.clone()
    module.train()  # a frozen BN stays in eval mode through model.train()
    assert module.training and not module.bn.training and module.weight_fake_quant.training
    x = _x(2)
    module(x)
    assert torch.equal(module.bn.running_mean, frozen_mean)
    float_eval = module.to_float().eval()
    assert _close(module(x), float_eval(x))  # frozen BN = folded conv
    module.apply(qat.update_bn_stats)
    assert module.bn.training
    module(x)
    assert not torch.equal(module.bn.running_mean, frozen_mean)


@pytest.mark.parametrize("kind", ["Linear", "LinearReLU", "LinearBn1d"])
def test_linear_family(no_fake_quant, kind):
    torch.manual_seed(0)
    linear = nn.Linear(6, 4)
    float_mod = {"Linear": linear, "LinearReLU": nni.LinearReLU(linear, nn.ReLU()),
                 "LinearBn1d": nni.LinearBn1d(linear, _bn(1, 4))}[kind]
    reference = copy.deepcopy(float_mod)
    module = getattr(qat, kind).from_float(float_mod, no_fake_quant)
    assert module.weight is linear.weight and isinstance(module, nn.Linear)
    x = torch.randn(8, 6)
    assert _close(module(x), reference(x))
    module.eval()
    reference.eval()
    with torch.no_grad():
        back = module.to_float()
        assert type(back) is (nni.LinearReLU if kind == "LinearReLU" else nn.Linear)
        assert _close(back(x), reference(x))
    module.train()
    module(x).sum().backward()
    assert linear.weight.grad is not None


def test_from_float_reads_module_qconfig(qconfig):
    conv = nn.Conv2d(3, 4, 3)
    conv.qconfig = qconfig
    assert qat.Conv2d.from_float(conv).qconfig is qconfig


@pytest.mark.parametrize("cls,mod", [
    (qat.Conv2d, nn.Conv1d(3, 4, 3)),
    (qat.ConvBn2d, nn.Conv2d(3, 4, 3)),
    (qat.Linear, nni.LinearReLU(nn.Linear(3, 4), nn.ReLU())),
])
def test_from_float_rejects_other_types(qconfig, cls, mod):
    with pytest.raises(ConfigValidationError, match="from_float takes"):
        cls.from_float(mod, qconfig)


def test_missing_qconfig_is_a_clear_error():
    with pytest.raises(ConfigValidationError, match="qconfig"):
        qat.Linear.from_float(nn.Linear(3, 4))


def test_non_zero_padding_modes_match_float(no_fake_quant):
    for mode, padding in [("reflect", 1), ("circular", (1, 2)), ("replicate", "same")]:
        conv = nn.Conv2d(3, 4, 3, padding=padding, padding_mode=mode, dilation=(1, 2))
        x = torch.randn(2, 3, 7, 8)
        assert _close(qat.Conv2d.from_float(conv, no_fake_quant)(x), conv(x))


def test_embedding_and_bag(embedding_qconfig):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, padding_idx=0)
    module = qat.Embedding.from_float(emb, embedding_qconfig)
    idx = torch.tensor([[1, 2, 0], [9, 3, 3]])
    fq_weight = module.weight_fake_quant(emb.weight)
    assert module.weight is emb.weight
    assert torch.equal(module(idx), F.embedding(idx, fq_weight, padding_idx=0))
    assert not torch.equal(module(idx), emb(idx))
    assert type(module.to_float()) is nn.Embedding

    bag = nn.EmbeddingBag(10, 4, mode="sum")
    module = qat.EmbeddingBag.from_float(bag, embedding_qconfig)
    flat, offsets = torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2])
    expected = F.embedding_bag(flat, module.weight_fake_quant(bag.weight), offsets, mode="sum")
    assert torch.equal(module(flat, offsets), expected)
    module(flat, offsets).sum().backward()
    assert bag.weight.grad is not None
    back = module.to_float()
    assert type(back) is nn.EmbeddingBag and back.mode == "sum"


def test_embedding_needs_float_qparams(qconfig):
    class PerTensor(nn.Module):
        qscheme = torch.per_tensor_affine

        def forward(self, w):
            return w

    qconfig.weight = PerTensor
    with pytest.raises(ConfigValidationError, match="per_channel_affine_float_qparams"):
        qat.Embedding.from_float(nn.Embedding(4, 2), qconfig)


def test_parametrized_weight_is_transferred(no_fake_quant):
    from torch.nn.utils import parametrize

    class Half(nn.Module):
        def forward(self, w):
            return w / 2

    linear = nn.Linear(3, 4)
    parametrize.register_parametrization(linear, "weight", Half())
    module = qat.Linear.from_float(linear, no_fake_quant)
    assert parametrize.is_parametrized(module, "weight")
    x = torch.randn(2, 3)
    assert _close(module(x), linear(x))


def test_modules_pickle_round_trip(qconfig, tmp_path):
    """Generated classes have importable names, so whole modules survive torch.save/load."""
    fused = nni.ConvBnReLU2d(nn.Conv2d(3, 4, 3), _bn(2, 4), nn.ReLU())
    module = qat.ConvBnReLU2d.from_float(copy.deepcopy(fused), qconfig).eval()
    torch.save({"fused": fused, "qat_state": module.state_dict()}, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(loaded["fused"]) is nni.ConvBnReLU2d
    twin = qat.ConvBnReLU2d(3, 4, 3, bias=True, qconfig=qconfig).eval()
    twin.load_state_dict(loaded["qat_state"])
    x = _x(2)
    assert torch.equal(twin(x), module(x))


def test_with_the_real_qconfig_and_fake_quantize():
    """Integration with qplug's QConfig and FakeQuantize (per-channel weights, float-qparams tables)."""
    defaults = pytest.importorskip("qplug_core.observers.defaults")
    from qplug_core.config import QConfig

    torch.manual_seed(0)
    qconfig = QConfig(activation=defaults.default_fake_quant,
                      weight=defaults.default_per_channel_weight_fake_quant)
    float_mod = _float_module("ConvBnReLU", 2)
    reference = copy.deepcopy(float_mod)
    module = qat.ConvBnReLU2d.from_float(float_mod, qconfig)
    x = _x(2)
    out = module(x)
    out.sum().backward()
    assert module.weight.grad is not None
    expected = reference(x).detach()
    assert not torch.equal(out, expected)
    assert torch.allclose(out, expected, atol=0.05 * float(expected.abs().max()))
    module.weight_fake_quant.disable_fake_quant()
    assert _close(module(x), reference(x))

    embedding_qconfig = QConfig(activation=defaults.default_fake_quant,
                                weight=defaults.default_embedding_fake_quant)
    emb = qat.Embedding.from_float(nn.Embedding(6, 3), embedding_qconfig)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ConfigValidationError, match="per_channel_affine_float_qparams"):
        qat.Embedding.from_float(nn.Embedding(6, 3), qconfig)
