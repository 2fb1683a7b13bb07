"""Eager-mode prepare: give every quantizable leaf module a qconfig and observers.

Which qconfig: a ``qconfig`` attribute on a module or any ancestor wins (torch.ao's
``propagate_qconfig_``, for code migrating from ``model.qconfig = ...``); otherwise the
QConfigMapping (given, or the backend's default) decides by module name and type.

What is observed: the output of each QuantStub, FloatFunctional and each module whose pattern the
backend runs with its own output observer and a (non-passthrough) kernel — weighted modules, fused
modules, batch norm, hardswish... (the reference backend, which has no kernels, observes every such
pattern). Passthrough ops (relu, pooling, dropout) and fixed-qparams ops (sigmoid, tanh) run on the
quantized tensors unobserved, as in torch.ao.

Input qparams: eager mode does not know which module produced a module's input, so each observed
module also gets an input observer (:mod:`qplug_core.eager.input_observers`; the qconfig's
activation observer, a fake quant in QAT). When a module consumes another's output directly both
see the same tensors and agree exactly; kernels use input qparams only to check the activation
dtype and to guard the int32 bias against overflow (engines that quantize the bias). The backend's
``post_prepare`` rules tune these input observers too (:mod:`qplug_core.eager.backend_rules`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from qplug_core.config import ObservationType, QConfig, QConfigMapping
from qplug_core.config.qconfig import check_optional_qconfig
from qplug_core.config.qconfig_mapping import require_mapping
from qplug_core.eager.backend_rules import apply_post_prepare_rules
from qplug_core.eager.functional import FloatFunctional
from qplug_core.eager.input_observers import INPUT_OBSERVER, attach_input_observer
from qplug_core.eager.kernel_check import record_example
from qplug_core.eager.passthrough_checks import note_input_shapes
from qplug_core.eager.stubs import DeQuantStub, QuantStub
from qplug_core.eager.torch_ao_modules import adopt_torch_ao_modules
from qplug_core.errors import ConfigValidationError, ConstraintViolationError
from qplug_core.flows.checks import check_fake_quantizes, check_model
from qplug_core.flows.regions import QUANTIZED_DTYPES, dtype_config_problems, weight_name_of
from qplug_core.flows.tags import EAGER_STATE
from qplug_core.flows.untrained import watch_untrained
from qplug_core.nn.computed_weights import without_computed_weights
from qplug_core.observers import ObserverBase
from qplug_core.registry.backends import Backend, resolve_backend

OUTPUT_OBSERVER = "activation_post_process"
#: where the output observer holds the module's input observer (see :func:`qplug_core.observers.fake_quantize.hidden_fake_quants`)
PAIRED_INPUT_OBSERVER = "paired_input_observer"
_UNSET = object()


def observe_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the output observer (identity) or fake quant (QAT) replaces the output."""
    return module.activation_post_process(output)


def resolve_qconfigs(model: nn.Module, mapping: QConfigMapping) -> dict[str, QConfig | None]:
    """Qualified name -> qconfig: nearest ``qconfig`` attribute (self or ancestor), else mapping."""
    result: dict[str, QConfig | None] = {}

    def visit(module: nn.Module, name: str, inherited: Any) -> None:
        own = module.__dict__.get("qconfig", _UNSET)
        if own is not _UNSET:  # torch.ao's own QConfig here once left the model float, silently
            own = check_optional_qconfig(own, f"model.{name}.qconfig" if name else "model.qconfig")
        chosen = inherited if own is _UNSET else own
        result[name] = (mapping.qconfig_for_module(name, type_before_parametrizations(module))
                        if chosen is _UNSET else chosen)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, chosen)

    visit(model, "", _UNSET)
    return result


def _is_observed_pattern(module: nn.Module, name: str, qconfig: QConfig, backend: Backend) -> bool:
    """Whether ``module`` is an op the backend quantizes statically with its own output qparams;
    raises when it would be, but ``qconfig`` cannot be honoured."""
    module_type = type_before_parametrizations(module)
    config = backend.config.pattern_to_config().get(module_type)
    if config is None or config.observation_type != ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT:
        return False
    if backend.kernels:
        spec = backend.kernels.get(module_type)
        if spec is None or spec.passthrough:
            return False
    static = [dc for dc in config.dtype_configs if not dc.is_dynamic
              and dc.output_dtype in QUANTIZED_DTYPES
              and dc.output_dtype_with_constraints.scale_exact_match is None]
    if not static:
        return False
    weighted = weight_name_of(module) is not None
    problems = [dtype_config_problems(qconfig, dc, weighted) for dc in static]
    if any(not p for p in problems):
        return True
    raise ConstraintViolationError(
        f"module {name!r} ({module_type.__name__}) cannot be quantized by backend "
        f"{backend.name!r}: {'; '.join(problems[0])}. Use the backend's default qconfig mapping "
        "(qp.get_default_qconfig_mapping), or set this module's qconfig to None to keep it float "
        "(with a DeQuantStub/QuantStub around it)", field=name)


def _observer(qconfig: QConfig, name: str, role: str) -> nn.Module:
    observer = qconfig.activation()
    observer.name = f"{role} of module {name!r}"
    return observer


def _attach(module: nn.Module, name: str, qconfig: QConfig, *, with_input: bool) -> None:
    module.qconfig = qconfig
    module.add_module(OUTPUT_OBSERVER, _observer(qconfig, name, "output"))
    if isinstance(module, FloatFunctional):
        return  # its ops call activation_post_process themselves
    # prepended, as torch.ao does: a user's hook sees the module's output after it was observed
    module.register_forward_hook(observe_output, prepend=True)
    if with_input:
        observer = _observer(qconfig, name, "input")
        attach_input_observer(module, observer)
        # no child, so model.apply(torch.ao.quantization.disable_observer) would miss it; the output
        # fake quant (a child, which runs qplug's namesake) switches it with itself
        vars(module._modules[OUTPUT_OBSERVER])[PAIRED_INPUT_OBSERVER] = observer


def _plan(model: nn.Module, qconfigs: dict[str, QConfig | None], backend: Backend
          ) -> list[tuple[str, nn.Module, QConfig, bool]]:
    """(name, module, qconfig, observe input) for every module to observe, in model order."""
    plan: list[tuple[str, nn.Module, QConfig, bool]] = []

    def visit(module: nn.Module, name: str) -> None:
        qconfig = qconfigs[name]
        if isinstance(module, DeQuantStub) and qconfig is None:
            module.qconfig = None  # convert keeps it: a stub without qconfig stays as is (torch.ao)
        if isinstance(module, (ObserverBase, DeQuantStub)):
            return
        if qconfig is not None and isinstance(module, (QuantStub, FloatFunctional)):
            plan.append((name, module, qconfig, False))
            return
        if qconfig is not None and name and _is_observed_pattern(module, name, qconfig, backend):
            plan.append((name, module, qconfig, True))
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return plan


def require_per_module_kernels(backend: Backend) -> Backend:
    """``backend``, unless it compiles graphs: eager mode has no graph to hand it, and its convert
    would give the reference backend's simulated int8 (float ops, slower than float) in silence."""
    if backend.kernels or backend.delegate is None:
        return backend
    raise ConfigValidationError(
        f"backend {backend.name!r} compiles int8 graphs, and eager mode swaps modules for per-module "
        f"kernels: it has no graph to give {backend.name!r}. Quantize with graph mode for this backend "
        f"(qp.quantize(model, example_inputs, calibration_data, backend={backend.name!r}), or qp.prepare_fx "
        "and qp.convert_fx), or use eager mode with a backend that has kernels (fbgemm, qnnpack)",
        field="backend", value=backend.name)


def _prepare(model: nn.Module, qconfig_mapping: QConfigMapping | None, backend: Any,
             inplace: bool, is_qat: bool) -> nn.Module:
    check_model(model)
    if getattr(model, EAGER_STATE, None) is not None:
        raise ConfigValidationError("this model is already prepared; prepare the float model once",
                                    field="model")
    chosen = require_per_module_kernels(resolve_backend(backend))
    mode = "qat" if is_qat else "static"
    mapping = chosen.default_qconfig_mapping(mode) if qconfig_mapping is None else qconfig_mapping
    mapping = require_mapping(mapping)
    model, inplace = without_computed_weights(model, inplace=inplace, trainable=is_qat)
    model = model if inplace else copy.deepcopy(model)
    adopt_torch_ao_modules(model)
    qconfigs = resolve_qconfigs(model, mapping)
    plan = _plan(model, qconfigs, chosen)
    if is_qat:
        check_fake_quantizes([qconfig for _, _, qconfig, _ in plan], "prepare_qat")
    for name, module, qconfig, with_input in plan:
        if is_qat and with_input:
            qat_class = chosen.config.pattern_to_config()[type_before_parametrizations(module)].qat_module
            if qat_class is not None:
                module = qat_class.from_float(module, qconfig)
                model.set_submodule(name, module)
        _attach(module, name, qconfig, with_input=with_input)
    apply_post_prepare_rules([(name, module, module.__dict__[INPUT_OBSERVER]) for name, module in model.named_modules()
                              if INPUT_OBSERVER in module.__dict__], chosen, mode)
    observed = {name for name, *_ in plan}
    for name, module in model.named_modules():
        if qconfigs.get(name) is not None and name not in observed:  # it may run on int8 tensors
            note_input_shapes(module)
    setattr(model, EAGER_STATE, {"backend": chosen.name, "mode": mode})
    record_example(model)
    if is_qat:
        watch_untrained(model)
    return model.train(is_qat)


def prepare(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, *,
            backend: str | Backend | None = None, inplace: bool = False) -> nn.Module:
    """Observed copy of ``model`` (eval mode) for static post-training quantization.

    Run calibration batches through it, then :func:`convert`. ``qconfig_mapping=None`` uses the
    backend's default static mapping (``module.qconfig`` attributes take precedence).
    """
    return _prepare(model, qconfig_mapping, backend, inplace, is_qat=False)


def prepare_qat(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, *,
                backend: str | Backend | None = None, inplace: bool = False) -> nn.Module:
    """QAT copy of ``model`` (training mode): QAT modules with weight fake quant, fake-quantized
    outputs. Fuse with ``fuse_modules(..., is_qat=True)`` first to keep BatchNorm trainable."""
    return _prepare(model, qconfig_mapping, backend, inplace, is_qat=True)
