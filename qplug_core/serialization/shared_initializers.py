"""A stored partition model's weights, kept once in the file: the reference form's tensors.

The ONNX model ``qp.save`` stores for a compiled partition carries the int8 weights the file's
reference form holds already, byte for byte (MobileNetV2 on onnxruntime: 3.4 of its 4.1 MiB ONNX
model, a 7.9 MiB file where fbgemm's is 3.8 MiB). Each such initializer is stored empty, with the
key of the file's tensor holding its bytes (:func:`left_out`); ``qp.load`` puts the bytes back
(:func:`put_back`) before the stored model's checks, so an initializer whose tensor is missing or
does not fit stays empty and the model fails ``onnx.checker`` (it is exported again, with the
warning every refused stored model gets). Files written before hold every initializer inline.
"""

from __future__ import annotations

import torch

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


def put_back(source: bytes, shared: dict[str, str], tensors: dict[str, torch.Tensor]) -> bytes:
    """``source`` with each initializer :func:`left_out` left empty holding its tensor's bytes again;
    one whose tensor is missing or of another dtype or shape stays empty."""
    if not shared:  # a file written before, or a model holding none of the reference form's tensors
        return source
    import onnx

    try:
        model = onnx.load_model_from_string(source)
    except Exception:  # noqa: BLE001 - a DecodeError: the stored model's checks say so
        return source
    for initializer in model.graph.initializer:
        tensor = tensors.get(shared.get(initializer.name, ""))
        if (tensor is not None and not initializer.raw_data
                and initializer.data_location == onnx.TensorProto.DEFAULT
                and (_onnx_type(tensor), tuple(tensor.shape)) == (initializer.data_type, tuple(initializer.dims))):
            initializer.raw_data = _bytes(tensor)
    return model.SerializeToString()


def _onnx_type(tensor: torch.Tensor) -> int | None:
    import onnx

    return {torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8,
            torch.int32: onnx.TensorProto.INT32, torch.float32: onnx.TensorProto.FLOAT}.get(tensor.dtype)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes()  # little-endian, as ONNX's raw_data
