"""Defects a user of PyTorch's built-in blocks (GNNs, transformer encoders, RNNs) found (2026-12-06):
each test is that user's own call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConstraintViolationError, ModelStateError, SerializationError
from qplug_core.flows.tags import DYNAMIC_LEFT_FLOAT
from qplug_core.onnx_export.api import reference_form

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")

NODES = 12


class GCN(nn.Module):
    """Two linears around ``torch.sparse.mm`` with the graph's sparse adjacency, an input."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(torch.sparse.mm(adj, self.l1(x))))


def _adjacency(edges: int) -> torch.Tensor:
    indices = torch.randint(0, NODES, (2, edges))
    return torch.sparse_coo_tensor(indices, torch.ones(edges), (NODES, NODES)).coalesce()


def test_a_sparse_adjacency_input_quantizes_the_linears_and_keeps_sparse_mm_float(tmp_path):
    """Calibration called ``x.min()`` on the sparse adjacency: a raw NotImplementedError "Could not
    run 'aten::min' with arguments from the 'SparseCPU' backend". The constant-input check now skips
    sparse inputs: the linears run int8, ``sparse.mm`` stays float and is reported; saving, which
    cannot name the sparse op, raises qplug's own error (as ONNX export does: ExportError)."""
    torch.manual_seed(0)
    model, adj = GCN().eval(), _adjacency(30)
    batches = [(torch.randn(NODES, 8), adj) for _ in range(8)]
    int8 = qp.quantize(model, batches[0], batches, backend="fbgemm")
    report = qp.quantization_report(int8)
    assert report.kernels == {"l1": "quantized::linear", "l2": "quantized::linear"}
    assert "_sparse_mm" in [s.node for s in report.skipped]
    x = torch.randn(NODES, 8)
    with torch.no_grad():
        out = int8(x, adj)
        assert qp.sqnr(model(x, adj), out) > 30  # 36.9 dB measured
        assert torch.equal(reference_form(int8)(x, adj), out)
    with pytest.raises(SerializationError, match="register_serializable"):
        qp.save(int8, tmp_path / "gcn.qplug")


def test_a_reference_dynamic_transformer_encoder_runs_and_matches_fbgemm():
    """``quantize_dynamic(backend="reference")`` gave a TransformerEncoder that raised
    "AttributeError: 'SimulatedDynamic' object has no attribute 'weight'" at every eval call (the
    layer's fast-path check reads ``linear1.weight``). SimulatedDynamic now shows its linear's
    weight and bias as DynamicLinear does, and answers as fbgemm's DynamicLinear does."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(4, 10, 32)
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        reference = qp.quantize_dynamic(model, backend="reference")
        fbgemm = qp.quantize_dynamic(model, backend="fbgemm")
    with torch.no_grad():
        assert qp.sqnr(fbgemm(x), reference(x)) > 100  # equal: both use the rounded weights
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            assert qp.sqnr(fbgemm(x), reference(x)) > 100  # 139.6 dB: each linear's own kernel
            assert qp.sqnr(model(x), reference(x)) > 45  # 49.2 dB
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    weight = reference.layers[0].linear1.weight
    assert weight.shape == (64, 32) and reference.layers[0].linear1.bias.shape == (64,)
    with pytest.raises(ModelStateError, match="read-only float view"):
        weight.add_(1)
    assert torch.equal(weight + 0, reference.layers[0].linear1.module.weight)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack", "reference"])
@pytest.mark.parametrize("write", [
    lambda w: w.zero_(),
    lambda w: w.data.mul_(0),
    lambda w: w.copy_(torch.zeros_like(w)),
    lambda w: w.__setitem__(0, 1.0),
    lambda w: w[1:].fill_(0),
    lambda w: w.detach().zero_(),
], ids=["zero_", "data.mul_", "copy_", "setitem", "slice.fill_", "detach.zero_"])
def test_writing_to_a_dynamic_layers_weight_is_refused_not_lost(backend, write):
    """A dynamic linear's float ``weight`` is made from its int8 weight at each read, so a user
    pruning or editing it in place wrote to a temporary: accepted, and lost (the output unchanged).
    Every write, through ``.data``, a slice or ``detach()`` too, is refused; reads still work."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    int8, x = qp.quantize_dynamic(model, backend=backend), torch.randn(3, 8)
    before, weight = int8(x), int8[0].weight
    with torch.no_grad(), pytest.raises(ModelStateError, match="read-only float view of its int8 weight"):
        write(weight)
    assert torch.equal(int8(x), before)
    assert torch.allclose(weight.t() + 0, model[0].weight.t(), atol=float(model[0].weight.abs().max()) / 127)


class GRUTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(16, 64, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_onnxruntime_dynamic_defaults_do_not_request_a_gru_and_say_it_stays_float(recwarn):
    """onnxruntime's default dynamic mapping requested int8 for ``nn.GRU``, which the backend has no
    kernel for: the GRU (99.8% of the weights) stayed float without a warning, the report saying
    "the backend lists no dtype config for this pattern". The default no longer requests it, the
    report says the backend has no int8 GRU, and a model left mostly float warns once."""
    torch.manual_seed(0)
    model, x = GRUTagger().eval(), torch.randn(2, 5, 16)
    assert qp.get_default_qconfig_mapping("onnxruntime", mode="dynamic").object_type_qconfigs[nn.GRU] is None
    int8 = qp.quantize_dynamic(model, backend="onnxruntime", example_inputs=(x,))
    reasons = {s.node: s.reason for s in qp.quantization_report(int8).skipped}
    assert reasons["rnn"] == "the backend has no int8 kernel for GRU"
    messages = [str(w.message) for w in recwarn]
    assert [m for m in messages if "of the model's weights stay float: 'rnn'" in m]


def test_an_explicit_gru_request_on_onnxruntime_warns_naming_the_node():
    """A mapping that requests int8 for ``nn.GRU`` on onnxruntime left it float without a word; it
    now warns, naming the node and the reason."""
    torch.manual_seed(0)
    model, x = GRUTagger().eval(), torch.randn(2, 5, 16)
    with pytest.warns(UserWarning, match="GRU at node 'rnn' stays float: the backend has no int8 kernel"):
        qp.quantize_dynamic(model, {nn.GRU, nn.Linear}, backend="onnxruntime", example_inputs=(x,))


class Tagger(nn.Module):
    def __init__(self, rnn: type[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.rnn = rnn(64, 128, batch_first=True)
        self.head = nn.Linear(128, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(torch.relu(self.inp(x)))[0])


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU])
def test_static_quantize_says_why_an_rnn_stays_float(rnn):
    """Static ``qp.quantize`` kept LSTM/GRU float with reason "qconfig is None for this op (not
    requested)" and no warning, though the user had requested nothing and the RNN held 98% of the
    weights. The reason now points at qp.quantize_dynamic, and one warning gives the float share."""
    torch.manual_seed(0)
    model = Tagger(rnn).eval()
    data = [(torch.randn(4, 12, 32),) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"qplug: 9\d\.\d% of the model's weights stay float: 'rnn'"):
        int8 = qp.quantize(model, data[0], data, backend="fbgemm")
    report = qp.quantization_report(int8)
    assert sorted(report.quantized) == ["head", "inp"]
    reasons = {s.node: s.reason for s in report.skipped}
    assert reasons["rnn"] == (f"{rnn.__name__} has int8 kernels for dynamic quantization only: "
                              "qp.quantize_dynamic quantizes it")


class ProjectedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 32)
        self.rnn = nn.LSTM(32, 64, proj_size=16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(torch.relu(self.enc(x)))[0])


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_dynamic_defaults_keep_a_projected_lstm_float_and_convert_the_rest(backend):
    """One ``LSTM(proj_size=...)`` made ``quantize_dynamic`` refuse the whole model with
    "DynamicLSTM: proj_size is not supported by torch.quantized_lstm", naming neither the module nor
    a way out. With the defaults that LSTM now stays float with a warning naming it, the linears
    convert; a qconfig_spec that selects it raises, naming it."""
    torch.manual_seed(0)
    model, x = ProjectedLSTM().eval(), torch.randn(4, 9, 16)
    with pytest.warns(UserWarning, match="module 'rnn' \\(LSTM\\) stays float: DynamicLSTM: proj_size"):
        int8 = qp.quantize_dynamic(model, backend=backend)
    assert type(int8.rnn) is nn.LSTM
    assert type(int8.enc).__name__ == type(int8.head).__name__ == "DynamicLinear"
    # the report gives the same reason (it said the qconfig_spec had not named the LSTM)
    [skipped] = qp.quantization_report(int8).skipped
    assert (skipped.node, skipped.op) == ("rnn", "LSTM")
    assert skipped.reason.startswith("left float: the kernel cannot take it: DynamicLSTM: proj_size")
    assert DYNAMIC_LEFT_FLOAT not in model.rnn.__dict__  # the reason is kept on the result's layer only
    with torch.no_grad():
        assert qp.sqnr(model(x), int8(x)) > 40  # 60+ dB measured
    with pytest.raises(ConstraintViolationError, match="cannot quantize module 'rnn' \\(LSTM\\).*'rnn' to None"):
        qp.quantize_dynamic(model, {nn.LSTM, nn.Linear}, backend=backend)


@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
def test_a_dynamic_transformer_encoder_in_eval_runs_its_int8_linears(backend, monkeypatch):
    """In eval under no_grad, torch's encoder fast path computed in float with the dequantized
    weights the swapped linears showed: their int8 kernels never ran. The weights are views torch's
    fast path declines, so each layer runs its own kernel, as with the fast path off. (Counted by
    patching the class: a forward hook would itself turn torch's fast path off.)"""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(4, 10, 32)
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        int8 = qp.quantize_dynamic(model, backend=backend)
    swapped = type(int8.layers[0].linear1)
    calls = []

    def counted(module, *args):
        calls.append(module)
        return forward(module, *args)

    forward = swapped.forward
    monkeypatch.setattr(swapped, "forward", counted)
    with torch.no_grad():
        fast_path_on = int8(x)
        assert len(calls) == 4  # linear1 and linear2 of both layers
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            fast_path_off = int8(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(fast_path_on, fast_path_off, atol=1e-5, rtol=0)  # attention: float either way


class LinearThenLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.rnn = nn.Linear(8, 16), nn.LSTM(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.fc(x))[0]


def test_the_report_of_a_reference_dynamic_model_lists_its_simulated_layers():
    """``qp.quantization_report`` refused every ``quantize_dynamic(backend="reference")`` model as
    "not produced by qplug" (its SimulatedDynamic layers were not counted as swapped)."""
    int8 = qp.quantize_dynamic(LinearThenLSTM(), backend="reference")
    report = qp.quantization_report(int8)
    assert report.backend == "reference" and report.mode == "dynamic"
    assert report.quantized == {"fc": "SimulatedDynamic", "rnn": "SimulatedDynamic"}
    assert report.kernels["fc"] == "SimulatedDynamic (reference: int8 rounding simulated in float)"
    assert report.skipped == []


class LSTMTagger(nn.Module):
    def __init__(self, proj_size: int = 0) -> None:
        super().__init__()
        self.emb, self.rnn = nn.Embedding(100, 32), nn.LSTM(32, 64, batch_first=True, proj_size=proj_size)
        self.fc = nn.Linear(proj_size or 64, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(self.emb(ids))[0])


@pytest.mark.parametrize("backend, proj_size, warning", [
    ("openvino", 0, r"qplug: 87\.\d% of the model's weights stay float: 'rnn' \(no quantization pattern"),
    ("onnxruntime", 16, r"qplug: 1 int8 layer\(s\) run in PyTorch in reference form .*'rnn' \(backend "
                        r"'onnxruntime' does not take LSTM: proj_size is set"),
])
def test_dynamic_on_a_compiling_backend_says_when_its_lstm_is_not_compiled(backend, proj_size, warning):
    """A tagger whose LSTM holds most of the weights came back from ``quantize_dynamic`` with that
    LSTM float (openvino has no dynamic LSTM) or in reference form (onnxruntime's
    DynamicQuantizeLSTM has no projection) and no warning: only the linear head was compiled."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 12))
    with pytest.warns(UserWarning, match=warning):
        int8 = qp.quantize_dynamic(LSTMTagger(proj_size).eval(), example_inputs=(ids,), backend=backend)
    assert qp.quantization_report(int8).kernels == {"fc": "delegate:delegate_0"}
