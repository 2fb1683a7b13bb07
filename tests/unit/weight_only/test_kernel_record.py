"""``qp.save`` records each weight-only linear's kernel and ``qp.load`` runs it again, so that every
process loading one file answers alike (kernels are chosen by timing and round differently)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import SerializationError
from qplug_core.kernels.weight_only import TorchInt8Kernel
from qplug_core.serialization.files import read_artifact_file, write_artifact_file

pytestmark = pytest.mark.usefixtures("one_thread")
X = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32)).eval()


def saved(tmp_path: Path, kernel: str) -> tuple[Path, torch.Tensor]:
    qmodel = qp.quantize_weights(model(), bits=8, kernel=kernel)
    with torch.no_grad():
        return qp.save(qmodel, tmp_path / "wo8.safetensors"), qmodel(X)


def edit_layers(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the file's layer entries as an older or a damaged qplug would have written them."""
    text, tensors = read_artifact_file(path)
    document = json.loads(text)
    for layer in document["layers"]:
        edit(layer)
    write_artifact_file(path, json.dumps(document), tensors)


def loaded(path: Path, **kwargs) -> tuple[nn.Module, torch.Tensor]:
    qmodel = qp.load(path, model=model(), **kwargs)
    with torch.no_grad():
        return qmodel, qmodel(X)


def test_the_recorded_kernel_is_used_and_answers_bit_identically(tmp_path, recwarn):
    path, expected = saved(tmp_path, "reference")
    for _ in range(2):  # no race: a fresh timing would mostly pick torch-int8pack here
        qmodel, y = loaded(path)
        assert qmodel.qplug_weight_only.kernels == {"0": "reference", "2": "reference"}
        assert torch.equal(y, expected)
    assert not [w for w in recwarn if "kernel recorded" in str(w.message)]


def test_a_recorded_kernel_that_cannot_run_here_is_measured_again_with_a_warning(tmp_path, monkeypatch):
    path, expected = saved(tmp_path, "torch-int8pack")
    assert torch.equal(loaded(path)[1], expected)
    monkeypatch.setattr(TorchInt8Kernel, "supports", lambda self, scheme, shape, dtype: "not on this CPU")
    with pytest.warns(UserWarning, match=r"2 weight-only layer\(s\) do not run the kernel recorded .*0, 2: kernel "
                                         r"'torch-int8pack' does not run here: not on this CPU"):
        qmodel, y = loaded(path)
    assert qmodel.qplug_weight_only.kernels == {"0": "reference", "2": "reference"}
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)


def test_a_recorded_row_split_is_rebuilt_and_reselect_measures_again(tmp_path):
    path, _ = saved(tmp_path, "torch-int8pack")
    edit_layers(path, lambda layer: layer["kernel"].update(max_rows=4))
    assert set(loaded(path)[0].qplug_weight_only.kernels.values()) == {"torch-int8pack (up to 4 rows; reference above)"}
    edit_layers(path, lambda layer: layer["kernel"].update(name="vendor-gone"))
    with pytest.warns(UserWarning, match="kernel 'vendor-gone' is not installed here"):
        loaded(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured again on purpose: nothing to warn about
        assert "vendor-gone" not in str(loaded(path, reselect=True)[0].qplug_weight_only.kernels)


def test_files_without_the_record_load_and_a_damaged_record_is_refused(tmp_path):
    path, expected = saved(tmp_path, "reference")
    edit_layers(path, lambda layer: layer.pop("kernel"))
    torch.testing.assert_close(loaded(path)[1], expected, rtol=1e-4, atol=1e-4)  # measured, as before the record
    edit_layers(path, lambda layer: layer.update(kernel={"name": "reference", "max_rows": 0}))
    with pytest.raises(SerializationError, match="0 rows is not a positive count"):
        loaded(path)
