"""``BackendPlugin``: one instance, hooks answering only for its backend, defaults for the common case."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import BackendPlugin, ConfigValidationError, QplugPluginWarning

MACHINE = platform.machine().lower()

SOURCE = f'''
from qplug_core.plugin_api import BackendPlugin

class Npu(BackendPlugin):
    name = "npu"
    description = "the reference patterns under another name, preferred here"
    preferred_machines = ({MACHINE!r},)

plugin = Npu()
'''


def test_hooks_answer_only_for_the_plugins_backend(fake_dist):
    fake_dist("qplug-npu", SOURCE, module="qplug_npu_plugin:plugin", entry_point="npu")
    infos = {i.name: i for i in qp.list_backends()}
    info = infos["npu"]  # the base class's defaults: the reference backend's patterns, no kernels
    assert (info.status, info.n_pattern_configs, info.n_kernels) == ("ok", infos["reference"].n_pattern_configs, 0)
    assert info.n_pattern_configs > 200
    reference = qp.get_backend("reference")
    assert [r.name for r in reference.contributors] == ["reference"]  # nothing added to others


def test_preferred_machine_makes_it_the_default_backend(fake_dist, capsys):
    fake_dist("qplug-npu", SOURCE, module="qplug_npu_plugin:plugin", entry_point="npu")
    assert qp.get_backend().name == "npu"
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    qp.quantize(model, torch.randn(2, 4), [torch.randn(2, 4)], progress=False)
    assert "using backend 'npu'" in capsys.readouterr().err


def test_defaults_give_qconfig_mappings_for_every_mode(fake_dist):
    fake_dist("qplug-npu", SOURCE, module="qplug_npu_plugin:plugin", entry_point="npu")
    for mode in ("static", "qat", "dynamic"):
        assert qp.get_default_qconfig_mapping("npu", mode).to_dict() \
            == qp.get_default_qconfig_mapping("reference", mode).to_dict()


def test_entry_point_naming_the_module_instead_of_the_object_is_broken_with_a_hint(fake_dist):
    fake_dist("qplug-npu", SOURCE, module="qplug_npu_plugin", entry_point="npu")
    with pytest.warns(QplugPluginWarning, match="implements no qplug hook.*module:object"):
        names = [i.name for i in qp.list_backends()]
    assert "npu" not in names


def test_a_subclass_must_name_its_backend():
    with pytest.raises(ConfigValidationError, match="must set the class attribute name"):
        type("Nameless", (BackendPlugin,), {})
