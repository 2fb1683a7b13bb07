"""What ``qp.save`` writes: the reference form of a converted model, captured before lowering.

Kernel modules hold packed, engine-specific weights that no file format can carry safely, so the
artifact is the reference form (quantize/dequantize modules with their qparams, weighted modules
with int8 weights, the fx graph) plus the name of the backend it was converted for. ``load``
lowers it again with the installed backend. The convert flows keep the reference form before
lowering (:mod:`qplug_core.flows.snapshot`); :func:`artifact_of` encodes it when a model is saved.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import fx

from qplug_core.config.codec import child, decode_dtype, expect, read_fields, where
from qplug_core.errors import ConfigError, SerializationError
from qplug_core.flows.fuse import FusionRecord
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.tags import (
    ABSORBED_CLAMPS,
    ARTIFACT,
    AUTO_RANKING,
    BAKED_TYPES,
    CAPTURE,
    FIXED_KEYWORDS,
    FOLDED_AFFINES,
    FUNCTIONAL_WEIGHTS,
    FUSIONS,
    KERNEL,
    REPORT,
    STATE,
)
from qplug_core.flows.target_rungs import RUNGS
from qplug_core.kernels.per_token import PER_TOKEN_LAYERS
from qplug_core.registry import plugins
from qplug_core.registry.backends import Backend, get_backend
from qplug_core.serialization import (
    affine_record,
    check_record,
    clamp_record,
    format_features,
    functional_record,
    partition_models,
    per_token_record,
    tree_record,
)
from qplug_core.serialization.graph_codec import encode_graph
from qplug_core.serialization.lowering_record import KEY as LOWERING_KEY
from qplug_core.serialization.lowering_record import LoweringRecord
from qplug_core.serialization.module_codec import TENSOR_KEYS, TensorTable, encode_modules
from qplug_core.serialization.receivers import check_receivers
from qplug_core.serialization.values import check_identifier

FORMAT = "qplug"
SCHEMA_VERSION = 1
TOP_KEYS = ("format", "schema_version", "backend", "plugins", "versions", "model")
MODEL_KEYS = ("graph", "modules", "attributes", "tensors", "training", "mode", "fusions")
#: written only when present, or added later (a file without ``capture`` was captured symbolically
#: or does not say): the capture level, and the float linears the model runs per-token dynamic
#: (a target search put them there after convert; ``load`` swaps them in again), and how convert
#: lowered it (``load`` rebuilds exactly that)
#: backend="auto"'s ranking of the backends that kept the contract, fastest first (``load`` takes
#: the first one installed)
AUTO_KEY = "auto_ranking"
#: true where the weights were chosen for kernels summing u8 x s8 pairs in int16 (x86 without
#: VNNI); absent: chosen where products accumulate in int32, so ``load`` on a CPU summing pairs
#: in int16 makes them safe
INT16_PAIRS_KEY = "weights_for_int16_pairs"
#: where each layer an accuracy target took out of static int8 runs (layer -> rung)
TARGET_RUNGS_KEY = "target_rungs"
#: forward keywords the capture fixed -> the values a call may give them (flows/fixed_keywords.py)
FIXED_KEYWORDS_KEY = "fixed_keywords"
#: the optional keys, the final check's scores (check_record), the clamps convert absorbed into
#: layers' int8 output ranges (clamp_record), the per-channel affines folded into convs
#: (affine_record), the float weights of layers made from functional calls (functional_record), the
#: per-token layers' int8 weights (per_token_record), an exported model's input and output structure
#: (tree_record) and the ONNX models of compiled partitions (partition_models)
OPTIONAL_MODEL_KEYS = ("capture", PER_TOKEN_LAYERS, LOWERING_KEY, AUTO_KEY, INT16_PAIRS_KEY, TARGET_RUNGS_KEY,
                       FIXED_KEYWORDS_KEY, check_record.KEY, clamp_record.KEY, affine_record.KEY,
                       functional_record.KEY, per_token_record.KEY, tree_record.KEY,
                       partition_models.KEY)
CAPTURES = ("symbolic", "export")
PLUGIN_KEYS = ("name", "dist", "version")
#: distribution names (PEP 508) and versions (PEP 440 characters) of a file's ``versions``
_DISTRIBUTION = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,98}[A-Za-z0-9])?\Z")
_VERSION = re.compile(r"[A-Za-z0-9.+!_-]{1,64}\Z")
_MAX_VERSIONS = 64


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


def capture_artifact(gm: fx.GraphModule, backend: str | Backend = "reference",
                     plugins: tuple[dict[str, str | None], ...] | None = None) -> Artifact:
    """Capture ``gm`` in reference form (straight after ``convert_graph``, before lowering);
    ``plugins`` as recorded at convert (default: the installed backend's contributors).

    Raises :class:`SerializationError` when the model holds something a file cannot express (a
    module class outside the allowlist, a graph calling a non-tensor function, ...).
    """
    lowered = [n.name for n in gm.graph.nodes if KERNEL in n.meta]
    if lowered:
        raise SerializationError(f"cannot capture a lowered model (nodes {lowered[:4]} run backend "
                                 "kernels); capture the reference form, before lower_graph")
    if plugins is None:
        name, plugins = backend_identity(backend)
    else:
        name = backend if isinstance(backend, str) else backend.name
    table = TensorTable()
    try:
        modules, attributes = encode_modules(gm, table)
        check_receivers(gm.graph, gm)
        graph = encode_graph(gm.graph)
    except ConfigError as exc:
        raise SerializationError(f"this model cannot be saved: {exc}") from exc
    model = {"graph": graph, "modules": modules, "attributes": attributes, "tensors": table.entries,
             "training": gm.training, "mode": gm.meta.get(STATE, {}).get("mode", "static"),
             "fusions": [asdict(f) for f in gm.meta.get(FUSIONS, [])],
             "capture": gm.meta.get(CAPTURE, "symbolic")}
    if gm.meta.get(ABSORBED_CLAMPS):
        model[clamp_record.KEY] = clamp_record.to_document(gm.meta[ABSORBED_CLAMPS])
    if gm.meta.get(FOLDED_AFFINES):
        model[affine_record.KEY] = affine_record.to_document(gm.meta[FOLDED_AFFINES])
    if gm.meta.get(FUNCTIONAL_WEIGHTS):
        model[functional_record.KEY] = functional_record.to_document(gm.meta[FUNCTIONAL_WEIGHTS])
    if gm.meta.get(FIXED_KEYWORDS):
        model[FIXED_KEYWORDS_KEY] = {key: list(values) for key, values in gm.meta[FIXED_KEYWORDS].items()}
    structure = tree_record.to_document(gm)
    if structure is not None:
        model[tree_record.KEY] = structure
    return Artifact(name, plugins, model, table.tensors)


def artifact_of(qmodel: object) -> Artifact | str | None:
    """What ``save`` writes for ``qmodel``: the artifact it was loaded from, else its encoded
    reference snapshot; a string says why the snapshot cannot be saved; ``None``: no qplug model."""
    if not isinstance(qmodel, fx.GraphModule):
        return None
    loaded = qmodel.meta.get(ARTIFACT)
    if isinstance(loaded, Artifact):  # with the per-token layers given to the loaded model since
        model, tensors = per_token_record.record(loaded.model, loaded.tensors, qmodel,
                                                 loaded.model.get(PER_TOKEN_LAYERS, []))
        return loaded if model is loaded.model else replace(loaded, model=model, tensors=tensors)
    snapshot = snapshot_of(qmodel)
    if snapshot is None:
        return None
    try:
        artifact = capture_artifact(snapshot.graph_module, snapshot.backend, snapshot.plugins)
    except SerializationError as exc:
        return str(exc)
    if snapshot.per_token_layers:
        model, tensors = per_token_record.record(artifact.model, artifact.tensors, qmodel,
                                                 snapshot.per_token_layers)
        artifact = replace(artifact, model={**model, PER_TOKEN_LAYERS: list(snapshot.per_token_layers)},
                           tensors=tensors)
    if snapshot.int16_pairs:
        artifact = replace(artifact, model={**artifact.model, INT16_PAIRS_KEY: True})
    if snapshot.target_rungs:
        artifact = replace(artifact, model={**artifact.model, TARGET_RUNGS_KEY: dict(snapshot.target_rungs)})
    if qmodel.meta.get(AUTO_RANKING):
        artifact = replace(artifact, model={**artifact.model, AUTO_KEY: list(qmodel.meta[AUTO_RANKING])})
    model, tensors = partition_models.record(artifact.model, artifact.tensors, qmodel)
    artifact = replace(artifact, model=model, tensors=tensors)
    report = qmodel.meta.get(REPORT)  # how convert lowered it: what load must rebuild
    if report is None:
        return artifact
    if report.final_check:
        artifact = replace(artifact, model={**artifact.model,
                                            check_record.KEY: check_record.to_document(report.final_check)})
    return with_lowering(artifact, LoweringRecord.of(report))


def fusion_records(artifact: Artifact) -> list[FusionRecord]:
    return [FusionRecord(f["module_name"], f["pattern"], f["fused_type"], tuple(f["nodes"]),
                         str(f.get("anchor_module", "")))
            for f in artifact.model["fusions"]]


def to_document(artifact: Artifact) -> dict[str, Any]:
    """The JSON document stored in the file's metadata (environment versions as of now)."""
    document = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "backend": artifact.backend,
                "plugins": list(artifact.plugins), "model": artifact.model,
                "versions": {"qplug-core": plugins.core_version() or "0+unknown", "torch": torch.__version__}}
    features = format_features.declarations(artifact.model)
    return {**document, format_features.KEY: features} if features else document


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
    read_fields(doc, "", (*TOP_KEYS, format_features.KEY), required=TOP_KEYS)
    unread = sorted(set(expect(doc.get(format_features.KEY, {}), dict, format_features.KEY, "a JSON object"))
                    - format_features.KNOWN)
    if unread:  # qp.load and qplug report leave them out first (format_features.accept)
        raise ConfigError(f"{format_features.KEY}: {unread[:8]} are not features this qplug-core reads",
                          field=format_features.KEY, value=unread)
    backend = expect(doc["backend"], str, "backend", "a backend name")
    plugins = tuple(_read_plugin(p, child("plugins", i))
                    for i, p in enumerate(expect(doc["plugins"], list, "plugins", "a JSON list")))
    _check_versions(expect(doc["versions"], dict, "versions", "a JSON object"))
    model = read_fields(doc["model"], "model", MODEL_KEYS + OPTIONAL_MODEL_KEYS, required=MODEL_KEYS)
    if model.get("capture", "symbolic") not in CAPTURES:
        raise ConfigError(f"model.capture must be one of {', '.join(CAPTURES)}, got "
                          f"{model['capture']!r}", field="model.capture", value=model["capture"])
    if PER_TOKEN_LAYERS in model:
        path = f"model.{PER_TOKEN_LAYERS}"
        for i, name in enumerate(expect(model[PER_TOKEN_LAYERS], list, path, "a JSON list")):
            expect(name, str, child(path, i), "a module name")
    if AUTO_KEY in model:
        path = f"model.{AUTO_KEY}"
        for i, name in enumerate(expect(model[AUTO_KEY], list, path, "a JSON list")):
            expect(name, str, child(path, i), "a backend name")
    expect(model.get(INT16_PAIRS_KEY, True), bool, f"model.{INT16_PAIRS_KEY}", "true or false")
    path = f"model.{TARGET_RUNGS_KEY}"
    for name, rung in expect(model.get(TARGET_RUNGS_KEY, {}), dict, path, "a JSON object").items():
        if rung not in RUNGS:
            raise ConfigError(f"{where(child(path, name))}: {rung!r} is not one of {', '.join(RUNGS)}",
                              field=path, value=rung)
    _check_fixed_keywords(expect(model.get(FIXED_KEYWORDS_KEY, {}), dict, f"model.{FIXED_KEYWORDS_KEY}",
                                 "a JSON object"), f"model.{FIXED_KEYWORDS_KEY}")
    expect(model["training"], bool, "model.training", "true or false")
    expect(model["mode"], str, "model.mode", "a quantization mode")
    for i, fusion in enumerate(expect(model["fusions"], list, "model.fusions", "a JSON list")):
        _read_fusion(fusion, child("model.fusions", i))
    _check_tensors(expect(model["tensors"], dict, "model.tensors", "a JSON object"), tensors)
    if per_token_record.KEY in model:
        per_token_record.check(model[per_token_record.KEY], model, tensors, child("model", per_token_record.KEY))
    if partition_models.KEY in model:
        partition_models.check(model[partition_models.KEY], tensors, child("model", partition_models.KEY))
    nodes = len(expect(model["graph"], list, "model.graph", "a JSON list"))
    if LOWERING_KEY in model:
        LoweringRecord.from_document(model[LOWERING_KEY], child("model", LOWERING_KEY), nodes)
    if clamp_record.KEY in model:
        clamp_record.from_document(model[clamp_record.KEY], child("model", clamp_record.KEY), nodes)
    if check_record.KEY in model:
        check_record.from_document(model[check_record.KEY], child("model", check_record.KEY))
    if affine_record.KEY in model:
        affine_record.from_document(model[affine_record.KEY], child("model", affine_record.KEY), nodes)
    if functional_record.KEY in model:
        functional_record.from_document(model[functional_record.KEY], child("model", functional_record.KEY), nodes)
    return Artifact(backend, plugins, model, tensors)


def _check_fixed_keywords(fixed: dict[str, Any], path: str) -> None:
    """``{"return_dict": [true, null]}``: identifiers -> lists of plain constants, the first one used."""
    for name, values in fixed.items():
        check_identifier(name, child(path, name), "keyword")
        if not expect(values, list, child(path, name), "a JSON list"):
            raise ConfigError(f"{where(child(path, name))}: no value", field=path, value=values)
        for i, value in enumerate(values):
            expect(value, BAKED_TYPES, child(child(path, name), i), "true, false, a number or null")


def _check_text(value: Any, pattern: re.Pattern[str], path: str, what: str) -> None:
    """``qplug report`` prints these: they must look like what qplug writes there."""
    if not isinstance(value, str) or not pattern.match(value):
        raise ConfigError(f"{where(path)}: {value!r} is not {what}", field=path, value=value)


def _check_versions(versions: dict[str, Any]) -> None:
    """``{"qplug-core": "0.1.0", "torch": "2.13.0+cpu"}``: distribution names and versions."""
    if len(versions) > _MAX_VERSIONS:
        raise ConfigError(f"versions: {len(versions)} entries, at most {_MAX_VERSIONS}",
                          field="versions", value=len(versions))
    for key, value in versions.items():
        _check_text(key, _DISTRIBUTION, child("versions", key), "a distribution name")
        _check_text(value, _VERSION, child("versions", key), "a version")


def with_lowering(artifact: Artifact, record: LoweringRecord) -> Artifact:
    """``artifact`` recording how its model was lowered (what ``load`` must rebuild)."""
    return replace(artifact, model={**artifact.model, LOWERING_KEY: record.to_document()})


def lowering_of(artifact: Artifact) -> LoweringRecord | None:
    """The lowering recorded in ``artifact`` (checked when it was read), None for older files."""
    doc = artifact.model.get(LOWERING_KEY)
    return None if doc is None else LoweringRecord(dict(doc["kernels"]), dict(doc["reference"]),
                                                   dict(doc.get("regions", {})))


def _read_plugin(doc: Any, path: str) -> dict[str, str | None]:
    read_fields(doc, path, PLUGIN_KEYS, required=PLUGIN_KEYS)
    return {k: expect(doc[k], (str, type(None)), child(path, k), "a string or null") for k in PLUGIN_KEYS}


def _read_fusion(doc: Any, path: str) -> None:
    read_fields(doc, path, ("module_name", "pattern", "fused_type", "nodes", "anchor_module"),
                required=("module_name", "pattern", "fused_type", "nodes"))
    for key in ("module_name", "pattern", "fused_type", "anchor_module"):
        if key in doc:
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
