"""A backend's own fused module (a subclass of ``plugin_api.FusedModule``, made by its fuser method)
prepares, lowers to the backend's kernel, saves and loads, and the testing kit builds its pattern
cases; one that is a bare ``nn.Sequential`` gets errors saying what it needs (qplug-acme's report).
The backend is the one docs/plugins/writing-a-backend.md shows (docs_src/plugin_tiny_conv)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, SerializationError
from qplug_core.testing.pattern_cases import case_id, cases_for, check_pattern
from qplug_core.testing.pattern_levels import check_export_level

TINY_CONV = Path(__file__).resolve().parents[2] / "docs_src" / "plugin_tiny_conv"

#: the same backend with the fused module written as a bare nn.Sequential (the vendor's first try)
SEQUENTIAL = '''
from torch import nn
from qplug_core.plugin_api import RELU_FORMS, BackendPatternConfig, KernelSpec
from qplug_tiny_conv.plugin import INT8, TinyConv, TinyConvPlugin


class PlainConvReLU(nn.Sequential):
    def __init__(self, conv, relu):
        super().__init__(conv, relu)


def fuse(is_qat, conv, relu):
    return PlainConvReLU(conv, relu)


class Plain(TinyConvPlugin):
    name = "plain"

    def pattern_configs(self):
        return [BackendPatternConfig(nn.Conv2d).add_dtype_config(INT8).set_root_module(nn.Conv2d),
                *(BackendPatternConfig((nn.Conv2d, relu)).add_dtype_config(INT8).set_fuser_method(fuse)
                  .set_fused_module(PlainConvReLU) for relu in RELU_FORMS),
                BackendPatternConfig(PlainConvReLU).add_dtype_config(INT8).set_root_module(nn.Conv2d)]

    def kernels(self):
        return {nn.Conv2d: KernelSpec("plain::conv2d", build=TinyConv),
                PlainConvReLU: KernelSpec("plain::conv2d_relu", build=TinyConv)}


plugin = Plain()
'''


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


def batches() -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=gen),) for _ in range(3)]


def model() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def tiny_conv(fake_dist) -> None:
    fake_dist("qplug-tiny-conv", module="qplug_tiny_conv.plugin:plugin", entry_point="tiny_conv",
              location=TINY_CONV)


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_own_fused_module_lowers_to_its_kernel_and_saves_bit_exact(tiny_conv, capture, tmp_path):
    observed = qp.calibrate(qp.prepare_fx(model(), None, batches()[0], backend="tiny_conv",
                                          capture=capture), batches())
    lowered = qp.convert_fx(observed)
    assert qp.quantization_report(lowered).kernels == {"conv1": "tiny_conv::conv2d_relu",
                                                       "conv2": "tiny_conv::conv2d"}
    x = batches()[0][0]
    expected = qp.convert_to_reference_fx(observed)(x)
    step = float(expected.unique().diff().min())  # the reference output lies on its int8 grid
    assert (lowered(x) - expected).abs().max() <= step * 1.01  # within one step of the reference form
    qp.save(lowered, tmp_path / "m.safetensors")
    loaded = qp.load(tmp_path / "m.safetensors")
    assert torch.equal(loaded(x), lowered(x))
    assert qp.quantization_report(loaded).kernels == qp.quantization_report(lowered).kernels


def test_pattern_cases_are_built_for_an_own_fused_module_at_both_levels(tiny_conv):
    case = next(c for c in cases_for("tiny_conv") if c.id == "ConvReLU")
    result = check_pattern("tiny_conv", case)
    assert result.ok and result.kernels, result.explain()
    fusion = next(c for c in cases_for("tiny_conv") if c.pattern == (nn.ReLU, nn.Conv2d))
    assert check_export_level(qp.get_backend("tiny_conv"), fusion) == []  # the relu forms fuse there too


@pytest.fixture
def plain(fake_dist) -> None:
    fake_dist("qplug-plain", SEQUENTIAL, module="qplug_plain:plugin", entry_point="plain",
              location=TINY_CONV)


def test_fused_module_that_is_no_FusedModule_cannot_be_saved_and_is_told_why(plain, tmp_path):
    qmodel = qp.quantize(model(), batches()[0], batches(), backend="plain")
    assert qp.quantization_report(qmodel).kernels["conv1"] == "plain::conv2d_relu"
    with pytest.raises(SerializationError, match=r"cannot recover the constructor argument 'conv' of "
                                                 r"PlainConvReLU .*if it is a backend's fused module, "
                                                 r"subclass qplug_core.plugin_api.FusedModule"):
        qp.save(qmodel, tmp_path / "m.safetensors")


def test_pattern_case_of_a_fused_module_that_is_no_FusedModule_says_what_it_needs(plain):
    case = next(c for c in cases_for("plain") if case_id(c.pattern) == "PlainConvReLU")
    with pytest.raises(ConfigValidationError, match=r"cannot build a small PlainConvReLU for its pattern "
                                                    r"case: .*subclass qplug_core.plugin_api.FusedModule "
                                                    r"with CHILD_TYPES"):
        check_pattern("plain", case)
