"""A compiled partition's ONNX model leaves out torch.onnx's notes for readers (node stack traces,
``value_info``): they were half of a small model's stored partition (a TCN's 281 kB -> 139 kB),
once per compiled signature in every ``qp.save`` file. ``QPLUG_DEBUG=1`` keeps them."""

from __future__ import annotations

import os
import warnings

import onnx
import pytest
import torch
from safetensors import safe_open
from torch import fx, nn

import qplug_core as qp
from qplug_core.onnx_export import to_onnx_proto

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class _Causal(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(2, 8, 3, padding=2), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)[:, :, :-2])[:, :, -1])


def _notes(model: onnx.ModelProto) -> list[str]:
    """Where ``model`` carries a note for readers."""
    found = [f"node {n.name}: {[p.key for p in n.metadata_props]}" for n in model.graph.node if n.metadata_props]
    found += [f"node {n.name}: doc_string" for n in model.graph.node if n.doc_string]
    return found + [f"value_info {v.name}" for v in model.graph.value_info]


def _quantized(backend: str) -> fx.GraphModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return qp.quantize(_Causal().eval(), (torch.randn(1, 2, 16),), [(torch.randn(1, 2, 16),) for _ in range(2)],
                           backend=backend)


@pytest.mark.slow  # 18 s in a fresh process (torch.onnx warms up; a quantize, a save, a load)
def test_a_stored_partition_model_has_no_exporter_notes(tmp_path):
    pytest.importorskip("qplug_onnxruntime")
    qmodel = _quantized("onnxruntime")
    path = qp.save(qmodel, tmp_path / "causal.safetensors")
    with safe_open(str(path), framework="pt") as f:
        blobs = [f.get_tensor(k).numpy().tobytes() for k in f.keys() if k.startswith("partition_models/")]  # noqa: SIM118
    assert blobs
    for blob in blobs:
        stored = onnx.load_model_from_string(blob)
        assert _notes(stored) == []
        assert [p.key for p in stored.metadata_props] == ["qplug.min_sizes"]  # qplug's own note stays
    longer = torch.randn(1, 2, 23)
    with torch.no_grad():  # built from the stored model, it answers as the saved one
        assert torch.equal(qp.load(path)(longer), qmodel(longer))


def test_qplug_debug_keeps_them(monkeypatch):
    monkeypatch.setenv("QPLUG_DEBUG", "1")
    kept = _notes(to_onnx_proto(fx.symbolic_trace(_Causal().eval()), (torch.randn(1, 2, 16),)))
    assert any("pkg.torch.onnx.stack_trace" in note for note in kept) and any("value_info" in n for n in kept)


@pytest.mark.slow  # 5 s on a loaded machine: a quantize and two exports
def test_an_exported_file_has_no_exporter_notes_and_answers_as_with_them(tmp_path, monkeypatch):
    """``qp.export_onnx`` wrote every node's stack trace (the quantizing machine's source paths:
    24.8 of the digits CNN's 55.0 kB) into the file a user ships; the runtime's answer is the same."""
    import onnxruntime as ort

    qmodel, x = _quantized("fbgemm"), torch.randn(1, 2, 16)
    path = qp.export_onnx(qmodel, tmp_path / "causal.onnx")
    monkeypatch.setenv("QPLUG_DEBUG", "1")
    kept = qp.export_onnx(qmodel, tmp_path / "causal_debug.onnx")
    exported = onnx.load(str(path))
    assert _notes(exported) == [] and os.path.dirname(qp.__file__) not in str(exported)
    assert any("pkg.torch.onnx.stack_trace" in note for note in _notes(onnx.load(str(kept))))
    assert path.stat().st_size < kept.stat().st_size / 2

    def run(file):
        session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]

    assert (run(path) == run(kept)).all()
