"""A request ONNX Runtime refuses is reported once, by the exception the caller gets: ORT printed an
error line to stderr for every such call too (report s26 F7: log noise in a server)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from qplug_onnxruntime import SessionSettings


def _gather_model() -> bytes:
    """Rows of a 10 x 4 table by index: an index past 9 is a bad request."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10, 4], np.zeros(40, dtype=np.float32))
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["rows"])], "gather",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, 4])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_refused_run_prints_nothing_to_stderr(capfd):
    session = SessionSettings(num_threads=1).inference_session(_gather_model())
    capfd.readouterr()
    with pytest.raises(Exception, match="out of data bounds"):
        session.run(None, {"ids": np.array([50], dtype=np.int64)})
    assert capfd.readouterr().err == ""
    assert session.run(None, {"ids": np.array([3], dtype=np.int64)})[0].shape == (1, 4)
