"""Tests of the tiny backend: discovery, hook contracts, the kernel against the reference backend.

``qplug_only`` is a fixture of qplug-core's pytest plugin; ``BackendPatternSuite`` runs qplug's
end-to-end check of every pattern the backend declares.
"""

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import Availability, BackendPatternSuite

from qplug_tiny.plugin import TinyLinear, plugin


@pytest.fixture
def tiny(qplug_only):
    return qplug_only("qplug-tiny")  # this plugin (and the core's reference backend) only


def test_entry_point_is_discovered_and_loaded(tiny):
    record = tiny.record("tiny")
    assert (record.dist, record.status) == ("qplug-tiny", "ok")


def test_hooks_honour_their_contracts(tiny):
    # collect() type-checks every return value against the hookspec; a failure is an error
    for hook, kwargs in [("qplug_register_backends", {}),
                         ("qplug_backend_pattern_configs", {"backend": "tiny"}),
                         ("qplug_int8_kernels", {"backend": "tiny"}),
                         ("qplug_default_qconfig_mapping", {"backend": "tiny", "mode": "static"})]:
        results = tiny.collect(hook, plugin="tiny", **kwargs)
        assert results and all(r.ok and r.value for r in results), [r.error for r in results]


def test_kernel_matches_the_reference_backend(tiny):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8)).eval()
    data = [torch.randn(4, 16) for _ in range(4)]
    mapping = qp.get_default_qconfig_mapping("tiny")  # same qparams for both backends
    ours = qp.quantize(model, data[0], data, backend="tiny", qconfig_mapping=mapping)
    oracle = qp.quantize(model, data[0], data, backend="reference", qconfig_mapping=mapping)
    assert qp.quantization_report(ours).kernels == {"0": "tiny::linear"}
    x = torch.randn(64, 16)
    step = float(oracle(x).max() - oracle(x).min()) / 255  # about one output quantization step
    assert ((ours(x) - oracle(x)).abs() <= step * 1.01).float().mean() >= 0.99
    # and not off the same way on average (one step off everywhere is within one step everywhere)
    assert abs(float((ours(x) - oracle(x)).mean())) <= 0.25 * step


def test_kernel_self_test_passes_here():
    TinyLinear.self_test()


def test_other_backends_are_left_alone(tiny):
    for result in tiny.collect("qplug_int8_kernels", backend="reference", plugin="tiny"):
        assert result.value == {}


def test_unavailable_backend_is_reported_not_fatal(qplug_only, monkeypatch):
    monkeypatch.setattr(plugin, "is_available", lambda: Availability(False, "no tiny chip here"))
    qplug_only("qplug-tiny")
    info = next(i for i in qp.list_backends() if i.name == "tiny")
    assert info.status == "unavailable" and "no tiny chip here" in info.reason
    with pytest.raises(qp.errors.BackendUnavailableError, match="no tiny chip here"):
        qp.quantize(nn.Linear(4, 4).eval(), torch.randn(1, 4), [torch.randn(1, 4)], backend="tiny")


class TestPatterns(BackendPatternSuite):
    backend = "tiny"
    distribution = "qplug-tiny"
