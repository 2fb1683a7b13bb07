"""``qp.save`` and ``qp.load``: converted models to and from one ``.safetensors`` file."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

from packaging.version import InvalidVersion, Version
from torch import fx, nn

from qplug_core.errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    QplugError,
    SerializationError,
    did_you_mean,
    warn_user,
)
from qplug_core.flows.finish import finish_conversion
from qplug_core.flows.preserved_attributes import preserved_names
from qplug_core.flows.safer_weights import make_safer
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.tags import (
    ABSORBED_CLAMPS,
    ARTIFACT,
    CAPTURE,
    EAGER_CONVERTED,
    EAGER_STATE,
    FIXED_KEYWORDS,
    FOLDED_AFFINES,
    FUNCTIONAL_WEIGHTS,
    FUSIONS,
)
from qplug_core.flows.target_rungs import name_rungs
from qplug_core.ir import module_stack
from qplug_core.kernels.per_token import PER_TOKEN_LAYERS, swap_in_per_token
from qplug_core.registry import plugins
from qplug_core.registry.backends import Backend, get_backend, list_backends
from qplug_core.registry.cpu_diagnostics import warn_if_slow_here
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
from qplug_core.serialization.artifact import (
    AUTO_KEY,
    FIXED_KEYWORDS_KEY,
    INT16_PAIRS_KEY,
    TARGET_RUNGS_KEY,
    Artifact,
    artifact_of,
    backend_identity,
    from_document,
    fusion_records,
    lowering_of,
    to_document,
    with_lowering,
)
from qplug_core.serialization.files import read_artifact_file, write_artifact_file
from qplug_core.serialization.graph_codec import decode_graph
from qplug_core.serialization.lowering_record import LoweringRecord
from qplug_core.serialization.module_codec import decode_modules
from qplug_core.serialization.receivers import check_receivers
from qplug_core.serialization.weight_only import (
    is_swapped_document,
    is_swapped_model,
    load_swapped,
    save_swapped,
)

#: PEP 508 distribution names
_DISTRIBUTION_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?\Z")


def save(qmodel: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write a converted model to ``path`` (one ``.safetensors`` file) and return the path.

    ``qmodel`` must come from ``qp.convert_fx``, ``qp.convert_to_reference_fx`` or ``qp.load``:
    what is written is the reference form recorded at convert time (int8 weights, qparams, graph;
    float tensors are shared with the model) and the backend it was converted for, so modules
    swapped into the model later are not saved. The file is replaced atomically, holds a SHA-256
    digest of its tensors and document that ``load`` checks, and saving the same model twice gives
    byte-identical files. Models quantized by module swap
    (``qp.quantize_weights``, ``qp.quantize_w8a8``, ``qp.quantize_dynamic(per_token=True)``) are
    saved as their quantized tensors and the rest of their float state (load them with ``model=``);
    so are ``qp.quantize_dynamic`` models whose dynamic layers are int8 linears.
    """
    target = Path(path)
    if is_swapped_model(qmodel):
        return save_swapped(qmodel, target)
    artifact = artifact_of(qmodel)
    if isinstance(artifact, str):
        raise SerializationError(f"cannot save to {target}: {artifact}", path=str(target))
    if not isinstance(artifact, Artifact) and _is_eager(qmodel):
        raise SerializationError(
            f"cannot save to {target}: the model comes from qplug's eager mode (qp.eager.prepare / "
            "qp.eager.convert), which qp.save does not write: it writes graph-mode models (their "
            "reference form), and an eager model's state_dict holds no int8 weights where kernels "
            "packed them (fbgemm, qnnpack). Save the float model (its state_dict) and run fuse_modules, "
            "prepare, calibration and convert again after loading it, or quantize with graph mode "
            "(qp.quantize, or qp.prepare_fx and qp.convert_fx), whose models qp.save writes", path=str(target))
    if not isinstance(artifact, Artifact):
        raise SerializationError(
            f"cannot save to {target}: the model was not produced by qp.convert_fx, "
            "qp.convert_to_reference_fx or qp.load (it holds no reference form); "
            "quantize it with qplug first. qp.quantize_dynamic's captured graphs (capture=... or an "
            "ExportedProgram) are not saved: they need no calibration, so save the float model and "
            "run qp.quantize_dynamic again after loading it (its module-swapped models are saved)", path=str(target))
    if kept := preserved_names(qmodel):
        warn_user(f"qplug: qp.save writes the quantized model, not the attributes it keeps from "
                  f"preserved_attributes ({', '.join(kept)}): set them again on the model qp.load returns")
    document = json.dumps(to_document(artifact), sort_keys=True, separators=(",", ":"), allow_nan=False)
    write_artifact_file(target, document, artifact.tensors)
    return target


def _is_eager(model: nn.Module) -> bool:
    """Whether ``model`` was prepared or converted by qplug's eager mode."""
    return any(getattr(model, tag, None) is not None for tag in (EAGER_STATE, EAGER_CONVERTED))


def load(path: str | os.PathLike[str], *, backend: str | Backend | None = None,
         model: nn.Module | None = None, reselect: bool = False) -> nn.Module:
    """Load a model saved by :func:`save`, lowered to the backend it was converted for.

    A model quantized by module swap (``qp.quantize_weights``, ``qp.quantize_w8a8``,
    ``qp.quantize_dynamic`` without ``example_inputs``, per-token or not) is loaded into
    ``model``: an instance of the original class built from the same config (``MyNet()``,
    ``AutoModelForCausalLM.from_config(config)``), whose float weights are replaced in place; it is returned, with kernels picked for this CPU
    (from ``backend``'s and the core's, or every installed backend's for ``None``). A weight-only
    linear runs the kernel recorded when the file was saved wherever that kernel is installed and
    passes its check, so processes loading the file on one kind of CPU answer alike; where it
    does not, the kernel is measured again here and a warning names the layers. A decoder's
    one-token steps start on the thread counts the file records (those made at more threads than
    this machine has cores are measured here). ``reselect=True`` measures every layer and thread
    choice again (a file moved to another CPU, where the recorded kernel may be slower: without
    VNNI, say), at the cost of outputs that may differ slightly from the saving process's; other
    files choose no kernel by timing and ignore it.

    The model is rebuilt as it was saved: what ran on kernels or compiled partitions then does
    again, what stayed in reference form stays so, or the load is refused naming the ops
    (:class:`SerializationError`). Nothing runs at load: a delegating backend (onnxruntime,
    openvino) builds each partition at its first call, from the ONNX models the file stores for it
    (checked at load; without them, or where they fail a check, exported from the reference form
    for the shapes it is called with), so no size recorded in the file is ever allocated. ``backend`` overrides that backend; ``backend="reference"`` gives the reference form, which
    runs anywhere. Nothing is ever unpickled: a pickle (``torch.save``) file raises
    :class:`UnsafeFileError` and there is no opt-in, because a pickle cannot carry a qplug model
    without running code. A damaged or tampered file raises :class:`SerializationError` naming it
    (one whose tensors or document no longer match the digest ``save`` stored in it, too); a
    backend that is not installed raises :class:`BackendNotFoundError` with the ``pip install``
    command. A plugin version that differs in its major version (minor for 0.x) from the one
    recorded only warns: the file holds the backend-independent reference form, and the installed
    plugin builds its kernels from it. A model quantized with ``backend="auto"`` loads on the
    fastest backend measured then that is available here; when that is not the one chosen (it
    is not installed, or cannot run here), a warning names the fallback.
    """
    source = Path(path)
    text, tensors = read_artifact_file(source)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"{source} is not a valid qplug artifact: {type(exc).__name__}: {exc}",
                                 path=str(source)) from exc
    document, tensors = format_features.accept(document, tensors, source)
    if is_swapped_document(document):
        return load_swapped(document, tensors, source, model,
                            backend.name if isinstance(backend, Backend) else backend, reselect)
    if model is not None:
        raise SerializationError(f"{source} holds a converted graph model, which qp.load builds itself; "
                                 "model= is only for files of models quantized by module swap (qp.quantize_weights, "
                                 "qp.quantize_w8a8, qp.quantize_dynamic without example_inputs)", path=str(source))
    try:
        artifact = from_document(document, tensors)
    except (ValueError, RecursionError, ConfigError) as exc:  # RecursionError: absurdly nested JSON
        raise SerializationError(f"{source} is not a valid qplug artifact: {type(exc).__name__}: {exc}",
                                 path=str(source)) from exc
    if backend is None and AUTO_KEY in artifact.model:
        backend = _auto_choice(artifact, source)
    chosen = _resolve_backend(artifact, backend, source)
    warn_if_slow_here(chosen.name, chosen.engine)  # who deploys a file is often not who quantized it
    gm = rebuild_graph(artifact, source)
    gm.meta[FUSIONS] = fusion_records(artifact)
    _make_weights_safe_here(gm, artifact, chosen, source)
    recorded = lowering_of(artifact) if chosen.name == artifact.backend else None
    stored = partition_models.stored_models(artifact.model, artifact.tensors) if recorded else {}
    if recorded is None:  # another backend's ONNX models are not this one's
        model_doc, tensors = partition_models.without(artifact.model, artifact.tensors)
        artifact = replace(artifact, model=model_doc, tensors=tensors)
    try:
        report = finish_conversion(gm, chosen, mode=artifact.model["mode"], loading=True,
                                   keep_reference=recorded.reference if recorded else None,
                                   keep_regions=recorded.regions if recorded else None, stored=stored)
    except QplugError:
        raise
    except Exception as exc:  # a tampered graph must not crash deep inside lowering
        raise SerializationError(f"{source}: lowering to backend {chosen.name!r} failed: "
                                 f"{type(exc).__name__}: {exc}", path=str(source)) from exc
    try:
        swap_in_per_token(gm, artifact.model.get(PER_TOKEN_LAYERS, []), simulate=not chosen.kernels,
                          saved=per_token_record.saved_weights(artifact.model, artifact.tensors))
    except ConfigError as exc:
        raise SerializationError(f"{source}: {exc}", path=str(source)) from exc
    name_rungs(report, artifact.model.get(TARGET_RUNGS_KEY, {}))
    report.final_check = dict(artifact.model.get(check_record.KEY, {}))  # checked when the document was read
    if recorded is not None:
        recorded.check_rebuilt(report, source)
    name, contributors = backend_identity(chosen)
    gm.meta[ARTIFACT] = with_lowering(replace(artifact, backend=name, plugins=contributors),
                                      LoweringRecord.of(report))
    return gm


def rebuild_reference(qmodel: fx.GraphModule) -> fx.GraphModule:
    """The reference form recorded when ``qmodel`` was converted (for exporters and compilers)."""
    snapshot = snapshot_of(qmodel)
    if snapshot is not None:
        return snapshot.graph_module  # a model of its own: callers may rewrite it
    artifact = qmodel.meta.get(ARTIFACT)
    if not isinstance(artifact, Artifact):
        raise SerializationError("the model's reference form was not recorded at convert: "
                                 "GraphModule.meta has neither a reference snapshot nor an artifact")
    gm = rebuild_graph(artifact, Path("<in-memory model>"))
    gm.meta[FUSIONS] = fusion_records(artifact)
    gm.meta[ARTIFACT] = artifact
    return gm


def rebuild_graph(artifact: Artifact, source: Path) -> fx.GraphModule:
    model, tensors = per_token_record.expand(*partition_models.without(artifact.model, artifact.tensors))
    try:
        graph = decode_graph(model["graph"])  # first: every name is checked before a module is built
        root, modes = decode_modules(model["modules"], model["attributes"], model["tensors"], tensors)
        check_receivers(graph, root)  # the objects the names reach, as capture checked them
        gm = fx.GraphModule(root, graph, class_name="GraphModule")
        gm.graph.lint()
        if tree_record.KEY in model:
            tree_record.install(gm, model[tree_record.KEY], f"model.{tree_record.KEY}")
        if model.get("capture", "symbolic") == "symbolic":
            _scope_module_calls(gm)
        gm.meta[FIXED_KEYWORDS] = model.get(FIXED_KEYWORDS_KEY, {})
        if affine_record.KEY in model:
            gm.meta[FOLDED_AFFINES] = affine_record.from_document(model[affine_record.KEY], affine_record.KEY,
                                                                  len(model["graph"]))
            affine_record.check_convs(gm.meta[FOLDED_AFFINES], gm, affine_record.KEY)
    except ConfigError as exc:
        raise SerializationError(f"{source} is not a valid qplug artifact: {exc}", path=str(source)) from exc
    except Exception as exc:  # fx rejects a graph that does not fit its modules with plain errors
        raise SerializationError(f"{source}: the saved graph does not fit its modules: "
                                 f"{type(exc).__name__}: {exc}", path=str(source)) from exc
    gm.train(model["training"])
    for module, training in modes:
        module.train(training)
    gm.meta[CAPTURE] = model.get("capture", "symbolic")  # what the report says it was captured by
    if clamp_record.KEY in model:  # checked when the document was read
        gm.meta[ABSORBED_CLAMPS] = clamp_record.from_document(model[clamp_record.KEY], clamp_record.KEY,
                                                              len(model["graph"]))
    if functional_record.KEY in model:
        gm.meta[FUNCTIONAL_WEIGHTS] = functional_record.from_document(
            model[functional_record.KEY], functional_record.KEY, len(model["graph"]))
    return gm


def _scope_module_calls(gm: fx.GraphModule) -> None:
    """Give each module call the module stack symbolic tracing wrote for it (its own module): the
    file keeps no node meta, and lowering carries the stack to the kernel that replaces the call,
    which is how qp.compare tells what a float module became (``b1`` run by ``batchnorm2d``)."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            target = str(node.target)
            node.meta.setdefault(module_stack.KEY, {target: (target, type(gm.get_submodule(target)))})


def _resolve_backend(artifact: Artifact, backend: str | Backend | None, source: Path) -> Backend:
    """The backend to lower to, checked before any work is done."""
    wanted = artifact.backend if backend is None else backend
    name = wanted.name if isinstance(wanted, Backend) else wanted
    try:
        chosen = get_backend(wanted).require_available()
    except BackendNotFoundError as exc:
        if backend is not None:  # the caller's own name: not the file's doing
            installed = [info.name for info in list_backends()]
            raise BackendNotFoundError(
                f"qp.load(..., backend={name!r}): no backend of that name is installed"
                f"{did_you_mean(name, installed)} (installed: {', '.join(installed) or 'none'}); leave "
                f"backend out for the one {source.name} was converted for ({artifact.backend!r})",
                backend=name) from exc
        recorded = [p["dist"] for p in artifact.plugins if p["name"] == name]
        dist = next((d for d in [*recorded, f"qplug-{name}"]
                     if _distribution_name(d)), None)
        install = f"install it with: pip install {dist}" if dist else "install the plugin that provides it"
        installed = ", ".join(info.name for info in list_backends()) or "none"
        raise BackendNotFoundError(
            f"{source} was converted for backend {name!r}, which is not installed (installed: "
            f"{installed}); {install}, or load the backend-independent reference form with "
            "qp.load(path, backend='reference')", backend=name) from exc
    except BackendUnavailableError as exc:
        raise BackendUnavailableError(f"{source}: {exc}; qp.load(path, backend='reference') gives the "
                                      "reference form, which runs anywhere", backend=name) from exc
    if name == artifact.backend:
        _check_plugin_versions(artifact, chosen, source)
    return chosen


def _make_weights_safe_here(gm: fx.GraphModule, artifact: Artifact, backend: Backend,
                            source: Path) -> None:
    """A file whose weights were chosen where int8 products accumulate in int32 (VNNI), loaded
    where ``backend``'s kernels sum u8 x s8 pairs in int16: its layers with 8-bit weights get
    7-bit ones (``flows/safer_weights.py``), which cannot saturate, with a warning. Nothing runs
    at load to tell which layers would saturate; a delegating backend checks each partition at
    its first call instead, on real inputs (``flows/delegate.FirstCallCheck``)."""
    if artifact.model.get(INT16_PAIRS_KEY) or backend.delegate is not None or not backend.kernels:
        return
    safer = make_safer(gm, backend.arithmetic)
    if safer is not None:
        shown = ", ".join(safer.layers[:4]) + (f" and {len(safer.layers) - 4} more" if len(safer.layers) > 4 else "")
        warn_user(f"qplug: {source} was converted where int8 products accumulate in int32 (VNNI); "
                  f"here backend {backend.name!r}'s kernels sum u8 x s8 pairs in int16, which its "
                  f"8-bit weights can saturate: loaded with 7-bit weights in {shown}; quantize "
                  "again on this CPU to choose the bits per layer on data")


def _auto_choice(artifact: Artifact, source: Path) -> str:
    """A ``backend="auto"`` file: the first backend of its measured ranking available here, else
    this machine's default, with a warning when that is not the one measured fastest."""
    ranking = artifact.model[AUTO_KEY]
    missing = []
    for name in ranking:
        try:
            get_backend(name).require_available()
        except QplugError as exc:
            missing.append(f"{name!r} ({str(exc).split(';')[0]})")
            continue
        if name != artifact.backend:
            warn_user(f"qplug: {source} was quantized with backend='auto', which chose "
                      f"{artifact.backend!r}; not available here: {', '.join(missing)}; using "
                      f"{name!r}, the fastest of the others it measured")
        return name
    fallback = get_backend(None).name
    warn_user(f"qplug: {source} was quantized with backend='auto', which chose "
              f"{artifact.backend!r}; none of the backends it measured is available here "
              f"({', '.join(missing) or 'none recorded'}); using {fallback!r}, this machine's "
              "default, which was not measured for this model")
    return fallback


def _distribution_name(text: str | None) -> bool:
    """Whether ``text`` is a valid distribution name: names from a file end up in pip commands."""
    return bool(text) and _DISTRIBUTION_NAME.match(text) is not None


def _check_plugin_versions(artifact: Artifact, chosen: Backend, source: Path) -> None:
    installed = {r.dist: r.version for r in chosen.contributors if r.dist}
    for saved in artifact.plugins:
        dist, version = saved["dist"], saved["version"]
        if not _distribution_name(dist) or dist == plugins.CORE_DISTRIBUTION or not _valid_version(version):
            continue
        if dist not in installed:
            message = (f"{source} was converted with plugin {dist} {version}, which does not contribute to "
                       f"backend {chosen.name!r} here; the patterns it provided stay in reference form")
        elif not _compatible(version, installed[dist]):
            message = (f"{source} was converted with {dist} {version} but {installed[dist]} is installed; "
                       f"its kernels may round differently (pip install '{dist}=={version}' reproduces "
                       "the original exactly)")
        else:
            continue
        warn_user(message, plugins.QplugPluginWarning)


def _valid_version(text: str | None) -> bool:
    try:
        Version(text or "")
    except InvalidVersion:
        return False
    return True


def _compatible(saved: str, installed: str | None) -> bool:
    """Same major version (same minor for 0.x), as with a caret requirement."""
    if not _valid_version(installed):
        return False
    a, b = Version(saved), Version(installed or "")
    width = 2 if a.major == 0 else 1
    return a.release[:width] == b.release[:width]
