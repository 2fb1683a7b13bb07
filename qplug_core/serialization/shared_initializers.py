"""A stored partition model's weights, kept once in the file: the reference form's tensors.

The ONNX model ``qp.save`` stores for a compiled partition carries the int8 weights the file's
reference form holds already, byte for byte (MobileNetV2 on onnxruntime: 3.4 of its 4.1 MiB ONNX
model, a 7.9 MiB file where fbgemm's is 3.8 MiB). Each such initializer is stored empty, with the
key of the file's tensor holding its bytes (:func:`left_out`); ``qp.load`` puts the bytes back
(:func:`put_back`) before the stored model's checks. A hostile file could name one weight for
thousands of empty slots (a 1 MiB file took GBs), so every name must be an empty slot of the
model's, once, of the tensor's dtype and shape, and the slots of one dtype and shape filled for one
signature across the file's partitions are at most the reference form's tensors of that dtype and
shape (an honest file's partitions hold distinct layers; two byte-equal layers name one tensor,
but the reference form holds both): else :class:`SerializationError`, and the partition is exported
again. Files written before hold every initializer inline.
"""

from __future__ import annotations

from collections import Counter

import torch

from qplug_core.errors import SerializationError

#: initializers below this size stay in the model (scales, zero points: not worth a name)
SHARED_BYTES = 1024


def left_out(source: bytes, tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """``source`` without the initializers some tensor of ``tensors`` holds byte for byte (same
    dtype and shape), and initializer name -> that tensor's key ({} and ``source`` if none)."""
    import onnx

    candidates: dict[tuple, list[str]] = {}
    for key, tensor in tensors.items():
        if tensor.numel() * tensor.element_size() >= SHARED_BYTES and _onnx_type(tensor) is not None:
            candidates.setdefault((_onnx_type(tensor), tuple(tensor.shape)), []).append(key)
    if not candidates:
        return source, {}
    model = onnx.load_model_from_string(source)
    shared: dict[str, str] = {}
    for initializer in model.graph.initializer:
        if len(initializer.raw_data) < SHARED_BYTES:
            continue
        for key in candidates.get((initializer.data_type, tuple(initializer.dims)), []):
            if _bytes(tensors[key]) == initializer.raw_data:
                shared[initializer.name] = key
                initializer.ClearField("raw_data")
                break
    return (model.SerializeToString(), shared) if shared else (source, {})


def room(tensors: dict[str, torch.Tensor]) -> Counter[tuple]:
    """(ONNX type, shape) -> how many slots the stored models of one signature may fill with
    tensors of that type and shape: the file's reference tensors of it (see the module's doc)."""
    return Counter((_onnx_type(t), tuple(t.shape)) for t in tensors.values()
                   if _onnx_type(t) is not None and t.numel() * t.element_size() >= SHARED_BYTES)


def put_back(source: bytes, shared: dict[str, str], tensors: dict[str, torch.Tensor], left: Counter[tuple]) -> bytes:
    """``source`` with each initializer :func:`left_out` left empty holding its tensor's bytes again,
    taking the slots it fills from ``left`` (:func:`room`); :class:`SerializationError` if ``shared``
    names anything else than empty slots of the tensors' dtypes and shapes, once each, or more than
    ``left`` holds."""
    if not shared:  # a file written before, or a model holding none of the reference form's tensors
        return source
    import onnx

    try:
        model = onnx.load_model_from_string(source)
    except Exception:  # noqa: BLE001 - a DecodeError: the stored model's checks say so
        return source
    slots = Counter(initializer.name for initializer in model.graph.initializer)
    if any(slots[name] != 1 for name in shared):
        raise SerializationError("its shared weights name initializers it does not hold once")
    for initializer in model.graph.initializer:
        if initializer.name not in shared:
            continue
        tensor = tensors[shared[initializer.name]]
        kind = (_onnx_type(tensor), tuple(tensor.shape))
        if (initializer.raw_data or initializer.data_location != onnx.TensorProto.DEFAULT
                or kind != (initializer.data_type, tuple(initializer.dims))):
            raise SerializationError(f"initializer {initializer.name[:100]!r} is not an empty slot for the "
                                     "reference tensor it names (dtype, shape)")
        if left[kind] <= 0:
            raise SerializationError("its shared weights fill more initializers than the reference form holds "
                                     f"tensors of dtype and shape {kind}")
        left[kind] -= 1
        initializer.raw_data = _bytes(tensor)
    try:
        return model.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - an EncodeError: past protobuf's 2 GB
        raise SerializationError(f"it cannot be serialized once its shared weights are put back ({exc})") from exc


def _onnx_type(tensor: torch.Tensor) -> int | None:
    import onnx

    return {torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8,
            torch.int32: onnx.TensorProto.INT32, torch.float32: onnx.TensorProto.FLOAT}.get(tensor.dtype)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()  # little-endian, as ONNX's raw_data
