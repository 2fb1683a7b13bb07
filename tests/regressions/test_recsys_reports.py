"""Defects a recommendation/tabular-model user found (2026-12-06): each test is that user's own
call, with the numbers or the error they rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.onnx_export.api import reference_form

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class DotInteraction(nn.Module):
    """DLRM's pairwise interaction: the lower triangle of ``T @ T^T``, taken with index tensors
    computed in ``forward`` or kept as buffers."""

    def __init__(self, buffers: bool) -> None:
        super().__init__()
        self.bot, self.top = nn.Linear(8, 16), nn.Linear(6, 1)
        self.buffers = buffers
        li, lj = torch.tril_indices(4, 4, offset=-1)
        self.register_buffer("li", li)
        self.register_buffer("lj", lj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.bot(x).view(-1, 4, 4)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = (self.li, self.lj) if self.buffers else torch.tril_indices(4, 4, offset=-1)
        return self.top(z[:, li, lj])


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("buffers", [False, True], ids=["tril_indices", "buffers"])
def test_the_dlrm_dot_interaction_quantizes_on_delegating_backends(backend, buffers):
    """The partitioner moved ``z[:, li, lj]`` between the partitions of ``z``, ``li`` and ``lj``
    forever: qp.quantize never returned on onnxruntime, openvino or auto."""
    torch.manual_seed(0)
    model = DotInteraction(buffers).eval()
    batches = [(torch.randn(64, 8),) for _ in range(4)]
    int8 = qp.quantize(model, batches[0], batches, backend=backend)
    x = torch.randn(256, 8)
    with torch.no_grad():
        out = int8(x)
        assert qp.sqnr(model(x), out) > 30  # 38.2 dB measured
        assert qp.sqnr(reference_form(int8)(x), out) > 50  # 60.2 dB
    assert qp.quantization_report(int8).partitions


class CatOfIntAndFloat(nn.Module):
    """DLRM's top-MLP input ``cat([x, Zf])``: an int8 value and a value float ops computed."""

    def __init__(self, float_first: bool = False) -> None:
        super().__init__()
        self.a, self.top = nn.Linear(8, 16), nn.Linear(22, 1)
        self.float_first = float_first

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        z = torch.bmm(y.unsqueeze(1), y.unsqueeze(2)).flatten(1) * torch.ones(1, 6)
        return self.top(torch.cat([z, h] if self.float_first else [h, z], dim=1))


@pytest.mark.parametrize("float_first", [False, True], ids=["int8-first", "float-first"])
@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_a_cat_of_an_int8_and_a_float_value_runs_the_int8_cat(backend, float_first, recwarn):
    """Prepare observed only the cat's first input, so ``quantized::cat`` got only the int8 piece:
    "broke the kernel contract ... returned shape (16, 16), expected (16, 22)", blaming the plugin;
    with the float value first the cat stayed float whole. Every operand is now quantized with the
    qparams of the first int8 one, as torch.ao does."""
    torch.manual_seed(0)
    model = CatOfIntAndFloat(float_first).eval()
    batches = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(4)]
    x = (torch.randn(256, 8), torch.randn(256, 8))
    int8 = qp.quantize(model, batches[0], batches, backend=backend)
    assert qp.quantization_report(int8).kernels["cat"] == "quantized::cat"
    assert not [w for w in recwarn if "cat" in str(w.message)]
    with torch.no_grad():
        assert qp.sqnr(model(*x), int8(*x)) > 40  # 44.3-44.5 dB measured (torch.ao: 30.3-31.4)


class WeightedBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 16, mode="sum")

    def forward(self, idx: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.bag(idx, offsets, weights)


def test_an_embedding_bag_with_per_sample_weights_runs_the_8_bit_row_kernel():
    """The float ``per_sample_weights`` counted as an unquantized activation of this weight-only op:
    no kernel ("its inputs or output are not quantized in this graph") and a model 12% larger than
    float (72000 bytes against 64000)."""
    torch.manual_seed(0)
    model = WeightedBag().eval()
    idx, offsets, weights = torch.randint(0, 1000, (40,)), torch.arange(0, 40, 5), torch.rand(40)
    int8 = qp.quantize(model, (idx, offsets, weights), [(idx, offsets, weights)], backend="fbgemm")
    assert qp.quantization_report(int8).kernels == {"bag": "quantized::embedding_bag_byte"}
    assert sum(t.numel() * t.element_size() for t in int8.state_dict().values()) == 24000
    assert (int8.bag.num_embeddings, int8.bag.embedding_dim) == (1000, 16)  # as the float bag says (s30/asr F1)
    idx, weights = torch.randint(0, 1000, (40,)), torch.rand(40)
    with torch.no_grad():
        expected = model(idx, offsets, weights)
        assert (int8(idx, offsets, weights) - expected).abs().max() < 0.02  # 0.016 measured (torch.ao: 0.0149)
        assert qp.sqnr(expected, int8(idx, offsets, weights)) > 40  # 48.4 dB


def test_a_cat_reading_a_float_operand_is_not_offered_to_the_int8_kernel(recwarn):
    """A graph whose cat reads a float operand (observed as before the fix above) was lowered with
    only the dequantized operands as the kernel's inputs: the contract check caught the short
    output and warned blaming the plugin. Such a cat now stays reference, with why, and no warning."""
    torch.manual_seed(0)
    model = CatOfIntAndFloat().eval()
    batches = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(4)]
    observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping("fbgemm"), batches[0], backend="fbgemm")
    cat = next(n for n in observed.graph.nodes if n.target is torch.cat)
    observer = cat.args[0][1]
    if observer.op == "call_module":  # the float operand's observer, which prepare puts there now
        cat.replace_input_with(observer, observer.args[0])
        observed.graph.erase_node(observer)
        observed.recompile()
    for batch in batches:
        observed(*batch)
    int8 = qp.convert_fx(observed)
    report = qp.quantization_report(int8)
    assert "cat" not in report.kernels
    assert report.reference["cat"] == "its inputs or output are not quantized in this graph"
    assert not [w for w in recwarn if "contract" in str(w.message)]
    x = (torch.randn(64, 8), torch.randn(64, 8))
    with torch.no_grad():
        assert qp.sqnr(model(*x), int8(*x)) > 30


class _BagThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.fc = nn.EmbeddingBag(100, 16, mode="sum"), nn.Linear(16, 4)

    def forward(self, indices, offsets):
        return self.fc(self.bag(indices, offsets))


def test_compiling_an_embedding_bag_for_onnx_runtime_logs_nothing(caplog):
    """onnx_ir's initializer pass logged "Skipped deduplication of initializer 'row_result' as it
    is a graph input or output" on stderr for every bag the exporter met."""
    torch.manual_seed(0)
    model = _BagThenLinear().eval()
    indices, offsets = torch.randint(0, 100, (20,)), torch.tensor([0, 5, 10, 15])
    int8 = qp.quantize(model, (indices, offsets), [(indices, offsets)], backend="onnxruntime")
    assert qp.sqnr(model(indices, offsets), int8(indices, offsets)) > 30
    assert [r.getMessage() for r in caplog.records if r.name.startswith("onnx_ir")] == []
