"""Row 39: plugin passes must not edit each other's annotations, nor qplug's own."""

from __future__ import annotations

import dataclasses

import pytest
from faultkit import conv_net, images

import qplug_core as qp
from qplug_core.errors import PluginContractError
from qplug_core.flows.tags import REGION
from qplug_core.registry.hookspecs import hookimpl

X = images(1)[0]


class Tagger:
    """Well-behaved: marks conv nodes under its own key after prepare."""

    @hookimpl
    def qplug_passes(self, stage, backend):
        def tag(gm):
            for node in gm.graph.nodes:
                if node.op == "call_module" and "conv" in node.target:
                    node.meta["tagger.hint"] = "fast-path"
        return [tag] if stage == "post_prepare" else []


class Meddler:
    """Rewrites the tagger's annotation before convert."""

    @hookimpl
    def qplug_passes(self, stage, backend):
        def overwrite(gm):
            for node in gm.graph.nodes:
                if "tagger.hint" in node.meta:
                    node.meta["tagger.hint"] = "slow-path"
        return [overwrite] if stage == "pre_convert" else []


class RegionEditor:
    """Flips qplug's own region decision on a node."""

    @hookimpl
    def qplug_passes(self, stage, backend):
        def flip(gm):
            for node in gm.graph.nodes:
                if REGION in node.meta:
                    node.meta[REGION] = dataclasses.replace(node.meta[REGION], quantized=False)
        return [flip] if stage == "post_prepare" else []


def test_a_plugin_keeping_to_its_own_keys_is_fine(register_plugin):
    register_plugin(Tagger(), "tagger")
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    assert any(n.meta.get("tagger.hint") == "fast-path" for n in observed.graph.nodes)
    qp.calibrate(observed, images(1))
    assert qp.quantization_report(qp.convert_fx(observed)).kernels


def test_editing_another_plugins_annotation_names_both(register_plugin):
    register_plugin(Tagger(), "tagger")
    register_plugin(Meddler(), "meddler")
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    qp.calibrate(observed, images(1))
    with pytest.raises(PluginContractError, match=r"plugin 'meddler' .* changed annotation "
                                                  r"'tagger.hint' on node 'conv', which plugin "
                                                  r"'tagger' .* wrote") as raised:
        qp.convert_fx(observed)
    assert raised.value.plugin.startswith("'meddler'")


def test_editing_qplugs_own_annotation_is_refused(register_plugin):
    register_plugin(RegionEditor(), "editor")
    with pytest.raises(PluginContractError, match=r"plugin 'editor' .* changed qplug's annotation "
                                                  r"'qplug_region'"):
        qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
