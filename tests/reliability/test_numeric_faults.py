"""Numeric guarantees at the flow level: constant inputs (G4), one-sided ranges (row 29), the fbgemm
non-VNNI default (row 30, G13), no silent float fallbacks (G5), and the user's float model is never
modified by any flow."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from faultkit import conv_net, images
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx, nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.int16_pairs import saturating_layers
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.reference import Quantize
from qplug_core.observers import MinMaxObserver, PerChannelMinMaxObserver
from qplug_core.qparams import dequantize, quantize

AVX2, VNNI = "avx2 fma", "avx2 avx512f avx512bw avx512_vnni"
pytestmark = pytest.mark.usefixtures("installed_backends")

X = images(1)[0]
EPS32 = torch.finfo(torch.float32).eps


def _reference_quantizers(model: fx.GraphModule) -> dict[str, Quantize]:
    return {name: m for name, m in model.named_modules() if type(m) is Quantize}


# -- G4: constant calibration data -----------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 2.5, -1e37], ids=["zero", "positive", "huge-negative"])
def test_constant_calibration_data_gives_finite_qparams(value):
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    qp.calibrate(observed, [(torch.full((2, 3, 8, 8), value),)])
    reference = qp.convert_to_reference_fx(observed)
    quantizers = _reference_quantizers(reference)
    assert quantizers
    for name, q in quantizers.items():
        scale = q.qparams.scale.reshape(-1)
        assert bool(torch.isfinite(scale).all()) and bool((scale >= EPS32).all()), name
        assert bool(((q.qparams.zero_point >= q.qparams.quant_min)
                     & (q.qparams.zero_point <= q.qparams.quant_max)).all()), name
    x_q = next(q for name, q in quantizers.items() if name.startswith("x_"))
    if value == 0.0:
        assert x_q.qparams.scale.item() == EPS32 == float(torch.tensor(1.1920929e-07))
    constant = torch.full((1, 3, 8, 8), value)
    assert torch.isfinite(reference(constant)).all()
    err = (dequantize(quantize(constant, x_q.qparams), x_q.qparams) - constant).abs().max()
    assert err <= x_q.qparams.scale.item() / 2 + 4 * math.ulp(abs(value))


# -- row 29: one-sided ranges ----------------------------------------------------------------------


@settings(max_examples=100, derandomize=True, deadline=None)
@given(low=st.floats(2.0 ** -20, 2.0 ** 20, width=32), span=st.floats(0, 2.0 ** 20, width=32),
       sign=st.sampled_from([1, -1]), per_channel=st.booleans(), dtype=st.sampled_from([torch.quint8, torch.qint8]))
def test_one_sided_range_includes_zero_exactly(low, span, sign, per_channel, dtype):
    x = sign * torch.tensor([[low, low + span], [low + span / 2, low]])
    observer = (PerChannelMinMaxObserver(dtype=dtype, ch_axis=0) if per_channel
                else MinMaxObserver(dtype=dtype))
    observer(x)
    qparams = observer.qparams()
    scale = qparams.scale.reshape(-1, 1) if per_channel else qparams.scale
    zero_point = qparams.zero_point.reshape(-1, 1) if per_channel else qparams.zero_point
    lowest, highest = (qparams.quant_min - zero_point) * scale, (qparams.quant_max - zero_point) * scale
    assert bool((lowest <= 0).all()) and bool((highest >= 0).all())  # the range was extended to 0
    zero = torch.zeros_like(x)
    assert torch.equal(dequantize(quantize(zero, qparams), qparams), zero)  # bit-exact
    ulp = torch.nextafter(x.abs(), torch.tensor(math.inf)) - x.abs()
    assert bool(((dequantize(quantize(x, qparams), qparams) - x).abs() <= scale / 2 + 4 * ulp).all())


# -- row 30 / G13: fbgemm's 7-bit weights by default on CPUs without VNNI ------------------------


def _ranges(mapping: qp.QConfigMapping) -> tuple[int, tuple[int, int]]:
    qconfig = mapping.global_qconfig
    weight = qconfig.weight()
    return qconfig.activation().quant_max, (weight.quant_min, weight.quant_max)


@pytest.mark.parametrize("flags, weights", [(AVX2, (-64, 64)), (VNNI, (-128, 127))])
def test_fbgemm_default_qparams_follow_vnni(flags, weights):
    with override_cpu_flags(flags):
        for mode in ("static", "qat"):
            assert _ranges(qp.get_default_qconfig_mapping("fbgemm", mode)) == (255, weights)
        # qnnpack's kernels accumulate in int32: its default does not depend on the x86 flags
        assert _ranges(qp.get_default_qconfig_mapping("qnnpack")) == (255, (-127, 127))


def test_g13_non_vnni_int16_pair_sums_cannot_saturate():
    with override_cpu_flags(AVX2):
        model = qp.quantize(conv_net(), X, images(), backend="fbgemm")
        observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
        eight_bit = qp.prepare_fx(conv_net(), qp.get_default_qconfig_mapping("qnnpack"), X,
                                  backend="reference")
    # every weighted layer: 2 * a_max * |w|_max <= 2 * 255 * 64 = 32,640 < 32,767
    assert saturating_layers(observed) == [] and len(saturating_layers(eight_bit)) >= 2
    assert torch.isfinite(model(X[0])).all()


def test_fbgemm_depthwise_inputs_get_7_bits_even_with_vnni():
    with override_cpu_flags(VNNI):
        observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    feeding = {n.args[0].target for n in observed.graph.nodes if n.op == "call_module" and n.target == "dw"}
    quant_max = {n.target: observed.get_submodule(n.target).quant_max for n in observed.graph.nodes
                 if n.op == "call_module" and n.target.startswith("activation_post_process")}
    assert [quant_max[t] for t in feeding] == [127]
    assert sorted(set(quant_max.values())) == [127, 255]  # every other activation keeps 8 bits


def test_full_8_bit_qparams_on_non_vnni_warn():
    with override_cpu_flags(VNNI):
        eight_bit = qp.get_default_qconfig_mapping("fbgemm")
    with override_cpu_flags(AVX2), pytest.warns(UserWarning, match=r"fbgemm: .*AVX2 without VNNI.*"
                                                                   r"can saturate"):
        qp.prepare_fx(conv_net(), eight_bit, X, backend="fbgemm")


# -- G5: no silent float fallbacks -----------------------------------------------------------------


class Mixed(nn.Module):
    """Quantizable ops next to ops no backend pattern covers, and a LayerNorm left float by default."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.soft = nn.Softplus()
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.soft(self.fc1(x)))
        return torch.cumsum(self.fc2(y), 1) + x.size(0)


class FloatCompute(fx.Interpreter):
    """Independent oracle: names of nodes that take a float tensor and return a float tensor."""

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.op.startswith("call_"):
            inputs = [self.env[a] for a in n.all_input_nodes]
            floats_in = any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs)
            if floats_in and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.float_nodes.append(n.name)
        return out

    def __call__(self, *args):
        self.float_nodes: list[str] = []
        self.run(*args)
        return self.float_nodes


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_g5_every_float_compute_node_is_reported_with_a_reason(backend):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    converted = qp.quantize(Mixed().eval(), (x,), [(x,)], backend=backend)
    report = qp.quantization_report(converted)
    float_nodes = FloatCompute(converted)(x)
    assert {"soft", "norm", "cumsum"} <= set(float_nodes)
    assert sorted(s.node for s in report.skipped) == sorted(float_nodes)
    assert all(s.reason for s in report.skipped)
    reasons = {s.node: s.reason for s in report.skipped}
    assert reasons["soft"] == "no quantization pattern of the backend matches this op"
    assert "qconfig is None" in reasons["norm"]


def test_g5_strict_raises_listing_the_float_ops():
    x = torch.randn(4, 8)
    with pytest.raises(ConfigValidationError, match=r"strict=True but \d+ op\(s\) stay float: .*soft "
                                                    r"\(Softplus\): no quantization pattern") as raised:
        qp.quantize(Mixed().eval(), (x,), [(x,)], backend="fbgemm", strict=True)
    assert raised.value.field == "strict"


def test_g5_strict_passes_when_everything_is_int8():
    converted = qp.quantize(conv_net(), X, images(1), backend="fbgemm", strict=True)
    assert qp.quantization_report(converted).skipped == []
    assert FloatCompute(converted)(X[0]) == []


# -- the float model is never modified ------------------------------------------------------------


def _snapshot(model: nn.Module):
    return ({k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
            dict(model.named_modules()), model.training)


def _assert_untouched(model: nn.Module, snapshot) -> None:
    state, modules, training = snapshot
    now = model.state_dict(keep_vars=True)
    assert list(now) == list(state)
    for key, value in state.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key].detach(), value), key
    assert dict(model.named_modules()) == modules  # the very same module objects, none added
    assert all(type(m) is type(modules[n]) for n, m in model.named_modules())
    assert model.training is training
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


FLOWS = {
    "fuse_fx": lambda m: qp.fuse_fx(m, X, backend="fbgemm", is_qat=m.training),
    "prepare_fx": lambda m: qp.calibrate(qp.prepare_fx(m, None, X, backend="fbgemm"), images(1)),
    "prepare_qat_fx": lambda m: qp.prepare_qat_fx(m, None, X, backend="fbgemm")(*X),
    "quantize": lambda m: qp.quantize(m, X, images(1), backend="fbgemm"),
    "quantize-reference": lambda m: qp.quantize(m, X, images(1), backend="reference"),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("flow", FLOWS)
def test_float_model_is_never_modified(flow, training):
    model = conv_net().train(training)
    snapshot = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FLOWS[flow](model)
    _assert_untouched(model, snapshot)


def test_convert_leaves_the_observed_model_usable():
    observed = qp.prepare_fx(conv_net(), None, X, backend="fbgemm")
    qp.calibrate(observed, images())
    before = copy.deepcopy(observed)
    first = qp.convert_fx(observed)
    assert observed.code == before.code
    for (k, a), (_, b) in zip(observed.state_dict().items(), before.state_dict().items()):
        assert torch.equal(a, b), k
    assert torch.equal(qp.convert_fx(observed)(X[0]), first(X[0]))  # converting twice is the same
