"""A Python number given to ``forward`` (``forward(x, scale: float)``) on a compiling backend: the ops
reading it run in PyTorch and the rest is compiled. ONNX Runtime and OpenVINO kept the whole model
in reference form ("compiling partition delegate_0 failed (AttributeError: 'float' object has no
attribute 'shape')"). The same for a sparse tensor given to ``forward`` (a GNN's adjacency): the
partition holding ``sparse.mm`` failed to export ("UnsupportedOperatorException:
aten._sparse_addmm"). Real runtimes on the host; outputs against the reference form."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale


@pytest.fixture(params=["onnxruntime", "openvino"])
def backend(request, plugin_autoload) -> str:
    if not any(info.name == request.param and info.available for info in qp.list_backends()):
        pytest.skip(f"{request.param} is not available here")
    return request.param


def _quantize(backend: str):
    torch.manual_seed(0)
    model = Scaled().eval()
    data = [(torch.randn(16, 8), 2.0) for _ in range(8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = qp.quantize(model, data[0], data, backend=backend)
    reference = qp.quantize(model, data[0], data, backend="reference")
    return model, quantized, reference, [str(w.message) for w in caught if "qplug" in str(w.message)]


def test_the_ops_reading_a_python_number_run_in_pytorch_and_the_rest_is_compiled(backend):
    model, quantized, reference, messages = _quantize(backend)
    assert messages == []
    report = qp.quantization_report(quantized)
    assert report.kernels == {"fc": "delegate:delegate_0"} and report.reference == {}
    assert report.outside["mul"].startswith("it reads forward() argument 'scale', which is not a tensor")
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for scale in (2.0, -0.5):  # each call's value, not the calibration's
            # fc's output stays float in the runtime (it folds the dequantization): closer to float
            assert qp.sqnr(reference(x, scale), quantized(x, scale)) > 35
            expected = model(x, scale)
            assert qp.sqnr(expected, quantized(x, scale)) >= qp.sqnr(expected, reference(x, scale))


def test_a_loaded_model_takes_the_python_number_too(backend, tmp_path):
    _, quantized, _, _ = _quantize(backend)
    loaded = qp.load(qp.save(quantized, tmp_path / "scaled.qplug"))
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x, 3.0), quantized(x, 3.0))
    assert qp.quantization_report(loaded).kernels == {"fc": "delegate:delegate_0"}


class GraphConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(torch.sparse.mm(adjacency, self.l1(x))))


def _graph(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    edges = torch.randint(0, 10, (2, 30), generator=g)
    adjacency = torch.sparse_coo_tensor(edges, torch.rand(30, generator=g), (10, 10), check_invariants=True)
    adjacency = adjacency.coalesce()
    return torch.randn(10, 16, generator=g), adjacency


def test_sparse_mm_runs_in_pytorch_and_the_linears_around_it_are_compiled(backend):
    torch.manual_seed(0)
    model = GraphConv().eval()
    g = torch.Generator().manual_seed(0)
    data = [_graph(g) for _ in range(5)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantized = qp.quantize(model, data[0], data[1:], backend=backend)
    reference = qp.quantize(model, data[0], data[1:], backend="reference")  # fbgemm's numbers, bit for bit
    assert [str(w.message) for w in caught if "qplug" in str(w.message)] == []
    report = qp.quantization_report(quantized)
    assert sorted(report.kernels) == ["l1", "l2"] and report.reference == {}
    assert all(kernel.startswith("delegate:") for kernel in report.kernels.values())
    assert report.outside["_sparse_mm"] == (
        "it takes 'adjacency', a sparse_coo tensor: compiled partitions take strided tensors only (their "
        "exporters cannot take it), so this op runs in float in PyTorch")
    step = float(reference.get_submodule("l2_quantize_3").qparams.scale)
    held_out = _graph(torch.Generator().manual_seed(1))
    with torch.no_grad():
        # in the calibrated range: the runtime keeps l1's and l2's outputs float (it folds the
        # dequantization), which moves them by up to two of l2's output steps
        assert float((quantized(*data[1]) - reference(*data[1])).abs().max()) <= 2 * step
        expected = model(*held_out)
        assert qp.sqnr(expected, quantized(*held_out)) >= qp.sqnr(expected, reference(*held_out))
