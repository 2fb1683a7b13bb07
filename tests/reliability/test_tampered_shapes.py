"""Loading never runs the model on sizes the file records (issue 25, issue 27 finding 1).

``qp.load`` used to build the ORT sessions by running the graph on zeros of the input shape the
file records: a 6.7 KB file recording [16777216, 8] took 83 s and 3.4 GB. Now partitions compile at
their first call, on the caller's inputs, so a tampered shape costs nothing at load (here one no
machine could allocate), and ``qp.export_onnx``, which needs example inputs, bounds the recorded
ones before allocating them.
"""

from __future__ import annotations

import pytest
import torch
from artifactkit import rewrite

import qplug_core as qp

pytestmark = [pytest.mark.usefixtures("one_thread", "plugin_autoload"), pytest.mark.slow]  # ~30 s

#: 2**40 float32 elements: 4 TiB, which no test machine can allocate
IMPOSSIBLE = [2**20, 2**20]


def _images(seed: int) -> tuple[torch.Tensor]:
    return qp.zoo.example_inputs("digits_cnn", seed=seed)


@pytest.fixture(scope="module")
def digits():
    with qp.testing.all_plugins_loaded():
        calibration = [_images(seed) for seed in range(2)]
        return qp.quantize(qp.zoo.get_model("digits_cnn", seed=0), calibration[0], calibration,
                           backend="onnxruntime")


def _partitions(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "OrtPartition"]


def _tamper_input_shape(document, tensors) -> None:
    (placeholder,) = [n for n in document["model"]["graph"] if n["op"] == "placeholder"]
    placeholder["meta"]["qplug_input_spec"]["shape"] = IMPOSSIBLE


def test_a_tampered_recorded_shape_costs_nothing_at_load(digits, tmp_path):
    path = qp.save(digits, tmp_path / "digits.safetensors")
    tampered = rewrite(path, _tamper_input_shape)
    loaded = qp.load(tampered)  # allocating the recorded shape would raise or be killed here
    assert not _partitions(loaded)
    x = _images(3)
    with torch.no_grad():
        assert torch.equal(loaded(*x), digits(*x))  # compiled now, for the caller's shape


def test_export_refuses_recorded_shapes_beyond_the_bound_and_takes_given_inputs(digits, tmp_path):
    tampered = qp.load(rewrite(qp.save(digits, tmp_path / "digits.safetensors"), _tamper_input_shape))
    with pytest.raises(qp.errors.ExportError, match=r"recorded example input shapes .* need 4,398,046,511,104 bytes, "
                                          r"more than the 67,108,864 bytes allowed .* pass example_inputs="):
        qp.export_onnx(tampered, tmp_path / "refused.onnx")
    assert not (tmp_path / "refused.onnx").exists()
    written = qp.export_onnx(tampered, tmp_path / "given.onnx", example_inputs=_images(0))
    assert written.stat().st_size > 0
