"""Files of a newer qplug-core: optional features left out with a warning, required ones refused.

Every key a newer qplug-core wrote made an older one refuse the whole file, optional or not. A
writer now declares what it adds beyond format 1 in the document's ``features``
(``serialization/format_features.py``); these files are today's, with such declarations and keys
added by hand as a newer writer would add them. Files declaring none (all files written so far)
load as they did: ``test_name_table.py`` loads one written by 9ff4cea, the last test here a
delegated one written by 6e4e0d1 (the format as it stood when the rule came).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from artifactkit import reference_model, rewrite
from safetensors.torch import load_file

from qplug_core import zoo
from qplug_core.cli.app import app
from qplug_core.errors import SerializationError
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.serialization import format_features, load, save
from qplug_core.serialization.format_features import Feature

X = torch.randn(2, 4)
LOST = "each layer's calibration histogram: qplug report shows no ranges"


@pytest.fixture
def saved(tmp_path):
    return save(reference_model(), tmp_path / "model.safetensors")


def _with_feature(name: str, feature: Feature, keys: dict | None = None, tensors: dict | None = None):
    """An edit adding ``feature``'s declaration, ``keys`` to the model and ``tensors`` to the file."""
    def edit(document, file_tensors) -> None:
        document["versions"]["qplug-core"] = "0.9.0"
        document.setdefault("features", {})[name] = feature.to_document()
        document["model"].update(keys or {})
        for key, tensor in (tensors or {}).items():
            file_tensors[key] = tensor
            document["model"]["tensors"][key] = {"dtype": str(tensor.dtype), "shape": list(tensor.shape)}
    return edit


HISTOGRAMS = Feature(required=False, since="0.9.0", keys=("model.histograms",), tensors=("histograms/",), lost=LOST)
HISTOGRAM_EDIT = _with_feature("histograms", HISTOGRAMS, {"histograms": {"fc": "histograms/fc"}},
                               {"histograms/fc": torch.ones(16)})


def test_an_unknown_optional_feature_is_left_out_with_a_warning_naming_it_and_the_loss(saved):
    with pytest.warns(UserWarning, match=r"written by qplug-core 0\.9\.0 with file-format features this qplug-core "
                                         rf".* does not know; it loads without them: histograms \(since 0\.9\.0\): "
                                         rf"{LOST}\. Upgrade qplug-core to 0\.9\.0 or later"):
        loaded = load(rewrite(saved, HISTOGRAM_EDIT))
    assert torch.equal(loaded(X), reference_model()(X))


def test_the_same_key_undeclared_is_still_refused(saved):
    """Only a declared feature's keys are left out: an unknown key is a typo or a tampered file."""
    def undeclared(document, tensors) -> None:
        document["model"]["histograms"] = {}

    with pytest.raises(SerializationError, match="unknown key 'histograms'"):
        load(rewrite(saved, undeclared))


def test_a_loaded_file_saved_again_holds_what_this_qplug_reads(saved, tmp_path):
    with pytest.warns(UserWarning, match="loads without them"):
        loaded = load(rewrite(saved, HISTOGRAM_EDIT))
    again = save(loaded, tmp_path / "again.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(load(again)(X), reference_model()(X))


def test_an_unknown_required_feature_is_refused_naming_it_and_the_version_to_install(saved):
    edit = _with_feature("int4_activations", Feature(required=True, since="0.8.0"), {"int4_activations": ["fc"]})
    with pytest.raises(SerializationError, match=r"needs file-format features this qplug-core .* does not read: "
                                                 r"'int4_activations' \(since qplug-core 0\.8\.0\); it was written by "
                                                 r"qplug-core 0\.9\.0\. Upgrade: pip install 'qplug-core>=0\.8\.0'"):
        load(rewrite(saved, edit))


def test_qplug_report_describes_a_file_with_an_unknown_optional_feature(saved):
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["report", str(rewrite(saved, HISTOGRAM_EDIT)), "--json"])
    assert result.exit_code == 0, result.output
    assert '"backend": "reference"' in result.stdout


@pytest.mark.parametrize("declaration", [
    {"required": False, "since": "0.9.0", "keys": ["format"]},  # the rule's own keys
    {"required": False, "since": "0.9.0", "keys": ["model.*"]},  # a path ends in a name
    {"required": False, "since": "0.9.0", "keys": ["*.*.x"]},  # and starts with one (top-level keys are a fixed list)
    {"required": False, "since": "0.9.0", "lost": "\x1b]0;title\x07"},  # printed in a warning
    {"required": "no", "since": "0.9.0"},
    {"required": False},
])
def test_a_malformed_declaration_is_refused(saved, declaration):
    def edit(document, tensors) -> None:
        document["features"] = {"histograms": declaration}

    with pytest.raises(SerializationError, match=r"is not a valid qplug artifact: features\.histograms"):
        load(rewrite(saved, edit))


def _hostile(document, tensors) -> None:
    """64 optional features x 64 paths of 16 segments over 4,000 junk nodes (refused by the strict
    reader): a document of under 10,000 nodes (4,400 in the declarations), which one walk per path
    would visit 4096 times."""
    document["features"] = {f"f{i}": {"required": False, "since": "0.9.0",
                                      "keys": ["model." + "*." * 14 + f"x{j}" for j in range(64)]} for i in range(64)}
    document["model"]["junk"] = [[0]] * 2000


@pytest.fixture
def visits(monkeypatch):
    """The number of document nodes the removal of declared keys looks into."""
    seen = [0]
    entries = format_features._entries

    def counted(node, segment):
        seen[0] += 1
        return entries(node, segment)

    monkeypatch.setattr(format_features, "_entries", counted)
    return seen


def test_a_file_declaring_many_star_paths_is_refused_within_a_few_visits_per_node(saved, visits):
    with pytest.raises(SerializationError, match=r"is not a valid qplug artifact: features: the declared keys' paths "
                                                 r"visit more than 2 nodes per node of the document"):
        load(rewrite(saved, _hostile))
    assert 0 < visits[0] <= 2 * 10_000


def test_qplug_report_refuses_the_same_file_within_the_same_budget(saved, visits):
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["report", str(rewrite(saved, _hostile))])
    assert result.exit_code != 0
    assert "visit more than 2 nodes per node of the document" in result.output
    assert 0 < visits[0] <= 2 * 10_000


DATA = Path(__file__).parent / "data"


@pytest.fixture
def delegated(tmp_path, monkeypatch, one_thread, plugin_autoload):
    """The digits CNN on onnxruntime, saved by main at 6e4e0d1 after calls at batch 2 and 1 (a
    copy): two stored models holding the reference form's weights by name (``shared``) and the
    runtime that checked them (``runtime``), no ``features``; torch.onnx.export refused."""
    pytest.importorskip("qplug_onnxruntime")
    if not cpu_int8().vnni:
        pytest.skip("its stored models were exported on a CPU with VNNI: not used here (test_load_on_another_cpu.py)")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.onnx.export was called")

    monkeypatch.setattr(torch.onnx, "export", refuse)
    return Path(shutil.copy(DATA / "digits_cnn_onnxruntime_written_by_6e4e0d1.safetensors", tmp_path))


def _answers_as_saved(loaded) -> None:
    with torch.no_grad():
        output = loaded(*zoo.example_inputs("digits_cnn", batch=4, seed=9))
    assert torch.equal(output, load_file(DATA / "digits_cnn_onnxruntime_written_by_6e4e0d1.expected.safetensors")["output"])


def test_a_delegated_file_written_by_6e4e0d1_builds_its_stored_models_and_answers_as_saved(delegated):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _answers_as_saved(load(delegated))


def test_an_unknown_optional_key_inside_each_stored_model_is_left_out(delegated):
    """A feature adding a key to every stored model (``*`` paths): the models are built as before."""
    feature = Feature(required=False, since="0.9.0", keys=("model.partition_models.*.models.*.checksum",),
                      lost="the stored models' checksums: they are not checked before they are built")

    def edit(document, tensors) -> None:
        _with_feature("model_checksums", feature)(document, tensors)
        for entry in document["model"]["partition_models"].values():
            for stored in entry["models"]:
                stored["checksum"] = "sha256:00"

    with pytest.warns(UserWarning, match="model_checksums \\(since 0.9.0\\): the stored models' checksums"):
        loaded = load(rewrite(delegated, edit))
    _answers_as_saved(loaded)
