"""Cross-layer equalization keeps the float function and evens out per-channel weight ranges."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.algorithms import equalize_cross_layer
from qplug_core.errors import ConfigValidationError
from qplug_core.nn.channel_clamp import ChannelClamp
from qplug_core.zoo import get_model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class _Chain(nn.Module):
    """conv -> ReLU6 -> depthwise conv -> ReLU -> 1x1 conv, with wildly unequal channel ranges."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU6()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.act2 = nn.ReLU()
        self.pw = nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            self.dw.weight.mul_(torch.logspace(-2, 2, 8).view(8, 1, 1, 1))

    def forward(self, x):
        return self.pw(self.act2(self.dw(self.act1(self.conv1(x)))))


def _fused(model: nn.Module, x: torch.Tensor):
    return qp.fuse_fx(model, (x,), backend="reference")


def test_mobilenet_v2_float_output_within_1e5_relative():
    torch.manual_seed(0)
    model = get_model("mobilenet_v2", seed=0)
    x = torch.randn(2, 3, 64, 64)
    gm = _fused(model, x)
    with torch.no_grad():
        before = gm(x)
        pairs = equalize_cross_layer(gm)
        after = gm(x)
    assert len(pairs) >= 30  # expand -> depthwise -> project in every block
    assert any(p.clamps for p in pairs)  # ReLU6 pairs equalized, their clamps rescaled
    assert _rel(after, before) < 1e-5
    with torch.no_grad():
        assert _rel(gm(x), model(x)) < 1e-5


def test_relu6_becomes_an_exact_per_channel_clamp_even_where_it_clips():
    torch.manual_seed(0)
    model = _Chain().eval()
    x = torch.randn(4, 3, 8, 8) * 20  # ReLU6 clips most values here
    gm = _fused(model, x)
    with torch.no_grad():
        before = gm(x)
        assert float((model.act1(model.conv1(x)) == 6).float().mean()) > 0.2
        pairs = equalize_cross_layer(gm)
        after = gm(x)
    assert _rel(after, before) < 1e-5
    clamp = gm.get_submodule("act1")
    assert isinstance(clamp, ChannelClamp) and clamp.upper.unique().numel() > 1
    first = next(p for p in pairs if p.first == "conv1")
    assert first.clamps == ["act1"]


def test_ranges_become_equal_across_the_pair():
    model = _Chain().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = _fused(model, x)
    pairs = {p.first: p for p in equalize_cross_layer(gm)}
    assert pairs["dw"].range_ratio_before > 1000
    assert pairs["dw"].range_ratio_after < pairs["dw"].range_ratio_before / 10
    dw = gm.get_submodule("dw")[0]  # fused with its ReLU
    pw = gm.get_submodule("pw")
    dw_rows = dw.weight.abs().flatten(1).amax(1)
    pw_cols = pw.weight.abs().amax(dim=(0, 2, 3))
    torch.testing.assert_close(dw_rows, pw_cols, rtol=1e-3, atol=0)  # sqrt(r1 r2) on both sides


def test_relu6_stop_leaves_clamped_pairs_alone():
    model = _Chain().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = _fused(model, x)
    pairs = equalize_cross_layer(gm, relu6="stop")
    assert [(p.first, p.second) for p in pairs] == [("dw", "pw")]
    assert isinstance(gm.get_submodule("act1"), nn.ReLU6)


def test_a_layer_feeding_two_users_is_not_equalized():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            y = self.a(x)
            return self.b(y) + y

    model = Branch().eval()
    gm = _fused(model, torch.randn(1, 3, 4, 4))
    assert equalize_cross_layer(gm) == []


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ConfigValidationError, match="relu6 must be one of"):
        equalize_cross_layer(_fused(_Chain().eval(), torch.randn(1, 3, 4, 4)), relu6="clip")
    with pytest.raises(ConfigValidationError, match="fused float graph"):
        equalize_cross_layer(_Chain())


def test_dfq_recipe_through_quantize_leaves_the_user_model_alone():
    model = _Chain().eval()
    state = copy.deepcopy(model.state_dict())
    data = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend="reference", recipe="dfq")
    record = qmodel.meta["qplug_recipe"]
    assert record.steps == ("equalize", "bias_correction")
    assert {p.first for p in record.results["equalize"]} == {"conv1", "dw"}
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])
    with torch.no_grad():
        assert qp.sqnr(model(*data[0]), qmodel(*data[0])) > 20
