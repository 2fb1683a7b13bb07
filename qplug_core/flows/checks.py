"""Misuse of the flows caught up front, with qplug's errors instead of a crash deep inside.

Each check answers one question the flows would otherwise answer with an ``AttributeError``,
``TypeError`` or a silently wrong model: is this a model at all, is it still float, is it float32,
is this calibration data, has this model got observers, did its last calibration finish, do the
module names in the mapping exist. The flows call them with one line each.
"""

from __future__ import annotations

import collections.abc
import inspect
from typing import Any

import torch
from torch import fx, nn

from qplug_core.config import QConfig, QConfigMapping
from qplug_core.errors import (
    CalibrationError,
    ConfigValidationError,
    ModelStateError,
    did_you_mean,
    warn_user,
)
from qplug_core.flows.tags import CALIBRATION_FAILED, REPORT, STATE
from qplug_core.flows.torch_ao_models import refuse_torch_ao_models
from qplug_core.kernels._common import KernelModule
from qplug_core.kernels.base import SwappedLayer
from qplug_core.kernels.reference import Dequantize, DynamicQuantize, Quantize
from qplug_core.nn.intrinsic import FusedModule
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.fake_quantize import FakeQuantizeBase


def check_model(model: Any, field: str = "model") -> nn.Module:
    """``model`` must be an ``nn.Module`` (not ``None``, a string, a function or a class): the one
    check every public entry point taking a model runs first, so they all answer alike."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, type) and issubclass(model, nn.Module):
        hint = f"got the class {model.__name__}; pass an instance: {model.__name__}(...)"
    elif inspect.ismethod(model) and isinstance(model.__self__, nn.Module):
        hint = (f"got the method {type(model.__self__).__name__}.{model.__name__}; qp.quantize takes it (the "
                "method is captured as forward), other entry points an nn.Module whose forward calls it")
    elif callable(model):
        hint = (f"got the function {getattr(model, '__name__', model)!r}; wrap the computation in "
                "an nn.Module (or call your factory and pass the model it returns)")
    else:
        hint = f"got {model!r} ({type(model).__name__})"
    raise ConfigValidationError(f"{field} must be a torch.nn.Module: {hint}", field=field,
                                value=type(model).__name__)


_OBSERVERS = (ObserverBase, FakeQuantizeBase)
_QUANTIZED = (Quantize, Dequantize, DynamicQuantize, KernelModule, SwappedLayer)


def _modules_of(model: nn.Module, classes: tuple[type, ...]) -> list[str]:
    return [name or "<model>" for name, module in model.named_modules() if isinstance(module, classes)]


def check_preparable(model: Any) -> Any:
    """A float model (or an ExportedProgram of one): not already observed (prepared) or
    quantized (converted) by qplug."""
    if isinstance(model, torch.export.ExportedProgram):
        return model  # a program holds no qplug state: its .module() is checked at prepare
    check_model(model)
    refuse_torch_ao_models(model)
    meta = getattr(model, "meta", None) or {}
    quantized = _modules_of(model, _QUANTIZED)
    if quantized or REPORT in meta:
        raise ModelStateError(
            f"this model is already quantized (it holds {_listed(quantized) or 'a qplug report'}); "
            "quantize the original float model instead")
    if STATE in meta:  # (a float model may hold fake-quant modules: QAT modules to convert)
        raise ModelStateError(
            f"this model is already prepared (it holds observers: {_listed(_modules_of(model, _OBSERVERS))}); "
            "calibrate it with qp.calibrate and convert it with qp.convert_fx, or prepare the "
            "original float model")
    return model


def refuse_quantized(model: nn.Module) -> None:
    """Raise :class:`ModelStateError` for a model qplug already quantized (swapped layers: weight-only,
    W8A8, dynamic; or a converted graph): quantizing it again would quantize nothing, only the layers
    the first quantization kept float on purpose, or the rounded weights a second time."""
    refuse_torch_ao_models(model)
    quantized = [(name or "<model>", type(m).__name__) for name, m in model.named_modules()
                 if isinstance(m, _QUANTIZED)]
    if quantized or REPORT in (getattr(model, "meta", None) or {}):
        layers = _listed([f"{name} ({kind})" for name, kind in quantized]) or "a qplug report"
        raise ModelStateError(f"this model is already quantized (layers {layers}); quantize the original "
                              "float model")


def _listed(names: list[str]) -> str:
    if not names:
        return ""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_float32(model: nn.Module, fix: str = "quantize model.float() and calibrate with float32 inputs") -> None:
    """The int8 kernels and the reference form compute in float32: say so at prepare (or load:
    ``fix`` says what to do there), not at the first call (where quantize_per_tensor or a float32
    bias meets a float16 tensor)."""
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in tensors:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                dtype = str(tensor.dtype).removeprefix("torch.")
                raise ModelStateError(
                    f"the model's {kind} {name!r} is {dtype}; qplug quantizes float32 models: "
                    f"{fix} (the int8 model takes float32 inputs)")


def check_weight_values(model: nn.Module) -> None:
    """Weights on the meta device hold no values, and a NaN or Inf in a parameter gives garbage
    scales: name the tensors up front, instead of a capture, weight observer or kernel search
    failing later without saying which layer (or moving to the CPU, which cannot help)."""
    empty = [f"{name!r}" for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if empty:
        raise ModelStateError(
            f"the model has tensors on the meta device, which hold no values: {_listed(empty)}; "
            "materialize it first (model.to_empty(device='cpu'), then load its weights, e.g. "
            "model.load_state_dict(state_dict, assign=True)) and quantize the loaded model")
    broken = [f"{name!r} ({int((~torch.isfinite(t)).sum())} of {t.numel()})" for name, t in model.named_parameters()
              if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all())]
    if broken:
        raise ModelStateError(
            f"the model has non-finite values (NaN or Inf) in {_listed(broken)}; quantizing them gives "
            "meaningless scales: fix the model first (it was left unchanged)")


def check_calibration_data(data: Any, name: str = "calibration_data") -> None:
    """Calibration data is a tensor or an iterable of batches (a list, a DataLoader)."""
    if isinstance(data, torch.Tensor):
        return
    if isinstance(data, (str, bytes)) or not isinstance(data, collections.abc.Iterable):
        raise CalibrationError(
            f"{name} must be an iterable of batches (a list of input tuples, a DataLoader) "
            f"or a tensor, got {data!r} ({type(data).__name__})")


def check_calibratable(model: Any, data: Any) -> None:
    """``qp.calibrate`` needs a prepared model: a float one would run and change nothing."""
    check_model(model)
    refuse_torch_ao_models(model)
    check_calibration_data(data)
    prepared = STATE in (getattr(model, "meta", None) or {})  # may hold none: all ops float
    if not prepared and not _modules_of(model, _OBSERVERS):
        raise ModelStateError(
            f"this {type(model).__name__} has no observers, so calibrating it records nothing; "
            "prepare it first with qp.prepare_fx (or qp.eager.prepare) and calibrate what that "
            "returns")


def mark_calibration_failed(model: nn.Module, error: BaseException) -> None:
    """Remember that a calibration batch raised: some observers may have seen part of it."""
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict):
        meta[CALIBRATION_FAILED] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


class ConstantInputs:
    """Which float inputs of the calibration batches never varied (all zeros, say) and whose first
    observers saw only that value: int8 keeps only that value there, and every other input answers
    garbage (cosine 0.1 against float on real inputs). A constant input whose observers saw a range
    (an all-ones attention mask read only through the softmax it masks) is left alone: a padding
    mask passed later still works."""

    def __init__(self) -> None:
        self.values: dict[int, float | None] = {}  # input position -> its one value (None: it varied)

    def add(self, batch: tuple) -> None:
        for i, x in enumerate(batch):
            # a sparse input (a graph's adjacency for torch.sparse.mm) has no min/max; no observer reads it
            if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()
                    and x.layout == torch.strided):
                continue
            if i not in self.values or self.values[i] is not None:
                low, high = float(x.min()), float(x.max())
                self.values[i] = low if low == high == self.values.get(i, low) else None

    def warning(self, model: nn.Module) -> str:
        constant = {i: v for i, v in self.values.items() if v is not None and _pins_an_observer(model, i)}
        if not constant:
            return ""
        listed = ", ".join(f"input {i} (every value {v:g})" for i, v in constant.items())
        return (f"qplug: calibration saw constant float inputs: {listed}; the observers after them "
                "saw one value, so the int8 model keeps only that value there. Calibrate with "
                "representative inputs")


def _pins_an_observer(model: nn.Module, index: int) -> bool:
    """Whether an observer first reached from input ``index`` (through any ops but another
    observer) saw a single value. Without a graph to follow (an eager-mode model), assume so."""
    if not isinstance(model, fx.GraphModule):
        return True
    placeholders = [node for node in model.graph.nodes if node.op == "placeholder"]
    if index >= len(placeholders):
        return True
    modules = dict(model.named_modules())
    stack, seen = [placeholders[index]], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        module = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(module, _OBSERVERS):
            if _saw_one_value(getattr(module, "activation_post_process", module)):
                return True
            continue
        stack.extend(node.users)
    return False


def _saw_one_value(observer: nn.Module) -> bool:
    low, high = getattr(observer, "min_val", None), getattr(observer, "max_val", None)
    return (isinstance(low, torch.Tensor) and isinstance(high, torch.Tensor) and low.numel() > 0
            and low.shape == high.shape and bool(torch.isfinite(low).all()) and bool((low == high).all()))


def check_not_converted(observed: nn.Module) -> None:
    """Refuse to convert a converted model: its observers are gone, so a second convert finds
    nothing to quantize and its report would say the int8 model is float."""
    if REPORT in (getattr(observed, "meta", None) or {}):
        raise ModelStateError(
            "this model is already converted (it holds a qplug report); it is the int8 model. "
            "Convert the prepared and calibrated model it came from, or quantize the original float model")


def check_calibration_finished(observed: nn.Module) -> None:
    """Refuse to convert a model whose last calibration raised partway through a batch."""
    failure = (getattr(observed, "meta", None) or {}).get(CALIBRATION_FAILED)
    if failure:
        raise CalibrationError(
            f"a calibration of this model raised ({failure}); the observers before the failing "
            "op already saw part of that batch, so the ranges are not trustworthy. Prepare the "
            "float model again and calibrate it with batches that fit")


def warn_unknown_module_names(mapping: Any, model: nn.Module) -> None:
    """``set_module_name('fcc', ...)`` on a model without ``fcc`` would silently do nothing."""
    names = [name for name, _ in model.named_modules() if name]
    present = set(names)
    for name in _named_in_mapping(mapping):
        if name not in present:
            warn_user(f"QConfigMapping names module {name!r}, which this {type(model).__name__} does "
                      f"not have{did_you_mean(name, names)}; that setting is ignored")


def _named_in_mapping(mapping: Any) -> list[str]:
    wanted = list(mapping.module_name_qconfigs)
    wanted += [name for name, _, _ in mapping.module_name_object_type_order_qconfigs]
    return list(dict.fromkeys(wanted))


def warn_fused_away_module_names(mapping: Any, model_names: set[str], fused: nn.Module) -> None:
    """``set_module_name('layer1.relu1', None)`` on a ReLU fused into ``layer1.conv1`` is ignored (the
    fused module follows its own name's rules, as in torch.ao): say so, naming where to set it."""
    now = dict(fused.named_modules())
    for name in _named_in_mapping(mapping):
        if name not in model_names or name in now or any(n.startswith(name + ".") for n in now):
            continue
        parent = name.rpartition(".")[0]
        merged = [f"{n!r} ({type(m).__name__})" for n, m in now.items()
                  if isinstance(m, FusedModule) and n.rpartition(".")[0] == parent]
        if not merged:  # not fused away (a capture that keeps no modules, a module never called)
            continue
        warn_user(f"qplug: QConfigMapping names module {name!r}, which fusion merged into {' or '.join(merged)}; "
                  "a fused module follows the rules for its own name, so this setting is ignored: set it on "
                  "the fused module's name")


def mapping_qconfigs(mapping: QConfigMapping) -> list[QConfig]:
    """Every qconfig ``mapping`` sets; its ``None`` entries (ops kept float) are left out."""
    tables = (mapping.object_type_qconfigs, mapping.module_name_regex_qconfigs,
              mapping.module_name_qconfigs, mapping.module_name_object_type_order_qconfigs)
    qconfigs = [mapping.global_qconfig, *(qconfig for table in tables for qconfig in table.values())]
    return [qconfig for qconfig in qconfigs if qconfig is not None]


def check_fake_quantizes(qconfigs: list[QConfig], call: str) -> None:
    """QAT qconfigs must fake-quantize something: with only observers (the static mapping, which
    torch.ao takes without a word) the forward is the float model's and "QAT" trains it in float."""
    if not qconfigs or any(issubclass(factory.cls, FakeQuantizeBase)
                           for qconfig in qconfigs for factory in qconfig if factory is not None):
        return
    kinds = sorted({factory.cls.__name__ for qconfig in qconfigs for factory in qconfig if factory is not None})
    raise ConfigValidationError(
        f"{call}: the qconfigs have no FakeQuantize (they only observe, with {', '.join(kinds)}: a "
        "static mapping), so training would simulate no quantization; use "
        "qp.get_default_qconfig_mapping(backend, mode=\"qat\") or qconfigs whose activation or "
        "weight is a FakeQuantize", field="qconfig_mapping")
