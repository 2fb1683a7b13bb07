"""qp.export_onnx of embedding tables: uint8 rows with per-row scale and offset, bags without a Loop."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.onnx_export import reference_form
from qplug_core.onnx_export.tables import Int8Table
from qplug_core.onnx_export.weights import with_int8_weights
from qplug_core.testing import all_plugins_loaded, one_thread

ROWS = 200


class Tables(nn.Module):
    """One of each table form: lookups, a weighted sum over offsets (one bag empty), a mean with a
    padding id, fixed-size bags of a 2-D input."""

    def __init__(self):
        super().__init__()
        self.lookup = nn.Embedding(ROWS, 8)
        self.weighted = nn.EmbeddingBag(ROWS, 8, mode="sum")
        self.mean = nn.EmbeddingBag(ROWS, 8, mode="mean", padding_idx=0)
        self.grid = nn.EmbeddingBag(ROWS, 8, mode="sum")
        self.fc = nn.Linear(32, 4)

    def forward(self, ids, bag_ids, offsets, weights, mean_ids, mean_offsets, grid_ids):
        return self.fc(torch.cat([self.lookup(ids), self.weighted(bag_ids, offsets, per_sample_weights=weights),
                                  self.mean(mean_ids, mean_offsets), self.grid(grid_ids)], dim=1))


def _inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    entries = 3 * batch
    offsets = torch.arange(0, entries, 3)
    offsets[1:2] = 0  # the first bag is empty (at batch >= 2)
    mean_ids = torch.randint(0, ROWS, (entries,), generator=g)
    mean_ids[::4] = 0  # padding entries, neither summed nor counted
    return (torch.randint(0, ROWS, (batch,), generator=g), torch.randint(0, ROWS, (entries,), generator=g),
            offsets, torch.rand(entries, generator=g), mean_ids, torch.arange(0, entries, 3),
            torch.randint(0, ROWS, (batch, 3), generator=g))


@pytest.fixture(scope="module")
def quantized():
    with one_thread(), all_plugins_loaded():
        torch.manual_seed(0)
        data = [_inputs(4, seed) for seed in range(3)]
        return qp.quantize(Tables().eval(), data[0], data, backend="fbgemm")


def test_the_tables_hold_uint8_rows_and_compute_the_reference_form(quantized):
    reference = reference_form(quantized)
    exportable = with_int8_weights(reference)
    tables = [m for m in exportable.modules() if isinstance(m, Int8Table)]
    assert len(tables) == 4 and all(t.qweight.dtype == torch.uint8 for t in tables)
    assert not any(p.numel() >= ROWS * 8 and p.is_floating_point()
                   for p in [*exportable.parameters(), *exportable.buffers()])
    x = _inputs(6, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(exportable(*x), reference(*x), rtol=0, atol=1e-5)


@pytest.mark.slow  # one export: ~10 s on a shared core
def test_the_onnx_file_holds_uint8_tables_no_loop_and_runs_like_the_reference_form(quantized, tmp_path):
    with one_thread():
        path = qp.export_onnx(quantized, tmp_path / "tables.onnx", _inputs(4), dynamic_batch=True)
    model = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert "Loop" not in ops
    sizes = collections.Counter()
    for init in model.graph.initializer:
        sizes[onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name] += int(np.prod(init.dims))
    assert sizes["uint8"] >= 4 * ROWS * 8  # the rows; in float: a scale and an offset per row, no table
    assert sizes["float32"] <= 4 * ROWS * 2 + 64
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    reference = reference_form(quantized)
    for batch in (1, 9):
        x = _inputs(batch, seed=batch)
        (got,) = session.run(None, {n: t.numpy() for n, t in zip(names, x)})
        with torch.no_grad():
            np.testing.assert_allclose(got, reference(*x).numpy(), rtol=0, atol=1e-5)
