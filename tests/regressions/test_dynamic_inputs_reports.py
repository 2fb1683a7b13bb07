"""Inputs nn.LSTM, nn.GRU and nn.Linear take, sent to the dynamic int8 modules that replace them
(s19/odd defects 1 and 11): each answers as the float module does, or, where the float module
refuses too, refuses with qplug's InputMismatchError."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import qplug_core as qp
from qplug_core.errors import InputMismatchError
from qplug_core.kernels.base import engine_context
from qplug_core.kernels.dynamic import DynamicGRU, DynamicLSTM

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

ENGINES = ["fbgemm", "qnnpack"]
KERNELS = {nn.LSTM: DynamicLSTM, nn.GRU: DynamicGRU}


def _states(hidden):
    return hidden if isinstance(hidden, tuple) else (hidden,)


def _layer(kind, **options):
    torch.manual_seed(0)
    return kind(16, 32, **options).eval()


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_a_packed_sequence_gives_torch_ao_s_packed_output_and_each_sequence_s_final_state(kind, engine):
    """The swapped module raised "AttributeError: 'PackedSequence' object has no attribute 'shape'";
    torch.ao's dynamic LSTM runs it (39 dB against float). Unsorted lengths and a given h0 check
    that every final state belongs to its own sequence, at its own length; with torch.ao's qparams
    the numbers are torch.ao's, bit for bit."""
    ao = pytest.importorskip("torch.ao.quantization")
    layer = _layer(kind, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(4, 7, 16)
    packed = pack_padded_sequence(x, torch.tensor([2, 7, 5, 3]), batch_first=True, enforce_sorted=False)
    h0 = torch.randn(4, 4, 32)
    hx = (h0, torch.randn(4, 4, 32)) if kind is nn.LSTM else h0
    with torch.no_grad():
        want_out, want_hidden = layer(packed, hx)
        out, hidden = qp.quantize_dynamic(nn.Sequential(layer), {kind}, backend=engine)[0](packed, hx)
        # torch.ao's qparams (per-tensor weights, 7-bit activations), so the two must agree exactly
        kernel = KERNELS[kind].from_float(layer, engine=engine, per_channel=False, reduce_range=True)
        with engine_context(engine):
            oracle = ao.quantize_dynamic(copy.deepcopy(nn.Sequential(layer)), {kind})[0]
            ao_out, ao_hidden = oracle(packed, hx)
        same_out, same_hidden = kernel(packed, hx)
    assert isinstance(out, PackedSequence)
    for field in ("batch_sizes", "sorted_indices", "unsorted_indices"):
        assert torch.equal(getattr(out, field), getattr(want_out, field))
    assert qp.sqnr(want_out.data, out.data) > 35
    for got, want in zip(_states(hidden), _states(want_hidden)):
        assert got.shape == want.shape and qp.sqnr(want, got) > 35
    assert torch.equal(same_out.data, ao_out.data)
    for got, want in zip(_states(same_hidden), _states(ao_hidden)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_an_unbatched_input_answers_with_the_float_layer_s_shapes(kind, batch_first, engine):
    """A (seq, features) input, which nn.LSTM takes: fbgemm raised "The number of rows in the packB
    should be equal to K: 7" and qnnpack answered (7, 16, 32) where the float LSTM gives (7, 32)."""
    layer = _layer(kind, num_layers=2, batch_first=batch_first)
    x, h0 = torch.randn(7, 16), torch.randn(2, 32)
    hx = (h0, torch.randn(2, 32)) if kind is nn.LSTM else h0
    int8 = qp.quantize_dynamic(nn.Sequential(layer), {kind}, backend=engine)[0]
    with torch.no_grad():
        for states in (None, hx):
            want_out, want_hidden = layer(x, states)
            out, hidden = int8(x, states)
            batched_states = None if states is None else tuple(s.unsqueeze(1) for s in _states(states))
            batched_out, _ = int8(x.unsqueeze(0 if batch_first else 1),
                                  batched_states if kind is nn.LSTM or states is None else batched_states[0])
            assert out.shape == want_out.shape == (7, 32)
            assert torch.equal(out, batched_out.squeeze(0 if batch_first else 1))
            assert qp.sqnr(want_out, out) > 35
            for got, want in zip(_states(hidden), _states(want_hidden)):
                assert got.shape == want.shape == (2, 32) and qp.sqnr(want, got) > 35


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("x_shape, h_shape, says", [
    ((5, 3, 15), None, r"int8 DynamicLSTM takes a \(seq, batch, 16\) input, an unbatched \(seq, 16\) one or a "
                       r"PackedSequence of \(steps, 16\) data, got shape \(5, 3, 15\)"),
    ((2, 5, 3, 16), None, r"got shape \(2, 5, 3, 16\)"),
    ((16,), None, r"got shape \(16,\)"),
    ((5, 3, 16), (1, 2, 32), r"int8 DynamicLSTM: h0 has shape \(1, 2, 32\), but an input of shape \(5, 3, 16\) "
                             r"takes \(1, 3, 32\)"),
    ((5, 3, 16), (1, 3, 31), r"h0 has shape \(1, 3, 31\)"),
    ((5, 16), (1, 1, 32), r"h0 has shape \(1, 1, 32\), but an input of unbatched shape \(5, 16\) takes \(1, 32\)"),
])
def test_an_input_the_float_lstm_refuses_is_refused_by_name_and_shape(engine, x_shape, h_shape, says):
    """qnnpack answered 15- or 17-feature inputs; the rest were raw torch errors ("Expected more
    hidden states in stacked_rnn", "tuple index out of range")."""
    layer = _layer(nn.LSTM)
    int8 = qp.quantize_dynamic(nn.Sequential(layer), {nn.LSTM}, backend=engine)[0]
    x = torch.randn(x_shape)
    hx = None if h_shape is None else (torch.zeros(h_shape), torch.zeros(h_shape))
    with pytest.raises(Exception):  # the float layer refuses it too: nothing a user relies on is lost
        layer(x, hx)
    with pytest.raises(InputMismatchError, match=says):
        int8(x, hx)


def test_a_packed_sequence_reaches_the_reference_backend_s_lstm():
    """The reference backend's simulated LSTM raised "'PackedSequence' object has no attribute 'numel'"."""
    layer = _layer(nn.LSTM, batch_first=True)
    packed = pack_padded_sequence(torch.randn(3, 7, 16), torch.tensor([7, 5, 2]), batch_first=True)
    with torch.no_grad():
        out, (h, c) = qp.quantize_dynamic(nn.Sequential(layer), {nn.LSTM}, backend="reference")[0](packed)
        want_out, (want_h, want_c) = layer(packed)
    assert isinstance(out, PackedSequence) and torch.equal(out.batch_sizes, want_out.batch_sizes)
    assert qp.sqnr(want_out.data, out.data) > 35 and qp.sqnr(want_h, h) > 35 and qp.sqnr(want_c, c) > 35


@pytest.mark.parametrize("engine", ENGINES)
def test_a_dynamic_linear_takes_one_vector_as_nn_linear_does(engine):
    """A 1-D input raised "The dimension of input tensor should be larger than or equal to 2"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    int8 = qp.quantize_dynamic(model, {nn.Linear}, backend=engine)
    x = torch.randn(16)
    with torch.no_grad():
        out = int8(x)
        assert out.shape == model(x).shape == (4,)
        assert torch.equal(out, int8(x.unsqueeze(0))[0])
        assert qp.sqnr(model(x), out) > 30


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("x, says", [
    (torch.randn(2, 17), r"int8 DynamicLinear takes inputs with 16 features \(last dimension\), got shape \(2, 17\)"),
    (torch.randn(()), r"int8 DynamicLinear takes inputs with 16 features \(last dimension\), got shape \(\)"),
    (torch.randn(2, 16).double(), r"int8 DynamicLinear takes float32 inputs, got float64 of shape \(2, 16\): "
                                  r"pass it .to\(torch.float32\)"),
])
def test_an_input_the_float_linear_refuses_is_refused_by_name_and_shape(engine, x, says):
    """qnnpack answered a 17-feature input to a 16-feature linear; the others were raw kernel errors."""
    linear = nn.Linear(16, 4).eval()
    int8 = qp.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, backend=engine)
    with pytest.raises(Exception):
        linear(x)
    with pytest.raises(InputMismatchError, match=says):
        int8(x)


class _PackedTagger(nn.Module):
    """Takes a PackedSequence, as speech and tagging models do, and pads the LSTM's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.fc = nn.LSTM(16, 24, batch_first=True), nn.Linear(24, 5)

    def forward(self, packed):
        out, _ = self.rnn(packed)
        padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.fc(padded)


def test_graph_mode_says_why_an_lstm_given_a_packed_sequence_stays_in_reference_form():
    """prepare_fx/convert_fx quantize tensors only: the LSTM kept its rounded weights and float
    compute with no warning, and the report blamed "Python values computed at run time"."""
    model = _PackedTagger().eval()
    x, lengths = torch.randn(3, 9, 16), torch.tensor([9, 4, 7])
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    mapping = qp.get_default_qconfig_mapping("fbgemm", mode="dynamic")
    observed = qp.prepare_fx(model, mapping, (packed,), backend="fbgemm")
    with pytest.warns(UserWarning, match=r"node 'rnn': its input\(s\) \['packed'\] are forward\(\) arguments "
                                         r"that are not tensors \(a PackedSequence.*qp.quantize_dynamic"):
        converted = qp.convert_fx(observed)
    report = str(qp.quantization_report(converted))
    assert "forward() arguments that are not tensors" in report and "computed at run time" not in report
    assert qp.sqnr(model(packed), converted(packed)) > 30


@pytest.mark.parametrize("backend", [*ENGINES, "reference"])
@pytest.mark.parametrize("kind", [nn.LSTMCell, nn.GRUCell, nn.RNNCell])
def test_a_dynamic_cell_takes_one_unbatched_step_as_the_float_cell_does(kind, backend):
    """The int8 cells raised torch's "dimension of input tensor should be larger than or equal to
    2" (the reference GRUCell an IndexError) on a 1-D input and state, which nn cells take."""
    torch.manual_seed(0)
    model = nn.Sequential(kind(16, 32)).eval()
    int8 = qp.quantize_dynamic(model, backend=backend)
    x, h = torch.randn(16), torch.randn(32)
    state = (h, torch.randn(32)) if kind is nn.LSTMCell else h
    batched_state = tuple(s[None] for s in state) if kind is nn.LSTMCell else h[None]
    got, as_batch, want = int8[0](x, state), int8[0](x[None], batched_state), model[0](x, state)
    for got_, as_batch_, want_ in zip(_states(got), _states(as_batch), _states(want)):
        assert got_.shape == want_.shape == (32,)
        assert torch.equal(got_, as_batch_.squeeze(0))
        assert qp.sqnr(want_, got_) > 35
    if backend != "reference":
        with pytest.raises(InputMismatchError, match=r"takes inputs with 16 features .* got shape \(2, 3, 16\)"):
            int8[0](torch.randn(2, 3, 16))
