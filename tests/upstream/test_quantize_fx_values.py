"""Port of PyTorch's ``TestQuantizeFx`` cases about values that are not float tensors and about
the converted model as an object (``test/quantization/fx/test_quantize_fx.py``):
``test_getattr_with_nontensor_result``, ``test_shape_followed_by_quantized_op``,
``test_assert_on_size_after_quant_layer``, the ``test_*_nontensor_args_not_observed`` family,
``test_fp32_sum``, ``test_fusion_pattern_unquantized``, ``test_quantized_model_type``,
``test_prepared_model_deepcopy``, ``test_linear_qint8_activation``, ``test_ref_linear_module``,
``test_ref_conv_module`` and the preparing part of ``TestFuseFx.test_fuse_conv_bn_relu``.

Translation as in ``test_quantize_fx_slice.py``. Many of these upstream cases only check that a
model "runs" although nothing in it is quantized; qplug raises ``NothingQuantizedError`` for such
a model unless ``allow_float=True`` (docs/migrating.md), so each case asserts that error and its
reason, then the upstream flow with qplug's switches for torch.ao's behaviour.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from upstream_testkit import call_module, check_graph_module_nodes, default_qconfig

import qplug_core as qp
import qplug_core.nn.intrinsic as nni
from qplug_core.errors import InputMismatchError, ModelStateError, NothingQuantizedError
from qplug_core.flows.tags import OBSERVER, VALUE_KIND
from qplug_core.kernels.reference import Dequantize, ReferenceWeighted
from qplug_core.observers import HistogramObserver, PerChannelMinMaxObserver

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


def _mapping() -> qp.QConfigMapping:
    return qp.QConfigMapping().set_global(default_qconfig())


def _prepared(model, example_inputs, mapping=None, **options):
    prepared = qp.prepare_fx(model.eval(), mapping or _mapping(), example_inputs, backend="fbgemm",
                             **options)
    prepared(*example_inputs)
    return prepared


def _calls(gm, word: str) -> int:
    """How many call_module nodes of the converted graph are qplug's quantize / dequantize steps."""
    return sum(n.op == "call_module" and re.search(rf"_{word}_\d+$", n.target) is not None
               for n in gm.graph.nodes)


# -- getattr with a non-tensor result --------------------------------------------------------------


class NdimAdd(nn.Module):
    def forward(self, x):
        dims = x.ndim
        dims_sub = dims - 1
        dims_sub2 = dims_sub - 1
        return torch.add(x, dims_sub2)


class NdimView(nn.Module):
    def forward(self, x):
        dims = x.ndim
        dims_sub = dims - 2
        mul = [1] * dims_sub
        dims_list = [-1, x.size(1)] + mul
        return x.view(dims_list)


class ShapeView(nn.Module):
    def forward(self, x):
        shape = x.shape
        return x.view(shape)


@pytest.mark.parametrize("model", [NdimAdd, NdimView, ShapeView])
def test_getattr_with_nontensor_result(model):
    example_inputs = (torch.rand(4, 4, 4, 4),)
    # nothing here is worth int8: an add of an int computed from x.ndim on its own, views
    with pytest.raises(NothingQuantizedError, match="nothing was quantized") as error:
        qp.convert_fx(_prepared(model(), example_inputs))
    reasons = " ".join(reason for reason, _ in error.value.reasons)
    assert ("no int8 value reaches it" if model is NdimAdd else "") in reasons
    # upstream's flow: every matched op quantized (keep_isolated_ops_float=False), a float result
    # accepted (allow_float=True); the non-tensor values (ndim, size, shape) are never observed
    prepared = _prepared(model(), example_inputs, keep_isolated_ops_float=False)
    for node in prepared.graph.nodes:
        if OBSERVER in node.meta:
            assert node.args[0].meta[VALUE_KIND] == "float_tensor", node.args[0]
    quantized = qp.convert_fx(prepared, allow_float=True)
    x = torch.rand(4, 4, 4, 4)
    expected = model()(x)
    if model is NdimAdd:  # the add is int8 with the scalar folded in
        assert qp.quantization_report(quantized).quantized == {"add": "torch.add"}
        torch.testing.assert_close(quantized(x), expected, atol=0.02, rtol=0)
    else:
        assert torch.equal(quantized(x), expected)


def test_shape_followed_by_quantized_op():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(2, 2, 2)
            self.conv2 = nn.Conv2d(2, 2, 2)

        def forward(self, x):
            x = self.conv1(x)
            s = x.shape
            torch._assert(s == x.shape, "")
            return self.conv2(x)

    example_inputs = (torch.randn(2, 2, 4, 4),)
    quantized = qp.convert_fx(_prepared(M(), example_inputs))
    quantized(*example_inputs)
    # the shape read does not break the int8 chain: one quantize at the input and conv2 takes
    # conv1's int8 output (upstream: one quantize_per_tensor, one dequantize); qplug reads the
    # shape from a dequantized view of conv1's output
    assert _calls(quantized, "quantize") == 1
    conv2 = next(n for n in quantized.graph.nodes if n.target == "conv2")
    assert conv2.args[0].target == "conv1"


def test_assert_on_size_after_quant_layer():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            x = self.conv1(x)
            torch._assert(x.size(1) == 1, "foobar")
            return x

    example_inputs = (torch.rand(4, 1, 4, 4),)
    quantized = qp.convert_fx(_prepared(M(), example_inputs))
    quantized(*example_inputs)
    assert qp.quantization_report(quantized).kernels == {"conv1": "quantized::conv2d"}


class NonReferenceTestModel(nn.Module):
    def __init__(self, func, lin_in, lin_out):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.lin = nn.Linear(lin_in, lin_out)
        self.func = func

    def forward(self, x, y, z):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        x = self.func(x, y, z)
        return self.lin(x)


NONTENSOR_CASES = {  # upstream's func, lin_in, (y, z)
    "masked_fill": (lambda x, y, z: x.masked_fill(y, z), 1176, (torch.randn(1176) > 0, 0.1)),
    "permute": (lambda x, y, z: x.permute(y, z), 1176, (0, 1)),
    "repeat": (lambda x, y, z: x.repeat(y, z), 1176, (2, 1)),
    "reshape": (lambda x, y, z: x.reshape(-1, y), 5, (5, None)),
    "size": (lambda x, y, z: x.reshape((-1, x.size(y))), 5, (0, None)),
    "transpose": (lambda x, y, z: x.transpose(y, z), 5, (0, 1)),
    "torch_transpose": (lambda x, y, z: torch.transpose(x, 0, 1), 5, (0, 1)),
    "unsqueeze": (lambda x, y, z: x.unsqueeze(y), 1176, (1, None)),
    "unsqueeze_": (lambda x, y, z: x.unsqueeze_(y), 1176, (1, None)),
    "torch_unsqueeze": (lambda x, y, z: torch.unsqueeze(x, 1), 1176, (1, None)),
    "view": (lambda x, y, z: x.view(-1, y), 5, (5, None)),
    "list_args": (lambda x, y, z: x.reshape(y), 5, ([-1, 5], None)),
    "split_list_args": (lambda x, y, z: x.reshape([y, z]), 5, (-1, 5)),
    "tuple_args": (lambda x, y, z: x.reshape(y), 5, ((-1, 5), None)),
    "split_tuple_args": (lambda x, y, z: x.reshape((y, z)), 5, (-1, 5)),
    "dict_args": (lambda x, y, z: x.transpose(y["first"], y["second"]), 5,
                  ({"first": 0, "second": 1}, None)),
    "dict_tuple_args": (lambda x, y, z: x.reshape(y["shape"]), 5, ({"shape": (-1, 5)}, None)),
    "dict_split_tuple_args": (lambda x, y, z: x.reshape((y["first"], y["second"])), 5,
                              ({"first": -1, "second": 5}, None)),
}


@pytest.mark.parametrize("case", list(NONTENSOR_CASES))
def test_nontensor_args_not_observed(case):
    """Upstream's ``_test_dtype_propagation``: with the backend's default mapping, no observer
    sits on a value that is not a float tensor, and the prepared model runs."""
    func, lin_in, (y, z) = NONTENSOR_CASES[case]
    model = NonReferenceTestModel(func, lin_in, 1).eval()
    args = (torch.randn(5, 3, 32, 32), y, z)  # the batch of 5 is part of the shapes
    prepared = qp.prepare_fx(model, qp.get_default_qconfig_mapping("fbgemm"), args, backend="fbgemm")
    observed = [n for n in prepared.graph.nodes if OBSERVER in n.meta]
    assert observed
    assert all(n.args[0].meta[VALUE_KIND] == "float_tensor" for n in observed)
    prepared(*args)
    quantized = qp.convert_fx(prepared)
    assert "conv1" in qp.quantization_report(quantized).kernels
    assert qp.sqnr(model(*copy.deepcopy(args)), quantized(*copy.deepcopy(args))) > 15


@pytest.mark.parametrize("second_conv", [False, True], ids=["sum_last", "sum_between_convs"])
def test_fp32_sum(second_conv):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 1, 1)
            self.conv2 = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            x = torch.stack([self.conv1(x)])
            if second_conv:
                return self.conv2(torch.sum(x, dim=0))
            return torch.sum(x)

    torch.manual_seed(0)  # unseeded, a 1x1 single-channel conv drawn near zero failed the SQNR bound
    example_inputs = (torch.rand(4, 1, 4, 4),)
    model = M().eval()
    quantized = qp.convert_fx(_prepared(model, example_inputs))
    x = torch.rand(4, 1, 4, 4)
    assert qp.sqnr(model(x), quantized(x)) > 25
    assert set(qp.quantization_report(quantized).kernels) == (
        {"conv1", "conv2"} if second_conv else {"conv1"})


def test_fusion_pattern_unquantized():
    """A fusable add-relu left float by ``module_name(child, None)`` runs through the flow."""
    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.relu = nn.ReLU()

        def forward(self, x):
            x = torch.add(x, 1.0)
            return F.relu(x)

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            return self.conv(self.child(x))

    example_inputs = (torch.rand(1, 1, 1, 1),)
    mapping = _mapping().set_module_name("child", None)
    quantized = qp.convert_fx(_prepared(Parent(), example_inputs, mapping))
    report = qp.quantization_report(quantized)
    assert report.kernels == {"conv": "quantized::conv2d"}
    assert {s.op for s in report.skipped} >= {"add"}


# -- the converted model as an object ----------------------------------------------------------------


class LinearM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x):
        return self.linear(x)


def test_quantized_model_type(tmp_path):
    """deepcopy works; ``load_state_dict`` of a lowered model is refused with what to do instead
    (upstream restores the packed weights; docs/migrating.md), and that works."""
    example_inputs = (torch.rand(8, 5),)
    quantized = qp.convert_fx(_prepared(LinearM(), example_inputs))
    quantized_copy = copy.deepcopy(quantized)
    assert torch.equal(quantized_copy(*example_inputs), quantized(*example_inputs))

    state_dict = quantized.state_dict()
    fresh = qp.convert_fx(_prepared(LinearM(), example_inputs))
    with pytest.raises(ModelStateError, match=r"packed outside the state_dict\. Save and load "
                                              r"graph-mode models with qp\.save / qp\.load \(eager-mode "
                                              r"models cannot be saved\)"):
        fresh.load_state_dict(state_dict)
    qp.save(quantized, tmp_path / "linear.qplug")
    loaded = qp.load(tmp_path / "linear.qplug")
    assert torch.equal(loaded(*example_inputs), quantized(*example_inputs))
    # quantizing the converted model again is refused too, naming what to quantize instead
    with pytest.raises(ModelStateError, match="already quantized .* quantize the original float model"):
        qp.prepare_fx(quantized, _mapping(), example_inputs, backend="fbgemm")


def test_prepared_model_deepcopy():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)
            self._foobar = "foobar"
            self.foobar2 = "foobar2"

        def forward(self, x):
            return self.conv(x)

    example_inputs = (torch.randn(4, 1, 4, 4),)
    prepared = _prepared(M(), example_inputs)
    prepared_copy = copy.deepcopy(prepared)
    quantized = qp.convert_fx(prepared_copy)
    assert torch.equal(quantized(*example_inputs), qp.convert_fx(prepared)(*example_inputs))


# -- the reference form -------------------------------------------------------------------------


class ConvLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 2, 2)
        self.linear = nn.Linear(8, 5)

    def forward(self, x):
        x = self.conv(x)
        x = torch.flatten(x, 1)
        return self.linear(x)


def test_linear_qint8_activation():
    """Upstream's conv + linear with signed (qint8) activations, converted to the reference form.

    No installed backend has kernels for signed activations, so the ops stay float with that
    reason and the result is refused as not quantized; torch.ao also leaves both float (its
    native config lists quint8 activations only) but returns the float model silently."""
    example_inputs = (torch.rand(2, 1, 5, 5),)
    qint8 = qp.QConfig(
        activation=HistogramObserver.with_args(qscheme=torch.per_tensor_symmetric, dtype=torch.qint8),
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8,
                                                  qscheme=torch.per_channel_symmetric))
    with pytest.warns(UserWarning, match="stays float: .*dtype torch.qint8 is not the backend's "
                                         "torch.quint8"):
        prepared = _prepared(ConvLinear(), example_inputs, qp.QConfigMapping().set_global(qint8))
    with pytest.raises(NothingQuantizedError, match="dtype torch.qint8 is not the backend's torch.quint8"):
        qp.convert_to_reference_fx(prepared)
    reference = qp.convert_to_reference_fx(prepared, allow_float=True)
    assert torch.equal(reference(*example_inputs), prepared(*example_inputs))

    # the oracle: torch.ao's own flow puts no quantize step in that reference model either
    quantize_fx = pytest.importorskip("torch.ao.quantization.quantize_fx")
    import torch.ao.quantization as tq
    ao_qconfig = tq.QConfig(
        activation=tq.HistogramObserver.with_args(qscheme=torch.per_tensor_symmetric, dtype=torch.qint8),
        weight=tq.default_per_channel_weight_observer)
    with pytest.warns(Warning):  # torch.ao's deprecation warning
        ao = quantize_fx.prepare_fx(ConvLinear().eval(), {"": ao_qconfig}, example_inputs)
        ao(*example_inputs)
        ao_reference = quantize_fx.convert_to_reference_fx(ao)
    assert not any(n.target == torch.quantize_per_tensor for n in ao_reference.graph.nodes)

    # with quint8 activations (the qconfigs upstream's defaults use) both layers get the form
    prepared = _prepared(ConvLinear(), example_inputs, qp.QConfigMapping().set_global(
        qp.QConfig(activation=HistogramObserver, weight=qint8.weight)))
    reference = qp.convert_to_reference_fx(prepared)
    assert sum(isinstance(m, ReferenceWeighted) for m in reference.modules()) == 2
    reference(*example_inputs)


def _assert_within_one_step(lowered, reference, *inputs) -> None:
    """Upstream asserts the lowered and reference outputs equal. The backend kernel rounds its
    int32 accumulator once where the reference form rounds float maths: the two agree to the bit
    except where a value lands on a rounding tie, and then by one step of the output scale (the
    tolerance every kernel is checked with at convert; it also holds across CPU ISAs)."""
    scale = float([m for m in reference.modules() if isinstance(m, Dequantize)][-1].qparams.scale)
    got, expected = lowered(*inputs), reference(*inputs)
    assert (got - expected).abs().max().item() <= scale * 1.001
    assert (got == expected).float().mean().item() >= 0.95


@pytest.mark.parametrize("relu", [False, True], ids=["linear", "linear_relu"])
def test_ref_linear_module(relu):
    """The lowered model computes what its reference form does."""
    model = nn.Sequential(nn.Linear(10, 5), *([nn.ReLU()] if relu else [])).eval()
    example_inputs = (torch.randn(5, 10),)
    prepared = _prepared(model, example_inputs)
    lowered = qp.convert_fx(copy.deepcopy(prepared))
    reference = qp.convert_to_reference_fx(prepared)
    _assert_within_one_step(lowered, reference, *example_inputs)


@pytest.mark.parametrize("relu", [False, True], ids=["conv", "conv_relu"])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_ref_conv_module(dim, relu):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim](3, 3, 3)
    model = nn.Sequential(conv, *([nn.ReLU()] if relu else [])).eval()
    data = torch.rand(2, 3, *([10] * dim))  # upstream's img_data_dict shapes
    prepared = _prepared(model, (data,))
    lowered = qp.convert_fx(copy.deepcopy(prepared))
    reference = qp.convert_to_reference_fx(prepared)
    _assert_within_one_step(lowered, reference, data)
    assert list(qp.quantization_report(lowered).kernels.values()) == [f"quantized::conv{dim}d"]


# -- TestFuseFx.test_fuse_conv_bn_relu: what prepare runs ---------------------------------------------


class Unrunnable(nn.Module):
    """Upstream's model: conv1d then conv2d on the same tensor runs on no input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d, self.bn1d = nn.Conv1d(1, 1, 1), nn.BatchNorm1d(1)
        self.conv2d, self.bn2d, self.relu = nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.ReLU()

    def forward(self, x):
        x = self.bn1d(self.conv1d(x))
        return self.relu(self.bn2d(self.conv2d(x)))


@pytest.mark.parametrize("prepare", [qp.prepare_fx, qp.prepare_qat_fx], ids=["ptq", "qat"])
def test_prepare_with_an_empty_mapping_only_fuses(prepare):
    """Nothing to observe: prepare fuses without running the model (torch.ao does the same)."""
    model = Unrunnable().train() if prepare is qp.prepare_qat_fx else Unrunnable().eval()
    everything_none = qp.QConfigMapping().set_object_type(nn.Conv2d, None)
    prepared = prepare(model, everything_none, (torch.randn(1, 1, 1, 1),), backend="fbgemm")
    if prepare is qp.prepare_qat_fx:
        check_graph_module_nodes(prepared, [call_module(nni.ConvBn1d), call_module(nni.ConvBnReLU2d)])
    else:
        check_graph_module_nodes(prepared, [call_module(nn.Conv1d), call_module(nni.ConvReLU2d)])
    assert not any(OBSERVER in n.meta for n in prepared.graph.nodes)


def test_prepare_with_qconfigs_runs_the_model_once():
    """With a qconfig to honour, prepare must learn which values are tensors: a model that cannot
    run on the example inputs is an InputMismatchError naming the inputs (docs/migrating.md)."""
    with pytest.raises(InputMismatchError, match=r"cannot run on the example inputs \(\(1, 1, 1, 1\)\)"):
        qp.prepare_fx(Unrunnable().eval(), _mapping(), (torch.randn(1, 1, 1, 1),), backend="fbgemm")
