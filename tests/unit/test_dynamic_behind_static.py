"""A dynamic Linear reading a static int8 layer's output runs its dynamic int8 kernel (issue 30):
the static output observer has taken over every use of the value, so the dynamic observer must
sit behind it, not hang off the raw value (the layer then failed to lower and stayed float)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.kernels import torch_int8 as K

pytestmark = pytest.mark.usefixtures("one_thread")



def _dynamic():
    """fbgemm's own dynamic qconfig, safe on this CPU (7-bit weights where u8 x s8 pairs sum in
    int16): a full-range one's kernel saturates on AVX2 and rightly stays in reference form."""
    return qp.get_default_qconfig_mapping("fbgemm", mode="dynamic").qconfig_for_module("", nn.Linear)


class _Chain(nn.Module):
    """static ``a`` -> dynamic ``b``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.a(x))


class _Fork(nn.Module):
    """static ``a``'s output read by a static ``s`` and a dynamic ``d``, in either order."""

    def __init__(self, dynamic_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dynamic_first = dynamic_first
        self.a, self.s, self.d = nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(32, 8)

    def forward(self, x):
        h = self.a(x)
        if self.dynamic_first:
            d = self.d(h)
            return self.s(h), d
        return self.s(h), self.d(h)


def _data(n: int = 4) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g),) for _ in range(n)]


def _outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(x)
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("model, dynamic", [
    (_Chain(), "b"), (_Fork(dynamic_first=False), "d"), (_Fork(dynamic_first=True), "d")],
    ids=["chain", "fork-static-first", "fork-dynamic-first"])
def test_a_dynamic_linear_behind_a_static_one_runs_its_dynamic_kernel(model, dynamic, plugin_autoload):
    model = model.eval()
    data = _data()
    mapping = qp.get_default_qconfig_mapping("fbgemm").set_module_name(dynamic, _dynamic())
    observed = qp.prepare_fx(model, mapping, data[0], backend="fbgemm")
    qp.calibrate(observed, data)
    reference = qp.convert_to_reference_fx(observed)
    qmodel = qp.convert_fx(observed, backend="fbgemm")

    assert type(qmodel.get_submodule(dynamic)) is K.DynamicLinear
    report = qp.quantization_report(qmodel)
    assert dynamic in report.quantized and dynamic in report.kernels
    assert dynamic not in {s.node for s in report.skipped}
    held = _data(6)[5][0]
    for want, ref, got in zip(_outputs(model, held), _outputs(reference, held), _outputs(qmodel, held)):
        assert sqnr(ref, got) > 40  # the kernel computes what the reference form says
        assert sqnr(want, got) > 30  # int8 noise of two layers, not a lost layer


def test_two_dynamic_linears_behind_a_static_one_share_one_dynamic_observer(plugin_autoload):
    model = _Fork(dynamic_first=True).eval()
    mapping = qp.get_default_qconfig_mapping("fbgemm").set_module_name("s", _dynamic()) \
        .set_module_name("d", _dynamic())
    observed = qp.prepare_fx(model, mapping, _data()[0], backend="fbgemm")
    a_output = next(n for n in observed.graph.nodes if n.args and getattr(n.args[0], "target", None) == "a")
    (dynamic_observer,) = a_output.users
    assert {u.target for u in dynamic_observer.users} == {"s", "d"}
    qp.calibrate(observed, _data())
    qmodel = qp.convert_fx(observed, backend="fbgemm")
    assert type(qmodel.s) is type(qmodel.d) is K.DynamicLinear
    held = _data(6)[5][0]
    for want, got in zip(_outputs(model, held), _outputs(qmodel, held)):
        assert sqnr(want, got) > 30
