"""Port of a slice of PyTorch's ``TestQuantizeFx`` (``test/quantization/fx/test_quantize_fx.py``):
the pattern-matching cases, QAT swap of fused modules, and the conv/linear matrix of
``_get_conv_linear_test_cases`` for both the lowered and the reference form.

Translation: ``_is_match`` -> ``qp.matcher.is_match``; ``MatchAllNode`` -> ``qp.MatchAllNode``;
``checkGraphModeFxOp(model, inputs, QuantType.STATIC|DYNAMIC, expected_node=nnq.X)`` ->
``qp.prepare_fx`` (+ calibration for static) with the backend's static or dynamic mapping, then
``qp.convert_fx`` and the report's kernel for the layer (``quantized::conv2d`` for ``nnq.Conv2d``,
``quantized::linear`` for ``nnq.Linear`` / ``quantized::linear_dynamic``; functional ops are first
turned into modules by qplug's normalisation, so ``F.conv2d`` lowers like ``nn.Conv2d``);
``is_reference=True`` -> ``qp.convert_to_reference_fx``: upstream's ``nnqr.*`` module with
``weight_scale`` / ``weight_zero_point`` -> qplug's ``ReferenceWeighted`` with ``weight_qparams``
stored as ``weight_qparams_holder.{scale,zero_point}`` buffers.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qplug_core as qp
from qplug_core.kernels.reference import ReferenceWeighted

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


def test_pattern_match():
    """MatchAllNode with conv - bn - add - relu."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)
            self.bn = nn.BatchNorm2d(1)
            self.relu = nn.ReLU()

        def forward(self, x, y):
            x = self.conv(x)
            x = self.bn(x)
            x = x + y
            return self.relu(x)

    pattern = (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), qp.MatchAllNode))
    m = torch.fx.symbolic_trace(M())
    modules = dict(m.named_modules())
    relus = [n for n in m.graph.nodes if n.op == "call_module" and type(modules[n.target]) is nn.ReLU]
    assert relus
    for n in relus:
        assert qp.matcher.is_match(modules, n, pattern)


def test_pattern_match_constant():
    class M(nn.Module):
        def forward(self, x):
            x, _ = torch.ops.aten.max_pool2d_with_indices.default(x)
            return x

    pattern = (operator.getitem, torch.ops.aten.max_pool2d_with_indices.default, 0)
    m = torch.fx.symbolic_trace(M())
    # drop the code that gets the second output of maxpool, so that the pattern can match
    m.graph.eliminate_dead_code()
    modules = dict(m.named_modules())
    getitems = [n for n in m.graph.nodes if n.op == "call_function" and n.target == operator.getitem]
    assert getitems
    for n in getitems:
        assert qp.matcher.is_match(modules, n, pattern)


def test_fused_module_qat_swap():
    class Tmp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = nn.Linear(5, 5)
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.tmp(x))

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mods1 = nn.Sequential(Tmp(), nn.Linear(5, 5))
            self.mods2 = nn.Linear(5, 5)

        def forward(self, x):
            a = self.mods1(x)
            x = torch.add(x, 5)
            x = self.mods2(x)
            x = torch.add(x, 5)
            return a, x

    qat = qp.get_default_qconfig_mapping("fbgemm", "qat").qconfig_for_module("x", nn.Linear)
    qconfig_mapping = (qp.QConfigMapping().set_global(None)
                       .set_object_type(nn.Linear, qat).set_object_type(nn.ReLU, qat))
    prepared = qp.prepare_qat_fx(M().train(), qconfig_mapping, (torch.randn(1, 5),), backend="fbgemm")
    import qplug_core.nn.qat as nniqat
    assert isinstance(getattr(prepared.mods1, "0").tmp, nniqat.LinearReLU)


class FunctionalConv1d(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.stride, self.padding, self.dilation, self.groups = 1, 0, 1, 1

    def forward(self, x):
        return F.conv1d(x, self.weight, None, self.stride, self.padding, self.dilation, self.groups)


class Conv1d(nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.conv = nn.Conv1d(*args)

    def forward(self, x):
        return self.conv(x)


class FunctionalConv2d(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.stride, self.padding, self.dilation, self.groups = (1, 1), (0, 0), (1, 1), 1

    def forward(self, x):
        return F.conv2d(x, self.weight, None, self.stride, self.padding, self.dilation, self.groups)


class Conv2d(nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.conv = nn.Conv2d(*args)

    def forward(self, x):
        return self.conv(x)


class FunctionalConv3d(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.stride, self.padding, self.dilation, self.groups = (1, 1, 1), (0, 0, 0), (1, 1, 1), 1

    def forward(self, x):
        return F.conv3d(x, self.weight, None, self.stride, self.padding, self.dilation, self.groups)


class Conv3d(nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.conv = nn.Conv3d(*args)

    def forward(self, x):
        return self.conv(x)


class Linear(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x):
        return F.linear(x, self.weight)


class LinearModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 10)

    def forward(self, x):
        return self.linear(x)


def _conv_linear_cases():
    """(is_dynamic, ModuleClass, constructor inputs, inputs, lowered kernel); upstream's shapes."""
    conv1d_input, conv1d_weight = torch.rand(1, 3, 224), torch.rand(3, 3, 3)
    conv2d_input, conv2d_weight = torch.rand(1, 3, 224, 224), torch.rand(3, 3, 3, 3)
    conv3d_input, conv3d_weight = torch.rand(1, 3, 32, 224, 224), torch.rand(3, 3, 3, 3, 3)
    linear_input, linear_weight = torch.rand(8, 5), torch.rand(10, 5)
    return [
        (False, FunctionalConv1d, (conv1d_weight,), (conv1d_input,), "quantized::conv1d"),
        (False, FunctionalConv2d, (conv2d_weight,), (conv2d_input,), "quantized::conv2d"),
        (False, FunctionalConv3d, (conv3d_weight,), (conv3d_input,), "quantized::conv3d"),
        (False, Conv1d, (3, 3, 3), (conv1d_input,), "quantized::conv1d"),
        (False, Conv2d, (3, 3, 3), (conv2d_input,), "quantized::conv2d"),
        (False, Conv3d, (3, 3, 3), (conv3d_input,), "quantized::conv3d"),
        (True, Linear, (linear_weight,), (linear_input,), "quantized::linear"),
        (False, Linear, (linear_weight,), (linear_input,), "quantized::linear"),
        (True, LinearModule, (), (torch.rand(8, 5),), "quantized::linear"),
        (False, LinearModule, (), (torch.rand(8, 5),), "quantized::linear"),
    ]


CASE_IDS = [f"{'dynamic' if c[0] else 'static'}-{c[1].__name__}" for c in _conv_linear_cases()]


def _prepare(is_dynamic, model, inputs):
    mode = "dynamic" if is_dynamic else "static"
    prepared = qp.prepare_fx(model.eval(), qp.get_default_qconfig_mapping("fbgemm", mode), inputs,
                             backend="fbgemm")
    if not is_dynamic:
        prepared(*inputs)  # upstream calibrates on the same inputs
    return prepared


@pytest.mark.parametrize("case", range(10), ids=CASE_IDS)
def test_conv_linear_not_reference(case):
    is_dynamic, module_class, ctor, inputs, kernel = _conv_linear_cases()[case]
    model = module_class(*ctor)
    quantized = qp.convert_fx(_prepare(is_dynamic, model, inputs))
    report = qp.quantization_report(quantized)
    assert list(report.kernels.values()) == [kernel]  # upstream's expected_node
    assert report.mode == ("dynamic" if is_dynamic else "static")
    assert not any(isinstance(m, ReferenceWeighted) for m in quantized.modules())  # no prepack left
    assert qp.sqnr(model(*inputs), quantized(*inputs)) > 20


@pytest.mark.parametrize("case", range(10), ids=CASE_IDS)
def test_conv_linear_reference(case):
    is_dynamic, module_class, ctor, inputs, _ = _conv_linear_cases()[case]
    model = module_class(*ctor)
    qr = qp.convert_to_reference_fx(_prepare(is_dynamic, model, inputs))
    references = [(n, m) for n, m in qr.named_modules() if isinstance(m, ReferenceWeighted)]
    assert len(references) == 1  # upstream: one nnqr.Conv*/Linear module
    name, ref = references[0]
    assert ref.weight_qparams is not None and ref.weight_qparams.dtype == torch.qint8
    qr = copy.deepcopy(qr)  # the qparams are preserved after copy
    ref = qr.get_submodule(name)
    assert ref.weight_qparams is not None
    # serialization: the weight qparams are in the state_dict and load_state_dict restores them
    state_dict = copy.deepcopy(qr.state_dict())
    keys = [f"{name}.weight_qparams_holder.scale", f"{name}.weight_qparams_holder.zero_point"]
    assert all(k in state_dict for k in keys)
    prev_scale = ref.weight_qparams_holder.scale.clone()
    ref.weight_qparams_holder.scale.fill_(123.0)
    qr.load_state_dict(state_dict)
    assert torch.equal(prev_scale, qr.get_submodule(name).weight_qparams_holder.scale)
