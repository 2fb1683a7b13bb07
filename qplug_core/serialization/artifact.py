"""What ``qp.save`` writes: the reference form of a converted model, captured before lowering.

Kernel modules hold packed, engine-specific weights that no file format can carry safely, so the
artifact is the reference form (quantize/dequantize modules with their qparams, weighted modules
with int8 weights, the fx graph) plus the name of the backend it was converted for. ``load``
lowers it again with the installed backend. The convert flows call :func:`record_artifact` between
``convert_graph`` and lowering, so every converted model can be saved later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import fx

from qplug_core import plugins
from qplug_core.backend import Backend, get_backend
from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.config.names import decode_dtype
from qplug_core.errors import ConfigError, SerializationError
from qplug_core.fx.fuse import FusionRecord
from qplug_core.fx.summary import QuantizationReport
from qplug_core.fx.tags import ARTIFACT, FUSIONS, KERNEL, STATE
from qplug_core.serialization.graph_codec import encode_graph
from qplug_core.serialization.lowering_record import KEY as LOWERING_KEY
from qplug_core.serialization.lowering_record import LoweringRecord
from qplug_core.serialization.module_codec import TENSOR_KEYS, TensorTable, encode_modules

#: GraphModule.meta key holding the :class:`Artifact` (or, if capture failed, why as a string)
ARTIFACT_KEY = ARTIFACT
FORMAT = "qplug"
SCHEMA_VERSION = 1
TOP_KEYS = ("format", "schema_version", "backend", "plugins", "versions", "model")
MODEL_KEYS = ("graph", "modules", "attributes", "tensors", "training", "mode", "fusions")
#: optional model keys (files written before them load without)
OPTIONAL_MODEL_KEYS = (LOWERING_KEY,)
PLUGIN_KEYS = ("name", "dist", "version")
#: GraphModule.meta keys written by the flows that the artifact keeps
_FLOW_STATE_KEY = STATE
FUSIONS_KEY = FUSIONS


@dataclass(frozen=True, repr=False, eq=False)
class Artifact:
    """A converted model's reference form as JSON-safe ``model`` data plus named ``tensors``.

    ``backend`` and ``plugins`` (name, dist, version of each contributing plugin) record what the
    model was converted for; ``load`` lowers to that backend again.
    """

    backend: str
    plugins: tuple[dict[str, str | None], ...]
    model: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    def __repr__(self) -> str:
        return (f"Artifact(backend={self.backend!r}, nodes={len(self.model['graph'])}, "
                f"tensors={len(self.tensors)})")


def backend_identity(backend: str | Backend) -> tuple[str, tuple[dict[str, str | None], ...]]:
    """The backend's name and the plugins that contribute to it, as recorded in a file."""
    chosen = get_backend(backend)
    return chosen.name, tuple({"name": r.name, "dist": r.dist, "version": r.version}
                              for r in chosen.contributors)


def capture_artifact(gm: fx.GraphModule, backend: str | Backend = "reference") -> Artifact:
    """Capture ``gm`` in reference form (straight after ``convert_graph``, before lowering).

    Raises :class:`SerializationError` when the model holds something a file cannot express (a
    module class outside the allowlist, a graph calling a non-tensor function, ...).
    """
    lowered = [n.name for n in gm.graph.nodes if KERNEL in n.meta]
    if lowered:
        raise SerializationError(f"cannot capture a lowered model (nodes {lowered[:4]} run backend "
                                 "kernels); capture the reference form, before lower_graph")
    name, plugins = backend_identity(backend)
    table = TensorTable()
    try:
        modules, attributes = encode_modules(gm, table)
        graph = encode_graph(gm.graph)
    except ConfigError as exc:
        raise SerializationError(f"this model cannot be saved: {exc}") from exc
    model = {"graph": graph, "modules": modules, "attributes": attributes, "tensors": table.entries,
             "training": gm.training, "mode": gm.meta.get(_FLOW_STATE_KEY, {}).get("mode", "static"),
             "fusions": [asdict(f) for f in gm.meta.get(FUSIONS_KEY, [])]}
    return Artifact(name, plugins, model, table.tensors)


def record_artifact(gm: fx.GraphModule, backend: str | Backend) -> None:
    """Keep what ``save`` needs in ``gm.meta``; the convert flows call this before lowering.

    A model that cannot be captured still converts: the reason is kept and ``save`` reports it.
    """
    try:
        gm.meta[ARTIFACT_KEY] = capture_artifact(gm, backend)
    except Exception as exc:  # saving is optional: it must never make convert fail
        gm.meta[ARTIFACT_KEY] = str(exc) if isinstance(exc, SerializationError) else (
            f"capturing the model for saving failed: {type(exc).__name__}: {exc}")


def record_lowering(gm: fx.GraphModule, report: QuantizationReport) -> None:
    """Add to ``gm``'s artifact how convert lowered it (``report``): what ``load`` rebuilds."""
    artifact = gm.meta.get(ARTIFACT_KEY)
    if isinstance(artifact, Artifact):
        gm.meta[ARTIFACT_KEY] = with_lowering(artifact, LoweringRecord.of(report))


def fusion_records(artifact: Artifact) -> list[FusionRecord]:
    return [FusionRecord(f["module_name"], f["pattern"], f["fused_type"], tuple(f["nodes"]))
            for f in artifact.model["fusions"]]


def to_document(artifact: Artifact) -> dict[str, Any]:
    """The JSON document stored in the file's metadata (environment versions as of now)."""
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "backend": artifact.backend,
            "plugins": list(artifact.plugins), "model": artifact.model,
            "versions": {"qplug-core": plugins.core_version() or "0+unknown", "torch": torch.__version__}}


def from_document(doc: Any, tensors: dict[str, torch.Tensor]) -> Artifact:
    """Check a file's document against its tensors; raises :class:`ConfigError` naming the field."""
    expect(doc, dict, "", "a JSON object")
    if doc.get("format") != FORMAT:
        raise ConfigError(f"not a qplug artifact (format {doc.get('format')!r}, expected {FORMAT!r})",
                          field="format", value=doc.get("format"))
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ConfigError(f"unsupported schema_version {version!r}: this qplug-core reads version "
                          f"{SCHEMA_VERSION}; upgrade qplug-core to load files written by a newer one",
                          field="schema_version", value=version)
    read_fields(doc, "", TOP_KEYS, required=TOP_KEYS)
    backend = expect(doc["backend"], str, "backend", "a backend name")
    plugins = tuple(_read_plugin(p, child("plugins", i))
                    for i, p in enumerate(expect(doc["plugins"], list, "plugins", "a JSON list")))
    expect(doc["versions"], dict, "versions", "a JSON object")
    model = read_fields(doc["model"], "model", MODEL_KEYS + OPTIONAL_MODEL_KEYS, required=MODEL_KEYS)
    expect(model["training"], bool, "model.training", "true or false")
    expect(model["mode"], str, "model.mode", "a quantization mode")
    for i, fusion in enumerate(expect(model["fusions"], list, "model.fusions", "a JSON list")):
        _read_fusion(fusion, child("model.fusions", i))
    _check_tensors(expect(model["tensors"], dict, "model.tensors", "a JSON object"), tensors)
    if LOWERING_KEY in model:
        nodes = len(expect(model["graph"], list, "model.graph", "a JSON list"))
        LoweringRecord.from_document(model[LOWERING_KEY], child("model", LOWERING_KEY), nodes)
    return Artifact(backend, plugins, model, tensors)


def with_lowering(artifact: Artifact, record: LoweringRecord) -> Artifact:
    """``artifact`` recording how its model was lowered (what ``load`` must rebuild)."""
    return replace(artifact, model={**artifact.model, LOWERING_KEY: record.to_document()})


def lowering_of(artifact: Artifact) -> LoweringRecord | None:
    """The lowering recorded in ``artifact`` (checked when it was read), None for older files."""
    doc = artifact.model.get(LOWERING_KEY)
    return None if doc is None else LoweringRecord(dict(doc["kernels"]), dict(doc["reference"]))


def _read_plugin(doc: Any, path: str) -> dict[str, str | None]:
    read_fields(doc, path, PLUGIN_KEYS, required=PLUGIN_KEYS)
    return {k: expect(doc[k], (str, type(None)), child(path, k), "a string or null") for k in PLUGIN_KEYS}


def _read_fusion(doc: Any, path: str) -> None:
    read_fields(doc, path, ("module_name", "pattern", "fused_type", "nodes"),
                required=("module_name", "pattern", "fused_type", "nodes"))
    for key in ("module_name", "pattern", "fused_type"):
        expect(doc[key], str, child(path, key), "a string")
    for i, node in enumerate(expect(doc["nodes"], list, child(path, "nodes"), "a JSON list")):
        expect(node, str, child(child(path, "nodes"), i), "a node name")


def _check_tensors(table: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The file must hold exactly the tensors its table lists, with the listed dtypes and shapes."""
    missing, extra = sorted(set(table) - set(tensors)), sorted(set(tensors) - set(table))
    if missing or extra:
        raise ConfigError(f"the file's tensors do not match its table: missing {missing[:8]}, "
                          f"extra {extra[:8]}", field="model.tensors", value=missing or extra)
    for key, entry in table.items():
        at = child("model.tensors", key)
        read_fields(entry, at, TENSOR_KEYS, required=("dtype", "shape"))
        dtype = decode_dtype(entry["dtype"], field=child(at, "dtype"))
        shape = expect(entry["shape"], list, child(at, "shape"), "a list of sizes")
        tensor = tensors[key]
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            raise ConfigError(f"{where(at)}: tensor is {tensor.dtype} {tuple(tensor.shape)} in the file but "
                              f"the table says {dtype} {tuple(shape)}", field=at, value=key)
