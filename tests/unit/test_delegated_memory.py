"""A deleted delegated model lets go of its int8 weights: exporting a partition left copies of
them held by torch.export's map of the last traced graph and by onnxscript's rewrite rules (the
last graph they matched) until the process exported something else; a process quantizing many
models (a sweep, ``backend="auto"``, a notebook) kept one model's weights too many. A large
partition is compiled from a file (protobuf's 2 GB limit)."""

from __future__ import annotations

import gc
import tempfile
import weakref

import pytest
import torch
from torch import nn

import qplug_core as qp

SHAPES = {(37, 19), (11, 37)}  # the int8 weights of the model below, shapes no other test uses


def int8_weights_alive() -> list[weakref.ref]:
    """A weakref to every int8 tensor in the process shaped like one of the model's weights."""
    return [weakref.ref(o) for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and o.dtype == torch.int8 and tuple(o.shape) in SHAPES]


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_int8_weights_of_a_deleted_delegated_model_are_collected(plugin_autoload, backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(19, 37), nn.ReLU(), nn.Linear(37, 11)).eval()
    example = (torch.randn(4, 19),)
    qmodel = qp.quantize(model, example, [example], backend=backend, progress=False)
    qmodel(*example)
    weights = int8_weights_alive()
    assert len(weights) >= 2
    del qmodel, model
    gc.collect()
    assert [ref() for ref in weights if ref() is not None] == []


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_partition_past_the_file_threshold_compiles_from_external_data(plugin_autoload, backend, monkeypatch,
                                                                         tmp_path):
    """A partition whose ONNX model passed 2 GB failed in protobuf's ``SerializeToString``; past
    ``PARTITION_FILE_BYTES`` (0 here) it is compiled from a file with its weights as external data,
    answers as the one compiled from bytes does, and the file, kept for rebuilds, is gone with the
    partition."""
    import copy

    from qplug_core.plugin_api import CompiledPartition, OnnxFile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).eval()
    example = (torch.randn(4, 64),)
    qmodel = qp.quantize(model, example, [example], backend=backend, progress=False)
    (partition,) = [m for m in qmodel.modules() if isinstance(m, CompiledPartition)]
    x = torch.randn(1, 64)  # batch 1: a model of its own (the example's batch axis is symbolic from 2)
    with torch.no_grad():
        from_bytes = copy.deepcopy(qmodel)(x)
        monkeypatch.setattr("qplug_core.onnx_export.partition_source.PARTITION_FILE_BYTES", 0)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        assert torch.equal(qmodel(x), from_bytes)
    source = partition.sources[-1]
    assert isinstance(source, OnnxFile) and len(partition.sources) == 2
    assert (source.path.parent / f"{source.path.name}.data").stat().st_size >= 64 * 48  # the int8 weights
    partition.recompile()  # built again from the file kept
    with torch.no_grad():
        assert torch.equal(qmodel(x), from_bytes)
    del qmodel, partition, source
    gc.collect()
    assert list(tmp_path.iterdir()) == []
