"""A target-search candidate with dynamic layers reuses the calibrated observers: no calibration
pass, and the same model as one calibrated from scratch (dynamic observers hold no statistics,
so they are neither copied nor compared)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.algorithms.pipeline import prepare_algorithms
from qplug_core.algorithms.reuse import calibrated_observers, observed_with
from qplug_core.flows import steps as flows
from qplug_core.flows.steps import resolve_backend
from qplug_core.kernels import torch_int8 as K

pytestmark = pytest.mark.usefixtures("one_thread")


class _Model(nn.Module):
    """``x`` read by static ``query`` and by ``key``; ``out`` reads ``query``'s output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.relu(self.query(x))) - self.key(x).sum(-1, keepdim=True)


def _data(n: int = 4) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g),) for _ in range(n)]


@pytest.mark.parametrize("dynamic", [["key"], ["out"], ["key", "out"]],
                         ids=["beside-static", "behind-static", "both"])
def test_a_candidate_with_dynamic_layers_is_converted_without_calibrating(dynamic, plugin_autoload,
                                                                         monkeypatch):
    backend = resolve_backend("fbgemm")
    data = _data()
    gm, inputs, batches, mapping, _ = prepare_algorithms(_Model().eval(), data[0], data, backend,
                                                         None, "none", {})
    calibrated = flows.prepare_fx(gm, mapping, inputs, backend=backend)
    flows.calibrate(calibrated, batches, progress=False)
    sources = calibrated_observers(calibrated)

    candidate = qp.get_default_qconfig_mapping("fbgemm")
    linear = backend.default_qconfig_mapping("dynamic").qconfig_for_module("", nn.Linear)
    for name in dynamic:
        candidate.set_module_name(name, linear)
    calls = []
    original = flows.calibrate
    monkeypatch.setattr(flows, "calibrate", lambda *a, **k: calls.append(1) or original(*a, **k))
    reused = flows.convert_fx(observed_with(gm, sources, candidate, inputs, batches, backend, {}),
                              backend=backend)
    assert calls == []
    monkeypatch.setattr(flows, "calibrate", original)

    fresh = flows.prepare_fx(gm, candidate, inputs, backend=backend)
    flows.calibrate(fresh, batches, progress=False)
    fresh = flows.convert_fx(fresh, backend=backend)
    for name in dynamic:
        assert type(reused.get_submodule(name)) is K.DynamicLinear
    with torch.no_grad():
        for batch in _data(6)[4:]:
            torch.testing.assert_close(reused(*batch), fresh(*batch), rtol=0, atol=0)
