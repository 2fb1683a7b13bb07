"""qp.export_onnx / qplug export: ONNX QDQ of the reference form, run by ONNX Runtime."""

from __future__ import annotations

import collections
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import qplug_core as qp
from qplug_core.cli.app import app
from qplug_core.errors import ExportError
from qplug_core.onnx_export import reference_form
from qplug_core.testing import all_plugins_loaded, one_thread

logging.getLogger("torch.onnx").setLevel(logging.ERROR)


class Block(nn.Module):
    """conv-bn-relu6, a residual add and a linear: per-channel weights, a clamp to fold, QLinearAdd."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU6()
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = y + self.conv2(y)
        return self.fc(y.mean((2, 3)))


def _data(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, 8, 8, generator=g),) for _ in range(n)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    with one_thread(), all_plugins_loaded():
        data = _data()
        torch.manual_seed(0)  # the weights: unseeded, the test after others failed once in a run
        qmodel = qp.quantize(Block().eval(), data[0], data, backend="fbgemm")
        path = qp.export_onnx(qmodel, tmp_path_factory.mktemp("onnx") / "block.onnx")
    return qmodel, path


def test_export_is_a_checked_qdq_model_with_int8_initializers(exported):
    _, path = exported
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["QuantizeLinear"] and ops["DequantizeLinear"] and "Clip" not in ops
    init = {i.name: i for i in model.graph.initializer}
    weight_dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in init]
    dtypes = collections.Counter(onnx.helper.tensor_dtype_to_np_dtype(init[n.input[0]].data_type).name
                                 for n in weight_dqs)
    assert dtypes == {"int8": 3, "int32": 3}  # conv, conv2, fc weights; their biases
    per_channel = [n for n in weight_dqs if init[n.input[0]].data_type == onnx.TensorProto.INT8]
    assert all(onnx.helper.get_attribute_value(a) == 0 for n in per_channel for a in n.attribute
               if a.name == "axis")
    assert all(len(init[n.input[1]].dims) == 1 for n in per_channel)


def test_ort_runs_it_like_the_reference_form_within_one_step(exported):
    qmodel, path = exported
    reference = reference_form(qmodel)  # rebuilt from the fbgemm model's save artifact
    x = _data(1)[0][0] * 1.5
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            expected = reference(x).numpy()
        step = float(reference.get_submodule(_output_dequantize(reference)).scale)
        assert np.abs(got - expected).max() <= step * 1.001


def _output_dequantize(gm) -> str:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return output.args[0].target


def test_ort_fuses_the_groups_into_int8_kernels(exported, tmp_path):
    _, path = exported
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = collections.Counter(n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node)
    assert ops["QLinearConv"] == 2 and ops["QLinearAdd"] == 1 and ops["QGemm"] == 1
    assert "Conv" not in ops and "Clip" not in ops


def _ort_output(path, x: torch.Tensor) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.fixture(scope="module")
def mlp():
    """A model with two weights past onnx_ir's 256-byte inline size: 64x64 and 8x64 int8."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 64, generator=g),) for _ in range(3)]
    torch.manual_seed(0)
    with one_thread(), all_plugins_loaded():
        return qp.quantize(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval(), data[0], data,
                           backend="fbgemm"), data[0][0]


def test_a_model_past_the_external_data_size_keeps_its_weights_beside_it(mlp, tmp_path, monkeypatch):
    """A model past 2 GB ended in protobuf's bare EncodeError: big models go to <path>.data."""
    qmodel, x = mlp
    monkeypatch.setattr("qplug_core.onnx_export.api.EXTERNAL_DATA_BYTES", 1024)  # this 4.6 KB model is "big"
    with one_thread(), all_plugins_loaded():
        path = qp.export_onnx(qmodel, tmp_path / "big.onnx")
    header = onnx.load(str(path), load_external_data=False)
    stored = [i for i in header.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert sorted(list(i.dims) for i in stored) == [[8, 64], [64, 64]]
    assert (tmp_path / "big.onnx.data").stat().st_size >= 64 * 64 + 8 * 64
    reference = reference_form(qmodel)
    with torch.no_grad():
        expected = reference(x).numpy()
    step = float(reference.get_submodule(_output_dequantize(reference)).scale)
    assert np.abs(_ort_output(path, x) - expected).max() <= step * 1.001


def test_external_data_it_cannot_write_is_an_export_error(mlp, tmp_path, monkeypatch):
    (tmp_path / "m.onnx.data").mkdir()
    monkeypatch.setattr("qplug_core.onnx_export.api.EXTERNAL_DATA_BYTES", 1024)
    with one_thread(), all_plugins_loaded(), pytest.raises(ExportError, match=r"external data .*m\.onnx\.data"):
        qp.export_onnx(mlp[0], tmp_path / "m.onnx")


def test_a_float_model_is_refused():
    with pytest.raises(ExportError, match="takes a model converted by qplug"):
        qp.export_onnx(Block(), "never.onnx")


def test_cli_exports_a_saved_model(tmp_path, exported):
    qmodel, _ = exported
    saved = qp.save(qmodel, tmp_path / "block.safetensors")
    result = CliRunner().invoke(app, ["export", str(saved), str(tmp_path / "cli.onnx")])
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(onnx.load(str(tmp_path / "cli.onnx")))
    assert "wrote" in result.output


def test_cli_export_to_a_path_it_cannot_write_is_one_line_before_the_export(tmp_path, exported):
    """It exported for seconds, then printed a 48-line traceback ending in FileNotFoundError."""
    saved = qp.save(exported[0], tmp_path / "block.safetensors")
    for target, why in ((tmp_path / "missing" / "m.onnx", "does not exist"), (tmp_path, "it is a directory")):
        result = CliRunner().invoke(app, ["export", str(saved), str(target)])
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines()[-1].startswith("qplug: error: cannot write")
        assert why in result.output and "Traceback" not in result.output


@pytest.fixture(scope="module")
def dynamic_reference():
    """The reference form of a dynamic int8 linear (the partition ONNX Runtime compiles) and an input."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16).eval()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    with one_thread(), all_plugins_loaded():
        qmodel = qp.quantize_dynamic(linear, backend="onnxruntime", example_inputs=(x,))
    return linear, qmodel.delegate_0.partition, x


def _run(proto, x: torch.Tensor) -> torch.Tensor:
    """The model's output by ONNX's definition of its ops (ONNX Runtime would fuse DequantizeLinear
    -> MatMul into a kernel that quantizes the input)."""
    from onnx.reference import ReferenceEvaluator

    return torch.from_numpy(ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x.numpy()})[0])


def test_a_dynamic_linear_exports_in_either_form(dynamic_reference):
    from qplug_core.plugin_api import to_onnx_proto

    _, reference, x = dynamic_reference
    fused = to_onnx_proto(reference, (x,))
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in fused.graph.node}
    with torch.no_grad():
        torch.testing.assert_close(_run(fused, x), reference(x), rtol=1e-5, atol=1e-5)
    # int8 weights into a float MatMul: the input stays float for a runtime that quantizes it itself
    weights = to_onnx_proto(reference, (x,), dynamic_linears="dequantized_weights")
    assert [n.op_type for n in weights.graph.node if n.op_type in ("DequantizeLinear", "MatMul", "MatMulInteger")] \
        == ["DequantizeLinear", "MatMul"]
    (weighted,) = [m for m in reference.modules() if hasattr(m, "weight_qparams")]
    grid, float_linear = weighted.weight_qparams, weighted.module  # its bias is corrected for the grid
    scales = grid.scale.reshape(-1, 1)
    rounded = torch.round(float_linear.weight / scales).clamp(grid.quant_min, grid.quant_max) * scales
    with torch.no_grad():
        torch.testing.assert_close(_run(weights, x), nn.functional.linear(x, rounded, float_linear.bias),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ExportError, match="dynamic_linears must be one of matmul_integer, dequantized_weights"):
        to_onnx_proto(reference, (x,), dynamic_linears="weights")


def test_the_exporter_reads_torchlib_once_per_process_and_exports_the_same_model(monkeypatch):
    """onnxscript re-parses the source of ~500 torchlib functions on every export (1 s each):
    qplug keeps the list after the first, and the models exported with it are the same."""
    from torch.onnx._internal import _lazy_import

    from qplug_core.onnx_export.api import to_onnx_proto

    apis = _lazy_import.onnxscript_apis
    unwrapped = getattr(apis.get_torchlib_ops, "__wrapped__", apis.get_torchlib_ops)
    reads = []
    monkeypatch.setattr(apis, "get_torchlib_ops", lambda: reads.append(1) or unwrapped())
    graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))
    first, second = (to_onnx_proto(graph, (torch.randn(2, 4),)) for _ in range(2))
    assert len(reads) == 1
    assert first.SerializeToString() == second.SerializeToString()


def test_the_copy_the_exporter_traces_holds_no_copy_of_the_reference_form_s_tensors(exported):
    """It shares them (the export only reads them): copied, a whole-model partition's float weights
    were alive twice while it was exported and compiled."""
    from qplug_core.onnx_export.weights import with_int8_weights

    gm = reference_form(exported[0])
    own = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    copy = with_int8_weights(gm)
    kept = {name: t for name, t in [*copy.named_parameters(), *copy.named_buffers()] if name in own and t.numel()}
    assert kept
    assert [name for name, t in kept.items() if t.untyped_storage().data_ptr() != own[name].untyped_storage().data_ptr()] \
        == []
