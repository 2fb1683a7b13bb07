"""New input shapes on onnxruntime: one session serves every size the partition's graph leaves
free (batch and the time axis of a ``(batch, channels, time)`` signal), sessions for the shapes
a graph fixes are kept up to ``shape_cache_size`` (least recently used first out), and ORT's
spinning threads are a setting."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx, nn

import qplug_core as qp
from qplug_core.plugin_api import ConfigValidationError, to_onnx_proto

from qplug_onnxruntime import SessionSettings, configure
from qplug_onnxruntime.session import OrtPartition


def signal(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.cumsum(0.1 * torch.randn(batch, 6, length, generator=torch.Generator().manual_seed(seed)), -1)


@pytest.fixture(scope="module")
def conv1d():
    """(onnxruntime model, reference form) of a 1-D CNN quantized at batch 2, 64 steps."""
    model = nn.Sequential(nn.Conv1d(6, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 8, 3)).eval()
    data = [(signal(2, 64, seed),) for seed in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        observed = qp.prepare_fx(model, None, data[0], backend="onnxruntime")
        qp.calibrate(observed, data)
        reference = qp.convert_to_reference_fx(observed)
        return qp.convert_fx(observed), reference


def test_one_session_serves_every_length_and_batch_the_graph_leaves_free(conv1d):
    ort_model, reference = conv1d
    (partition,) = [m for m in ort_model.modules() if isinstance(m, OrtPartition)]
    with torch.no_grad():
        for batch, length in ((2, 40), (3, 100), (5, 257), (2, 3)):  # 3: the smallest a kernel-3 conv takes
            x = signal(batch, length, seed=batch + length)
            got, expected = ort_model(x), reference(x)
            assert got.shape == (batch, 8, length - 2)
            # the last conv writes float (no int8 op reads it): two steps of its range / 255
            assert (got - expected).abs().max() <= 2 * float(expected.max() - expected.min()) / 255
    assert len(partition.sessions) == 1
    assert [isinstance(size, str) for size in partition.sessions[0].get_inputs()[0].shape] == [True, False, True]


def test_sessions_for_shapes_the_graph_fixes_stay_within_the_cache_size():
    graph = fx.symbolic_trace(nn.Sequential(nn.Conv1d(6, 4, 3), nn.ReLU()).eval())

    def static(gm, inputs):  # every shape fixed: a session per shape
        return to_onnx_proto(gm, inputs).SerializeToString()

    partition = OrtPartition(graph, (signal(1, 16, 0),), static, SessionSettings(shape_cache_size=1))
    first = partition.sessions[0]
    with pytest.warns(UserWarning, match="shape_cache_size") as warned, torch.no_grad():
        x = signal(1, 20, 1)
        torch.testing.assert_close(partition(x), graph(x))
    assert len(warned) == 1 and len(partition.sessions) == 1 and partition.sessions[0] is not first


def test_spinning_and_the_cache_size_are_settings():
    previous = configure(allow_spinning=False)
    try:
        options = SessionSettings(**{**previous.__dict__, "allow_spinning": False}).session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        configure(allow_spinning=previous.allow_spinning)
    assert SessionSettings().session_options().get_session_config_entry("session.intra_op.allow_spinning") == "1"
    with pytest.raises(ConfigValidationError, match="shape_cache_size must be an int >= 1"):
        configure(shape_cache_size=0)
    with pytest.raises(ConfigValidationError, match="allow_spinning must be True or False"):
        SessionSettings(allow_spinning="no")
