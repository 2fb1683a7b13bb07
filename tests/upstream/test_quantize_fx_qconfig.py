"""Port of PyTorch's ``TestQuantizeFx`` qconfig cases (``test/quantization/fx/test_quantize_fx.py``):
which ops a QConfigMapping quantizes (``test_qconfig_*``), QAT qconfigs per module type, float16
qconfigs (``test_mul_add_fp16_config``, ``test_dynamic_quant_fp16``) and functional linears and
convs (``test_qconfig_for_call_func``, ``test_qparams_buffers``, ``test_packed_weight_fused_op``,
``test_functional_linear``, ``test_functional_conv``).

Upstream's functional models hold their weights as plain tensor attributes (``self.w =
torch.ones(5, 5)``), which torch.fx stores as buffers. qplug turns a functional linear/conv into a
module only when its weight is an ``nn.Parameter``; on a buffer it stays a functional op
(docs/migrating.md). The ports hold the weights as frozen parameters for upstream's results, and
``test_functional_linear_on_a_buffer`` asserts the other behaviour.

Translation as in ``test_quantize_fx_slice.py``: a ``qconfig_dict`` -> ``qp.QConfigMapping``;
``nnq.Conv2d`` / ``nnq.Linear`` / ``torch.ops.quantized.linear`` in a converted graph -> the
report's kernel for that layer; ``default_qconfig`` / ``default_qat_qconfig`` /
``float16_dynamic_qconfig`` -> qconfigs of the same observers (below). Where qplug differs on
purpose (docs/migrating.md, "Found by porting PyTorch's tests"), the case asserts qplug's behaviour
and its message.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from upstream_testkit import LinReluLin, default_qat_qconfig, default_qconfig

import qplug_core as qp
from qplug_core.config.defaults import float16_dynamic_qconfig
from qplug_core.errors import ModelStateError, NothingQuantizedError
from qplug_core.kernels.dynamic import DynamicLinear
from qplug_core.observers import PlaceholderObserver

pytestmark = pytest.mark.usefixtures("plugin_autoload", "one_thread")


def _quantize(model, mapping, example_inputs, **prepare_options):
    prepared = qp.prepare_fx(model.eval(), mapping, example_inputs, backend="fbgemm",
                             **prepare_options)
    prepared(*example_inputs)
    quantized = qp.convert_fx(prepared)
    quantized(*example_inputs)
    return quantized


class TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 1, 1)
        self.conv2 = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        return self.conv2(self.conv1(x))


def test_qconfig_none():
    mapping = qp.QConfigMapping().set_global(default_qconfig()).set_module_name("conv2", None)
    quantized = _quantize(TwoConvs(), mapping, (torch.randn(1, 1, 1, 1),))
    # first conv is quantized, second conv is not quantized
    report = qp.quantization_report(quantized)
    assert report.kernels == {"conv1": "quantized::conv2d"}
    assert type(quantized.conv2) is nn.Conv2d
    assert [s.reason for s in report.skipped if s.node == "conv2"] == [
        "qconfig is None for this op (not requested)"]


def test_qconfig_module_type():
    """Upstream's conv + linear model: only ``nn.Conv2d`` has a qconfig."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)
            self.linear = nn.Linear(9, 3)

        def forward(self, x):
            x = self.conv(x)
            x = x.reshape((1, -1))
            return self.linear(x)

    mapping = qp.QConfigMapping().set_object_type(nn.Conv2d, default_qconfig())
    quantized = _quantize(M(), mapping, (torch.randn(1, 1, 3, 3),))
    # quantize -> quantized conv -> dequantize -> float linear
    assert qp.quantization_report(quantized).kernels == {"conv": "quantized::conv2d"}
    assert type(quantized.linear) is nn.Linear
    order = [n.target for n in quantized.graph.nodes if n.op == "call_module"]
    assert order.index("conv") < order.index("linear")
    assert any(target.startswith("conv_dequantize") for target in order)


def test_qconfig_qat_module_type():
    """A QAT qconfig per module type; upstream converts the model while it is still training."""
    mapping = (qp.QConfigMapping().set_global(None)
               .set_object_type(nn.Linear, default_qat_qconfig())
               .set_object_type(nn.ReLU, default_qat_qconfig()))
    example_inputs = (torch.rand(5, 5),)
    prepared = qp.prepare_qat_fx(LinReluLin().train(), mapping, example_inputs, backend="fbgemm")
    prepared(*example_inputs)
    import qplug_core.nn.qat as nnqat
    assert isinstance(prepared.get_submodule("lin_relu.0"), nnqat.LinearReLU)
    assert type(prepared.linear) is nnqat.Linear
    # qplug refuses to convert a QAT model in training mode, and says what to do
    with pytest.raises(ModelStateError, match=r"still in training mode; call model\.eval\(\)"):
        qp.convert_fx(prepared)
    quantized = qp.convert_fx(prepared.eval())
    quantized(*example_inputs)
    # upstream: quantize_per_tensor -> nniq.LinearReLU -> nnq.Linear -> dequantize
    report = qp.quantization_report(quantized)
    assert report.kernels == {"lin_relu.0": "quantized::linear", "linear": "quantized::linear"}
    assert [f.fused_type for f in report.fusions] == ["LinearReLU"]
    assert report.mode == "qat"


def test_qconfig_function():
    class M(nn.Module):
        def forward(self, x, y):
            return x + y

    data = torch.randn(1, 1, 1, 1)
    mapping = qp.QConfigMapping().set_object_type(operator.add, default_qconfig())
    # an add between two float inputs is an isolated op qplug keeps float by default
    # (docs/migrating.md); keep_isolated_ops_float=False quantizes it as torch.ao does
    with pytest.raises(NothingQuantizedError, match="no int8 value reaches it"):
        _quantize(M(), mapping, (data, data))
    quantized = _quantize(M(), mapping, (data, data), keep_isolated_ops_float=False)
    assert qp.quantization_report(quantized).kernels == {"add": "quantized::add"}


def test_qconfig_module_name_regex():
    mapping = qp.QConfigMapping().set_module_name_regex("conv*", default_qconfig())
    quantized = _quantize(TwoConvs(), mapping, (torch.randn(1, 1, 1, 1),))
    assert qp.quantization_report(quantized).kernels == {"conv1": "quantized::conv2d",
                                                         "conv2": "quantized::conv2d"}
    # both convs in one int8 chain: one quantize at the input, one dequantize at the output
    calls = [n.target for n in quantized.graph.nodes if n.op == "call_module"]
    assert sum("quantize" in t and "dequantize" not in t for t in calls) == 1
    assert sum("dequantize" in t for t in calls) == 1


@pytest.mark.parametrize("relu", [nn.ReLU(), F.relu, torch.relu], ids=["module", "functional", "torch"])
@pytest.mark.parametrize("model", ["linear", "conv", "conv_bn"])
def test_qconfig_dict_with_fused_modules(model, relu):
    """Upstream: preparing these with the default mapping must not crash (pytorch#75825)."""
    layers = {"linear": lambda: [nn.Linear(3, 3)], "conv": lambda: [nn.Conv1d(3, 3, 3)],
              "conv_bn": lambda: [nn.Conv1d(3, 3, 3), nn.BatchNorm1d(3)]}[model]()

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)
            self.relu = relu

        def forward(self, x):
            return self.relu(self.layers(x))

    example_inputs = (torch.randn(1, 3, 3, 3) if model == "linear" else torch.randn(1, 3, 3),)
    prepared = qp.prepare_fx(M().eval(), qp.get_default_qconfig_mapping("fbgemm"), example_inputs,
                             backend="fbgemm")
    prepared(*example_inputs)
    quantized = qp.convert_fx(prepared)
    # conv + torch.relu is not upstream's fusion pattern ("TODO: add fusion for torch.relu"); it is
    # qplug's, as linear + torch.relu is
    fused = {"linear": ["LinearReLU"], "conv": ["ConvReLU1d"], "conv_bn": ["ConvReLU1d"]}[model]
    assert [f.fused_type for f in qp.quantization_report(quantized).fusions] == fused


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """Upstream's plain tensor attribute, as the frozen parameter qplug treats as a weight."""
    return nn.Parameter(tensor, requires_grad=False)


class ConstLinear(nn.Module):
    """Upstream's functional linear on constant weights (``plain=True``: plain tensors, as upstream)."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        wrap = (lambda t: t) if plain else frozen
        self.w = wrap(torch.ones(5, 5))
        self.b = wrap(torch.zeros(5))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


class ThreeConstLinears(nn.Module):
    def __init__(self, scale_first: bool = False, relu: bool = False, plain: bool = False) -> None:
        super().__init__()
        self.mods1 = nn.Sequential(ConstLinear(plain), ConstLinear(plain))
        self.mods2 = ConstLinear(plain)
        self.scale_first, self.relu = scale_first, relu

    def forward(self, x):
        if self.scale_first:
            x = x * 5
            x = x + 5
        x = self.mods2(self.mods1(x))
        return F.relu(x) if self.relu else x


def test_qconfig_for_call_func():
    """Functional linears on constant weights are weighted ops; ``mods2`` is configured float."""
    mapping = qp.QConfigMapping().set_global(default_qconfig()).set_module_name("mods2", None)
    example_inputs = (torch.rand(5, 5),)
    model = ThreeConstLinears().eval()
    quantized = _quantize(model, mapping, example_inputs)
    report = qp.quantization_report(quantized)
    # upstream: quantize -> quantized.linear -> quantized.linear -> dequantize -> F.linear
    assert list(report.kernels.values()) == ["quantized::linear", "quantized::linear"]
    assert [(s.node, s.reason) for s in report.skipped] == [
        ("mods2.linear_2_module", "qconfig is None for this op (not requested)")]
    x = torch.rand(5, 5)
    assert qp.sqnr(model(x), quantized(x)) > 30


@pytest.mark.parametrize("relu", [False, True], ids=["linear", "linear_relu"])
def test_qparams_buffers_and_packed_weight_fused_op(relu):
    """``test_qparams_buffers`` / ``test_packed_weight_fused_op``: every constant-weight linear is
    lowered (upstream: a ``*_packed_weight_0`` attribute each); a trailing F.relu fuses."""
    example_inputs = (torch.rand(5, 5),)
    model = ThreeConstLinears(relu=relu).eval()
    quantized = _quantize(model, qp.QConfigMapping().set_global(default_qconfig()), example_inputs)
    report = qp.quantization_report(quantized)
    assert list(report.kernels.values()) == ["quantized::linear"] * 3
    assert [f.fused_type for f in report.fusions] == (["LinearReLU"] if relu else [])
    x = torch.rand(5, 5)
    assert qp.sqnr(model(x), quantized(x)) > 30


def test_functional_linear_on_a_buffer():
    """Upstream's plain tensor weights (buffers once traced) are weighted ops like parameters:
    three ``quantized::linear`` static, three float16 ``DynamicLinear`` dynamic."""
    example_inputs = (torch.rand(5, 5),)
    model = ThreeConstLinears(plain=True).eval()
    quantized = _quantize(model, qp.QConfigMapping().set_global(default_qconfig()), example_inputs)
    assert list(qp.quantization_report(quantized).kernels.values()) == ["quantized::linear"] * 3
    x = torch.rand(5, 5)
    assert qp.sqnr(model(x), quantized(x)) > 30
    assert isinstance(model.mods2.w, torch.Tensor) and not isinstance(model.mods2.w, nn.Parameter)
    prepared = qp.prepare_fx(model, qp.QConfigMapping().set_global(float16_dynamic_qconfig()),
                             example_inputs, backend="fbgemm")
    dynamic = qp.convert_fx(prepared)
    linears = [m for m in dynamic.modules() if isinstance(m, DynamicLinear)]
    assert len(linears) == 3 and all(m.dtype == torch.float16 for m in linears)


class StatefulLinear(nn.Module):
    """A buffer the forward writes in place is state, not a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.eye(5))

    def forward(self, x):
        self.w.add_(x.mean() * 0)  # traced: an in-place write of the buffer in the graph
        return F.linear(x, self.w)


def test_functional_linear_on_a_written_buffer_stays_functional():
    example_inputs = (torch.rand(5, 5),)
    prepared = qp.prepare_fx(StatefulLinear().eval(), qp.QConfigMapping().set_global(default_qconfig()),
                             example_inputs, backend="fbgemm")
    assert not any(isinstance(m, nn.Linear) for m in prepared.modules())
    assert any(n.target is F.linear for n in prepared.graph.nodes)


def test_mul_add_fp16_config():
    """A global float16 dynamic qconfig: the linears get float16 weights; mul/add stay float."""
    example_inputs = (torch.rand(5, 5),)
    model = ThreeConstLinears(scale_first=True).eval()
    mapping = qp.QConfigMapping().set_global(float16_dynamic_qconfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = qp.prepare_fx(model, mapping, example_inputs, backend="fbgemm")
    assert [str(w.message).removeprefix("qplug: ").split(":")[0] for w in caught] == [
        "operator.mul at node 'mul' stays float", "operator.add at node 'add' stays float"]
    quantized = qp.convert_fx(prepared)
    x = torch.rand(5, 5)
    torch.testing.assert_close(quantized(x), model(x))  # ones and zeros are exact in float16
    report = qp.quantization_report(quantized)
    assert len(report.kernels) == 3 and report.mode == "dynamic"
    linears = [m for m in quantized.modules() if isinstance(m, DynamicLinear)]
    assert len(linears) == 3 and all(m.dtype == torch.float16 for m in linears)
    assert {s.op for s in report.skipped} == {"mul", "add"}


class FuncLinear(nn.Module):
    def __init__(self, use_bias: bool) -> None:
        super().__init__()
        self.w = frozen(torch.randn(4, 30))
        self.b = frozen(torch.randn(4))
        self.use_bias = use_bias

    def forward(self, x):
        return F.linear(x, self.w, self.b) if self.use_bias else F.linear(x, self.w)


class LinearModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(30, 4)

    def forward(self, x):
        return self.linear(x)


@pytest.mark.parametrize("make", [lambda: FuncLinear(True), lambda: FuncLinear(False), LinearModule],
                         ids=["functional_bias", "functional", "module"])
def test_dynamic_quant_fp16(make):
    """``test_dynamic_quant_fp16`` / ``test_linear_dynamic_fp16``: float16 weights, float in/out;
    the reference form keeps the weight rounded to float16, the lowered form packs it."""
    model = make().eval()
    example_inputs = (torch.rand(1, 30),)
    mapping = qp.QConfigMapping().set_global(float16_dynamic_qconfig())
    prepared = qp.prepare_fx(model, mapping, example_inputs, backend="fbgemm")
    lowered = qp.convert_fx(prepared)
    linears = [m for m in lowered.modules() if isinstance(m, DynamicLinear)]
    assert len(linears) == 1 and linears[0].dtype == torch.float16
    reference = qp.convert_to_reference_fx(prepared)
    x = torch.rand(8, 30)
    weight = next(m for m in reference.modules() if hasattr(m, "weight")).weight
    expected = F.linear(x, model.linear.weight if isinstance(model, LinearModule) else model.w,
                        None)
    torch.testing.assert_close(weight, (model.linear.weight if isinstance(model, LinearModule)
                                        else model.w).half().float())
    for out in (reference(x), lowered(x)):
        bias = (model.linear.bias if isinstance(model, LinearModule)
                else model.b if model.use_bias else 0)
        torch.testing.assert_close(out, expected + bias, atol=2e-2, rtol=1e-2)


class ConvSub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        x = x.transpose(2, 3)
        x = self.conv(x)
        return x.transpose(2, 3)


class ConvSubConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = ConvSub()
        self.conv1 = nn.Conv2d(1, 1, 1)
        self.conv2 = nn.Conv2d(1, 1, 1)

    def forward(self, x):
        x = self.conv1(x)
        x = self.sub(x)
        x = self.conv2(x)
        return x.transpose(2, 3)


def _module_calls(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_module", "call_method")]


@pytest.mark.parametrize("sub_quantized", [False, True], ids=["sub_none", "only_sub"])
def test_qconfig_for_call_method(sub_quantized):
    """A module-name qconfig covers the method calls (transpose) inside that module."""
    mapping = (qp.QConfigMapping().set_module_name("sub", default_qconfig()) if sub_quantized else
               qp.QConfigMapping().set_global(default_qconfig()).set_module_name("sub", None))
    torch.manual_seed(0)  # the weights and the data: not whatever tests ran before in this process
    example_inputs = (torch.randn(2, 1, 3, 3),)
    model = ConvSubConv().eval()
    quantized = _quantize(model, mapping, example_inputs)
    kernels = qp.quantization_report(quantized).kernels
    if sub_quantized:
        # upstream: conv1 float, quantize, transpose, nnq.Conv2d, transpose, dequantize, ...
        # qplug quantizes after the transpose (a shape op on its own stays float)
        assert kernels == {"sub.conv": "quantized::conv2d"}
        assert _module_calls(quantized) == ["conv1", "transpose", "transpose_quantize_0", "sub.conv",
                                            "sub_conv_dequantize_1", "transpose", "conv2", "transpose"]
    else:
        # upstream: the output of conv1 is dequantized for float sub, conv2's input quantized
        # again; the last transpose is int8 upstream, float here (its output feeds no int8 op)
        assert kernels == {"conv1": "quantized::conv2d", "conv2": "quantized::conv2d"}
        assert _module_calls(quantized) == [
            "x_quantize_0", "conv1", "conv1_dequantize_1", "transpose", "sub.conv", "transpose",
            "transpose_1_quantize_2", "conv2", "conv2_dequantize_3", "transpose"]
    x = example_inputs[0]  # inside the calibrated ranges (one batch cannot calibrate for another)
    assert qp.sqnr(model(x), quantized(x)) > 25


def test_dequantize():
    """A dequantize is placed before an op that is not quantized (GELU)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(self.conv(x))

    quantized = _quantize(M(), qp.QConfigMapping().set_global(default_qconfig()),
                          (torch.rand(5, 1, 3, 3),))
    assert _module_calls(quantized) == ["x_quantize_0", "conv", "conv_dequantize_1", "act"]
    assert type(quantized.act) is nn.GELU


def test_dict_output():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            return {"output": self.conv(x["input"])}

    model = M().eval()
    example_inputs = ({"input": torch.randn(1, 1, 1, 1)},)
    quantized = _quantize(model, qp.QConfigMapping().set_global(default_qconfig()), example_inputs)
    out = quantized(*example_inputs)
    assert list(out) == ["output"]
    torch.testing.assert_close(out["output"], model(*example_inputs)["output"], atol=0.02, rtol=0)


def test_attention():
    """A corner case of attention (chunk, views, an assert on a size, mm) around an int8 conv."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            x = self.conv(x)
            q, k, v = x.chunk(3, dim=0)
            q = q.contiguous().view(-1, 1).transpose(0, 1)
            k = k.contiguous().view(-1, 1).transpose(0, 1)
            v = v.contiguous().view(-1, 1).transpose(0, 1)
            torch._assert(k.size(1) == 1, "key size should be equal to 1")
            r = torch.mm(k, v)
            return q * k + r

    mapping = qp.QConfigMapping().set_global(None).set_object_type(nn.Conv2d, default_qconfig())
    quantized = _quantize(M(), mapping, (torch.randn(3, 1, 1, 1),))
    assert qp.quantization_report(quantized).kernels == {"conv": "quantized::conv2d"}


class BinaryOp(nn.Module):
    """Upstream's ``BinaryOp``: op(conv1(x), conv2(y) or 3), then op(that, x)."""

    def __init__(self, op, is_scalar: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 1, 1)
        self.conv2 = nn.Conv2d(1, 1, 1)
        self.op, self.is_scalar = op, is_scalar

    def forward(self, x, y):
        x = self.conv1(x)
        y = 3 if self.is_scalar else self.conv2(y)
        x = self.op(x, y)
        return self.op(y, x)


@pytest.mark.parametrize("is_scalar", [False, True], ids=["tensor", "scalar"])
@pytest.mark.parametrize("op", [operator.add, operator.mul], ids=["add", "mul"])
def test_binary_op_float16_static(op, is_scalar):
    """``_test_binary_op_float16_impl``: a float16 static qconfig on add/mul. Upstream runs it
    with a test-only legacy config that casts to float16; no qplug backend has float16 static
    kernels, so the ops stay float with that reason (docs/migrating.md)."""
    float16_static = qp.QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float16),
                                weight=PlaceholderObserver.with_args(dtype=torch.float16))
    mapping = qp.QConfigMapping().set_object_type(op, float16_static)
    data = (torch.randn(1, 1, 1, 1), torch.randn(1, 1, 1, 1))
    with pytest.warns(UserWarning, match="dtype torch.float16 is not the backend's torch.quint8"):
        prepared = qp.prepare_fx(BinaryOp(op, is_scalar).eval(), mapping, data, backend="fbgemm")
    with pytest.raises(NothingQuantizedError, match="torch.float16 is not the backend's"):
        qp.convert_fx(prepared)
    # int8 (upstream's _test_binary_op_int8_impl): the convs are int8; op of two int8 values
    # whose output is the graph's is kept float by the connector rule
    prepared = qp.prepare_fx(BinaryOp(op, is_scalar).eval(),
                             qp.QConfigMapping().set_global(default_qconfig()), data, backend="fbgemm")
    prepared(*data)
    kernels = qp.quantization_report(qp.convert_fx(prepared)).kernels
    assert set(kernels) == ({"conv1"} if is_scalar else {"conv1", "conv2"})


def test_return_none():
    class M(nn.Module):
        def forward(self, x):
            pass

    prepared = qp.prepare_fx(M().eval(), qp.QConfigMapping().set_global(default_qconfig()),
                             (torch.randn(1),), backend="fbgemm")
    with pytest.raises(NothingQuantizedError, match="no ops found"):
        qp.convert_fx(prepared)
    assert qp.convert_fx(prepared, allow_float=True)(torch.randn(1)) is None


class FuncConv(nn.Module):
    """Upstream's ``test_functional_conv`` model (its plain tensor weights as frozen parameters)."""

    def __init__(self, dim: int, use_bias: bool, relu) -> None:
        super().__init__()
        self.conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dim]
        self.w = frozen(torch.randn((3,) * (dim + 2)))
        self.b = frozen(torch.randn(3)) if use_bias else None
        self.stride, self.padding, self.dilation = (1,) * dim, (0,) * dim, (1,) * dim
        self.relu = relu if relu is not None else nn.Identity()

    def forward(self, x):
        x = self.conv(x, self.w, self.b, self.stride, self.padding, self.dilation, 1)
        return self.relu(x)


# upstream's full product of bias x relu form, in three rows that cover every value of each
BIAS_RELU = [(True, None), (False, F.relu), (True, nn.ReLU())]
BIAS_RELU_IDS = ["bias", "no_bias-functional_relu", "bias-module_relu"]


@pytest.mark.parametrize("use_bias, relu", BIAS_RELU, ids=BIAS_RELU_IDS)
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_functional_conv(dim, use_bias, relu):
    """``test_functional_conv`` (static): a functional conv on constant weights is lowered like
    ``nn.Conv*d``, fused with a following relu."""
    model = FuncConv(dim, use_bias, relu).eval()
    data = (torch.randn(2, 3, *([4] * dim)),)
    quantized = _quantize(model, qp.get_default_qconfig_mapping("fbgemm"), data)
    report = qp.quantization_report(quantized)
    assert list(report.kernels.values()) == [f"quantized::conv{dim}d"]
    assert [f.fused_type for f in report.fusions] == ([] if relu is None else [f"ConvReLU{dim}d"])
    assert qp.sqnr(model(*data), quantized(*data)) > 20


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("use_bias, relu", BIAS_RELU, ids=BIAS_RELU_IDS)
def test_functional_linear(use_bias, relu, mode):
    """``test_functional_linear``: ``F.linear`` on plain tensor weights, static and dynamic."""
    class M(FuncLinear):
        def __init__(self) -> None:
            super().__init__(use_bias)
            self.relu_or_id = relu if relu is not None else nn.Identity()

        def forward(self, x):
            return self.relu_or_id(super().forward(x))

    model = M().eval()
    data = (torch.rand(8, 30),)  # upstream calibrates on one row; 8 give ranges worth comparing
    quantized = _quantize(model, qp.get_default_qconfig_mapping("fbgemm", mode), data)
    report = qp.quantization_report(quantized)
    assert list(report.kernels.values()) == ["quantized::linear"] and report.mode == mode
    assert [f.fused_type for f in report.fusions] == ([] if relu is None else ["LinearReLU"])
    assert qp.sqnr(model(*data), quantized(*data)) > 20
