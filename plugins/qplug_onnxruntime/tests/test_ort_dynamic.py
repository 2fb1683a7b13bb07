"""Dynamic int8 linears on onnxruntime: ORT's DynamicQuantizeMatMul, the reference form's numbers."""

from __future__ import annotations

import collections

import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import QplugError

from qplug_onnxruntime.session import OrtPartition


class SharedInput(nn.Module):
    """Three linears reading one value (attention's q, k, v) and a fused linear-relu."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))
        self.ff = nn.Sequential(nn.Linear(32, 64), nn.ReLU())

    def forward(self, x):
        return self.ff(self.q(x) * self.k(x) + self.v(x))


def test_dynamic_linears_run_as_dynamic_quantize_matmul(tmp_path):
    torch.manual_seed(0)
    model, x = SharedInput().eval(), torch.randn(4, 10, 32)
    mapping = qp.get_default_qconfig_mapping("onnxruntime", "dynamic")
    observed = qp.prepare_fx(model, mapping, (x,), backend="onnxruntime")
    reference = qp.convert_to_reference_fx(observed)
    ort_model = qp.convert_fx(observed)
    assert qp.quantization_report(ort_model).mode == "dynamic"
    (partition,) = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(partition.sources[0], options,
                         providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    assert ops["DynamicQuantizeMatMul"] + ops["MatMulIntegerToFloat"] == 4
    assert "MatMulNBits" not in ops and "MatMul" not in ops
    with torch.no_grad():
        got, expected = ort_model(x), reference(x)
    # ORT divides by the scale, torch multiplies by its inverse: an input now and then lands one
    # step away, which moves the outputs it feeds by about that step times a weight
    close = (got - expected).abs() <= 1e-4
    assert float(close.float().mean()) >= 0.98
    assert float((got - expected).abs().max()) <= 0.01 * float(expected.abs().max())


class Tagger(nn.Module):
    """An LSTM tagger: embedding-free, a linear in front and one behind."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.rnn = nn.LSTM(16, 16, num_layers=2, batch_first=True)
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        return self.out(self.rnn(self.inp(x))[0])


@pytest.mark.parametrize("model_class, shape", [(SharedInput, (4, 10, 32)), (Tagger, (3, 6, 12))])
def test_quantize_dynamic_compiles_linears_and_lstms_as_the_graph_flow_does(model_class, shape, tmp_path):
    torch.manual_seed(0)
    model, x = model_class().eval(), torch.randn(*shape)
    ort_model = qp.quantize_dynamic(model, backend="onnxruntime", example_inputs=(x,))
    mapping = qp.get_default_qconfig_mapping("onnxruntime", "dynamic")
    graph_flow = qp.convert_fx(qp.prepare_fx(model, mapping, (x,), backend="onnxruntime"))
    report = qp.quantization_report(ort_model)
    assert report.mode == "dynamic" and report.reference == {}
    assert all(s.partition == "delegate_0" for s in report.skipped)  # nothing float outside ORT
    assert report.kernels == qp.quantization_report(graph_flow).kernels
    assert report.skipped == qp.quantization_report(graph_flow).skipped
    assert set(report.kernels.values()) == {"delegate:delegate_0"}  # one session, LSTM included
    with torch.no_grad():
        assert torch.equal(ort_model(x), graph_flow(x))
        loaded = qp.load(qp.save(ort_model, tmp_path / "dynamic.safetensors"))
        assert torch.equal(loaded(x), ort_model(x))


def test_quantize_dynamic_on_onnxruntime_says_what_it_needs():
    with pytest.raises(QplugError, match=r"compiles the model's graph.*example_inputs=\(x,\)"):
        qp.quantize_dynamic(SharedInput(), backend="onnxruntime")
    x = (torch.randn(2, 32),)
    with pytest.raises(QplugError, match=r"per_token=True needs one activation scale per token"):
        qp.quantize_dynamic(SharedInput(), backend="onnxruntime", example_inputs=x, per_token=True)
    with pytest.raises(QplugError, match=r"int8 only, got dtype=torch.float16"):
        qp.quantize_dynamic(SharedInput(), dtype=torch.float16, backend="onnxruntime", example_inputs=x)
