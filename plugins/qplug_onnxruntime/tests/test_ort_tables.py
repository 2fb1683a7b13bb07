"""Embedding tables in ONNX Runtime partitions: uint8 rows, bags without a Loop, invalid ids refused."""

from __future__ import annotations

import collections

import onnx
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.plugin_api import CompiledPartition, QplugError, whole_model


class Tables(nn.Module):
    """A lookup of one column of an id matrix and a weighted bag over offsets, then a linear."""

    def __init__(self):
        super().__init__()
        self.lookup = nn.Embedding(300, 16)
        self.bag = nn.EmbeddingBag(400, 16, mode="sum")
        self.fc = nn.Linear(32, 4)

    def forward(self, columns, ids, offsets, weights):
        return self.fc(torch.cat([self.lookup(columns[:, 1]), self.bag(ids, offsets, per_sample_weights=weights)], 1))


def _inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 300, (batch, 2), generator=g), torch.randint(0, 400, (3 * batch,), generator=g),
            torch.arange(0, 3 * batch, 3), torch.rand(3 * batch, generator=g))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = Tables().eval()
    data = [_inputs(8, seed) for seed in range(2)]
    return model, qp.quantize(model, data[0], data, backend="onnxruntime")


def test_the_partition_holds_uint8_tables_and_no_loop(quantized):
    _, qmodel = quantized
    (partition,) = [m for m in qmodel.modules() if isinstance(m, CompiledPartition)]
    model = onnx.load_from_string(whole_model(partition.sources[0]))
    assert "Loop" not in {n.op_type for n in model.graph.node}  # a Loop over bags ran ~100x slower than float
    elements = collections.Counter()
    for init in model.graph.initializer:
        elements[init.data_type] += int(torch.Size(init.dims).numel())
    assert elements[onnx.TensorProto.UINT8] >= (300 + 400) * 16
    assert elements[onnx.TensorProto.FLOAT] < (300 + 400) * 16 / 2  # a scale and an offset per row
    x = _inputs(5, seed=9)
    with torch.no_grad():  # the partition is the whole model: its reference form takes the same inputs
        torch.testing.assert_close(qmodel(*x), partition.partition(*x), rtol=0, atol=1e-4)


@pytest.mark.parametrize(("which", "bad"), [("columns", -1), ("columns", 300), ("ids", -1), ("ids", 400)])
def test_ids_the_float_tables_refuse_are_refused(quantized, which, bad):
    model, qmodel = quantized
    x = list(_inputs(4, seed=3))
    position = 0 if which == "columns" else 1
    x[position] = x[position].clone()
    x[position].view(-1)[-1] = bad
    with pytest.raises((IndexError, RuntimeError)):
        model(*x)
    with pytest.raises(QplugError, match=f"input '{which}' holds ids from .* to .*, but the table") as refused:
        qmodel(*x)
    assert type(refused.value).__name__ == "InputMismatchError"
