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
from qplug_core.serialization.shared_initializers import FILL_FACTOR, Room, left_out, put_back

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


def _linear_model(weight: torch.Tensor) -> bytes:
    """A model holding ``weight`` transposed, as the onnxruntime export holds a linear's (``*_weight_t``)."""
    initializer = onnx.numpy_helper.from_array(weight.T.contiguous().numpy(), "fc_weight_t")
    node = onnx.helper.make_node("Identity", ["fc_weight_t"], ["out"])
    output = onnx.helper.make_tensor_value_info("out", onnx.TensorProto.INT8, list(weight.T.shape))
    return onnx.helper.make_model(onnx.helper.make_graph([node], "g", [], [output], [initializer])).SerializeToString()


@pytest.mark.parametrize("shape", [(32, 128), (64, 64)], ids=["linear", "square"])
def test_a_transposed_weight_is_left_out_and_put_back_transposed(shape):
    """A linear's weight is stored [in, out] (Wav2Vec2 on onnxruntime: every linear's int8 weights
    again in the file, once per input signature); a square one must not come back untransposed."""
    weight = torch.arange(shape[0] * shape[1]).remainder(251).sub(125).to(torch.int8).reshape(shape)
    tensors = {"fc.weight": weight}
    source = _linear_model(weight)
    stored, shared, transposed = left_out(source, tensors)
    assert (shared, transposed) == ({}, {"fc_weight_t": "fc.weight"})
    assert len(stored) < len(source) - weight.numel()
    assert put_back(stored, shared, tensors, Room(tensors), transposed) == source


def test_a_transposed_slot_of_another_shape_is_refused():
    weight = torch.zeros(32, 128, dtype=torch.int8)
    stored, _, transposed = left_out(_linear_model(weight), {"fc.weight": weight})
    with pytest.raises(SerializationError, match="'fc_weight_t' is not an empty slot for the reference tensor"):
        put_back(stored, {}, {"fc.weight": weight.T.contiguous()}, Room({"fc.weight": weight}), transposed)
