"""Clamps after a conv/linear become its output range (issue 19 item 18), for every backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.flows.clamps import absorbed_clamps
from qplug_core.kernels.reference import Quantize
from qplug_core.testing import one_thread


class ConvClamp(nn.Module):
    """conv -> clamp (a module, or a function traced as call_function/call_method) -> conv."""

    def __init__(self, clamp, depthwise_next: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.clamp = clamp if isinstance(clamp, nn.Module) else None
        self.fn = clamp
        self.next = nn.Conv2d(8, 8, 3, padding=1, groups=8 if depthwise_next else 1)

    def forward(self, x):
        y = self.conv(x)
        return self.next(self.clamp(y) if self.clamp is not None else self.fn(y))


CLAMPS = {
    "relu6": nn.ReLU6(),
    "hardtanh": nn.Hardtanh(-0.5, 0.5),
    "F.relu6": lambda x: F.relu6(x),
    "clamp": lambda x: torch.clamp(x, min=0.0, max=1.5),
    "clamp method": lambda x: x.clamp(-1.0, 1.0),
    "F.hardtanh": lambda x: F.hardtanh(x, -2.0, 2.0),
    "clamp min only": lambda x: torch.clamp(x, min=0.0),
    "clamp method max only": lambda x: x.clamp(max=1.0),
    "clip": lambda x: torch.clip(x, -1.0, 1.0),
    "clip method": lambda x: x.clip(min=0.0),
}


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, 6, 6, generator=g) * 3,) for _ in range(3)]


def _clamp_calls(gm) -> list[str]:
    names = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), (nn.ReLU6, nn.Hardtanh)):
            names.append(node.name)
        elif node.op in ("call_function", "call_method") and getattr(node.target, "__name__", node.target) in (
                "relu6", "hardtanh", "clamp", "clip"):
            names.append(node.name)
    return names


@pytest.mark.parametrize("kind", list(CLAMPS))
def test_clamp_disappears_and_the_output_range_is_the_clamps(kind):
    data = _data()
    model = ConvClamp(CLAMPS[kind]).eval()
    with one_thread():
        reference = qp.quantize(model, data[0], data, backend="reference")
    assert _clamp_calls(reference) == []
    (layer, clamp), = absorbed_clamps(reference).items()  # recorded for qp.compare
    extremes = torch.tensor([-1e9, -0.25, 1e9])
    assert layer == "conv" and torch.equal(clamp.apply(extremes), CLAMPS[kind](extremes))
    conv_out = reference.get_submodule(next(n.target for n in reference.graph.nodes
                                            if n.op == "call_module" and n.args and n.args[0].name == "conv"))
    assert isinstance(conv_out, Quantize)
    with torch.no_grad():
        low = float(CLAMPS[kind](torch.tensor(-1e9)))
        high = float(CLAMPS[kind](torch.tensor(1e9)))
    qmin, qmax = (0, 255)
    scale, zp = float(conv_out.scale), int(conv_out.zero_point)
    assert (qmin - zp) * scale >= low - scale / 2 and (qmax - zp) * scale <= high + scale / 2


class AddClip(nn.Module):
    """conv + conv -> torch.clip -> conv: the clip follows an add, so it is not folded."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3), nn.Conv2d(4, 8, 3)
        self.next = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        return self.next(torch.clip(self.a(x) + self.b(x), -1.0, 1.0))


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_a_clip_between_int8_layers_runs_on_int8_values(capture):
    """torch.clip is clamp's alias: it keeps its input's qparams instead of being a float island."""
    data = _data()
    with one_thread():
        reference = qp.quantize(AddClip().eval(), data[0], data, backend="reference", recipe="none",
                                capture=capture)
    clip = next(n for n in reference.graph.nodes if getattr(n.target, "__name__", None) == "clip")
    after = reference.get_submodule(next(iter(clip.users)).target)
    before = reference.get_submodule(clip.args[0].args[0].target)  # clip <- dequantize <- quantize
    assert isinstance(before, Quantize) and isinstance(after, Quantize)
    assert (float(after.scale), int(after.zero_point)) == (float(before.scale), int(before.zero_point))


def test_folding_gives_the_numbers_of_quantizing_the_clamped_value():
    """quantize(x) with saturation equals quantize(relu6(x)) for the same qparams."""
    data = _data()
    model = ConvClamp(nn.ReLU6()).eval()
    with one_thread():
        observed = qp.prepare_fx(model, None, data[0], backend="reference")
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
    quantize = next(m for m in reference.modules() if isinstance(m, Quantize)
                    and float(m.scale) * 255 <= 6.0 + float(m.scale))
    x = torch.linspace(-20, 20, 4001)
    assert torch.equal(quantize(x), quantize(F.relu6(x)))


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_backends_match_the_reference_with_folded_clamps(backend, plugin_autoload):
    data = _data()
    model = ConvClamp(nn.ReLU6()).eval()
    with one_thread():
        observed = qp.prepare_fx(model, None, data[0], backend=backend)
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        lowered = qp.convert_fx(observed)
        with torch.no_grad():
            got, expected = lowered(*data[0]), reference(*data[0])
    assert _clamp_calls(lowered) == []
    step = float(next(m for m in reversed(list(reference.modules())) if isinstance(m, Quantize)).scale)
    assert (got - expected).abs().max() <= step * 1.001


def test_fbgemm_7_bit_input_of_a_depthwise_conv_keeps_the_clamp(plugin_autoload):
    """fbgemm narrows the depthwise conv's input to [0, 127]: quantizing to the full uint8 range
    with that scale does not saturate at 6, so the clamp stays, between two equal quantizes."""
    data = _data()
    model = ConvClamp(nn.ReLU6(), depthwise_next=True).eval()
    with one_thread():
        observed = qp.prepare_fx(model, None, data[0], backend="fbgemm")
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        lowered = qp.convert_fx(observed)
    assert len(_clamp_calls(reference)) == 1
    # kept, but the conv's own 0..127 output already lies in [0, 6]: qp.compare clamps its float side
    assert [c.op for c in absorbed_clamps(lowered).values()] == ["ReLU6"]
    (clamp,) = [n for n in reference.graph.nodes if n.name in _clamp_calls(reference)]
    before, after = clamp.args[0].args[0], next(iter(clamp.users))
    q_before, q_after = reference.get_submodule(before.target), reference.get_submodule(after.target)
    assert isinstance(q_before, Quantize) and torch.equal(q_before.scale, q_after.scale)
    with torch.no_grad():
        step = float(q_after.scale)
        assert (lowered(*data[0]) - reference(*data[0])).abs().max() <= 2 * step


def test_a_clamp_whose_low_bound_is_above_zero_is_kept():
    data = _data()
    model = ConvClamp(lambda x: torch.clamp(x, min=0.5, max=2.0)).eval()
    with one_thread():
        reference = qp.quantize(model, data[0], data, backend="reference")
        expected = model(*data[0])
        got = reference(*data[0])
    assert len(_clamp_calls(reference)) == 1 and absorbed_clamps(reference) == {}
    assert qp.sqnr(expected, got) > 25


def _dead_channel_relu6():
    """conv -> ReLU6 -> conv whose first conv has a dead channel (bias -300): its output spans
    [-300, 4] before the ReLU6, the ReLU6's [0, 6] after."""
    torch.manual_seed(0)
    model = ConvClamp(nn.ReLU6()).eval()
    with torch.no_grad():
        model.conv.bias[0] = -300.0
    return model


def _next_input(model, data) -> torch.Tensor:
    """What the layer ``next`` reads in ``model`` (an int8 model's int8 layer or its float one)."""
    seen = []
    handle = model.get_submodule("next").register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(*data)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("backend", ["reference", "fbgemm"])
def test_a_float_reader_keeps_the_clamped_output_grid(backend, plugin_autoload):
    """Leaving the layer after a ReLU6 float must not widen the conv's int8 output to its
    unclamped range (it did: 4 dB against 30 dB all int8): the conv outputs on the same [0, 6]
    grid whatever reads the ReLU6, as torch.ao keeps a producer's grid whatever its reader."""
    data, model = _data(), _dead_channel_relu6()
    mapping = qp.get_default_qconfig_mapping(backend=backend)
    with one_thread():
        all_int8 = qp.quantize(model, data[0], data, backend=backend, qconfig_mapping=mapping)
        next_float = qp.quantize(model, data[0], data, backend=backend,
                                 qconfig_mapping=mapping.set_module_name("next", None))
        with torch.no_grad():
            expected = model(*data[0])
            assert qp.sqnr(expected, next_float(*data[0])) >= qp.sqnr(expected, all_int8(*data[0]))
        assert _clamp_calls(next_float) == [] and list(absorbed_clamps(next_float)) == ["conv"]
        read_float, read_int8 = _next_input(next_float, data[0]), _next_input(all_int8, data[0])
    if backend == "reference":  # fbgemm's int8 layer reads a quantized tensor: compare the values
        assert torch.equal(read_float, read_int8)
    else:
        assert torch.equal(read_float, read_int8.dequantize())
