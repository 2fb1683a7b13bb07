"""Row 32, int32 bias overflow, end to end: a pruned output channel that keeps its bias, and a bias
of -1e5 on an ordinary channel, give the float answer on every backend and in the exported ONNX
file (``kernels/int32_bias.py``), with a warning naming the layer whose weight scales were raised.

Before the fix the int32 bias (scale input scale x weight scale) wrapped: the pruned channel gave
-7.28 instead of 10 on onnxruntime and openvino (-2.50 from the ONNX file), the -1e5 channel
+-59940, and qnnpack's fitted bias left no room for the dot product (+99560 instead of -1e5).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.kernels.reference import Dequantize, ReferenceWeighted
from qplug_core.observers import PerChannelMinMaxObserver
from qplug_core.onnx_export.weights import DequantizedWeights
from qplug_core.qparams import fake_quantize

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")  # tests/conftest.py
pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

BACKENDS = ("fbgemm", "qnnpack", "onnxruntime", "openvino")


def _linear(case: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256)).eval()
    with torch.no_grad():
        if case == "pruned":
            model[0].weight[0].zero_()
            model[0].bias[0] = 10.0
        else:
            model[0].bias[0], model[0].bias[1] = 1e5, -1e5
    return model


def _data():
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(2, 64, generator=g),)
    return example, [torch.randn(16, 64, generator=g) for _ in range(4)], torch.randn(8, 64, generator=g)


def _quantized(model: nn.Module, backend: str) -> tuple[nn.Module, list[str]]:
    example, calibration, _ = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping(backend), example, backend=backend)
        qp.calibrate(observed, calibration)
        lowered = qp.convert_fx(observed)
    return lowered, [str(w.message) for w in caught]


def _steps(got: torch.Tensor, want: torch.Tensor, channels: slice) -> float:
    """The largest difference on ``channels``, in 8-bit steps of the float output's range."""
    step = float(want.max() - want.min()) / 255
    return float((got[:, channels] - want[:, channels]).abs().max()) / step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["pruned", "big-bias"])
def test_a_bias_int32_cannot_hold_gives_the_float_answer_on_every_backend(case, backend):
    model = _linear(case)
    lowered, messages = _quantized(model, backend)
    x = _data()[2]
    with torch.no_grad():
        want, got = model(x), lowered(x)
    channels = slice(0, 1) if case == "pruned" else slice(0, 2)
    assert torch.equal(torch.sign(got[:, channels]), torch.sign(want[:, channels]))
    assert _steps(got, want, channels) < 3
    if case == "pruned":  # 9.994 (fbgemm, qnnpack's per-tensor weights) or 10.0, was -7.28
        assert got[:, 0].sub(10.0).abs().max() < 0.05
    raised = [m for m in messages if "int32 bias would overflow" in m]
    if backend != "qnnpack" or case == "big-bias":  # qnnpack's per-tensor weight scale holds 10.0
        assert raised and raised[0].startswith("qplug: layer '0': ") and "raised the weight scale" in raised[0]
    assert not [m for m in messages if "broke the kernel contract" in m]
    assert qp.quantization_report(lowered).kernels["0"] != "reference"


def _onnx_output(model: nn.Module, x: torch.Tensor, tmp_path) -> np.ndarray:
    import onnxruntime as ort

    path = str(tmp_path / "model.onnx")
    qp.export_onnx(model, path, (x,))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def test_the_exported_onnx_file_gives_the_float_answer(tmp_path):
    model = _linear("pruned")
    lowered, _ = _quantized(model, "fbgemm")
    x = _data()[2]
    out = _onnx_output(lowered, x, tmp_path)
    assert np.abs(out[:, 0] - 10.0).max() < 0.05  # was -2.50
    assert _steps(torch.from_numpy(out), model(x).detach(), slice(0, None)) < 3


def test_an_unfitted_layer_is_exported_with_its_bias_in_float():
    """A reference form whose weight scales were not fitted (built before the fix): the export keeps
    the bias float instead of writing one that wraps; a fitted layer's bias is int32."""
    model = _linear("pruned")
    example, calibration, x = _data()
    observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping("onnxruntime"), example, backend="onnxruntime")
    qp.calibrate(observed, calibration)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = qp.convert_to_reference_fx(observed)
    layer = reference.get_submodule("0")
    input_qparams = next(m for m in reference.modules() if isinstance(m, Dequantize)).qparams
    assert hasattr(DequantizedWeights(layer, input_qparams), "qbias")
    observer = PerChannelMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    observer(model[0].weight.detach())
    unfitted = ReferenceWeighted(model[0], observer.qparams())  # channel 0's scale: eps
    exported = DequantizedWeights(unfitted, input_qparams)
    assert not hasattr(exported, "qbias")
    dequantized_input = fake_quantize(x, input_qparams)
    with torch.no_grad():
        assert exported(dequantized_input)[:, 0].sub(10.0).abs().max() < 1e-4

