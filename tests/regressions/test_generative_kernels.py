"""Defects a generative-model user found (2026-12-06: DCGAN, UNet): each test is that user's own
call, with the numbers or the report text they rely on."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import qplug_core as qp
from qplug_core.flows.kernel_check import ValueRecorder
from qplug_core.observers import HistogramObserver
from qplug_core.observers.batch_sync import BatchReduction, reduce_each_batch
from qplug_core.onnx_export.api import reference_form

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


def _conv_act_conv(act: nn.Module) -> nn.Module:
    """A standalone int8 activation between two convs (the pool keeps it out of a conv fusion)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.MaxPool2d(1), act,
                         nn.Conv2d(16, 8, 3, padding=1)).eval()


@pytest.mark.parametrize(("act", "kernel"), [
    (lambda inplace: nn.LeakyReLU(0.2, inplace), "quantized::leakyrelu"),
    (lambda inplace: nn.Hardswish(inplace), "quantized::hardswish"),
    (lambda inplace: nn.ELU(inplace=inplace), "quantized::elu"),
], ids=["leaky_relu", "hardswish", "elu"])
def test_an_in_place_activation_runs_the_same_kernel_as_its_out_of_place_twin(act, kernel):
    """``nn.LeakyReLU(0.2, inplace=True)`` (DCGAN), ``Hardswish`` and ``ELU(inplace=True)`` on fbgemm
    warned "kernel quantized::leakyrelu of plugin 'fbgemm' broke the kernel contract on the example
    inputs (3049 of 8192 outputs differ ...)" and kept the reference form: the check kept the
    reference run's dequantized input, which the in-place activation then overwrote, so the kernel
    was checked on an input activated twice. The kernel now runs, and the int8 model, like its
    reference form, answers exactly as the one built from the ``inplace=False`` model."""
    torch.manual_seed(1)
    batches = [(torch.randn(2, 8, 16, 16),) for _ in range(4)]
    x = torch.randn(2, 8, 16, 16)
    outputs = {}
    for inplace in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            int8 = qp.quantize(_conv_act_conv(act(inplace)), batches[0], batches, backend="fbgemm")
        assert not [w for w in caught if "kernel contract" in str(w.message)]
        assert qp.quantization_report(int8).kernels["3"] == kernel
        with torch.no_grad():
            outputs[inplace] = int8(x), reference_form(int8)(x)
    assert torch.equal(outputs[True][0], outputs[False][0])
    assert torch.equal(outputs[True][1], outputs[False][1])
    with torch.no_grad():
        assert qp.sqnr(_conv_act_conv(act(False))(x), outputs[True][0]) > 30  # 36-45 dB measured


@pytest.mark.parametrize(("act", "kernel"), [
    (nn.LeakyReLU(0.2, inplace=True), "quantized::leakyrelu"),
    (nn.ELU(inplace=True), "quantized::elu"),
    (nn.Hardsigmoid(inplace=True), "quantized::hardsigmoid"),
], ids=["leaky_relu", "elu", "hardsigmoid"])
def test_an_in_place_activation_captured_by_torch_export_is_int8_as_under_symbolic_tracing(act, kernel):
    """Under torch.export, ``LeakyReLU(inplace=True)`` arrives as ``aten.leaky_relu_``, which was
    not made out-of-place like ``relu_`` or ``hardswish_``: it stayed float between the two int8
    convs (so did ``elu_`` and ``hardsigmoid_``). It now runs the kernel symbolic tracing gives it."""
    torch.manual_seed(1)
    batches = [(torch.randn(2, 8, 16, 16),) for _ in range(4)]
    x = torch.randn(2, 8, 16, 16)
    int8 = {capture: qp.quantize(_conv_act_conv(act), batches[0], batches, backend="fbgemm", capture=capture)
            for capture in ("symbolic", "export")}
    report = qp.quantization_report(int8["export"])
    assert kernel in report.kernels.values()
    assert not report.skipped
    with torch.no_grad():
        assert torch.equal(int8["export"](x), int8["symbolic"](x))


def test_recorded_values_are_those_produced_even_when_a_later_op_writes_through_a_view():
    """The contract check (and delegation's, and layer parity) reads values a graph run recorded;
    a later in-place write, here through a view, must not change what was recorded."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.add, (x, 1.0))
    view = graph.call_method("view", (y, -1))
    graph.call_method("mul_", (view, 0.0))
    graph.output(y)
    gm = fx.GraphModule(nn.Module(), graph)
    values: dict[fx.Node, object] = {}
    inputs = torch.arange(6.0).reshape(2, 3)
    returned = ValueRecorder(gm, {y}, values).run(inputs)
    assert torch.equal(values[y], inputs + 1)
    assert not returned.any()  # the run itself computes as the graph says


class _OneRank:
    """The collectives of a group of one rank (its statistics are what all ranks agree on)."""

    def min_max(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return low, high

    def total(self, value: torch.Tensor) -> torch.Tensor:
        return value


def test_distributed_calibration_counts_the_values_an_observer_saw_before_an_in_place_op():
    """Calibrating with ``sync_observers_each_step`` (every=1), a histogram observer's batch
    values wait for the ranks' common range until the forward pass ends; ``ELU(inplace=True)``
    after the observed value overwrote them meanwhile, so the histogram counted ELU's outputs, not
    what one process calibrating the same batch counts. It now counts what it observed."""
    x = torch.randn(2, 8, 16, 16)
    observed = qp.prepare_fx(qp.fuse_fx(_conv_act_conv(nn.ELU(inplace=True)), backend="fbgemm"),
                             backend="fbgemm", example_inputs=(x,))
    alone, synced = copy.deepcopy(observed), copy.deepcopy(observed)
    reduction = BatchReduction(_OneRank(), deferred=True)
    for module in synced.modules():
        if isinstance(module, HistogramObserver):
            reduce_each_batch(module, reduction)
    with torch.no_grad():
        alone(x)
        synced(x)
        reduction.flush()
    pairs = [(a, b) for a, b in zip(alone.modules(), synced.modules()) if isinstance(a, HistogramObserver)]
    assert len(pairs) == 4
    for a, b in pairs:
        assert torch.equal(a.histogram, b.histogram)


class Upsampler(nn.Module):
    """UNet's decoder step: conv, upsample (``F.interpolate`` with these arguments), conv."""

    def __init__(self, dims: int, upsample: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 **interpolate: Any) -> None:
        super().__init__()
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.a, self.b = conv(4, 4, 3, padding=1), conv(4, 4, 3, padding=1)
        self.upsample = upsample or functools.partial(F.interpolate, **interpolate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.upsample(self.a(x)))


_UPSAMPLES = [
    ((8, 8), dict(scale_factor=2, mode="nearest")),
    ((7, 9), dict(scale_factor=1.7, mode="nearest")),
    ((7, 9), dict(scale_factor=1.3, mode="nearest", recompute_scale_factor=True)),
    ((8, 8), dict(size=(13, 7), mode="nearest")),
    ((7, 9), dict(scale_factor=2.5, mode="nearest-exact")),
    ((7, 9), dict(scale_factor=1.5, mode="bilinear", align_corners=True)),
    ((7, 9), dict(scale_factor=(1.5, 2.25), mode="bilinear")),
    ((8, 8), dict(size=(11, 5), mode="bilinear")),
    ((4, 5, 3), dict(scale_factor=2, mode="nearest")),
]


@pytest.mark.parametrize(("spatial", "interpolate"), _UPSAMPLES, ids=[
    f"{'x'.join(map(str, s))}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for s, kw in _UPSAMPLES])
def test_an_upsample_captured_by_torch_export_is_int8_as_under_symbolic_tracing(spatial, interpolate):
    """conv -> ``F.interpolate(scale_factor=2, mode="nearest")`` -> conv was int8 through the
    upsample under symbolic tracing but kept ``upsample_nearest2d.vec`` float under torch.export
    (a UNet whose forward reads its timestep's type), reported as "no quantization pattern of the
    backend matches this op". The ATen upsample is raised to the ``F.interpolate`` call that
    computes it exactly (the float graph equals the float model), and the int8 model is the one
    symbolic tracing gives."""
    torch.manual_seed(0)
    model = Upsampler(len(spatial), **interpolate).eval()
    batches = [(torch.randn(1, 4, *spatial),) for _ in range(3)]
    x = torch.randn(2, 4, *spatial)
    raised = qp.fuse_fx(model, batches[0], backend="fbgemm", capture="export")
    assert [n.target for n in raised.graph.nodes if n.op == "call_function"] == [F.interpolate]
    int8 = {capture: qp.quantize(model, batches[0], batches, backend="fbgemm", capture=capture)
            for capture in ("symbolic", "export")}
    assert not [s.node for s in qp.quantization_report(int8["export"]).skipped]
    with torch.no_grad():
        assert torch.equal(raised(x), model(x))
        assert torch.equal(int8["export"](x), int8["symbolic"](x))


_ATEN = torch.ops.aten


@pytest.mark.parametrize(("call", "raised"), [
    (lambda h: _ATEN.upsample_nearest2d.default(h, [15, 11]), True),
    (lambda h: _ATEN.upsample_bilinear2d.default(h, [15, 11], True), True),
    (lambda h: _ATEN.upsample_nearest2d.default(h, [15, 11], 1.9, 1.4), False),
    (lambda h: _ATEN.upsample_bilinear2d.default(h, [15, 11], False, 1.9, 1.4), False),
], ids=["nearest", "bilinear", "nearest-with-scales", "bilinear-with-scales"])
def test_a_plain_aten_upsample_is_raised_only_where_interpolate_computes_it_exactly(call, raised):
    """The plain overloads take an output size and optional scales (the source index comes from
    the scales); ``F.interpolate`` has no call taking both, so one with scales stays ATen."""
    torch.manual_seed(0)
    model = Upsampler(2, call).eval()
    x = torch.randn(1, 4, 8, 8)
    graph = qp.fuse_fx(model, (x,), backend="fbgemm", capture="export")
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert (targets == [F.interpolate]) is raised
    with torch.no_grad():
        assert torch.equal(graph(x), model(x))


def test_an_upsample_mode_without_int8_kernels_says_its_aten_op_has_no_mapping():
    """A bicubic upsample has no int8 kernel on fbgemm or qnnpack, so its ATen op stays as torch.export
    wrote it; the report said "no quantization pattern of the backend matches this op", as if
    the backend had no pattern for ``F.interpolate``. It now says the ATen op has no mapping."""
    torch.manual_seed(0)
    model = Upsampler(2, scale_factor=2, mode="bicubic").eval()
    batches = [(torch.randn(1, 4, 8, 8),) for _ in range(3)]
    int8 = qp.quantize(model, batches[0], batches, backend="fbgemm", capture="export")
    skipped = {s.op: s.reason for s in qp.quantization_report(int8).skipped}
    assert skipped == {"upsample_bicubic2d.vec": (
        "no quantization pattern of the backend matches this op: it is an ATen op from torch.export "
        "that qplug does not map to the module or functional the patterns name")}
    with torch.no_grad():
        x = torch.randn(1, 4, 8, 8)
        assert qp.sqnr(model(x), int8(x)) > 20  # 25.2 dB measured
