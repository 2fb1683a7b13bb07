"""torch.ao's keywords passed to qplug's graph-mode calls get a qplug error naming qplug's way instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, UnsupportedKeywordError

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")
EXAMPLE = (torch.randn(2, 8),)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()


@pytest.mark.parametrize(("keyword", "answer"), [
    ("prepare_custom_config", "non_traceable_module_names="),
    ("backend_config", r"backend=qp\.get_backend\(name\)\.with_config\(cfg\)"),
    ("_equalization_config", 'recipe="smoothquant"'),
    ("preserved_attributes", "set the attributes on the returned model"),
])
def test_prepare_names_qplugs_way_for_a_torch_ao_keyword(keyword, answer):
    with pytest.raises(UnsupportedKeywordError, match=rf"prepare_fx\(\) takes no {keyword}= \(a torch\.ao keyword\): .*{answer}"):
        qp.prepare_fx(_model(), None, EXAMPLE, backend="reference", **{keyword: object()})


@pytest.mark.parametrize(("keyword", "answer"), [
    ("convert_custom_config", "drop it"),
    ("is_reference", r"qp\.convert_to_reference_fx\(observed\)"),
    ("qconfig_mapping", r"the mapping given to qp\.prepare_fx"),
    ("backend_config", "with_config"),
])
def test_convert_names_qplugs_way_for_a_torch_ao_keyword(keyword, answer):
    observed = qp.calibrate(qp.prepare_fx(_model(), None, EXAMPLE, backend="reference"), [EXAMPLE])
    with pytest.raises(UnsupportedKeywordError, match=rf"convert_fx\(\) takes no {keyword}=.*{answer}") as caught:
        qp.convert_fx(observed, **{keyword: True})
    assert isinstance(caught.value, ConfigValidationError) and isinstance(caught.value, TypeError)
