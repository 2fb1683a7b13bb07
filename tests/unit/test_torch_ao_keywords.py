"""torch.ao's keywords passed to qplug's graph-mode calls: taken at torch.ao's defaults, refused with
qplug's way for any other value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, UnsupportedKeywordError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")
EXAMPLE = (torch.randn(2, 8),)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()


def _observed() -> torch.fx.GraphModule:
    return qp.calibrate(qp.prepare_fx(_model(), None, EXAMPLE, backend="reference"), [EXAMPLE])


@pytest.mark.parametrize(("keyword", "answer"), [
    ("prepare_custom_config", "non_traceable_module_names="),
    ("backend_config", r"backend=qp\.get_backend\(name\)\.with_config\(cfg\)"),
    ("_equalization_config", 'recipe="smoothquant"'),
])
def test_prepare_names_qplugs_way_for_a_torch_ao_keyword(keyword, answer):
    with pytest.raises(UnsupportedKeywordError, match=rf"prepare_fx\(\) takes no {keyword}= \(a torch\.ao keyword\): .*{answer}"):
        qp.prepare_fx(_model(), None, EXAMPLE, backend="reference", **{keyword: object()})


@pytest.mark.parametrize(("keyword", "value", "answer"), [
    ("convert_custom_config", True, "drop it"),
    ("is_reference", True, r"qp\.convert_to_reference_fx\(observed\)"),
    ("qconfig_mapping", True, r"the mapping given to qp\.prepare_fx"),
    ("backend_config", True, "with_config"),
    ("_remove_qconfig", False, r"no qconfig attribute.*qp\.quantization_report"),
    ("keep_original_weights", True, "keeps no float weights"),
])
def test_convert_names_qplugs_way_for_a_torch_ao_keyword(keyword, value, answer):
    with pytest.raises(UnsupportedKeywordError, match=rf"convert_fx\(\) takes no {keyword}=.*{answer}") as caught:
        qp.convert_fx(_observed(), **{keyword: value})
    assert isinstance(caught.value, ConfigValidationError) and isinstance(caught.value, TypeError)


@pytest.mark.parametrize("config", [
    {"non_traceable_module_name": ["0"]},
    {"preserved_attributes": ["labels"], "input_quantized_idxs": [0]},
], ids=["other setting", "preserved and another"])
def test_a_custom_config_setting_more_than_preserved_attributes_is_refused(config):
    with pytest.raises(UnsupportedKeywordError, match=r"prepare_custom_config= .*non_traceable_module_names="):
        qp.prepare_fx(_model(), None, EXAMPLE, backend="reference", prepare_custom_config=config)


def test_torch_ao_keywords_at_their_defaults_change_nothing():
    """torch.ao's defaults written out (is_reference=False, _remove_qconfig=True, ...) are taken."""
    expected = qp.convert_fx(_observed())(*EXAMPLE)
    observed = qp.calibrate(qp.prepare_fx(_model(), None, EXAMPLE, backend="reference", backend_config=None,
                                          _equalization_config=None, prepare_custom_config={}), [EXAMPLE])
    assert not hasattr(observed, "meta") or "_user_preserved_attributes" not in observed.meta
    converted = qp.convert_fx(observed, convert_custom_config=None, _remove_qconfig=True,
                              qconfig_mapping=None, backend_config=None, is_reference=False,
                              keep_original_weights=False)
    assert torch.equal(converted(*EXAMPLE), expected)
    reference = qp.convert_to_reference_fx(observed, is_reference=True, _remove_qconfig=True)
    assert torch.equal(reference(*EXAMPLE), qp.convert_to_reference_fx(observed)(*EXAMPLE))
    with pytest.raises(UnsupportedKeywordError, match=r"convert_to_reference_fx\(\) takes no is_reference="):
        qp.convert_to_reference_fx(observed, is_reference=False)
