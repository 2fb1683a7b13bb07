"""quantize_dynamic: recurrent models, cells and a BERT-style encoder vs float, per-channel and
float16 defaults, the reference simulation vs the fbgemm kernels, and torch.ao as an oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.analysis.layers import sqnr
from qplug_core.config import QConfigMapping
from qplug_core.config.defaults import dynamic_qconfig
from qplug_core.errors import (
    ConfigError,
    ConfigValidationError,
    ConstraintViolationError,
    InputMismatchError,
    NothingQuantizedError,
)
from qplug_core.flows.dynamic import SimulatedDynamic
from qplug_core.kernels import torch_int8 as K
from qplug_core.kernels.base import engine_context
from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags
from qplug_core.zoo import example_inputs, get_model
from qplug_core.zoo.transformer import make_realistic_bert

BACKENDS = ["reference", "fbgemm", "qnnpack"]
#: 7-bit activations, as fbgemm's dynamic kernels use: makes the simulation comparable
SEVEN_BIT = dynamic_qconfig(per_channel=True, reduce_range=True)


def _unpacked_weight(kernel: nn.Module) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_unpack(kernel._packed)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["lstm_classifier", "gru_classifier"])
def test_recurrent_classifiers_stay_close_to_float(name, backend, plugin_autoload):
    model = get_model(name, seed=0)
    x = example_inputs(name, batch=4)
    before = copy.deepcopy(model.state_dict())
    quantized = qp.quantize_dynamic(model, backend=backend)
    with torch.no_grad():
        ref, out = model(*x), quantized(*x)
    cos = torch.nn.functional.cosine_similarity(ref, out).min().item()
    print(f"\n{name} on {backend}: SQNR {sqnr(ref, out):.1f} dB, min cosine {cos:.5f}")
    assert sqnr(ref, out) > 30 and cos > 0.999
    kinds = {"reference": (SimulatedDynamic, SimulatedDynamic)}.get(
        backend, (K.DynamicLSTM if name.startswith("lstm") else K.DynamicGRU, K.DynamicLinear))
    assert (type(quantized.rnn), type(quantized.fc)) == kinds
    assert type(model.rnn) in (nn.LSTM, nn.GRU) and type(model.fc) is nn.Linear  # user model unchanged
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


CELLS = [nn.LSTMCell(16, 24), nn.GRUCell(16, 24), nn.RNNCell(16, 24, nonlinearity="relu")]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: type(c).__name__)
def test_cells_simulation_matches_fbgemm(cell, plugin_autoload):
    torch.manual_seed(0)
    x, h = torch.randn(5, 16), torch.randn(5, 24)
    hx = (h, h) if isinstance(cell, nn.LSTMCell) else h
    first = (lambda y: y[0]) if isinstance(cell, nn.LSTMCell) else (lambda y: y)
    with torch.no_grad():
        ref = first(cell(x, hx))
        int8 = first(qp.quantize_dynamic(cell, backend="fbgemm")(x, hx))
        # the simulation of fbgemm's own default (7-bit weights on CPUs without VNNI)
        fbgemm_default = qp.get_default_qconfig_mapping("fbgemm", "dynamic")
        simulated = first(qp.quantize_dynamic(cell, fbgemm_default, backend="reference")(x, hx))
    print(f"\n{type(cell).__name__}: fbgemm vs float {sqnr(ref, int8):.1f} dB, vs simulation "
          f"{sqnr(simulated, int8):.1f} dB")
    assert sqnr(ref, int8) > 30 and sqnr(simulated, int8) > 50


@pytest.mark.parametrize("flags", [None, "avx2 fma"], ids=["host", "avx2-without-vnni"])
def test_linear_simulation_matches_fbgemm_with_the_default_qparams(plugin_autoload, flags):
    """fbgemm's default dynamic mapping (8-bit activations; 7-bit weights on CPUs without VNNI) is
    what its kernels compute: the simulation with that mapping matches them, one with 7-bit
    activations does not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    x = torch.randn(8, 32)
    with override_cpu_flags(flags or " ".join(cpu_int8().flags)), torch.no_grad():
        default = qp.get_default_qconfig_mapping("fbgemm", "dynamic").qconfig_for_module("0", nn.Linear)
        int8 = qp.quantize_dynamic(model, backend="fbgemm")(x)
    matching = qp.quantize_dynamic(model, {nn.Linear: default}, backend="reference")(x)
    seven = qp.quantize_dynamic(model, {nn.Linear: SEVEN_BIT}, backend="reference")(x)
    print(f"\nfbgemm vs its default's simulation {sqnr(matching, int8):.1f} dB, vs 7-bit "
          f"activations {sqnr(seven, int8):.1f} dB")
    assert sqnr(matching, int8) > 45 and sqnr(matching, int8) > sqnr(seven, int8) + 10
    assert default.activation().quant_max == 255


def test_bert_encoder_all_linears_dynamic_on_fbgemm(plugin_autoload):
    model = make_realistic_bert()
    inputs = example_inputs("bert_encoder", batch=4)
    quantized = qp.quantize_dynamic(model, backend="fbgemm")
    with torch.no_grad():
        ref, out = model(*inputs), quantized(*inputs)
    cos = torch.nn.functional.cosine_similarity(ref, out).min().item()
    print(f"\nBERT-style encoder fbgemm dynamic: SQNR {sqnr(ref, out):.1f} dB, min cosine {cos:.6f}")
    assert sqnr(ref, out) > 35 and cos > 0.9999
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert n_linear == sum(type(m) is K.DynamicLinear for m in quantized.modules()) == 12
    assert not any(type(m) is nn.Linear for m in quantized.modules())


def test_fbgemm_defaults_to_per_channel_weights(plugin_autoload):
    model = get_model("lstm_classifier", seed=0)
    per_channel = qp.quantize_dynamic(model, backend="fbgemm")
    per_tensor = qp.quantize_dynamic(model, {nn.Linear: dynamic_qconfig(per_channel=False,
                                                                        reduce_range=False)},
                                     backend="fbgemm")
    assert _unpacked_weight(per_channel.fc).qscheme() == torch.per_channel_affine
    assert _unpacked_weight(per_tensor.fc).qscheme() == torch.per_tensor_affine


def test_float16_on_fbgemm(plugin_autoload):
    model = get_model("lstm_classifier", seed=0)
    x = example_inputs("lstm_classifier", batch=4)
    quantized = qp.quantize_dynamic(model, dtype=torch.float16, backend="fbgemm")
    simulated = qp.quantize_dynamic(model, dtype=torch.float16, backend="reference")
    assert quantized.fc.dtype == quantized.rnn.dtype == torch.float16
    with torch.no_grad():
        ref, out, sim = model(*x), quantized(*x), simulated(*x)
    print(f"\nfloat16 dynamic on fbgemm: SQNR {sqnr(ref, out):.1f} dB")
    assert sqnr(ref, out) > 60 and torch.allclose(out, sim, atol=1e-4)


def test_qnnpack_refuses_float16_naming_the_backend(plugin_autoload):
    with pytest.raises(ConstraintViolationError, match=r"backend 'qnnpack' has no torch.float16 dynamic "
                                                       r"kernel for module 'rnn' \(LSTM\).*qint8"):
        qp.quantize_dynamic(get_model("lstm_classifier", seed=0), dtype=torch.float16,
                            backend="qnnpack")


def test_differential_vs_torch_ao(plugin_autoload):
    tq = pytest.importorskip("torch.ao.quantization")
    model = get_model("lstm_classifier", seed=0)
    x = example_inputs("lstm_classifier", batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tq.quantize_dynamic(model, {nn.LSTM, nn.Linear}, dtype=torch.qint8)
        with torch.no_grad():
            ao_out = theirs(*x)
    ours = qp.quantize_dynamic(model, {nn.LSTM, nn.Linear}, backend="fbgemm")
    with torch.no_grad():
        ref, out = model(*x), ours(*x)
    print(f"\nvs float: qplug fbgemm {sqnr(ref, out):.1f} dB, torch.ao {sqnr(ref, ao_out):.1f} dB; "
          f"qplug vs torch.ao {sqnr(ao_out, out):.1f} dB")
    assert sqnr(ao_out, out) > 30 and sqnr(ref, out) > sqnr(ref, ao_out) - 3


class _Recurrent(nn.Module):
    """One recurrent layer answering its output and final state(s), all compared."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.rnn = layer

    def forward(self, x):
        return self.rnn(x)


def _tensors(value) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _tensors(v)]


def _graph_dynamic(model: nn.Module, mapping: QConfigMapping, x: torch.Tensor, backend: str):
    """(lowered, reference form) of ``model`` by prepare_fx / convert_fx with a dynamic mapping."""
    observed = qp.calibrate(qp.prepare_fx(model, mapping, (x,), backend=backend), [(x,)])
    lowered = qp.convert_fx(observed)
    kind = type(model.rnn).__name__.lower()
    assert qp.quantization_report(lowered).kernels == {"rnn": f"quantized::{kind}_dynamic"}
    return lowered, qp.convert_to_reference_fx(observed)


def _observed_weights(backend: str, qscheme: torch.qscheme):
    """A dynamic qconfig with per-tensor ``qscheme`` min/max weights, in qplug's names and in
    torch.ao's (qnnpack: its legal weight range and smallest scale; torch.ao's dynamic RNNs take
    7-bit activations on fbgemm, whatever their observer says)."""
    from torch.ao import quantization as tq

    weights = dict(dtype=torch.qint8, qscheme=qscheme)
    if backend == "qnnpack":
        weights.update(quant_min=-127, quant_max=127, eps=2 ** -12)
    ours = qp.QConfig(weight=qp.observers.MinMaxObserver.with_args(**weights),
                      activation=qp.observers.PlaceholderObserver.with_args(
                          dtype=torch.quint8, quant_min=0, quant_max=127 if backend == "fbgemm" else 255,
                          is_dynamic=True))
    return ours, tq.QConfig(activation=tq.default_dynamic_quant_observer,
                            weight=tq.MinMaxObserver.with_args(**weights))


RECURRENT = [(nn.LSTM, {}), (nn.LSTM, dict(num_layers=2, bidirectional=True)),
             (nn.LSTM, dict(batch_first=True, bias=False)), (nn.GRU, {}),
             (nn.GRU, dict(num_layers=2, batch_first=True)), (nn.GRU, dict(bidirectional=True, bias=False))]


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
@pytest.mark.parametrize("layer, options", RECURRENT, ids=lambda v: v.__name__ if isinstance(v, type) else
                         "-".join(f"{k}={w}" for k, w in v.items()) or "plain")
def test_graph_mode_recurrent_kernels_are_quantize_dynamics_and_torch_aos(layer, options, backend,
                                                                           plugin_autoload):
    """prepare_fx / convert_fx and qp.quantize_dynamic pack each LSTM/GRU weight matrix with the
    qparams its observer gave, as torch.ao does: bit for bit, for the backend's default mapping and
    torch.ao's symmetric or affine min/max weights. The graph flow's kernels observed the reference
    form's rounded weights again (a second rounding, to other scales), and qp.quantize_dynamic took
    symmetric qparams of its own for every matrix, whatever the observer."""
    from torch.ao import quantization as tq

    torch.manual_seed(0)
    model, x = _Recurrent(layer(16, 32, **options)).eval(), torch.randn(4, 7, 16)
    with torch.no_grad():
        for name, weight in model.named_parameters():  # trained weights are not centred on zero
            weight.add_(0.02 * weight.abs().max() if name.startswith("weight") else 0)
    for qconfigs in (None, _observed_weights(backend, torch.per_tensor_symmetric),
                     _observed_weights(backend, torch.per_tensor_affine)):
        mapping = qp.get_default_qconfig_mapping(backend, "dynamic") if qconfigs is None else \
            QConfigMapping().set_object_type(layer, qconfigs[0])
        lowered, _ = _graph_dynamic(model, mapping, x, backend)
        swapped = qp.quantize_dynamic(model, mapping, backend=backend)
        with torch.no_grad():
            got = _tensors(lowered(x))
            assert all(map(torch.equal, got, _tensors(swapped(x))))
        if qconfigs is not None and options.get("bias", True):  # torch.ao's dynamic RNNs need biases
            with warnings.catch_warnings(), engine_context(backend), torch.no_grad():
                warnings.simplefilter("ignore")
                ao = tq.quantize_dynamic(copy.deepcopy(model), {layer: qconfigs[1]})
                assert all(map(torch.equal, got, _tensors(ao(x))))


@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU])
def test_graph_mode_recurrent_reference_form_runs_the_kernels_weights(layer, plugin_autoload):
    """The reference form runs the kernels' int8 weights (integers and scales) and quantizes the
    layer's input as they do, once per call; it keeps the hidden state float, which the kernels
    quantize before every step's hidden product, as it keeps a stacked layer's input. One step of
    one layer from a zero state, where that is exact, it answers as the kernels to float rounding,
    on each backend (fbgemm's kernels held other weights, 1.1e-3 off it)."""
    torch.manual_seed(0)
    model, x = _Recurrent(layer(16, 32, bidirectional=True, batch_first=True)).eval(), torch.randn(4, 1, 16)
    for backend in ("fbgemm", "qnnpack"):
        mapping = qp.get_default_qconfig_mapping(backend, "dynamic")
        lowered, reference = _graph_dynamic(model, mapping, x, backend)
        with torch.no_grad():
            for got, expected in zip(_tensors(lowered(x)), _tensors(reference(x)), strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_qconfig_spec_forms_select_modules():
    model = get_model("lstm_classifier", seed=0)
    by_name = qp.quantize_dynamic(model, {"fc"}, backend="reference")
    assert type(by_name.fc) is SimulatedDynamic and type(by_name.rnn) is nn.LSTM
    opted_out = qp.quantize_dynamic(model, {nn.LSTM: None, nn.Linear: SEVEN_BIT}, backend="reference")
    assert type(opted_out.rnn) is nn.LSTM and opted_out.fc.input_quantize.quant_max == 127
    mapping = QConfigMapping().set_module_name("rnn", SEVEN_BIT)
    assert type(qp.quantize_dynamic(model, mapping, backend="reference").fc) is nn.Linear
    same = qp.quantize_dynamic(model, backend="reference", inplace=True)
    assert same is model and type(model.rnn) is SimulatedDynamic


@pytest.mark.parametrize("spec, error, message", [
    ({"rn": None}, ConfigError, r"names module 'rn'.*did you mean 'rnn'"),
    ({nn.Conv2d}, ConfigError, r"Conv2d cannot be quantized dynamically"),
    ({"rnn.": None}, ConfigError, r"did you mean 'rnn'"),
    ([3], ConfigError, r"object_type must be a module class"),
    ("fc", ConfigValidationError, r"qconfig_spec must be"),
])
def test_bad_qconfig_spec(spec, error, message):
    with pytest.raises(error, match=message):
        qp.quantize_dynamic(get_model("lstm_classifier", seed=0), spec, backend="reference")


def test_static_qconfig_and_bad_dtype_are_refused():
    model = get_model("lstm_classifier", seed=0)
    with pytest.raises(ConstraintViolationError, match=r"module 'fc' \(Linear\).*static"):
        qp.quantize_dynamic(model, qp.get_default_qconfig_mapping("reference", "static"),
                            backend="reference")
    with pytest.raises(ConfigValidationError, match="dtype must be torch.qint8 or torch.float16"):
        qp.quantize_dynamic(model, dtype=torch.quint8, backend="reference")


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("model, holds", [
    (nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), "convolutions have no dynamic kernels"),
    (_Attention(), "nn.MultiheadAttention computes with its weights directly"),
])
def test_a_model_with_nothing_to_convert_is_not_returned_as_if_quantized(model, holds, plugin_autoload):
    """It came back float without a word, where docs/migrating.md promises NothingQuantizedError."""
    with pytest.raises(NothingQuantizedError, match=f"found no module it converts.*{holds}.*allow_float=True"):
        qp.quantize_dynamic(model, backend="fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accepted = qp.quantize_dynamic(model, backend="fbgemm", allow_float=True)
    assert type(accepted) is type(model) and accepted is not model


def test_attention_projections_left_float_are_named(plugin_autoload):
    """Through qplug's warning channel: 'qplug:' first, at the caller's line (it bypassed warn_user)."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    with pytest.warns(UserWarning, match=r"^qplug: qp.quantize_dynamic: 1 nn.MultiheadAttention module\(s\) keep "
                                         r"float projections \('self_attn'\)") as caught:
        quantized = qp.quantize_dynamic(layer, backend="fbgemm")
    assert {w.filename for w in caught if "MultiheadAttention" in str(w.message)} == {__file__}
    assert type(quantized.linear1) is not nn.Linear
    assert type(quantized.self_attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    with pytest.raises(ConfigError, match=r"'att.out_proj'.*'att' is an nn.MultiheadAttention, which "
                                          r"computes with its projection weights directly"):
        qp.quantize_dynamic(_Attention(), {"att.out_proj"}, backend="fbgemm")


def test_a_compiling_backend_with_nothing_dynamic_accepts_allow_float(plugin_autoload):
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval(), torch.randn(1, 3, 8, 8)
    with pytest.raises(NothingQuantizedError):
        qp.quantize_dynamic(model, backend="onnxruntime", example_inputs=(x,))
    accepted = qp.quantize_dynamic(model, backend="onnxruntime", example_inputs=(x,), allow_float=True)
    torch.testing.assert_close(accepted(x), model(x))


@pytest.mark.parametrize("backend", ["reference", "fbgemm", "qnnpack"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_is_one_qplug_error_on_every_backend(backend, bad, plugin_autoload):
    """fbgemm answered finite numbers for NaN and a wrong-sign channel for Inf, qnnpack torch's own
    errors ("min should be less than or equal to max"), the reference form a calibration error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    quantized = qp.quantize_dynamic(model, backend=backend)
    x = torch.tensor([[1.0, bad] + [0.5] * 6])
    with pytest.raises(InputMismatchError, match=r"got an input with 1 NaN or Inf value\(s\) among 8 at "
                                                 r"inference: dynamic int8 quantizes each input over its own "
                                                 r"range.* Check the data before the call"):
        quantized(x)
    finite = torch.randn(3, 8)
    assert torch.isfinite(quantized(finite)).all()


def test_embedding_tables_left_float_are_reported_and_warned_of_when_they_hold_most_weights(plugin_autoload):
    class Recommender(nn.Module):
        def __init__(self, rows: int):
            super().__init__()
            self.ids, self.bag = nn.Embedding(rows, 16), nn.EmbeddingBag(rows, 16)
            self.fc = nn.Linear(32, 4)

        def forward(self, ids, bag_ids):
            return self.fc(torch.cat([self.ids(ids), self.bag(bag_ids)], 1))

    with pytest.warns(UserWarning, match=r"9\d\.\d% of the model's weights stay float, in its 2 embedding table\(s\) "
                                         r"\('ids', 'bag'\).*qp.quantize_weights\(model, embeddings=True\)"):
        qmodel = qp.quantize_dynamic(Recommender(rows=1000), backend="fbgemm")
    report = qp.quantization_report(qmodel)
    assert list(report.quantized) == ["fc"]
    assert {(s.node, s.op) for s in report.skipped} == {("ids", "Embedding"), ("bag", "EmbeddingBag")}
    assert all("no embedding kernel" in s.reason for s in report.skipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # small tables beside the linears: reported, not warned of
        qp.quantize_dynamic(Recommender(rows=2), backend="fbgemm")
