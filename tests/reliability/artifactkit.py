"""A small real artifact and the ways the hostile-file tests edit it (as an attacker would: with a
new digest, which checks for damage, not for edits, so that the file's contents are checked next)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load, save_file
from torch import fx, nn

from qplug_core.flows.tags import ARTIFACT
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.qparams import QParams
from qplug_core.serialization import capture_artifact
from qplug_core.serialization.digest import DIGEST_KEY, digest_of


def reference_model() -> fx.GraphModule:
    """quantize -> dequantize -> int8-weight linear, with per-channel weight qparams."""
    torch.manual_seed(0)
    activation = QParams(torch.tensor(0.05), torch.tensor(128), torch.quint8, 0, 255)
    weight = QParams(torch.full((3,), 0.02), torch.zeros(3, dtype=torch.int64), torch.qint8, -128, 127,
                     axis=0)
    root = nn.Module()
    root.quantize, root.dequantize = Quantize(activation), Dequantize(activation)
    root.fc = ReferenceWeighted(nn.Linear(4, 3), weight)
    graph = fx.Graph()
    x = graph.placeholder("x")
    quantized = graph.call_module("quantize", (x,))
    graph.output(graph.call_module("fc", (graph.call_module("dequantize", (quantized,)),)))
    gm = fx.GraphModule(root, graph)
    gm.meta[ARTIFACT] = capture_artifact(gm)
    return gm


def rewrite(source: Path, edit: Callable[[dict[str, Any], dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``source`` (``edited.safetensors`` beside it) with its document and tensors edited."""
    with safe_open(str(source), framework="pt") as f:
        document = json.loads(f.metadata()["qplug"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    edit(document, tensors)
    target = source.with_name("edited.safetensors")
    text = json.dumps(document)
    save_file(tensors, str(target), metadata={"qplug": text, DIGEST_KEY: digest_of(text, tensors)})
    return target


def rewrite_header(source: Path, target: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """``source`` with only its JSON header edited, written back in front of the same tensor bytes
    (a safetensors file is an 8-byte header length, the JSON header, then raw data): fast enough to
    do for hundreds of names."""
    raw = source.read_bytes()
    document = json.loads(_header(raw)["__metadata__"]["qplug"])
    edit(document)
    text = json.dumps(document)
    return _with_metadata(source, target, {"qplug": text, DIGEST_KEY: digest_of(text, load(raw))})


def without_digest(source: Path, target: Path) -> Path:
    """``source`` as ``qp.save`` wrote files before it stored a digest: the same document and
    tensors, no ``qplug.digest`` field."""
    return _with_metadata(source, target, {"qplug": _header(source.read_bytes())["__metadata__"]["qplug"]})


def with_metadata_field(source: Path, target: Path, key: str, value: str) -> Path:
    """``source`` with one metadata string set, the rest as it was."""
    return _with_metadata(source, target, {**_header(source.read_bytes())["__metadata__"], key: value})


def with_bit_flipped(source: Path, target: Path, tensor: str) -> Path:
    """``source`` with the lowest bit of the first byte of ``tensor`` flipped, as a bad disk or copy
    would: header and digest untouched."""
    raw = bytearray(source.read_bytes())
    raw[_start(raw, tensor)] ^= 0x01
    target.write_bytes(raw)
    return target


def with_value_scaled(source: Path, target: Path, tensor: str, factor: float) -> Path:
    """``source`` with the first value of float16, float32 or float64 ``tensor`` multiplied by
    ``factor``, in its bytes: header and digest untouched."""
    raw = bytearray(source.read_bytes())
    start, layout = _start(raw, tensor), _FORMATS[_header(raw)[tensor]["dtype"]]
    (value,) = struct.unpack_from(layout, raw, start)
    struct.pack_into(layout, raw, start, value * factor)
    target.write_bytes(raw)
    return target


_FORMATS = {"F16": "<e", "F32": "<f", "F64": "<d"}


def _header(raw: bytes | bytearray) -> dict[str, Any]:
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def _start(raw: bytes | bytearray, tensor: str) -> int:
    """Where the bytes of ``tensor`` begin in the file ``raw``."""
    return 8 + int.from_bytes(raw[:8], "little") + _header(raw)[tensor]["data_offsets"][0]


def _with_metadata(source: Path, target: Path, metadata: dict[str, str]) -> Path:
    """``source`` with its header's metadata replaced, in front of the same tensor bytes."""
    raw = source.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = _header(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    target.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])
    return target


def node(document: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for n in document["model"]["graph"] if n["name"] == name)


def module(document: dict[str, Any], path: str) -> dict[str, Any]:
    return next(m for m in document["model"]["modules"] if m["path"] == path)


def with_nodes(source: Path, target: Path, *nodes: dict[str, Any]) -> Path:
    """``source`` with ``nodes`` inserted before the output, which then returns the last of them."""
    def edit(document: dict[str, Any]) -> None:
        graph = document["model"]["graph"]
        output = graph.pop()
        graph.extend(nodes)
        output["args"] = [{"node": nodes[-1]["name"]}]
        graph.append(output)
    return rewrite_header(source, target, edit)
