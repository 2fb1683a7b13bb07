"""A file quantized for one backend, loaded on another: a kernel that cannot compute a region
exactly with the file's qparams is not used. fbgemm's depthwise convs sum pairs of u8 x s8
products in int16 on every CPU; a qnnpack file gives them 8-bit inputs and weights, and its
depthwise conv ran at 19.6 dB against the file's own reference form, without a word. Decisions
under overridden CPU flags, fbgemm's kernels for real on the host."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import override_cpu_flags
from tests.reliability.test_int16_pair_sums import AVX2, VNNI

pytestmark = pytest.mark.usefixtures("installed_backends")


def _depthwise() -> nn.Module:
    """Positive taps on non-negative inputs: pairs of products near the top of their range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, groups=32)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.rand_like(model[0].weight) * 0.5 + 0.5)
    return model


def _data(seed: int) -> torch.Tensor:
    return torch.rand(8, 32, 8, 8, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.fixture(scope="module")
def qnnpack_file(tmp_path_factory):
    calibration = [_data(seed) for seed in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = qp.quantize(_depthwise(), calibration[0], calibration, backend="qnnpack")
    return qp.save(quantized, tmp_path_factory.mktemp("dw") / "dw_qnnpack.qplug")


def _load(path, flags):
    with override_cpu_flags(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = qp.load(path, backend="fbgemm")
    return loaded, [str(w.message) for w in caught]


def test_a_depthwise_conv_fbgemm_would_saturate_keeps_the_reference_form(qnnpack_file):
    loaded, messages = _load(qnnpack_file, VNNI)  # VNNI: the file's 8-bit weights are kept
    (message,) = [m for m in messages if "refused" in m]
    assert message.startswith("qplug: backend 'fbgemm' runs 1 region(s) in reference form")
    assert ("node '0': kernel quantized::conv2d refused this region: fbgemm's depthwise convs add pairs "
            "of u8 x s8 products in int16") in message
    assert "input integers reach 255 and its weight integers 127: a pair can reach 64,770" in message
    report = qp.quantization_report(loaded)
    assert list(report.reference) == ["0"] and "refused this region" in report.reference["0"]
    x = _data(9)
    reference = qp.load(qnnpack_file, backend="reference")
    with torch.no_grad():
        assert torch.equal(loaded(x), reference(x))


def test_with_7_bit_weights_the_same_file_runs_fbgemm_s_depthwise_kernel(qnnpack_file):
    loaded, messages = _load(qnnpack_file, AVX2)  # int16 pairs: loaded with 7-bit weights
    assert not [m for m in messages if "refused" in m]
    assert qp.quantization_report(loaded).kernels == {"0": "quantized::conv2d"}
    x = _data(9)
    with torch.no_grad():
        expected, reference = _depthwise()(x), qp.load(qnnpack_file, backend="reference")(x)
        assert qp.sqnr(expected, loaded(x)) > qp.sqnr(expected, reference) - 7  # one bit of weights
        assert qp.sqnr(reference, loaded(x)) > 35  # not saturated pairs (19.6 dB)


@pytest.mark.parametrize("flags", [VNNI, AVX2], ids=["vnni", "avx2"])
def test_fbgemm_s_own_depthwise_conv_runs_its_kernel(flags):
    calibration = [_data(seed) for seed in range(4)]
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.simplefilter("error")
        quantized = qp.quantize(_depthwise(), calibration[0], calibration, backend="fbgemm")
    assert qp.quantization_report(quantized).kernels == {"0": "quantized::conv2d"}
    x = _data(9)
    with torch.no_grad():
        assert qp.sqnr(_depthwise()(x), quantized(x)) > 35
