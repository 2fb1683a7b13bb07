"""preserved_attributes: the attributes forward() does not use survive prepare and convert as in torch.ao."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")
EXAMPLE = (torch.randn(2, 8),)
NAMES = ("labels", "extra", "version", "threshold")  # what the oracle test looks for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 4), nn.Linear(2, 2)  # extra: a module forward() does not call
        self.labels, self.threshold = ["cat", "dog", "eel", "fox"], 0.5

    def forward(self, x):
        return self.fc(x)


def _kept(model: nn.Module) -> dict:
    return {name: getattr(model, name) for name in NAMES if hasattr(model, name)}


def _torch_ao(prepare_config, convert_config) -> tuple[dict, dict]:
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    ao = pytest.importorskip("torch.ao.quantization")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation
        observed = quantize_fx.prepare_fx(Net().eval(), ao.get_default_qconfig_mapping("fbgemm"), EXAMPLE,
                                          prepare_custom_config=prepare_config)
        observed(*EXAMPLE)
        observed.version = 2  # set after prepare, kept by convert's config
        return _kept(observed), _kept(quantize_fx.convert_fx(observed, convert_custom_config=convert_config))


@pytest.mark.parametrize("form", ["config objects", "dicts"])
def test_the_attributes_torch_ao_keeps_are_kept(form):
    names_at_prepare, names_at_convert = ["labels", "extra"], ["labels", "extra", "version"]
    if form == "dicts":
        prepare_config = {"preserved_attributes": names_at_prepare}
        convert_config = {"preserved_attributes": names_at_convert}
    else:
        custom_config = pytest.importorskip("torch.ao.quantization.fx.custom_config")
        prepare_config = custom_config.PrepareCustomConfig().set_preserved_attributes(names_at_prepare)
        convert_config = custom_config.ConvertCustomConfig().set_preserved_attributes(names_at_convert)
    ao_observed, ao_converted = _torch_ao(prepare_config, convert_config)

    observed = qp.prepare_fx(Net().eval(), None, EXAMPLE, backend="fbgemm", prepare_custom_config=prepare_config)
    qp.calibrate(observed, [EXAMPLE])
    observed.version = 2
    converted = qp.convert_fx(observed, convert_custom_config=convert_config)
    for ours, theirs in ((_kept(observed), ao_observed), (_kept(converted), ao_converted)):
        assert ours.keys() == theirs.keys()
        assert ours["labels"] == theirs["labels"] and str(ours["extra"]) == str(theirs["extra"])
    assert converted.version == ao_converted["version"] == 2
    assert qp.quantization_report(converted).quantized  # the int8 model itself is unchanged by them


def test_kept_attributes_follow_the_model_through_convert_and_copies():
    """Beyond torch.ao (whose convert keeps only what its own config names): qplug's convert and
    qp.quantize keep what prepare kept; the user's model is not shared where it could change."""
    model = Net().eval()
    observed = qp.calibrate(qp.prepare_fx(model, None, EXAMPLE, backend="fbgemm",
                                          preserved_attributes=["labels", "extra"]), [EXAMPLE])
    observed.labels = ["ant"]  # changed after prepare: convert reads the observed model's
    converted = qp.convert_fx(observed)
    assert converted.labels == ["ant"] and copy.deepcopy(converted).labels == ["ant"]
    assert observed.extra is not model.extra and torch.equal(observed.extra.weight, model.extra.weight)
    quantized = qp.quantize(model, EXAMPLE, [EXAMPLE], backend="fbgemm", preserved_attributes=["threshold"])
    assert quantized.threshold == 0.5


def test_a_missing_name_warns_and_one_forward_uses_is_refused():
    with pytest.warns(UserWarning, match=r"qplug: preserved_attributes names 'labls', which this Net does "
                                         r"not have \(did you mean 'labels'\?\)"):
        qp.prepare_fx(Net().eval(), None, EXAMPLE, backend="fbgemm", preserved_attributes=["labls"])
    with pytest.raises(ConfigValidationError, match=r"preserved_attributes names 'fc', which the captured "
                                                    r"GraphModule has as its own \(Linear\)"):
        qp.prepare_fx(Net().eval(), None, EXAMPLE, backend="fbgemm", preserved_attributes=["fc"])
    with pytest.raises(ConfigValidationError, match=r"must be a list of attribute names"):
        qp.prepare_fx(Net().eval(), None, EXAMPLE, backend="fbgemm", preserved_attributes="labels")


def test_save_says_the_kept_attributes_are_not_written(tmp_path):
    observed = qp.prepare_fx(Net().eval(), None, EXAMPLE, backend="reference", preserved_attributes=["labels"])
    converted = qp.convert_fx(qp.calibrate(observed, [EXAMPLE]))
    with pytest.warns(UserWarning, match=r"qplug: qp.save writes the quantized model, not the attributes.*"
                                         r"\(labels\): set them again"):
        qp.save(converted, tmp_path / "m.safetensors")
    assert not hasattr(qp.load(tmp_path / "m.safetensors"), "labels")
