"""A delegated partition's model compiled for a new input signature is held to the contract on its
outputs, without compiling its int8 regions one by one again: that check graph is a second export
of the whole partition (125 of the 199 s of an FPN detector's first batch-4 call on onnxruntime),
and convert already checked the regions of this graph."""

from __future__ import annotations

import torch
from torch import nn

import qplug_core as qp
from qplug_core.flows.delegate import NewSignatureContract


class _Compiles:
    """A delegate that records what it is asked to compile (a region-by-region check would ask)."""

    def __init__(self) -> None:
        self.asked = 0

    def compile(self, *args, **kwargs):
        self.asked += 1
        raise RuntimeError("not compiled here")


def _reference() -> tuple[torch.fx.GraphModule, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    data = [(torch.randn(2, 3, 12, 12),) for _ in range(3)]
    observed = qp.prepare_fx(model, None, data[0], backend="reference")
    for batch in data:
        observed(*batch)
    return qp.convert_to_reference_fx(observed), data[0]


def _contract(delegate: _Compiles) -> NewSignatureContract:
    return NewSignatureContract({}, delegate, "delegate_0", regions=3, backend_name="reference")


def test_a_drifting_new_signature_is_kept_without_compiling_its_regions_again():
    reference, inputs = _reference()
    expected = reference(*inputs)
    step = float(expected.max() - expected.min()) / 255
    some = torch.rand(expected.shape, generator=torch.Generator().manual_seed(1)) < 0.05
    drifting = expected + 3 * step * some  # beyond one kernel's contract, within the partition's
    delegate = _Compiles()
    assert _contract(delegate).problem(reference, lambda *x: drifting, inputs) == ""
    assert delegate.asked == 0


def test_a_wrong_new_signature_is_still_refused_on_its_outputs():
    reference, inputs = _reference()
    expected = reference(*inputs)
    delegate = _Compiles()
    assert "point away" in _contract(delegate).problem(reference, lambda *x: -expected, inputs)
    assert "rounding noise" in _contract(delegate).problem(reference, lambda *x: 1.5 * expected, inputs)
