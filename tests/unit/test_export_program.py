"""qp.export_program: a converted model's reference form as a torch.export ExportedProgram in
PT2E's quantized_decomposed convention, whatever backend it was lowered to."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError, ExportError
from qplug_core.onnx_export import reference_form
from qplug_core.testing import all_plugins_loaded, one_thread

# the namespace's consumers (Inductor, ExecuTorch) load torch's definition; a test may, qplug does not
pytest.importorskip("torch.ao.quantization.fx._decomposed")


class Block(nn.Module):
    """conv-relu, a residual add over a second conv, a linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = y + self.conv2(y)
        return self.fc(y.mean((2, 3)))


def _data(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, 8, 8, generator=g),) for _ in range(n + 1)]


@pytest.fixture(scope="module", params=["fbgemm", "qnnpack"])
def converted(request):
    data = _data()
    with one_thread(), all_plugins_loaded(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # qnnpack on x86 says it is slow there
        torch.manual_seed(0)
        qmodel = qp.quantize(Block().eval(), data[0], data[:-1], backend=request.param)
        program = qp.export_program(qmodel, data[0])
    return qmodel, program, data[-1][0]


def _targets(program):
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_program_is_the_reference_form_in_quantized_decomposed_ops(converted):
    qmodel, program, x = converted
    assert isinstance(program, torch.export.ExportedProgram)
    targets = _targets(program)
    assert {"quantized_decomposed.quantize_per_tensor.default", "quantized_decomposed.dequantize_per_tensor.default",
            "quantized_decomposed.dequantize_per_channel.default", "aten.conv2d.default",
            "aten.linear.default", "aten.add.Tensor"} <= targets
    assert not any(t.startswith(("qplug.", "quantized.")) for t in targets)
    int8_weights = [t for t in program.state_dict.values() if t.dtype == torch.int8]
    assert len(int8_weights) == 3  # conv, conv2, fc: stored int8, dequantized in the graph
    with torch.no_grad():
        assert torch.equal(program.module()(x), reference_form(qmodel)(x))  # an input it was not exported on


def test_save_load_round_trip(converted, tmp_path):
    qmodel, program, x = converted
    torch.export.save(program, tmp_path / "block.pt2")
    loaded = torch.export.load(tmp_path / "block.pt2")
    assert _targets(loaded) == _targets(program)
    with torch.no_grad():
        assert torch.equal(loaded.module()(x), program.module()(x))


def test_qplug_ops_on_request(converted):
    qmodel, _, x = converted
    program = qp.export_program(qmodel, (x,), ops="qplug")
    assert "qplug.quantize_per_tensor.default" in _targets(program)
    assert not any(t.startswith("quantized_decomposed.") for t in _targets(program))
    with torch.no_grad():
        assert torch.equal(program.module()(x), reference_form(qmodel)(x))
    with pytest.raises(ConfigValidationError, match="ops must be one of"):
        qp.export_program(qmodel, (x,), ops="aten")


def test_module_swapped_models_are_refused_naming_the_graph_flows():
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    with all_plugins_loaded():
        qmodel = qp.quantize_dynamic(model, backend="fbgemm")
    with pytest.raises(ExportError, match=r"export_program takes a model converted by qplug in graph mode"):
        qp.export_program(qmodel, (torch.randn(2, 8),))


def test_dynamic_layers_are_choose_qparams_and_quantize_dequantize():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(2, 8)
    with all_plugins_loaded():
        mapping = qp.get_default_qconfig_mapping("fbgemm", mode="dynamic")
        qmodel = qp.convert_fx(qp.prepare_fx(model, mapping, (x,), backend="fbgemm"), backend="fbgemm")
    program = qp.export_program(qmodel, (x,))
    targets = _targets(program)
    assert {"quantized_decomposed.choose_qparams.tensor", "quantized_decomposed.quantize_per_tensor.tensor",
            "quantized_decomposed.dequantize_per_channel.default"} <= targets
    assert not any(t.startswith("qplug.") for t in targets)
    with torch.no_grad():
        for scale in (0.1, 1.0, 30.0):  # each call's own range
            other = scale * torch.randn(2, 8)
            assert torch.equal(program.module()(other), reference_form(qmodel)(other))


def test_a_loaded_model_exports_at_its_recorded_input_shapes(converted, tmp_path):
    qmodel, program, x = converted
    with all_plugins_loaded():
        loaded = qp.load(qp.save(qmodel, tmp_path / "block.safetensors"))
    again = qp.export_program(loaded)  # no example: zeros shaped like the ones it was prepared with
    with torch.no_grad():
        assert torch.equal(again.module()(x), program.module()(x))
