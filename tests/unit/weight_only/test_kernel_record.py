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
from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags
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


VNNI = "avx2 fma avx512f avx512bw avx512_vnni"
AVX2 = "avx2 fma"


def other_cpu_warnings(path: Path, flags: str, **kwargs) -> list[str]:
    with override_cpu_flags(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded(path, **kwargs)
    return [str(w.message) for w in caught if "weight-only kernels were chosen on" in str(w.message)]


def test_loading_where_the_cpu_has_other_int8_capabilities_warns_once(tmp_path):
    """Outputs are identical across loads on one kind of CPU only, and nothing said so when the
    recorded kernels ran on another kind."""
    with override_cpu_flags(VNNI):
        path, _ = saved(tmp_path, "reference")
    document = json.loads(read_artifact_file(path)[0])
    assert document["kernel_cpu"] == {"machine": cpu_int8().machine, "int8": ["avx2", "avx512", "vnni"]}
    machine = cpu_int8().machine
    assert other_cpu_warnings(path, AVX2) == [  # one for the file, not one per layer
        f"qplug: {path}: its weight-only kernels were chosen on {machine} with AVX2 + AVX-512 + VNNI, running "
        f"on {machine} with AVX2; a kernel may take another code path on another kind of CPU, so outputs may "
        "differ slightly from the saving process's (they are identical across loads on one kind of CPU only), "
        "and the recorded kernels may not be the fastest here: qp.load(..., reselect=True) measures them "
        "again for this CPU"]
    assert other_cpu_warnings(path, VNNI) == []
    assert other_cpu_warnings(path, AVX2, reselect=True) == []  # measured here: nothing recorded runs


def test_a_reloaded_file_keeps_the_cpu_its_kernels_were_chosen_on(tmp_path):
    with override_cpu_flags(VNNI):
        path, _ = saved(tmp_path, "reference")
    with override_cpu_flags(AVX2), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said above
        again = qp.save(loaded(path)[0], tmp_path / "again.safetensors")
        measured = qp.save(loaded(path, reselect=True)[0], tmp_path / "measured.safetensors")
    assert again.read_bytes() == path.read_bytes()
    assert json.loads(read_artifact_file(measured)[0])["kernel_cpu"]["int8"] == ["avx2"]
    text, tensors = read_artifact_file(path)
    write_artifact_file(path, json.dumps({**json.loads(text), "kernel_cpu": {"machine": "x86_64",
                                                                             "int8": ["sse"]}}), tensors)
    with pytest.raises(SerializationError, match=r"kernel_cpu\.int8: 'sse' is not one of avx2"):
        loaded(path)
