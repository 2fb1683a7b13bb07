"""onnxruntime sessions for shapes a graph fixes are kept up to ``shape_cache_size`` (least
recently used first out; one session serving every free size: tests/plugins/test_delegated_shapes.py),
and ORT's spinning threads are a setting."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from qplug_core.plugin_api import ConfigValidationError, to_onnx_proto

from qplug_onnxruntime import SessionSettings, configure
from qplug_onnxruntime.session import OrtPartition


def signal(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.cumsum(0.1 * torch.randn(batch, 6, length, generator=torch.Generator().manual_seed(seed)), -1)


@pytest.mark.slow  # ~2-4 s: two static exports and sessions
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


def test_the_shapes_a_session_takes_are_read_from_the_session_as_the_model_states_them():
    """The session's own reading of its inputs (not a second parse of the model, weights and all)
    gives what parsing the ONNX model gives: names, types, symbolic sizes and their minimums."""
    from qplug_core.plugin_api import onnx_input_shapes

    graph = fx.symbolic_trace(nn.Sequential(nn.Conv1d(6, 4, 3), nn.ReLU()).eval())
    model = to_onnx_proto(graph, (signal(3, 16, 0),), flexible=True).SerializeToString()
    partition = OrtPartition(graph, (signal(3, 16, 0),), lambda gm, inputs: model, SessionSettings())
    read = partition.compiled[0].input_shapes
    assert read == onnx_input_shapes(model)
    assert all(isinstance(size, str) for size in (read.shapes[0][0], read.shapes[0][2])) and read.minimums
    assert read.fit([signal(2, 6, 1)]) and not read.fit([signal(2, 2, 1)]) and not read.fit([signal(2, 6, 1).double()])
