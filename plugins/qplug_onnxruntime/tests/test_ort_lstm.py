"""Dynamic int8 nn.LSTM on onnxruntime: ORT's DynamicQuantizeLSTM with qplug's int8 weights.

Three numbers per case: ORT's output, the reference form's (a float LSTM on grid weights after one
dynamic quantization of its input) and an oracle written here: the reference LSTM's own equations
with every GEMM input (the layer input, and the hidden state at every step) dynamically quantized,
which is what ORT's DynamicQuantizeLSTM (and every int8 LSTM kernel) computes. One intra-op
thread (conftest): with more, ORT splits the batch and quantizes the state per chunk.
"""

from __future__ import annotations

import collections
import copy
import warnings

import onnx
import pytest
import torch
from safetensors import safe_open
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import PAIRS_SATURATE, override_cpu_flags, probe_pair_sums, whole_model

from qplug_onnxruntime.session import OrtPartition

_MAPPING = ("onnxruntime", "dynamic")


class Stateful(nn.Module):
    """An LSTM given (h0, c0), returning (out, h, c)."""

    def __init__(self, **options):
        super().__init__()
        self.rnn = nn.LSTM(12, 16, **options)

    def forward(self, x, h0, c0):
        output, (h, c) = self.rnn(x, (h0, c0))
        return output, h, c


class Classifier(nn.Module):
    """A recurrent layer (batch first) and a linear head on its last step."""

    def __init__(self, cell: type[nn.RNNBase] = nn.LSTM, **options):
        super().__init__()
        self.rnn = cell(12, 16, batch_first=True, **options)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def _quantized(model: nn.Module, inputs: tuple, mapping=None):
    """(onnxruntime model, reference model) from one prepared model."""
    mapping = mapping if mapping is not None else qp.get_default_qconfig_mapping(*_MAPPING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, mapping, inputs, backend="onnxruntime")
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        return qp.convert_fx(observed), reference


def _dfq(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.qplug.dynamic_fake_quantize(x, 0, 255, torch.uint8)


def _oracle(lstm: nn.LSTM, x: torch.Tensor, state=None):
    """nn.LSTM's equations on ``lstm``'s (grid) weights, every GEMM input quantized per call."""
    dirs = 2 if lstm.bidirectional else 1
    x = x.transpose(0, 1) if lstm.batch_first else x
    seq, batch = x.shape[:2]
    zeros = torch.zeros(lstm.num_layers * dirs, batch, lstm.hidden_size)
    h0, c0 = (_dfq(state[0]), _dfq(state[1])) if state else (zeros, zeros)  # as the reference form
    hs, cs = [], []
    for layer in range(lstm.num_layers):
        xq, outs = _dfq(x), []
        for d, suffix in enumerate(("", "_reverse")[:dirs]):
            def p(name):
                value = getattr(lstm, f"{name}_l{layer}{suffix}", None)
                return torch.zeros(4 * lstm.hidden_size) if value is None else value
            h, c = h0[layer * dirs + d], c0[layer * dirs + d]
            out = [h] * seq
            for t in (range(seq - 1, -1, -1) if d else range(seq)):
                gates = xq[t] @ p("weight_ih").t() + p("bias_ih") + _dfq(h) @ p("weight_hh").t() + p("bias_hh")
                i, f, g, o = gates.chunk(4, -1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                out[t] = h
            outs.append(torch.stack(out))
            hs.append(h)
            cs.append(c)
        x = torch.cat(outs, -1)
    return (x.transpose(0, 1) if lstm.batch_first else x), torch.stack(hs), torch.stack(cs)


def _ort_ops(qmodel) -> collections.Counter:
    (partition,) = [m for m in qmodel.modules() if isinstance(m, OrtPartition)]
    (source,) = map(whole_model, partition.sources)  # bytes, or a file
    return collections.Counter((n.domain, n.op_type) for n in onnx.load_from_string(source).graph.node)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0))


@pytest.mark.parametrize("options", [
    dict(num_layers=2),
    dict(num_layers=2, batch_first=True),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=1, bidirectional=True, batch_first=True, bias=False),
], ids=["stacked", "batch_first", "bidirectional", "bidirectional_batch_first_no_bias"])
def test_lstm_runs_in_ort_with_the_reference_numbers(options):
    torch.manual_seed(0)
    model = Stateful(**options).eval()
    dirs, layers = (2 if options.get("bidirectional") else 1), options["num_layers"]
    x = torch.randn((3, 6, 12) if options.get("batch_first") else (6, 3, 12))
    inputs = (x, torch.randn(layers * dirs, 3, 16), torch.randn(layers * dirs, 3, 16))
    ort_model, reference = _quantized(model, inputs)
    report = qp.quantization_report(ort_model)
    assert report.kernels["rnn"].startswith("delegate:") and report.outside == {}
    assert _ort_ops(ort_model)[("com.microsoft", "DynamicQuantizeLSTM")] == layers
    assert _ort_ops(ort_model)[("", "LSTM")] == 0
    with torch.no_grad():
        got, expected, floats = ort_model(*inputs), reference(*inputs), model(*inputs)
        oracle = _oracle(reference.get_submodule("rnn").module, inputs[0], inputs[1:])
    for g, o, e, f in zip(got, oracle, expected, floats):
        assert g.shape == e.shape
        # ORT computes the oracle's numbers; only summation order and MLAS' sigmoid/tanh differ
        # (measured <= 2e-7), and a value rounding the other way at one step's quantization moves
        # what follows by about one step (1/255 of the state's range) times a weight
        assert float(((g - o).abs() <= 1e-5).float().mean()) >= 0.99
        assert float((g - o).abs().max()) <= 0.01 * float(o.abs().max())
        # quantizing the states (ORT) moves the result less than quantizing weights and input did
        assert float((g - e).abs().max()) <= float((e - f).abs().max())
        assert _cosine(g, f) >= 0.999


def test_ort_runs_qplugs_int8_weights():
    torch.manual_seed(0)
    model, x = Classifier(num_layers=1).eval(), torch.randn(2, 5, 12)
    ort_model, reference = _quantized(model, (x,))
    (partition,) = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    (source,) = map(whole_model, partition.sources)  # bytes, or a file
    graph = onnx.load_from_string(source).graph
    (node,) = [n for n in graph.node if n.op_type == "DynamicQuantizeLSTM"]
    initializers = {i.name: torch.from_numpy(onnx.numpy_helper.to_array(i).copy()) for i in graph.initializer}
    lstm = reference.get_submodule("rnn").module  # the grid-weight nn.LSTM
    for weight, scale, zero_point, name in ((1, 8, 9, "weight_ih_l0"), (2, 10, 11, "weight_hh_l0")):
        q = initializers[node.input[weight]]
        assert q.dtype == torch.int8 and not bool(initializers[node.input[zero_point]].any())
        dequantized = (q[0].float() * initializers[node.input[scale]][0]).t()  # [4h, in], gates i, o, f, c
        i, o, f, c = dequantized.chunk(4)
        torch.testing.assert_close(torch.cat([i, f, c, o]), getattr(lstm, name).detach(), rtol=1e-6, atol=0)


def test_save_and_load_rebuild_the_session(tmp_path):
    torch.manual_seed(0)
    model, x = Classifier(num_layers=2).eval(), torch.randn(2, 5, 12)
    ort_model, _ = _quantized(model, (x,))
    qp.save(ort_model, tmp_path / "lstm.qplug")
    with safe_open(str(tmp_path / "lstm.qplug"), "pt") as f:  # int8, as ORT runs them (float: 4x the file)
        matrices = [key for key in f.keys() if key.startswith("rnn.module.weight_")]  # noqa: SIM118
        assert len(matrices) == 4 and {f.get_slice(key).get_dtype() for key in matrices} == {"I8"}
    loaded = qp.load(tmp_path / "lstm.qplug")
    with torch.no_grad():  # the first call compiles the partition
        assert torch.equal(loaded(x), ort_model(x))
    assert _ort_ops(loaded)[("com.microsoft", "DynamicQuantizeLSTM")] == 2


def test_what_ort_cannot_run_stays_in_pytorch_with_the_reason():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 12)
    gru = Classifier(cell=nn.GRU).eval()
    ort_gru, reference = _quantized(gru, (x,))
    assert "ONNX Runtime has no dynamic int8 GRU op" in qp.quantization_report(ort_gru).outside["rnn"]
    assert isinstance(ort_gru.get_submodule("rnn"), nn.GRU)
    with torch.no_grad():
        assert _cosine(ort_gru(x), gru(x)) >= 0.999

    float_lstm = Classifier().eval()
    mapping = qp.get_default_qconfig_mapping(*_MAPPING).set_module_name("rnn", None)
    ort_model, reference = _quantized(float_lstm, (x,), mapping)
    assert "not quantized" in qp.quantization_report(ort_model).outside["rnn"]
    with torch.no_grad():
        assert torch.equal(ort_model.get_submodule("rnn")(x)[0], float_lstm.rnn(x)[0])


class WholeTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(12, 16)

    def forward(self, x):
        return self.rnn(x)


def test_an_lstm_whose_tuple_leaves_the_model_stays_in_reference_form():
    torch.manual_seed(0)
    model, x = WholeTuple().eval(), torch.randn(5, 2, 12)
    ort_model, reference = _quantized(model, (x,))
    report = qp.quantization_report(ort_model)
    assert "tuple is used as a whole" in report.reference["rnn"]
    with torch.no_grad():
        (out, (h, c)), (r_out, (r_h, r_c)) = ort_model(x), reference(x)
    assert torch.equal(out, r_out) and torch.equal(h, r_h) and torch.equal(c, r_c)


def test_standard_onnx_export_keeps_standard_ops(tmp_path):
    """qp.export_onnx targets any runtime: a float LSTM behind DynamicQuantizeLinear, no contrib op."""
    torch.manual_seed(0)
    model, x = Classifier().eval(), torch.randn(2, 5, 12)
    ort_model, _ = _quantized(model, (x,))
    ops = collections.Counter(n.op_type for n in onnx.load(str(qp.export_onnx(ort_model, tmp_path / "m.onnx"))).graph.node)
    assert ops["LSTM"] == 1 and ops["DynamicQuantizeLinear"] == 2 and "DynamicQuantizeLSTM" not in ops


@pytest.mark.parametrize("flags", ["avx2 fma", "avx2 fma avx512f avx512bw avx512_vnni"],
                         ids=["avx2", "vnni"])
def test_the_cpus_weight_grid_runs_in_ort_with_its_own_integers(flags):
    """Without VNNI the LSTM's weights are 7-bit (their int16 pair sums cannot saturate): ORT gets
    those integers, not the even 8-bit ones that dequantize alike; with VNNI, full 8 bits. On a
    host whose ORT kernels saturate, VNNI's 8-bit weights break the contract at convert, which
    keeps the reference form (checked on ORT's real AVX2 kernels under QEMU's emulated Haswell)."""
    from qplug_onnxruntime.probe import matmul_integer

    torch.manual_seed(0)
    model = Stateful(num_layers=1).eval()
    inputs = (torch.randn(6, 3, 12), torch.randn(1, 3, 16), torch.randn(1, 3, 16))
    with override_cpu_flags(flags):
        ort_model, reference = _quantized(model, inputs,
                                          qp.get_default_qconfig_mapping(*_MAPPING))
    report = qp.quantization_report(ort_model)
    if flags != "avx2 fma" and probe_pair_sums(matmul_integer) == PAIRS_SATURATE:
        assert "rnn" not in report.kernels and "broke the kernel contract" in report.reference["rnn"]
        return
    assert report.kernels["rnn"].startswith("delegate:")
    (partition,) = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    graph = onnx.load_from_string(whole_model(partition.sources[0])).graph
    weights = [onnx.numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.INT8]
    top = max(int(abs(w.astype("int32")).max()) for w in weights)
    assert top == (64 if flags == "avx2 fma" else 127)
    with torch.no_grad():
        for got, expected in zip(ort_model(*inputs), reference(*inputs)):
            assert _cosine(got, expected) > 0.999


class EncoderDecoder(nn.Module):
    """A decoder LSTM fed the encoder's (h, c) as a whole: the encoder stays in PyTorch."""

    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.LSTM(4, 16, batch_first=True), nn.LSTM(4, 16, batch_first=True)
        self.proj = nn.Linear(16, 1)

    def forward(self, x):
        _, state = self.enc(x)
        out, _ = self.dec(x[:, -3:], state)
        return self.proj(out).squeeze(-1)


def test_a_decoder_fed_the_encoders_state_tuple_compiles_with_its_tensors():
    """The partition read the (h, c) tuple made outside it, and its compile failed ('tuple' object
    has no attribute 'shape'): decoder and projection ran in reference form. It reads h and c."""
    torch.manual_seed(0)
    model, x = EncoderDecoder().eval(), torch.randn(8, 24, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping(*_MAPPING), (x,), backend="onnxruntime")
        reference = qp.convert_to_reference_fx(copy.deepcopy(observed))
        ort_model = qp.convert_fx(observed)
    report = qp.quantization_report(ort_model)
    assert report.kernels == {"dec": "delegate:delegate_0", "proj": "delegate:delegate_0"}
    assert list(report.reference) == ["enc"]
    assert [str(w.message) for w in caught if "qplug" in str(w.message)] == [
        f"qplug: 1 int8 layer(s) run in PyTorch in reference form (int8 rounding simulated in float, slower than "
        f"the backend's own): 'enc' ({report.reference['enc']})"]
    with torch.no_grad():
        got, expected = ort_model(x), reference(x)
    assert got.shape == expected.shape == (8, 3)
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
