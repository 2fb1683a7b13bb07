"""What the stored partition models of one file may fill with the reference form's weights.

A model may fill each of the reference form's weights into one slot (a weight tied across two
partitions is in each partition's model: it was refused in the second and exported again), and
the models of one file at most ``FILL_FACTOR`` times those weights in all (K stored models for one
partition each filled every weight: K times the weights from a file of a few KiB more), refused
before anything is filled.
"""

from __future__ import annotations

import onnx
import pytest
import torch

from qplug_core.errors import SerializationError
from qplug_core.serialization.shared_initializers import FILL_FACTOR, Room, put_back

WEIGHT = torch.arange(64 * 64, dtype=torch.int32).remainder(255).sub(127).to(torch.int8).reshape(64, 64)
TENSORS = {"fc.weight": WEIGHT}


def _model(*slots: str) -> bytes:
    """A model whose initializers ``slots`` are empty int8 [64, 64] slots."""
    initializers = [onnx.TensorProto(name=name, data_type=onnx.TensorProto.INT8, dims=[64, 64]) for name in slots]
    nodes = [onnx.helper.make_node("Identity", [name], [f"{name}_out"]) for name in slots]
    outputs = [onnx.helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.INT8, [64, 64]) for name in slots]
    return onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [], outputs, initializers)).SerializeToString()


def _filled(source: bytes) -> list[bytes]:
    return [i.raw_data for i in onnx.load_model_from_string(source).graph.initializer]


def test_a_weight_tied_across_two_partitions_fills_each_partitions_model():
    room = Room(TENSORS)
    first = put_back(_model("w"), {"w": "fc.weight"}, TENSORS, room)
    second = put_back(_model("shared_w"), {"shared_w": "fc.weight"}, TENSORS, room)
    assert _filled(first) == _filled(second) == [WEIGHT.numpy().tobytes()]


def test_one_model_fills_a_weight_once():
    with pytest.raises(SerializationError, match="fill more initializers than the reference form holds tensors "
                                                 r"of dtype and shape \(3, \(64, 64\)\)"):
        put_back(_model("a", "b"), {"a": "fc.weight", "b": "fc.weight"}, TENSORS, Room(TENSORS))


def test_the_models_of_one_file_fill_at_most_the_factor_times_its_weights():
    room = Room(TENSORS)
    for _ in range(FILL_FACTOR):
        put_back(_model("w"), {"w": "fc.weight"}, TENSORS, room)
    with pytest.raises(SerializationError, match=r"would fill 4096 bytes where the file's stored models may fill 0 "
                                                 rf"more \(at most {FILL_FACTOR} times the reference form's weights"):
        put_back(_model("w"), {"w": "fc.weight"}, TENSORS, room)
