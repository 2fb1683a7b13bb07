"""The route to a phone the qnnpack docs give (docs/guide/export.md, "Deploying to mobile"):
``torch.jit.trace`` of the int8 model, saved for PyTorch's lite interpreter, answers as the model
once loaded under the qnnpack engine, without qplug in the loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.jit.mobile import _load_for_lite_interpreter

import qplug_core as qp
from qplug_core.plugin_api import engine_context


@pytest.mark.slow  # the process's first torch.jit.trace takes ~4 s; the test itself ~0.5 s
def test_a_traced_qnnpack_cnn_saved_for_the_lite_interpreter_answers_as_the_model(qplug_only, tmp_path):
    qplug_only("qplug-qnnpack")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardswish(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    calibration = [(torch.randn(2, 3, 16, 16),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86; TracerWarnings of qplug's input checks
        int8 = qp.quantize(model, calibration[0], calibration, backend="qnnpack", progress=False)
        traced = torch.jit.trace(int8, calibration[0])
    traced._save_for_lite_interpreter(str(tmp_path / "m.ptl"))
    x = torch.randn(3, 3, 16, 16)
    with engine_context("qnnpack"):  # as on a phone: the file packs its weights for the engine it loads under
        lite = _load_for_lite_interpreter(str(tmp_path / "m.ptl"))
        assert torch.equal(lite(x), int8(x))


@pytest.mark.slow  # two torch.export runs: ~2-4 s on the shared machine
def test_export_program_of_a_qnnpack_model_says_xnnpack_would_not_delegate_it(qplug_only):
    """uint8 activations with per-channel weights: XNNPACK's per-channel kernels take int8 activations
    only. fbgemm's program of the same layout is Inductor's, and says nothing."""
    qplug_only("qplug-qnnpack", "qplug-fbgemm")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), (torch.randn(1, 3, 8, 8),)
    said = {}
    for backend in ("qnnpack", "fbgemm"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qp.export_program(qp.quantize(model, x, [x], backend=backend, progress=False), x, ops="qplug")
        said[backend] = [str(w.message) for w in caught if "XNNPACK" in str(w.message)]
    assert len(said["qnnpack"]) == 1 and said["fbgemm"] == []
    assert "uint8 activations with per-channel int8 weights (1 layer(s))" in said["qnnpack"][0]
