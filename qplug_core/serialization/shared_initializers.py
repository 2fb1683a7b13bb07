"""A stored partition model's weights, kept once in the file: the reference form's tensors.

The ONNX model ``qp.save`` stores for a compiled partition carries the int8 weights the file's
reference form holds already, byte for byte (MobileNetV2 on onnxruntime: 3.4 of its 4.1 MiB ONNX
model, a 7.9 MiB file where fbgemm's is 3.8 MiB), or transposed (a linear's ``*_weight_t``, [in,
out] for MatMulInteger: a Wav2Vec2 file was 7.18 MB on onnxruntime, 3.39 on fbgemm, with a model
per input signature). Each such initializer is stored empty, with the key of the file's tensor
holding its bytes (:func:`left_out`: ``shared``, or ``transposed``); ``qp.load`` puts the bytes back
(:func:`put_back`) before the stored model's checks. A hostile file could name one weight for
thousands of empty slots (a 1 MiB file took GBs), so every name must be an empty slot of the
model's, once, of the tensor's dtype and shape (its shape reversed, transposed); one model fills each dtype and shape at most as
often as the reference form holds it (an honest model holds distinct layers: two byte-equal layers
name one tensor, but the reference form holds both), and the models of one file fill at most
:data:`FILL_FACTOR` times the reference form's weights in all (:class:`Room`): else
:class:`SerializationError`, before a byte is filled, and the partition is exported again. Files
written before hold every initializer inline.
"""

from __future__ import annotations

from collections import Counter

import torch

from qplug_core.errors import SerializationError
from qplug_core.partition.stored_model import FILL_FACTOR

#: initializers below this size stay in the model (scales, zero points: not worth a name)
SHARED_BYTES = 1024


def left_out(source: bytes, tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, str], dict[str, str]]:
    """``source`` without the initializers some tensor of ``tensors`` holds byte for byte (same
    dtype and shape), or transposed (a 2-D tensor), and initializer name -> that tensor's key for
    each ({}, {} and ``source`` if none)."""
    import onnx

    candidates: dict[tuple, list[str]] = {}
    for key, tensor in tensors.items():
        if tensor.numel() * tensor.element_size() >= SHARED_BYTES and _onnx_type(tensor) is not None:
            candidates.setdefault((_onnx_type(tensor), tuple(tensor.shape)), []).append(key)
    if not candidates:
        return source, {}, {}
    model = onnx.load_model_from_string(source)
    shared: dict[str, str] = {}
    transposed: dict[str, str] = {}
    for initializer in model.graph.initializer:
        if len(initializer.raw_data) < SHARED_BYTES:
            continue
        kind, dims = initializer.data_type, tuple(initializer.dims)
        for found, keys, flip in ((shared, candidates.get((kind, dims), []), False),
                                  (transposed, candidates.get((kind, dims[::-1]), []) if len(dims) == 2 else [], True)):
            key = next((key for key in keys if _bytes(tensors[key], flip) == initializer.raw_data), None)
            if key is not None:
                found[initializer.name] = key
                initializer.ClearField("raw_data")
                break
    return (model.SerializeToString(), shared, transposed) if shared or transposed else (source, {}, {})


class Room:
    """What the stored models of one file may still fill: each model, the reference form's tensors
    of each dtype and shape as often as the reference form holds them (a model holds distinct
    layers; a weight tied across partitions is in each partition's model), and all of them, at
    most :data:`FILL_FACTOR` times the bytes of those tensors (a file of 1.2 MiB could fill one
    weight into each of K stored models for one partition: K times its weights)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        shareable = [t for t in tensors.values()
                     if _onnx_type(t) is not None and t.numel() * t.element_size() >= SHARED_BYTES]
        self.per_model = Counter((_onnx_type(t), tuple(t.shape)) for t in shareable)
        self.bytes_left = FILL_FACTOR * sum(t.numel() * t.element_size() for t in shareable)

    def take(self, kinds: Counter[tuple], size: int) -> None:
        """Count one model filling ``kinds`` ((ONNX type, shape) -> slots) of ``size`` bytes in
        all; :class:`SerializationError`, counting nothing, past what the file may fill."""
        over = [kind for kind, slots in kinds.items() if slots > self.per_model[kind]]
        if over:
            raise SerializationError("its shared weights fill more initializers than the reference form holds "
                                     f"tensors of dtype and shape {over[0]}")
        if size > self.bytes_left:
            raise SerializationError(f"its shared weights would fill {size} bytes where the file's stored models "
                                     f"may fill {self.bytes_left} more (at most {FILL_FACTOR} times the reference "
                                     "form's weights in all: more input signatures than that are compiled again)")
        self.bytes_left -= size


def put_back(source: bytes, shared: dict[str, str], tensors: dict[str, torch.Tensor], room: Room,
             transposed: dict[str, str] | None = None) -> bytes:
    """``source`` with each initializer :func:`left_out` left empty holding its tensor's bytes again
    (``transposed``: the 2-D tensor's transpose), counted against ``room`` before any is filled;
    :class:`SerializationError` if ``shared`` and ``transposed`` name anything else than empty
    slots of the tensors' dtypes and shapes (reversed, transposed), once each, or more than the
    room holds."""
    transposed = transposed or {}
    if not shared and not transposed:  # a file written before, or a model holding none of the reference form's tensors
        return source
    import onnx

    try:
        model = onnx.load_model_from_string(source)
    except Exception:  # noqa: BLE001 - a DecodeError: the stored model's checks say so
        return source
    slots = Counter(initializer.name for initializer in model.graph.initializer)
    if any(slots[name] != 1 for name in (*shared, *transposed)) or shared.keys() & transposed.keys():
        raise SerializationError("its shared weights name initializers it does not hold once")
    filled = [(initializer, tensors[named[initializer.name]], flip)
              for named, flip in ((shared, False), (transposed, True))
              for initializer in model.graph.initializer if initializer.name in named]
    for initializer, tensor, flip in filled:
        shape = tuple(tensor.shape)[::-1] if flip else tuple(tensor.shape)
        if (initializer.raw_data or initializer.data_location != onnx.TensorProto.DEFAULT or (flip and tensor.dim() != 2)
                or (_onnx_type(tensor), shape) != (initializer.data_type, tuple(initializer.dims))):
            raise SerializationError(f"initializer {initializer.name[:100]!r} is not an empty slot for the "
                                     "reference tensor it names (dtype, shape)")
    room.take(Counter((_onnx_type(t), tuple(t.shape)) for _, t, _ in filled),
              sum(t.numel() * t.element_size() for _, t, _ in filled))
    for initializer, tensor, flip in filled:
        initializer.raw_data = _bytes(tensor, flip)
    try:
        return model.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - an EncodeError: past protobuf's 2 GB
        raise SerializationError(f"it cannot be serialized once its shared weights are put back ({exc})") from exc


def _onnx_type(tensor: torch.Tensor) -> int | None:
    import onnx

    return {torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8,
            torch.int32: onnx.TensorProto.INT32, torch.float32: onnx.TensorProto.FLOAT}.get(tensor.dtype)


def _bytes(tensor: torch.Tensor, transposed: bool = False) -> bytes:
    return (tensor.T if transposed else tensor).contiguous().numpy().tobytes()  # little-endian, as ONNX's raw_data
