"""Files of a newer qplug-core: optional features left out with a warning, required ones refused.

Every key a newer qplug-core wrote made an older one refuse the whole file, optional or not. A
writer now declares what it adds beyond format 1 in the document's ``features``
(``serialization/format_features.py``); these files are today's, with such declarations and keys
added by hand as a newer writer would add them. Files declaring none (all files written so far)
load as they did: ``test_name_table.py`` loads one written by 9ff4cea, the others here today's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from artifactkit import reference_model, rewrite

from qplug_core.cli.app import app
from qplug_core.errors import SerializationError
from qplug_core.serialization import load, save
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
    {"required": False, "since": "0.9.0", "lost": "\x1b]0;title\x07"},  # printed in a warning
    {"required": "no", "since": "0.9.0"},
    {"required": False},
])
def test_a_malformed_declaration_is_refused(saved, declaration):
    def edit(document, tensors) -> None:
        document["features"] = {"histograms": declaration}

    with pytest.raises(SerializationError, match=r"is not a valid qplug artifact: features\.histograms"):
        load(rewrite(saved, edit))
