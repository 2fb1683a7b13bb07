"""Tests of the tiny backend: discovery, hook contracts, numerics against the reference backend."""

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import qplug_core as qp
from qplug_core import plugins
from qplug_core.cli import app


def test_entry_point_is_discovered_and_loaded():
    record = next(r for r in plugins.plugin_records() if r.name == "tiny")
    assert (record.dist, record.status) == ("qplug-tiny", plugins.PluginStatus.OK)


def test_hooks_honour_their_contracts():
    # collect() type-checks every return value against the hookspec; a failure is an error
    for hook, kwargs in [("qplug_register_backends", {}),
                         ("qplug_backend_pattern_configs", {"backend": "tiny"}),
                         ("qplug_int8_kernels", {"backend": "tiny"}),
                         ("qplug_check_environment", {"backend": "tiny"})]:
        results = [r for r in plugins.collect(hook, **kwargs) if r.record.name == "tiny"]
        assert results and all(r.ok for r in results), [r.error for r in results]


def test_backend_is_listed_by_the_cli():
    result = CliRunner().invoke(app, ["list-backends", "--json", "--strict"])
    assert result.exit_code == 0, result.output
    assert "tiny" in result.stdout


def test_kernels_match_the_reference_backend():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    data = [torch.randn(4, 16) for _ in range(4)]
    mapping = qp.get_default_qconfig_mapping("tiny")  # same qparams for both backends
    ours = qp.quantize(model, data[0], data, backend="tiny", qconfig_mapping=mapping)
    oracle = qp.quantize(model, data[0], data, backend="reference", qconfig_mapping=mapping)
    assert qp.quantization_report(ours).kernels  # really lowered to our kernel
    x = torch.randn(4, 16)
    torch.testing.assert_close(ours(x), oracle(x), atol=0.05, rtol=0)


def test_other_backends_are_left_alone():
    assert plugins.collect("qplug_backend_pattern_configs", backend="reference")
    for result in plugins.collect("qplug_int8_kernels", backend="reference"):
        if result.record.name == "tiny":
            assert result.value == {}


def test_unavailable_engine_is_reported_not_fatal(monkeypatch):
    from qplug_tiny import plugin

    monkeypatch.setattr(plugin, "ENGINE", "no-such-engine")
    plugins.reset()
    info = next(i for i in qp.list_backends() if i.name == "tiny")
    assert info.status == "unavailable" and "no-such-engine" in info.reason
    with pytest.raises(qp.errors.BackendUnavailableError):
        qp.quantize(nn.Linear(4, 4).eval(), torch.randn(1, 4), [torch.randn(1, 4)], backend="tiny")
