"""Models quantized by module swap in and out of one ``.safetensors`` file: ``qp.quantize_weights``
(weight-only), ``qp.quantize_w8a8`` and ``qp.quantize_dynamic`` models (int8 or float16 linears,
LSTMs, GRUs and RNN cells; not the reference backend's float simulation).

The file holds plain tensors (each quantized layer's own: ``qweight`` / ``scales`` /
``zero_points`` / ``input_scale`` for weight-only layers, ``weight_int8`` / ``weight_scale`` for
int8 ones, ``weight_float16`` for float16 dynamic ones, and ``bias``; a dynamic LSTM / GRU /
cell's per weight matrix, ``weight_ih_l0.weight_int8`` ...; the rest of the model's float state under its ``state_dict`` keys, which
includes the norms SmoothQuant folded its scales into) and a JSON document listing the quantized
layers by module name, kind and shape, and what made them. No code and no class name is stored:
the model is rebuilt by the user (their own class, from its config) and passed to
``qp.load(path, model=...)``, which checks every listed name against that model's own modules (a
table of its ``named_modules()``, never an attribute walk), swaps the quantized layers in, loads
the float state, runs the kernels the file records where they run here and, for weight-only and
W8A8 models, installs the decode-step thread choice (:mod:`qplug_core.weight_only.decode_step`),
starting from the choices the file records (:mod:`~qplug_core.serialization.decode_threads_record`).
Layer kinds map to builders through :data:`_BUILDERS`; an unknown kind is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from qplug_core.config.codec import child
from qplug_core.errors import ConfigValidationError, SerializationError, warn_user
from qplug_core.flows.checks import check_float32
from qplug_core.ir.autocast_off import compute_in_float32
from qplug_core.ir.tracing import reading_state_dict
from qplug_core.kernels.arithmetic import engine_arithmetic, pair_sums_saturate, pairs_fit
from qplug_core.kernels.capabilities import engine_capabilities
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.kernels.dynamic import (
    DynamicGRU,
    DynamicLinear,
    DynamicLSTM,
    GRUCell,
    HalfWeight,
    IntegerWeight,
    LSTMCell,
    RNNCell,
    StoredWeight,
)
from qplug_core.kernels.layer_faults import name_layers
from qplug_core.kernels.per_token import PerTokenDynamicLinear, SharedInput, best_gemm
from qplug_core.kernels.reference import dynamic_weight_names
from qplug_core.kernels.static_int8 import StaticInt8Linear
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme
from qplug_core.serialization import decode_threads_record, kernel_record, meta_models, per_token_codec
from qplug_core.serialization.files import write_artifact_file
from qplug_core.weight_only import decode_step
from qplug_core.weight_only.api import (
    INFO_ATTRIBUTE,
    WeightOnlyInfo,
    choose_kernels,
    conv1d_class,
    linear_weight,
)
from qplug_core.weight_only.modules import WeightOnlyEmbedding, WeightOnlyEmbeddingBag, WeightOnlyLinear
from qplug_core.weight_only.selection import available_kernels
from qplug_core.weight_only.smoothing import Smoothed
from qplug_core.weight_only.w8a8 import ACTIVATIONS, LAYER_KIND, STATIC_KIND, W8A8_ATTRIBUTE, W8A8Info

FORMAT = "qplug-weight-only"
SCHEMA_VERSION = 1
_QUANTIZED = "quantized/"
_FLOAT = "float/"
#: what made the model: restored as its info attribute at load
MODES = ("weight_only", "w8a8", "dynamic")
_FIELDS = ("qweight", "scales", "zero_points", "bias", "input_scale", "weight_int8", "weight_scale",
           "weight_zero_point", "activation_scale", "activation_zero_point", "weight_float16")
DYNAMIC_KIND = "dynamic_linear"
#: a dynamic layer's weight matrix as the file holds it: int8 with its scales, or float16
_INTEGER_FIELDS = ("weight_int8", "weight_scale", "weight_zero_point")
_HALF_FIELD = "weight_float16"
#: a dynamic layer's document entry: the dtype of its weights (files without it hold int8 ones)
_WEIGHT_DTYPES = {"qint8": torch.qint8, "float16": torch.float16}
#: layer kind of a recurrent layer or cell -> its kernel (the only classes such a kind can build)
_RECURRENT_KINDS: dict[str, type[DynamicLSTM | DynamicGRU | LSTMCell | GRUCell | RNNCell]] = {
    "dynamic_lstm": DynamicLSTM, "dynamic_gru": DynamicGRU, "dynamic_lstm_cell": LSTMCell,
    "dynamic_gru_cell": GRUCell, "dynamic_rnn_cell": RNNCell}
#: what each module-swap mode is called where the user reads it
#: document entry: float key -> the key whose tensor it shares (written once)
_TIED_KEY = "tied"
_SWAP_MODES = {"weight_only": "weight-only", "w8a8": "W8A8", "dynamic": "per-token dynamic"}
_WEIGHT_ONLY_KINDS = ("linear", "embedding", "embedding_bag")
_BAG_MODES = ("sum", "mean", "max")
#: engines a dynamic linear may name in a file (and this torch must support to load it)
_ENGINES = ("fbgemm", "x86", "qnnpack", "onednn")


def is_swapped_model(model: Any) -> bool:
    """A model quantized by module swap (not a converted graph, which carries its own artifact)."""
    if isinstance(getattr(model, INFO_ATTRIBUTE, None), WeightOnlyInfo) or \
            isinstance(getattr(model, W8A8_ATTRIBUTE, None), W8A8Info):
        return True
    return isinstance(model, nn.Module) and not isinstance(model, fx.GraphModule) and \
        any(isinstance(m, PerTokenDynamicLinear) or _is_dynamic_layer(m) for m in model.modules())


def _is_dynamic_layer(module: nn.Module) -> bool:
    """A module ``qp.quantize_dynamic`` swaps in (a dynamic kernel or its reference simulation)."""
    return type(module).__module__ in ("qplug_core.kernels.dynamic", "qplug_core.flows.dynamic")


def is_swapped_document(document: Any) -> bool:
    return isinstance(document, dict) and document.get("format") == FORMAT


def swap_mode(document: dict[str, Any]) -> str:
    return _SWAP_MODES.get(document.get("mode"), str(document.get("mode")))


def swapped_facts(document: dict[str, Any]) -> dict[str, Any]:
    """What a module-swap document holds (a file's, or a model's record as ``qp.save`` writes it):
    the mode, the layers by kind, the scheme, smoothing, fusion and the layers left float."""
    layers: dict[str, int] = {}
    for layer in document.get("layers", []):
        kind = layer["kind"] + (" (float16 weights)" if layer.get("weight_dtype") == "float16" else "")
        layers[kind] = layers.get(kind, 0) + 1
    facts: dict[str, Any] = {"mode": swap_mode(document), "int8_layers": layers}
    scheme = document.get("scheme")
    if scheme:
        group = scheme.get("group_size")
        facts["scheme"] = (f"int{scheme['bits']} {'symmetric' if scheme.get('symmetric') else 'asymmetric'}, "
                           + (f"groups of {group}" if group else "per channel"))
    for key in ("algorithm", "activations"):
        if document.get(key):
            facts[key] = document[key]
    if document.get("smoothed") is not None:
        # an input alpha="auto" chose not to smooth is listed with alpha None: nothing was folded
        facts["smoothed_groups"] = sum(1 for entry in document["smoothed"] if entry.get("alpha") is not None)
    if document.get("fused"):
        facts["fused_groups"] = len(document["fused"])
    if document.get("skipped"):
        facts["left_float"] = dict(document["skipped"])
    return facts


def swapped_layers(model: nn.Module) -> tuple[str, dict[str, str], dict[str, Any]]:
    """(mode, layer name -> kind, the mode's own document entries) of a swapped model."""
    info = getattr(model, INFO_ATTRIBUTE, None)
    if isinstance(info, WeightOnlyInfo):
        return "weight_only", dict(info.layers), {"algorithm": info.algorithm, "scheme": info.scheme.to_dict(),
                                                  "skipped": info.skipped, "calibration": info.calibration,
                                                  "fused": [list(names) for names in info.fused]}
    w8a8 = getattr(model, W8A8_ATTRIBUTE, None)
    if isinstance(w8a8, W8A8Info):
        return "w8a8", dict(w8a8.layers), {"alpha": w8a8.alpha, "activations": w8a8.activations,
                                           "skipped": w8a8.skipped, "unsmoothed": w8a8.unsmoothed,
                                           "smoothed": [vars(s) for s in w8a8.smoothed]}
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(module, PerTokenDynamicLinear):
            kinds[name] = LAYER_KIND
        elif isinstance(module, DynamicLinear):
            kinds[name] = DYNAMIC_KIND
        else:
            kinds.update({name: kind for kind, kernel in _RECURRENT_KINDS.items() if type(module) is kernel})
    return "dynamic", kinds, {}


def save_swapped(model: nn.Module, target: Path) -> Path:
    mode, kinds, entries = swapped_layers(model)
    if mode == "dynamic":
        _check_savable(model, target)
    modules = dict(model.named_modules())
    layers, tensors = [], {}
    for name, kind in kinds.items():
        module = modules.get(name)
        encoded = _encode(kind, module)
        if encoded is None:
            raise SerializationError(f"cannot save to {target}: layer {name!r} is no longer the {kind} it was "
                                     "quantized to (the model was changed after quantization)", path=str(target))
        layer, values = encoded
        layers.append({"name": name, "kind": kind, **layer})
        tensors.update({f"{_QUANTIZED}{name}/{f}": v.detach() for f, v in values.items() if v is not None})
    prefixes = tuple(f"{name}." for name in kinds)
    with reading_state_dict():  # the quantized layers' weights are written above
        state = model.state_dict()
    float_state = {key: value for key, value in state.items() if not key.startswith(prefixes)}
    tied = _tied_keys(float_state)
    tensors.update({_FLOAT + key: value for key, value in float_state.items() if key not in tied})
    document = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "mode": mode, "layers": layers, **entries}
    if tied:
        document[_TIED_KEY] = tied
    info = getattr(model, INFO_ATTRIBUTE, None)
    if isinstance(info, WeightOnlyInfo) and info.kernel_cpu is not None:
        document[kernel_record.CPU_KEY] = kernel_record.cpu_document(info.kernel_cpu)
    decode_step.measure_before_saving(model)
    step = getattr(model, decode_step.ATTRIBUTE, None)
    if isinstance(step, decode_step.DecodeStepThreads) and step.recorded():
        document[decode_threads_record.KEY] = decode_threads_record.to_document(step.recorded())
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    write_artifact_file(target, text, tensors)
    return target


def _tied_keys(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Key -> the first key holding the very same tensor (tied weights: an LLM's ``lm_head`` and
    input embedding): the file keeps one copy and ``qp.load`` fills the others from it."""
    first: dict[tuple, str] = {}
    tied = {}
    for key, value in state.items():
        if not value.numel():
            continue
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                value.dtype, value.device)
        if view in first:
            tied[key] = first[view]
        else:
            first[view] = key
    return tied


def _check_savable(model: nn.Module, target: Path) -> None:
    """A dynamic model is saved only if every dynamic layer runs a kernel this file format knows."""
    savable = (DynamicLinear, *_RECURRENT_KINDS.values())
    for name, module in model.named_modules():
        if _is_dynamic_layer(module) and type(module) not in savable:
            raise SerializationError(
                f"cannot save to {target}: layer {name!r} is a dynamic {type(module).__name__}, the reference "
                "backend's float simulation, which qp.save does not write (it holds float weights): quantize "
                "with a backend that has dynamic kernels (backend='fbgemm' or 'qnnpack'), or save the float "
                "model and run qp.quantize_dynamic again after loading it", path=str(target))


def _encode(kind: str, module: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor | None]] | None:
    """(the layer's document entry, its tensors), or None when ``module`` is not of ``kind``."""
    static = isinstance(module, StaticInt8Linear)
    if (kind == LAYER_KIND and isinstance(module, PerTokenDynamicLinear) and not static) or \
            (kind == STATIC_KIND and static):
        values = per_token_codec.encode(module)
        if static:
            values.update(activation_scale=module.activation_scale,
                          activation_zero_point=module.activation_zero_point)
        return {"shape": [module.out_features, module.in_features], "simulated": module.simulate}, values
    if kind == DYNAMIC_KIND and isinstance(module, DynamicLinear):
        weight = module.stored_weight()
        return _dynamic_entry(weight, module), {**_weight_fields(weight), "bias": module.bias}
    if kind in _RECURRENT_KINDS and type(module) is _RECURRENT_KINDS[kind]:
        weights = module.stored_weights()
        values: dict[str, torch.Tensor | None] = {}
        for matrix, (weight, bias) in weights.items():
            values.update({f"{matrix}.{field}": value for field, value in _weight_fields(weight).items()})
            values[matrix.replace("weight", "bias", 1)] = bias
        entry = _dynamic_entry(next(iter(weights.values()))[0], module)
        return {**entry, "options": {o: getattr(module, o) for o in module.OPTIONS}}, values
    if kind not in _WEIGHT_ONLY_KINDS or not isinstance(module, (WeightOnlyLinear, WeightOnlyEmbedding)):
        return None
    layer: dict[str, Any] = {"shape": list(module.quantized_weight().shape), "scheme": module.scheme.to_dict()}
    if isinstance(module, WeightOnlyLinear):
        layer.update(transposed=module.from_transposed, **{kernel_record.KEY: kernel_record.to_document(module.kernel)})
    else:
        layer["padding_idx"] = module.padding_idx
    if isinstance(module, WeightOnlyEmbeddingBag):
        layer.update(mode=module.mode, include_last_offset=module.include_last_offset)
    return layer, {f: getattr(module, f, None) for f in ("qweight", "scales", "zero_points", "bias", "input_scale")}


def _dynamic_entry(weight: StoredWeight, module: DynamicLinear | DynamicLSTM | DynamicGRU | LSTMCell | GRUCell
                   | RNNCell) -> dict[str, Any]:
    """A dynamic layer's document entry: its (first) weight matrix's shape, how it is stored, its engine."""
    stored = {"weight_dtype": "float16"} if isinstance(weight, HalfWeight) else {"per_channel": weight.per_channel}
    return {"shape": list(weight.shape), **stored, "engine": module.engine, "reduce_range": module.reduce_range}


def _weight_fields(weight: StoredWeight) -> dict[str, torch.Tensor | None]:
    if isinstance(weight, HalfWeight):
        return {_HALF_FIELD: weight.half}
    return dict(zip(_INTEGER_FIELDS, (weight.int8, weight.scales, weight.zero_points)))


def load_swapped(document: dict, tensors: dict[str, torch.Tensor], source: Path,
                 model: nn.Module | None, backend: str | None, reselect: bool = False) -> nn.Module:
    """Fill ``model`` (built by the user from the same class and config) and return it, each
    weight-only linear on the kernel recorded in the file where it runs here (measured again
    everywhere with ``reselect``)."""
    if not isinstance(model, nn.Module):
        raise SerializationError(
            f"{source} holds a model quantized by module swap (qp.quantize_dynamic, qp.quantize_weights, "
            "qp.quantize_w8a8): pass the model to fill, built from its class and config like the original, "
            "e.g. qp.load(path, model=MyNet()) or, for Hugging Face, "
            "qp.load(path, model=AutoModelForCausalLM.from_config(config))",
            path=str(source))
    if document.get("schema_version") != SCHEMA_VERSION:
        raise SerializationError(f"{source}: weight-only schema_version {document.get('schema_version')!r} "
                                 f"is not supported (this qplug reads {SCHEMA_VERSION}); upgrade qplug",
                                 path=str(source))
    mode = document.get("mode", "weight_only")
    if mode != "weight_only":  # int8 linears with float32 scales: a bf16 model met them at its first call
        check_float32(model, fix="load into model.float()")
        compute_in_float32(model)  # as quantize_dynamic / quantize_w8a8 made it
    try:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        info = _info(mode, document, backend)
        layers = list(document["layers"])
        groups = _fused_groups(document, layers) if mode == "weight_only" else []
        recorded = {} if reselect else _recorded_kernels(layers)
        chosen_on = kernel_record.cpu_from_document(document[kernel_record.CPU_KEY], kernel_record.CPU_KEY) \
            if recorded and kernel_record.CPU_KEY in document else None
        tied = _tied_from_document(document, tensors)
        threads = [] if reselect else decode_threads_record.from_document(
            document.get(decode_threads_record.KEY, []), decode_threads_record.KEY)
    except Exception as exc:  # a tampered document: wrong types, missing keys
        raise SerializationError(f"{source} is not a valid qplug weight-only file: {type(exc).__name__}: "
                                 f"{exc}", path=str(source)) from exc
    context = _LoadContext(source, tensors, backend, info)
    modules = dict(model.named_modules())
    with torch.no_grad():
        rebuilt = [(layer["kind"], *_rebuild_layer(layer, modules, context)) for layer in layers]
        if context.narrowed:
            _warn_narrowed(source, context.narrowed)
        dtypes = {name: linear_weight(modules[name]).dtype for kind, name, _ in rebuilt if kind == "linear"}
        # the float state before the swap: swapped-in kernels keep their weights packed, outside any
        # state_dict
        _load_float_state(model, [name for _, name, _ in rebuilt], tensors, tied, source)
        for key in [key for key in tensors if key.startswith(_FLOAT)]:
            del tensors[key]  # copied into the model (or now its own): not held while kernels are packed
        for kind, name, swapped in rebuilt:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, swapped)
            del modules[name]  # the float layer swapped out is let go before kernels are packed
            if info is not None:
                info.layers[name] = kind
    changed = choose_kernels(model, info if isinstance(info, WeightOnlyInfo) else None, groups, context.kernels(),
                             dtypes, recorded=recorded)
    if changed:
        _warn_changed_kernels(source, changed)
    if isinstance(info, WeightOnlyInfo):
        reused = set(recorded) - set(changed)  # running the kernels the file records
        info.kernel_cpu = chosen_on if reused else kernel_record.cpu_of(cpu_int8())
        if reused and chosen_on is not None:
            _warn_other_cpu(source, chosen_on)
        setattr(model, INFO_ATTRIBUTE, info)
    elif isinstance(info, W8A8Info):
        setattr(model, W8A8_ATTRIBUTE, info)
    if info is not None:
        decode_step.install(model)
        step = getattr(model, decode_step.ATTRIBUTE, None)
        if isinstance(step, decode_step.DecodeStepThreads):
            step.restore(threads)
    name_layers(model)
    return model


def _tied_from_document(document: dict, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The file's tied float keys (alias -> the key it shares), each naming a tensor the file holds
    (files written before ``qp.save`` wrote tied weights once have none)."""
    tied = document.get(_TIED_KEY, {})
    if not isinstance(tied, dict):
        raise ValueError(f"{_TIED_KEY} {tied!r} is not a mapping")
    for alias, kept in tied.items():
        if not isinstance(kept, str) or _FLOAT + kept not in tensors or _FLOAT + alias in tensors:
            raise ValueError(f"tied key {alias!r} -> {kept!r} does not name one float tensor of the file "
                             "in place of a missing one")
    return dict(tied)


def _recorded_kernels(layers: list) -> dict[str, tuple[str, int | None]]:
    """Each linear's kernel as the file records it (files written before the record: none)."""
    return {layer["name"]: kernel_record.from_document(layer[kernel_record.KEY], child(layer["name"], kernel_record.KEY))
            for layer in layers if isinstance(layer, dict) and kernel_record.KEY in layer}


def _warn_changed_kernels(source: Path, changed: dict[str, str]) -> None:
    reasons: dict[str, list[str]] = {}
    for name, why in changed.items():
        reasons.setdefault(why, []).append(name)
    listed = "; ".join(f"{', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}: {why}"
                       for why, names in reasons.items())
    warn_user(f"qplug: {source}: {len(changed)} weight-only layer(s) do not run the kernel recorded when the file "
              f"was saved, so their outputs may differ slightly from the saving process's ({listed}); their "
              "kernels were measured again here")


def _warn_other_cpu(source: Path, chosen_on: tuple[str, frozenset[str]]) -> None:
    """Once per load: the recorded kernels run on a CPU whose int8 capabilities differ from those
    of the CPU that chose them, where they may take another code path."""
    difference = kernel_record.cpu_difference(chosen_on, cpu_int8())
    if difference is not None:
        warn_user(f"qplug: {source}: its weight-only kernels were {difference}; a kernel may take another "
                  "code path on another kind of CPU, so outputs may differ slightly from the saving process's "
                  "(they are identical across loads on one kind of CPU only), and the recorded kernels may not "
                  "be the fastest here: qp.load(..., reselect=True) measures them again for this CPU")


def _fused_groups(document: dict, layers: list) -> list[tuple[str, ...]]:
    """The saved groups of linears run as one kernel call, each naming linear layers of the file."""
    linears = {layer.get("name") for layer in layers if isinstance(layer, dict) and layer.get("kind") == "linear"}
    groups = []
    for group in document.get("fused", []):
        names = tuple(group)
        if not all(isinstance(name, str) and name in linears for name in names):
            raise ValueError(f"fused group {group!r} names layers that are not linear layers of the file")
        groups.append(names)
    return groups


def _info(mode: str, document: dict, backend: str | None) -> WeightOnlyInfo | W8A8Info | None:
    skipped = {str(k): str(v) for k, v in dict(document.get("skipped", {})).items()}
    if mode == "weight_only":
        calibration = document.get("calibration", "")  # files written before it was saved: ""
        if not isinstance(calibration, str):
            raise ValueError(f"calibration {calibration!r} is not a string")
        return WeightOnlyInfo(WeightOnlyScheme.from_dict(document["scheme"]), str(document["algorithm"]),
                              skipped=skipped, fusion="as saved", calibration=calibration)
    if mode == "w8a8":
        alpha = document.get("alpha")
        if not (alpha is None or alpha == "auto" or isinstance(alpha, float)):
            raise ValueError(f"alpha {alpha!r}")
        smoothed = [Smoothed(str(s["into"]), tuple(str(n) for n in s["layers"]),
                             None if s["alpha"] is None else float(s["alpha"]),
                             *(None if s.get(k) is None else float(s[k]) for k in ("error_before", "error_after")))
                    for s in document.get("smoothed", [])]
        activations = document.get("activations", "per_token")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations {activations!r}")
        unsmoothed = {str(k): str(v) for k, v in dict(document.get("unsmoothed", {})).items()}
        return W8A8Info(alpha, "simulated" if backend == "reference" else best_gemm(), activations,
                        smoothed=smoothed, unsmoothed=unsmoothed, skipped=skipped)
    return None


class _LoadContext:
    """What rebuilding every layer of one file shares: the file, its tensors, the kernels, the
    one input cache the int8 linears share (q/k/v quantize their input once)."""

    def __init__(self, source: Path, tensors: dict[str, torch.Tensor], backend: str | None,
                 info: WeightOnlyInfo | W8A8Info | None) -> None:
        self.source, self.tensors, self.backend, self.info = source, tensors, backend, info
        self.shared = SharedInput()
        self._kernels: list | None = None
        #: dynamic layers whose activations load at 7 bits, not the file's 8 (:func:`_reduce_range`)
        self.narrowed: list[str] = []

    def kernels(self) -> list:
        if self._kernels is None:
            self._kernels = available_kernels(self.backend)
        return self._kernels

    def error(self, message: str) -> SerializationError:
        return SerializationError(f"{self.source}: {message}", path=str(self.source))

    def values(self, name: str, fields: tuple[str, ...] = _FIELDS, prefix: str = "") -> dict[str, torch.Tensor | None]:
        """Layer ``name``'s tensors by field (``prefix``: a recurrent layer's matrix, ``weight_ih_l0.``)."""
        return {f: self.tensors.get(f"{_QUANTIZED}{name}/{prefix}{f}") for f in fields}

    def check(self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, layer: str,
              field: str) -> None:
        problem = per_token_codec.tensor_problem(tensor, shape, dtype, layer, field)
        if problem is not None:
            raise self.error(problem)


def _rebuild_layer(layer: Any, modules: dict[str, nn.Module], context: _LoadContext) -> tuple[str, nn.Module]:
    if not isinstance(layer, dict) or not isinstance(layer.get("name"), str):
        raise context.error(f"a layer entry is malformed: {layer!r}")
    name, kind = layer["name"], layer.get("kind")
    target = modules.get(name)
    if target is None or not name:
        raise context.error(f"layer {name!r} is not a module of the model given to qp.load (is it built from "
                            "the same class and config?)")
    build = _BUILDERS.get(kind) if isinstance(kind, str) else None
    if build is None:
        raise context.error(f"layer {name!r} has kind {kind!r}, which this qplug does not know (known: "
                            f"{', '.join(_BUILDERS)})")
    try:
        n, k = (int(v) for v in layer["shape"])
    except Exception as exc:
        raise context.error(f"layer {name!r} is malformed: {type(exc).__name__}: {exc}") from exc
    expected = _expected_shape(target, kind)
    if expected is None:
        raise context.error(f"layer {name!r} was a {kind} but the model given has a {type(target).__name__} there")
    if expected != (n, k):
        raise context.error(f"layer {name!r} has shape {(n, k)} in the file but {expected} in the model given")
    values = context.values(name)
    for field, shape in (("bias", (n,)), ("input_scale", (k,))):
        if values[field] is not None:
            context.check(values[field], shape, values[field].dtype, name, field)
    return name, build(layer, name, (n, k), values, target, context)


def _weight_only(layer: dict, name: str, shape: tuple[int, int], values: dict, target: nn.Module,
                 context: _LoadContext) -> nn.Module:
    try:
        scheme = WeightOnlyScheme.from_dict(layer["scheme"])
    except Exception as exc:
        raise context.error(f"layer {name!r} is malformed: {type(exc).__name__}: {exc}") from exc
    n, k = shape
    groups = scheme.groups(k)
    context.check(values["qweight"], (n, k if scheme.bits == 8 else (k + 1) // 2), torch.uint8, name, "qweight")
    context.check(values["scales"], (n, groups), torch.float32, name, "scales")
    if not scheme.symmetric:
        context.check(values["zero_points"], (n, groups), torch.uint8, name, "zero_points")
    weight = QuantizedWeight(scheme, (n, k), values["qweight"], values["scales"], values["zero_points"])
    padding = layer.get("padding_idx")
    padding = padding if isinstance(padding, int) else None
    if layer["kind"] == "embedding":
        return WeightOnlyEmbedding(weight, padding)
    if layer["kind"] == "embedding_bag":
        mode = layer.get("mode")
        if mode not in _BAG_MODES:
            raise context.error(f"layer {name!r} has mode {mode!r}; an embedding bag's is one of {_BAG_MODES}")
        return WeightOnlyEmbeddingBag(weight, mode, bool(layer.get("include_last_offset", False)), padding)
    # its kernel is chosen once every layer is built, with the groups that run as one call
    return WeightOnlyLinear(weight, values["bias"], values["input_scale"],
                            from_transposed=bool(layer.get("transposed", False)))


def _per_token(layer: dict, name: str, shape: tuple[int, int], values: dict, target: nn.Module,
               context: _LoadContext) -> nn.Module:
    problem = per_token_codec.weight_problem(values, shape, name)
    if problem is not None:
        raise context.error(problem)
    scale = values["weight_scale"]
    # simulated as saved unless backend= says otherwise; the GEMM is picked for this CPU again
    # (weights requantized where its exact range is narrower than the saving CPU's)
    simulate = bool(layer.get("simulated", False)) if context.backend is None else context.backend == "reference"
    if layer["kind"] == LAYER_KIND:
        return PerTokenDynamicLinear(values["weight_int8"], scale, values["bias"], simulate=simulate,
                                     shared=context.shared)
    for field in ("activation_scale", "activation_zero_point"):
        context.check(values[field], (), torch.float32, name, field)
    try:
        return StaticInt8Linear(values["weight_int8"], scale, values["bias"], float(values["activation_scale"]),
                                float(values["activation_zero_point"]), simulate=simulate)
    except ConfigValidationError as exc:
        raise context.error(f"layer {name!r}: {exc}") from exc


def _engine(layer: dict, name: str, context: _LoadContext) -> str:
    """The engine a dynamic layer of the file names, once this torch is known to run it (and to pack
    float16 weights, for a float16 layer)."""
    engine = layer.get("engine")
    if engine not in _ENGINES or engine not in torch.backends.quantized.supported_engines:
        raise context.error(f"layer {name!r} names engine {engine!r}; this torch runs "
                            f"{[e for e in torch.backends.quantized.supported_engines if e in _ENGINES]}")
    if layer.get("weight_dtype") == "float16" and not engine_capabilities(engine).fp16_dynamic_linear:
        raise context.error(f"layer {name!r} holds float16 weights, which engine {engine!r} cannot pack on torch "
                            f"{torch.__version__}")
    return engine


def _stored_weight(layer: dict, name: str, shape: tuple[int, int], values: dict, context: _LoadContext
                   ) -> StoredWeight:
    """A dynamic layer's weight matrix of ``shape`` from the file (int8 or float16), checked."""
    dtype = _WEIGHT_DTYPES.get(layer.get("weight_dtype", "qint8"))
    if dtype is None:
        raise context.error(f"layer {name!r} has weight_dtype {layer.get('weight_dtype')!r}; a dynamic layer's is "
                            f"one of {list(_WEIGHT_DTYPES)}")
    if dtype == torch.float16:
        context.check(values[_HALF_FIELD], shape, torch.float16, name, _HALF_FIELD)
        if not bool(torch.isfinite(values[_HALF_FIELD]).all()):
            raise context.error(f"layer {name!r} {_HALF_FIELD} has values that are not finite")
        return HalfWeight(values[_HALF_FIELD])
    per_channel = layer.get("per_channel")
    if not isinstance(per_channel, bool):
        raise context.error(f"layer {name!r} is malformed: per_channel {per_channel!r}")
    channels = (shape[0],) if per_channel else ()
    context.check(values["weight_int8"], shape, torch.int8, name, "weight_int8")
    context.check(values["weight_scale"], channels, torch.float64, name, "weight_scale")
    context.check(values["weight_zero_point"], channels, torch.int64, name, "weight_zero_point")
    scale = values["weight_scale"]
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise context.error(f"layer {name!r} weight_scale has values that are not finite and positive")
    return IntegerWeight(values["weight_int8"], scale, values["weight_zero_point"], per_channel)


def _reduce_range(layer: dict, name: str, engine: str, weights: list[StoredWeight], context: _LoadContext) -> bool:
    """The file's activation range for a dynamic layer, narrowed to 7 bits where ``engine``'s kernels
    would saturate their int16 pair sums with it on this CPU: a file saved where they sum in int32
    (VNNI) and loaded on an x86 CPU without VNNI would otherwise clip its sums without a word."""
    saved = bool(layer.get("reduce_range", True))
    integers = [weight for weight in weights if isinstance(weight, IntegerWeight)]
    if saved or not integers or not pair_sums_saturate(engine_arithmetic(engine)):
        return saved
    if pairs_fit(255, max(int(weight.int8.abs().max()) for weight in integers)):
        return saved
    context.narrowed.append(name)
    return True


def _warn_narrowed(source: Path, names: list[str]) -> None:
    shown = ", ".join(repr(name) for name in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    warn_user(f"qplug: {source}: {len(names)} dynamic int8 layer(s) ({shown}) were saved with 8-bit activations, "
              f"whose products the kernels here sum in int16 pairs, which can saturate ({cpu_int8().summary()}); "
              "they quantize activations to 7 bits here, so outputs differ slightly from the saving process's")


def _dynamic(layer: dict, name: str, shape: tuple[int, int], values: dict, target: nn.Module,
             context: _LoadContext) -> nn.Module:
    weight, engine = _stored_weight(layer, name, shape, values, context), _engine(layer, name, context)
    return DynamicLinear.from_stored(weight, values["bias"], engine=engine,
                                     reduce_range=_reduce_range(layer, name, engine, [weight], context))


def _dynamic_recurrent(layer: dict, name: str, shape: tuple[int, int], values: dict, target: nn.Module,
                       context: _LoadContext) -> nn.Module:
    """A dynamic LSTM / GRU / cell, for a float module of the model given with the options the file records."""
    kernel = _RECURRENT_KINDS[layer["kind"]]
    options = layer.get("options")
    expected = {option: getattr(target, option) for option in kernel.OPTIONS}
    if options != expected:
        raise context.error(f"layer {name!r} has options {options!r} in the file but {expected} in the model "
                            "given (is it built from the same class and config?)")
    if getattr(target, "proj_size", 0):
        raise context.error(f"layer {name!r} has proj_size={target.proj_size} in the model given; int8 LSTMs "
                            "have none")
    # an LSTM / GRU packs zeros for missing biases, a bias-free cell packs none
    biased = isinstance(target, nn.RNNBase) or bool(target.bias)
    weights = {}
    for matrix in dynamic_weight_names(target):
        weight = _stored_weight(layer, f"{name}.{matrix}", tuple(getattr(target, matrix).shape),
                                context.values(name, (*_INTEGER_FIELDS, _HALF_FIELD), prefix=f"{matrix}."), context)
        bias_name = matrix.replace("weight", "bias", 1)
        bias = context.values(name, (bias_name,))[bias_name]
        if biased:
            context.check(bias, (weight.shape[0],), torch.float32, name, bias_name)
        elif bias is not None:
            raise context.error(f"layer {name!r} has {bias_name} in the file but no bias in the model given")
        weights[matrix] = (weight, bias)
    engine = _engine(layer, name, context)
    reduce_range = _reduce_range(layer, name, engine, [weight for weight, _ in weights.values()], context)
    return kernel.from_stored(expected, weights, engine=engine, reduce_range=reduce_range)


#: layer kind -> builder: the only code a name in the file can reach
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    **{kind: _weight_only for kind in _WEIGHT_ONLY_KINDS}, LAYER_KIND: _per_token, STATIC_KIND: _per_token,
    DYNAMIC_KIND: _dynamic, **{kind: _dynamic_recurrent for kind in _RECURRENT_KINDS}}


def _expected_shape(module: nn.Module, kind: Any) -> tuple[int, int] | None:
    conv1d = conv1d_class()
    linear = isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))
    if kind in ("linear", LAYER_KIND, STATIC_KIND, DYNAMIC_KIND) and linear:
        return tuple(linear_weight(module).shape)  # type: ignore[return-value]
    if kind in _RECURRENT_KINDS and isinstance(module, _RECURRENT_KINDS[kind]._float_type):
        return tuple(getattr(module, dynamic_weight_names(module)[0]).shape)  # type: ignore[return-value]
    if (kind == "embedding" and isinstance(module, nn.Embedding)) or \
            (kind == "embedding_bag" and isinstance(module, nn.EmbeddingBag)):
        return tuple(module.weight.shape)  # type: ignore[return-value]
    return None


def _load_float_state(model: nn.Module, layers: list[str], tensors: dict[str, torch.Tensor],
                      tied: dict[str, str], source: Path) -> None:
    """The file's float tensors into ``model``, checked first: a file that does not fit leaves the
    model as it was (``load_state_dict`` copies what fits before it reports what does not). A
    model built on the meta device takes the file's tensors as its own."""
    state = {key[len(_FLOAT):]: value for key, value in tensors.items() if key.startswith(_FLOAT)}
    state.update({alias: state[kept] for alias, kept in tied.items()})
    own = tuple(f"{name}." for name in layers)
    with reading_state_dict():  # the keys only
        expected = model.state_dict()
    missing = [key for key in expected if key not in state and not key.startswith(own)]
    unexpected = [key for key in state if key not in expected]
    shapes = [f"{key} {tuple(value.shape)} (the model's {tuple(expected[key].shape)})"
              for key, value in state.items() if key in expected and value.shape != expected[key].shape]
    if missing or unexpected or shapes:
        raise SerializationError(f"{source} does not fit the model given to qp.load: missing "
                                 f"{missing[:5]}, unexpected {unexpected[:5]}, other shapes {shapes[:5]} (build the "
                                 "model from the same class and config; it was left unchanged)", path=str(source))
    groups = _tie_groups(meta_models.identity(model), expected, state)
    untied = next((keys for keys in groups if any(not torch.equal(state[keys[0]], state[key]) for key in keys[1:])),
                  [])
    if untied:
        raise SerializationError(f"{source} does not fit the model given to qp.load: the model holds "
                                 f"{' and '.join(untied)} as one shared tensor, but the file has different values "
                                 "for them (the saved model did not tie them): build the model with the config the "
                                 "saved one had (for a Hugging Face model, tie_word_embeddings=False); it was left "
                                 "unchanged", path=str(source))
    meta = meta_models.on_meta(model)
    if meta:
        meta_models.compute_unsaved_buffers(model, source)
        # assigned, each key takes its own tensor: the model's tied keys get one (a file holding both
        # copies would untie them)
        state.update({key: state[keys[0]] for keys in groups for key in keys[1:]})
    model.load_state_dict(state, strict=False, assign=meta)


def _tie_groups(identity: dict[str, int], expected: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The keys the file gives that the model shares one tensor between (tied weights), by tensor;
    if the file gives them different values, loading would keep one of them and the model would
    answer differently from the saved one."""
    shared: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        if key in state and key in identity and tensor.numel():
            shared.setdefault(identity[key], []).append(key)
    return [keys for keys in shared.values() if len(keys) > 1]
