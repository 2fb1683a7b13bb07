"""The ONNX models of a delegated model's compiled partitions, kept in its file beside the reference form.

A loaded onnxruntime or OpenVINO model compiled each partition at its first call from the reference
form: an export (the digits CNN's first call took 7.0 s on onnxruntime, 14.4 s on openvino, and a
worker held torch.onnx and onnxscript, ~237 MiB, for a 38 KB model). ``qp.save`` stores the ONNX
model each compiled partition was built from, for each input signature it was compiled for, as
uint8 tensors under ``partition_models/<partition>/<i>`` (covered by the file's digest); the record
(partition -> the CPU's VNNI at save, the runtime's name and version where its plugin says them,
and, per model, its tensor, input signature and the initializers whose bytes are the reference
form's tensors, as they are or transposed: :mod:`~qplug_core.serialization.shared_initializers`)
is plain data. ``qp.load`` hands them to the first call (``flows/delegate.FirstCallCheck``), which
builds the runtime's models from them instead of exporting, once each has passed the checks of :mod:`qplug_core.partition.stored_model`, and holds
them to the contract again where the runtime's version is not the recorded one. Files without the
record load as they did; files without the runtime load as before it was recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qplug_core.config.codec import child, encode_dtype, expect, read_fields, where
from qplug_core.errors import ConfigError, SerializationError, warn_user
from qplug_core.flows.tags import SPEC_DTYPES
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.partition.compiled import CompiledPartition
from qplug_core.partition.served import runs
from qplug_core.partition.source_file import whole_model
from qplug_core.partition.stored_model import StoredPartition
from qplug_core.serialization.shared_initializers import Room, left_out, put_back

KEY = "partition_models"
_PREFIX = "partition_models/"
_ENTRY = ("vnni", "models")
_RUNTIME = ("name", "version")
_MODEL = ("tensor", "inputs")
_SHARED = "shared"
#: initializers holding a reference tensor's transpose: a declared file-format feature (older
#: readers, which would fill a square weight untransposed, leave them out and export again)
_TRANSPOSED = "shared_transposed"
_INPUT = ("shape", "dtype")
#: a stored model's signature: (shape, dtype) of each input, as ``CompiledPartition`` keys it
Signature = tuple[tuple[torch.Size, torch.dtype], ...]


def record(model: dict[str, Any], tensors: dict[str, torch.Tensor], qmodel: nn.Module
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``model`` and ``tensors`` with the ONNX models of ``qmodel``'s compiled partitions (the
    sources each kept for the signatures it was compiled for: no export); a partition too large
    for one protobuf message (a file with external data) is left out."""
    reference = {key: tensor for key, tensor in tensors.items() if not key.startswith(_PREFIX)}
    entries, table, tensors = {}, dict(model["tensors"]), dict(tensors)
    for name, module in qmodel.named_children():
        compiled = runs(module)
        if not isinstance(compiled, CompiledPartition):
            continue
        models = []
        for i, (signature, kept) in enumerate(compiled.kept_sources()):
            source = whole_model(kept)
            if source is None:
                continue
            source, shared, transposed = left_out(source, reference)
            key = f"{_PREFIX}{name}/{i}"
            tensors[key] = torch.frombuffer(bytearray(source), dtype=torch.uint8)
            table[key] = {"dtype": encode_dtype(torch.uint8), "shape": [len(source)]}
            models.append({"tensor": key, "inputs": [{"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                                                     for shape, dtype in signature],
                           **({_SHARED: shared} if shared else {}),
                           **({_TRANSPOSED: transposed} if transposed else {})})
        if models:
            runtime = compiled.runtime()
            entries[name] = {"vnni": cpu_int8().vnni, "models": models,
                             **({"runtime": dict(zip(_RUNTIME, runtime))} if runtime else {})}
    return ({**model, "tensors": table, KEY: entries}, tensors) if entries else (model, tensors)


def check(doc: Any, tensors: dict[str, torch.Tensor], path: str) -> None:
    """The record of a file whose tensors match its table: each model a 1-D uint8 tensor of its
    own with input shapes and dtypes; raises :class:`ConfigError` naming the bad field."""
    seen: set[str] = set()
    for name, entry in expect(doc, dict, path, "a JSON object").items():
        at = child(path, name)
        read_fields(entry, at, (*_ENTRY, "runtime"), required=_ENTRY)
        expect(entry["vnni"], bool, child(at, "vnni"), "true or false")
        if "runtime" in entry:
            read_fields(entry["runtime"], child(at, "runtime"), _RUNTIME, required=_RUNTIME)
            for key in _RUNTIME:
                expect(entry["runtime"][key], str, child(child(at, "runtime"), key), "a string")
        for i, stored in enumerate(expect(entry["models"], list, child(at, "models"), "a JSON list")):
            here = child(child(at, "models"), i)
            read_fields(stored, here, (*_MODEL, _SHARED, _TRANSPOSED), required=_MODEL)
            key = expect(stored["tensor"], str, child(here, "tensor"), "a tensor name")
            tensor = tensors.get(key)
            if not key.startswith(_PREFIX) or key in seen or tensor is None or tensor.dtype != torch.uint8 \
                    or tensor.dim() != 1:
                raise ConfigError(f"{where(child(here, 'tensor'))}: {key!r} is not a stored partition model's "
                                  "tensor of its own (1-D uint8)", field=child(here, "tensor"), value=key)
            seen.add(key)
            for field in (_SHARED, _TRANSPOSED):
                for initializer, held in expect(stored.get(field, {}), dict, child(here, field), "a JSON object").items():
                    if not isinstance(held, str) or held.startswith(_PREFIX) or held not in tensors:
                        raise ConfigError(f"{where(child(child(here, field), initializer))}: {held!r} is not a tensor "
                                          "of the file's reference form", field=child(here, field), value=held)
            for j, spec in enumerate(expect(stored["inputs"], list, child(here, "inputs"), "a JSON list")):
                _check_input(spec, child(child(here, "inputs"), j))


def _check_input(spec: Any, path: str) -> None:
    read_fields(spec, path, _INPUT, required=_INPUT)
    for k, size in enumerate(expect(spec["shape"], list, child(path, "shape"), "a list of sizes")):
        if expect(size, int, child(child(path, "shape"), k), "a size") < 0:
            raise ConfigError(f"{where(child(path, 'shape'))}: negative size {size}", field=path, value=size)
    if spec["dtype"] not in SPEC_DTYPES:
        raise ConfigError(f"{where(child(path, 'dtype'))}: {spec['dtype']!r} is not one of "
                          f"{', '.join(SPEC_DTYPES)}", field=child(path, "dtype"), value=spec["dtype"])


def without(model: dict[str, Any], tensors: dict[str, torch.Tensor]
            ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The reference form alone: ``model`` and ``tensors`` without the stored models."""
    if KEY not in model:
        return model, tensors
    keep = {key: value for key, value in model.items() if key != KEY}
    keep["tensors"] = {key: entry for key, entry in model["tensors"].items() if not key.startswith(_PREFIX)}
    return keep, {key: tensor for key, tensor in tensors.items() if not key.startswith(_PREFIX)}


def stored_models(model: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, StoredPartition]:
    """Partition -> the models stored for it (input signature, serialized ONNX model) and the
    runtime recorded with them, where this CPU's VNNI is what it was at save (an export may depend
    on it: OpenVINO compiles a dynamic linear per shape without it); the others are exported again
    at the first call, as a warning says."""
    vnni, entries = cpu_int8().vnni, model.get(KEY, {})
    other = [name for name, entry in entries.items() if entry["vnni"] != vnni]
    if other:
        warn_user(f"qplug: the file's stored ONNX models ({', '.join(other)}) were exported on a CPU "
                  f"{'without' if vnni else 'with'} VNNI, so they are not used here: each is exported again "
                  "at its first call (seconds)")
    if not entries:
        return {}
    room = Room(without(model, tensors)[1])  # Room() imports onnx (seconds): only for a file with stored models
    stored = {}
    for name, entry in entries.items():
        if name in other:
            continue
        try:
            models = [(tuple((torch.Size(spec["shape"]), SPEC_DTYPES[spec["dtype"]]) for spec in record["inputs"]),
                       put_back(tensors[record["tensor"]].numpy().tobytes(), record.get(_SHARED, {}), tensors, room,
                                record.get(_TRANSPOSED, {})))
                      for record in entry["models"]]
        except SerializationError as exc:
            warn_user(f"qplug: the ONNX model the file stores for partition {name} is not used: {exc}; the "
                      "partition is exported again from its reference form at its first call (seconds; the file "
                      "may be damaged or tampered with)")
            continue
        runtime = (entry["runtime"]["name"], entry["runtime"]["version"]) if "runtime" in entry else None
        stored[name] = StoredPartition(models, runtime)
    return stored
