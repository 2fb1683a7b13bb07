"""SmoothQuant keeps the float function and lowers the int8 error of outlier-heavy linear inputs."""

from __future__ import annotations

import pytest
import torch

import qplug_core as qp
from qplug_core.algorithms import smooth_quant
from qplug_core.errors import CalibrationError, ConfigValidationError
from qplug_core.nn.channel_scale import ChannelScale
from qplug_core.zoo.transformer import make_realistic_bert

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        mask = torch.ones(2, 16)
        mask[1, 12:] = 0
        batches.append((torch.randint(0, 1000, (2, 16), generator=g), mask))
    return batches


@pytest.fixture(scope="module")
def smoothed():
    model = make_realistic_bert(seed=0, outlier_scale=12.0)
    data = _tokens(1, 3)
    gm = qp.fuse_fx(model, data[0], backend="reference")
    with torch.no_grad():
        before = [gm(*b) for b in _tokens(2, 2)]
    mapping = qp.get_default_qconfig_mapping("reference")
    results = smooth_quant(gm, data, qconfig_mapping=mapping)
    return model, gm, before, results, data


def test_float_output_within_1e5_relative(smoothed):
    _, gm, before, results, _ = smoothed
    assert any(r.alpha is not None for r in results)
    assert any(isinstance(m, ChannelScale) for m in gm.modules())
    with torch.no_grad():
        for want, batch in zip(before, _tokens(2, 2)):
            got = gm(*batch)
            assert float((got - want).norm() / want.norm()) < 1e-5


def test_query_key_value_share_one_scale_and_errors_drop(smoothed):
    _, _, _, results, _ = smoothed
    qkv = next(r for r in results if r.layers[0].endswith("attention.self.query"))
    assert [name.rsplit(".", 1)[1] for name in qkv.layers] == ["query", "key", "value"]
    for r in results:
        assert r.error_after <= r.error_before  # "no smoothing" is always a candidate
    assert qkv.error_after < qkv.error_before / 2  # the LayerNorm outlier channels are tamed


def test_smoothquant_recipe_improves_the_int8_model(smoothed):
    model, _, _, _, data = smoothed
    held = _tokens(3, 2)
    with torch.no_grad():
        want = torch.cat([model(*b) for b in held])
        plain = qp.quantize(model, data[0], data, backend="reference", recipe="none")
        smooth = qp.quantize(model, data[0], data, backend="reference", recipe="smoothquant")
        assert qp.sqnr(want, torch.cat([smooth(*b) for b in held])) > qp.sqnr(
            want, torch.cat([plain(*b) for b in held]))


def test_bad_arguments_are_clear_errors(smoothed):
    _, gm, _, _, data = smoothed
    with pytest.raises(ConfigValidationError, match="QConfigMapping"):
        smooth_quant(gm, data, qconfig_mapping=None)
    with pytest.raises(CalibrationError, match="0 calibration batches"):
        smooth_quant(gm, [], qconfig_mapping=qp.get_default_qconfig_mapping("reference"))


def test_an_input_made_by_int8_ops_is_left_alone():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            y = self.norm(x)
            return self.fc3(self.fc1(y) + self.fc2(y))

    data = [(torch.randn(4, 16) * torch.logspace(-1, 2, 16),) for _ in range(2)]
    gm = qp.fuse_fx(Block().eval(), data[0], backend="reference")
    results = smooth_quant(gm, data, qconfig_mapping=qp.get_default_qconfig_mapping("reference"))
    assert [r.layers for r in results] == [["fc1", "fc2"]]  # fc3 reads the int8 add


def _topic_batches(seed: int, topics: range, batches: int = 2) -> list[tuple[torch.Tensor]]:
    """Rows with two loud channels always on and, per topic, a few quiet channels firing 20x:
    new data (other topics) fires channels its calibration never saw fire."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for topic in topics:
        for _ in range(batches):
            x = torch.randn(32, 64, generator=g)
            x[:, :2] *= 60.0
            x[:, 2 + 4 * topic: 6 + 4 * topic] *= 20.0
            out.append((x,))
    return out


def test_the_strength_is_chosen_on_rows_its_scale_never_saw():
    """Scored on the rows that fitted it, strong smoothing always wins (nothing exceeds the range),
    but it evens the channels' maxima, so a channel quiet in calibration that fires on new data
    is multiplied up and clipped: held out, it did worse than no smoothing at all."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).eval()
    calibration, held_out = _topic_batches(1, range(4)), _topic_batches(2, range(4, 8))
    with torch.no_grad():
        want = torch.cat([model(*b) for b in held_out])
        sqnr = {recipe: qp.sqnr(want, torch.cat([q(*b) for b in held_out])) for recipe, q in (
            (recipe, qp.quantize(model, calibration[0], calibration, backend="reference", recipe=recipe))
            for recipe in ("none", "smoothquant"))}
    assert sqnr["smoothquant"] >= sqnr["none"] - 0.1, sqnr


def test_one_calibration_row_is_scored_on_itself():
    gm = qp.fuse_fx(torch.nn.Sequential(torch.nn.Linear(8, 4)).eval(), (torch.randn(1, 8),), backend="reference")
    (result,) = smooth_quant(gm, [(torch.randn(1, 8),)], qconfig_mapping=qp.get_default_qconfig_mapping("reference"))
    assert result.error_after <= result.error_before
