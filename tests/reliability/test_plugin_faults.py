"""Plugins failing *during* quantization (rows 5, 20, 21 at flow level, kernel self-tests): the
failure is attributed to one plugin, other backends keep working, the user's models are unchanged."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from faultkit import conv_net, images
from torch import fx

import qplug_core as qp
from qplug_core.errors import PassError, PluginHookError
from qplug_core.flows import lower
from qplug_core.passes import PassResult
from qplug_core.plugin_api import BackendPlugin
from qplug_core.registry import plugins
from qplug_core.registry.hookspecs import hookimpl

pytestmark = pytest.mark.usefixtures("installed_backends")

X = images(1)[0]


class RaisingPasses:
    """Contributes fbgemm passes and raises while doing it (a plugin bug, not a pass bug)."""

    @hookimpl
    def qplug_passes(self, stage, backend):
        if backend == "fbgemm":
            raise RuntimeError("pass table corrupt")
        return []


def test_plugin_hook_raising_during_quantization_names_the_plugin(register_plugin):
    register_plugin(RaisingPasses(), "meddler")
    with pytest.warns(plugins.QplugPluginWarning, match="plugin 'meddler' .qplug-meddler 0.1.: hook "
                                                        "qplug_passes raised RuntimeError"):
        with pytest.raises(PluginHookError) as raised:
            qp.quantize(conv_net(), X, images(1), backend="fbgemm")
    error = raised.value
    assert (error.plugin, error.dist, error.hook) == ("meddler", "qplug-meddler", "qplug_passes")
    assert "pass table corrupt" in str(error) and "disable with QPLUG_DISABLE_PLUGINS=meddler" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    # another backend is unaffected by the broken plugin
    report = qp.quantization_report(qp.quantize(conv_net(), X, images(1), backend="qnnpack"))
    assert {"conv", "fc"} <= set(report.kernels)


class RaisingKernels:
    @hookimpl
    def qplug_int8_kernels(self, backend):
        if backend == "fbgemm":
            raise ValueError("kernel registry unavailable")
        return {}


def test_plugin_raising_in_qplug_int8_kernels_costs_only_its_own_contribution(register_plugin):
    register_plugin(RaisingKernels(), "vendor")
    with pytest.warns(plugins.QplugPluginWarning, match="'vendor'.*qplug_int8_kernels raised ValueError"):
        rows = {info.name: info for info in qp.list_backends()}
    # another plugin's failure does not break fbgemm (only its registering plugin's would); it is said
    assert rows["fbgemm"].status == "ok" and "kernel registry unavailable" in rows["fbgemm"].reason
    assert rows["qnnpack"].status == "ok" and rows["reference"].status == "ok"
    # fbgemm's own kernels are still used: the broken plugin only loses its own contribution
    report = qp.quantization_report(qp.quantize(conv_net(), X, images(1), backend="fbgemm"))
    assert report.kernels["fc"] == "quantized::linear"


def _self_test_fails():
    raise RuntimeError("packed weights mismatch")


class SelfTestFailingBackend(BackendPlugin):
    """fbgemm's patterns and kernels under another name, whose linear kernel fails its self-test."""

    name = "flaky-linear"
    description = "fbgemm with a broken linear kernel"
    engine = "fbgemm"

    def kernels(self):
        return {k: dataclasses.replace(v, self_test=_self_test_fails) if v.op == "quantized::linear"
                else v for k, v in super().kernels().items()}

    def default_qconfig_mapping(self, mode):
        return qp.get_default_qconfig_mapping("fbgemm", mode)


def test_kernel_failing_its_self_test_falls_back_to_reference_with_a_warning(register_plugin, monkeypatch):
    monkeypatch.setattr(lower, "_self_test_results", {})  # self-tests run once per process: forget
    register_plugin(SelfTestFailingBackend(), "flaky")
    observed = qp.prepare_fx(conv_net(), None, X, backend="flaky-linear")
    qp.calibrate(observed, images())
    with pytest.warns(UserWarning, match="backend 'flaky-linear': kernel quantized::linear of plugin 'flaky' .* failed "
                                         "its self-test .packed weights mismatch.; using the reference form"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert "fc" not in report.kernels and report.kernels["conv"] == "quantized::conv2d"
    assert "failed its self-test" in report.reference["fc"]
    assert "fc" in {s.node for s in report.skipped}  # G5: the float fallback is reported
    reference = qp.convert_to_reference_fx(observed)
    for (batch,) in images(2, seed=7):
        expected = reference(batch)
        step = 2 * float(expected.abs().max()) / 255  # one quantization step of the output
        assert (lowered(batch) - expected).abs().max() <= step + 1e-6  # still correct, within 1 LSB


def _partial_then_raise(gm: fx.GraphModule):
    """Edits the graph, then fails: the flow must not hand back (or leave) a half-edited model."""
    for node in gm.graph.nodes:
        node.meta["half_done"] = True
    gm.register_buffer("debris", torch.zeros(1))
    raise IndexError("ran off the end of the node list")


class PassPlugin:
    def __init__(self, stage: str, fn) -> None:
        self.stage, self.fn = stage, fn

    @hookimpl
    def qplug_passes(self, stage, backend):
        return [self.fn] if stage == self.stage and backend == "fbgemm" else []


def test_pass_raising_partway_is_a_pass_error_and_the_input_is_unchanged(register_plugin):
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    qp.calibrate(observed, images())
    code, state = observed.code, {k: v.clone() for k, v in observed.state_dict().items()}
    plugin = PassPlugin("pre_convert", _partial_then_raise)
    register_plugin(plugin, "halfway")
    with pytest.raises(PassError) as raised:
        qp.convert_fx(observed)
    error = raised.value
    assert error.pass_name == "_partial_then_raise" and error.completed_passes == ()
    assert "pass '_partial_then_raise' raised IndexError: ran off the end" in str(error)
    assert isinstance(error.__cause__, IndexError)
    assert observed.code == code and not hasattr(observed, "debris")
    assert not any("half_done" in n.meta for n in observed.graph.nodes)
    assert all(torch.equal(v, state[k]) for k, v in observed.state_dict().items())
    plugins.get_manager().pm.unregister(plugin)
    plugins.get_manager().cache.clear()
    assert "fc" in qp.quantization_report(qp.convert_fx(observed)).kernels  # still convertible


def _dangle(gm: fx.GraphModule) -> PassResult:
    """Makes fc consume a node inserted *after* it: the graph is no longer topologically sorted."""
    target = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "fc")
    with gm.graph.inserting_after(target):
        ghost = gm.graph.call_function(torch.neg, (target.args[0],))
    target.args = (ghost,)
    return PassResult(gm, True)


def test_pass_leaving_an_invalid_graph_is_caught_in_debug_mode(register_plugin, monkeypatch):
    monkeypatch.setenv("QPLUG_DEBUG", "1")  # run_checks_after_each_pass: Graph.lint() after each pass
    register_plugin(PassPlugin("post_prepare", _dangle), "dangler")
    model = conv_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PassError, match="check '_lint' failed after pass '_dangle'") as raised:
            qp.prepare_fx(model, None, X, backend="fbgemm")
    assert raised.value.pass_name == "_dangle"
    assert "used before it is defined" in str(raised.value) or "topolog" in str(raised.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class PatternsRaise(BackendPlugin):
    """A backend whose own pattern table fails to build: every op would stay float."""

    name = "vendorx"
    description = "a backend whose pattern hook raises"

    def pattern_configs(self):
        raise RuntimeError("pattern table corrupt")

    def default_qconfig_mapping(self, mode):
        return qp.get_default_qconfig_mapping("reference", mode)


def test_backend_whose_own_hook_raised_is_refused_naming_the_plugin_and_hook(register_plugin):
    """Issue 27: the cause was only in a warning; the error said "no quantization pattern matches"."""
    register_plugin(PatternsRaise(), "vendorx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plugins.QplugPluginWarning)
        with pytest.raises(qp.errors.BackendUnavailableError) as raised:
            qp.quantize(conv_net(), X, images(1), backend="vendorx")
    message = str(raised.value)
    assert "backend 'vendorx' is broken: plugin 'vendorx' (qplug-vendorx 0.1): hook " \
           "qplug_backend_pattern_configs raised RuntimeError: pattern table corrupt" in message
    assert isinstance(raised.value.__cause__, PluginHookError)
    assert raised.value.__cause__.hook == "qplug_backend_pattern_configs"
