"""``qp.load(qp.save(m))`` answers exactly as ``m`` on every zoo model, for every in-tree backend
with per-op kernels and the reference form (issue 25; onnxruntime's twin is in its plugin's
tests/test_ort_parity.py). The file records what ran on kernels and what stayed in reference form,
and load rebuilds exactly that: outputs bit-identical, the same kernels in the report."""

from __future__ import annotations

import warnings

import pytest
import torch

import qplug_core as qp

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]

BACKENDS = ("reference", "fbgemm", "qnnpack")
IMAGE_MODELS = ("resnet18", "resnet50", "mobilenet_v2")


def _inputs(name: str, seed: int) -> tuple[torch.Tensor, ...]:
    if name in IMAGE_MODELS:  # small images: the same graph, a tenth of the time
        return (torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)
    return qp.zoo.example_inputs(name, seed=seed)


@pytest.mark.parametrize("name", qp.zoo.list_models())
@pytest.mark.parametrize("backend", BACKENDS)
def test_loaded_model_answers_bit_identically(backend, name, tmp_path):
    calibration = [_inputs(name, seed) for seed in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recurrent layers stay float under static defaults
        qmodel = qp.quantize(qp.zoo.get_model(name, seed=0), calibration[0], calibration, backend=backend,
                             allow_float=True)
    loaded = qp.load(qp.save(qmodel, tmp_path / f"{name}.safetensors"))
    saved_report, loaded_report = qp.quantization_report(qmodel), qp.quantization_report(loaded)
    assert (loaded_report.kernels, loaded_report.reference) == (saved_report.kernels, saved_report.reference)
    with torch.no_grad():
        for seed in (7, 8):
            x = _inputs(name, seed)
            assert torch.equal(loaded(*x), qmodel(*x))
