"""Eager-mode convert: swap every observed module for its int8 (or simulated) version.

With a backend that has kernels, each module becomes the kernel its pattern maps to in the
backend's kernel table, built from a :class:`KernelContext` holding the float module (QAT modules
give ``to_float()``), the weight qparams (the qconfig's weight observer run on the weight, or the
QAT weight fake quant's), the output qparams (``activation_post_process``) and the input qparams
(``activation_pre_process``, see :mod:`qplug_core.eager.prepare`); where a backend rule chose
those input qparams, the kernel's input is requantized to them first. QuantStub/DeQuantStub become the
table's ``quantize``/``dequantize`` kernels and FloatFunctional a :class:`QFunctional`. Unobserved
modules (pooling, upsampling, relu) stay and run on the int8 tensors they get; upsampling and
pooling modules get them with a dense batch stride where they can need it, as lowering gives them
in graph mode (:mod:`qplug_core.eager.batch_stride`), and one whose call the backend's passthrough
check refuses runs on dequantized values (:mod:`qplug_core.eager.passthrough_checks`). The model's
call runs under the backend's engine and names the swapped layer a failure came from
(:mod:`qplug_core.eager.root_call`).

The reference backend has no kernels: modules become :class:`SimulatedOutput` (weights rounded to
the int8 grid, output quantized and dequantized) and every value stays a float tensor, so the
result runs anywhere and is the oracle for the int8 backends. With kernels, each swapped module
also gets that simulated form as its reference computation, against which
:mod:`qplug_core.eager.kernel_check` checks the converted model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from qplug_core.config import QConfig
from qplug_core.config.qconfig import remove_qconfig_attributes
from qplug_core.eager.batch_stride import keep_needed_restrides, restride
from qplug_core.eager.float_modules import guard_float_modules
from qplug_core.eager.functional import OP_PATTERNS, FloatFunctional, QFunctional
from qplug_core.eager.input_observers import INPUT_OBSERVER, observe_input, without_input_observer
from qplug_core.eager.kernel_check import Swap, check_kernels, recorded_example
from qplug_core.eager.passthrough_checks import noted_input_shapes, refusal
from qplug_core.eager.prepare import OUTPUT_OBSERVER, observe_output, require_per_module_kernels
from qplug_core.eager.root_call import own_call
from qplug_core.eager.stubs import DeQuantStub, QuantStub
from qplug_core.errors import (
    ConfigValidationError,
    ConstraintViolationError,
    ModelStateError,
    UncalibratedObserverError,
    warn_user,
)
from qplug_core.flows.regions import weight_name_of
from qplug_core.flows.tags import EAGER_CONVERTED, EAGER_INPUT_REQUANTIZED, EAGER_STATE
from qplug_core.flows.untrained import unwatch
from qplug_core.kernels._common import activation_qparams
from qplug_core.kernels.base import DEQUANTIZE_KEY, QUANTIZE_KEY, KernelContext, TensorArg
from qplug_core.kernels.layer_faults import dtype_refusal
from qplug_core.kernels.passthrough import reads_batch_stride, unsupported_passthrough_ops
from qplug_core.kernels.reference import Dequantize, Quantize, ReferenceWeighted
from qplug_core.nn.computed_weights import without_computed_weights
from qplug_core.observers import FakeQuantizeBase, ObserverBase
from qplug_core.qparams import QParams
from qplug_core.registry.backends import Backend, get_backend


class SimulatedOutput(nn.Module):
    """Runs ``module`` (or passes the input through) and rounds the output to the int8 grid."""

    def __init__(self, module: nn.Module | None, qparams: QParams) -> None:
        super().__init__()
        self.module = module
        self.quantize = Quantize(qparams)
        self.dequantize = Dequantize(qparams)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.module is None and args[0].dtype is not torch.float32:  # a stub: as the int8 quantize kernels
            raise dtype_refusal("quantize (reference form)", args[0], torch.float32)
        y = self.module(*args, **kwargs) if self.module is not None else args[0]
        return self.dequantize(self.quantize(y))


class RequantizedInput(nn.Module):
    """Runs ``kernel`` on its int8 input requantized to ``qparams``: the input qparams a backend
    rule chose, which the module producing that input does not know of in eager mode."""

    def __init__(self, kernel: nn.Module, qparams: QParams) -> None:
        super().__init__()
        self.kernel = kernel
        self.scale, self.zero_point, _ = activation_qparams(qparams, "input_qparams[0]")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a cat of one tensor requantizes it as it lies (channels_last after a conv); the table's
        # dequantize + quantize make a contiguous float copy: 10x slower, measured
        return self.kernel(torch.ops.quantized.cat([x], 1, self.scale, self.zero_point))


class DequantizedRun(nn.Module):
    """Runs ``module`` on its quantized input dequantized, and requantizes the result to the input's
    qparams: an unobserved op the engine lacks or gets wrong on quantized tensors (torch 2.13's
    qnnpack relu6 / hardtanh / clamp on channels_last ones, where graph mode keeps the reference
    form)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_quantized:
            return self.module(x)
        y = self.module(x.dequantize())
        return torch.quantize_per_tensor(y, x.q_scale(), x.q_zero_point(), x.dtype)


def _uncalibrated(model: nn.Module) -> list[str]:
    """Names of the prepare-inserted observers that never saw data."""
    missing = []
    for module in model.modules():
        if isinstance(module, (ObserverBase, FakeQuantizeBase)):
            continue
        for observer in (module._modules.get(OUTPUT_OBSERVER), module.__dict__.get(INPUT_OBSERVER)):
            inner = getattr(observer, OUTPUT_OBSERVER, observer)  # a fake quant's observer
            if isinstance(inner, ObserverBase) and not inner.has_data:
                missing.append(inner.name)
    return missing


def _float_and_weight_qparams(module: nn.Module, qconfig: QConfig
                              ) -> tuple[nn.Module, QParams | None]:
    """The float module a kernel is built from, and its weight qparams (None: unweighted)."""
    if hasattr(module, "weight_fake_quant"):
        return module.to_float(), module.weight_fake_quant.qparams()
    weight_name = weight_name_of(module)
    if weight_name is None or qconfig.weight is None:
        return module, None
    observer = qconfig.weight()
    observer(module.get_parameter(weight_name).detach())
    return module, observer.qparams()


def _clean_float(module: nn.Module) -> nn.Module:
    """A copy of an observed float module without its observers and qplug hooks."""
    clean = copy.copy(module)
    clean._modules = {k: v for k, v in module._modules.items() if k != OUTPUT_OBSERVER}
    without_input_observer(clean)
    clean.__dict__.pop(EAGER_INPUT_REQUANTIZED, None)
    clean._forward_hooks = type(module._forward_hooks)(
        (k, h) for k, h in module._forward_hooks.items() if h is not observe_output)
    clean.__dict__.pop("qconfig", None)
    return clean


def _user_hooks(source: nn.Module, target: nn.Module) -> nn.Module:
    for hook in source._forward_pre_hooks.values():
        if hook is not observe_input:
            target.register_forward_pre_hook(hook)
    for hook in source._forward_hooks.values():
        if hook is not observe_output:
            target.register_forward_hook(hook)
    return target


class _Converter:
    def __init__(self, backend: Backend, input_shapes: dict[str, set[tuple[int, ...]]]) -> None:
        self.backend = backend
        self.kernels = backend.kernels
        #: the input shapes prepare noted for passthrough modules with a check, and why a check refused one
        self.input_shapes, self.refused = input_shapes, {}
        self.unsupported = tuple(op for op in unsupported_passthrough_ops(backend.engine)
                                 if isinstance(op, type)) if backend.kernels else ()
        #: the upsampling and pooling modules given a dense batch stride (:func:`restride`)
        self.restrided: list[nn.Module] = []

    def _context(self, **fields: Any) -> KernelContext:
        return KernelContext(engine=self.backend.engine, **fields)

    def stub(self, name: str, stub: nn.Module) -> Swap:
        if isinstance(stub, DeQuantStub):
            reference: nn.Module = nn.Identity()
            return Swap(name, self._dequantize() if self.kernels else reference, reference)
        qparams = stub.activation_post_process.qparams()
        reference = SimulatedOutput(None, qparams)
        return Swap(name, self._quantize(qparams) if self.kernels else reference, reference)

    def _dequantize(self) -> nn.Module:
        return self.kernels[DEQUANTIZE_KEY].build(self._context(pattern=DEQUANTIZE_KEY, module=None, target=None))

    def _quantize(self, qparams: QParams) -> nn.Module:
        return self.kernels[QUANTIZE_KEY].build(self._context(
            pattern=QUANTIZE_KEY, module=None, target=None, output_qparams=qparams))

    def functional(self, name: str, functional: FloatFunctional) -> Swap:
        qparams = functional.activation_post_process.qparams()
        simulated = FloatFunctional()
        simulated.activation_post_process = SimulatedOutput(None, qparams)
        if not self.kernels:
            return Swap(name, simulated, simulated)
        specs = {op: self.kernels.get(pattern) for op, pattern in OP_PATTERNS.items()}
        return Swap(name, QFunctional(specs, qparams, self.backend.engine, self.backend.name), simulated)

    def in_reference_form(self, reference: nn.Module, output_qparams: QParams) -> nn.Module:
        """A module's reference computation between the backend's dequantize and quantize."""
        return nn.Sequential(self._dequantize(), reference, self._quantize(output_qparams)).eval()

    def op(self, name: str, module: nn.Module) -> Swap:
        output_qparams = module.activation_post_process.qparams()
        input_qparams = module.__dict__[INPUT_OBSERVER].qparams()
        requantized = module.__dict__.get(EAGER_INPUT_REQUANTIZED)  # a backend rule chose the input qparams
        float_module, weight_qparams = _float_and_weight_qparams(_clean_float(module), module.qconfig)
        reference: nn.Module = SimulatedOutput(
            float_module if weight_qparams is None
            else ReferenceWeighted(float_module, weight_qparams, weight_name_of(float_module)), output_qparams)
        if requantized:
            reference = nn.Sequential(SimulatedOutput(None, input_qparams), reference)
        if not self.kernels:
            return Swap(name, reference, reference)
        swap = Swap(name, reference, reference, output_qparams)
        pattern = type(float_module)
        try:
            kernel = self.kernels[pattern].build(self._context(
                pattern=pattern, module=float_module, target=None, args=(TensorArg(0),),
                input_qparams=(input_qparams,), output_qparams=output_qparams,
                weight_qparams=weight_qparams))
            swap.int8 = RequantizedInput(kernel, input_qparams) if requantized else kernel
        except ConstraintViolationError as refusal:  # the kernel cannot compute it exactly: as lowering does
            warn_user(f"qplug: backend {self.backend.name!r}: kernel {self.kernels[pattern].op} refused a "
                      f"{pattern.__name__}: {refusal}; it runs in reference form between a dequantize and "
                      "a quantize")
            swap.int8, swap.output_qparams = self.in_reference_form(reference, output_qparams), None
        return swap

    def unobserved(self, name: str, module: nn.Module) -> Swap | None:
        """Keep an unobserved module (qconfig None or not quantizable; None: look inside), which
        runs on the int8 tensors it gets, unless its passthrough check refuses a call noted at
        prepare: then it runs on dequantized values."""
        if not self.kernels:
            return None
        why = refusal(self.kernels.get(type(module)), module, self.input_shapes[name],
                      self.backend.engine) if name in self.input_shapes else ""
        if why:
            self.refused[name] = why
            run = DequantizedRun(module)
            return Swap(name, run, run)
        if reads_batch_stride(module):
            restride(module)
            self.restrided.append(module)
        return None

    def warn_refused(self) -> None:
        """One warning naming every module a passthrough check refused."""
        if self.refused:
            named = "; ".join(f"module {name!r}: {why}" for name, why in self.refused.items())
            warn_user(f"qplug: backend {self.backend.name!r} runs {len(self.refused)} module(s) in float "
                      f"between a dequantize and a quantize because their int8 kernel refused them: {named}")

    def swap(self, name: str, module: nn.Module) -> Swap | None:
        """The replacement of ``module`` (qualified ``name``), or None to keep it (and look inside)."""
        if isinstance(module, DeQuantStub):
            kept = "qconfig" in module.__dict__ and module.qconfig is None
            return None if kept else self.stub(name, module)
        if isinstance(module, self.unsupported):
            run = DequantizedRun(module)
            return Swap(name, run, run)
        if isinstance(module, (ObserverBase, FakeQuantizeBase)) or not isinstance(module._modules.get(OUTPUT_OBSERVER), (ObserverBase, FakeQuantizeBase)):
            return self.unobserved(name, module)
        if isinstance(module, QuantStub):
            return self.stub(name, module)
        if isinstance(module, FloatFunctional):
            return self.functional(name, module)
        return self.op(name, module)


def _convert_children(parent: nn.Module, converter: _Converter, prefix: str, swaps: list[Swap]) -> None:
    """Swap the modules under ``parent`` (qualified name ``prefix``), noting each in ``swaps``."""
    for name, child in list(parent.named_children()):
        swap = converter.swap(f"{prefix}{name}", child)
        if swap is None:
            _convert_children(child, converter, f"{prefix}{name}.", swaps)
            continue
        if not isinstance(swap.int8, DequantizedRun):  # the wrapped module keeps its own hooks
            _user_hooks(child, swap.int8).train(False)
        setattr(parent, name, swap.int8)
        swaps.append(swap)


def _check_quant_stub(model: nn.Module) -> None:
    """Refuse a model whose int8 modules nothing feeds int8: eager mode quantizes where a QuantStub
    says (torch.ao's own stubs count too); without one every int8 module met a float tensor at the
    first call and torch raised "Could not run 'quantized::conv2d.new' ... 'CPU'"."""
    if any(type(m).__name__ == "QuantStub" for m in model.modules()):
        return
    observed = [name for name, m in model.named_modules() if hasattr(m, "activation_post_process")]
    if observed:
        raise ModelStateError(
            f"eager mode quantizes what runs between a QuantStub and a DeQuantStub, and this model has no "
            f"QuantStub: its int8 modules ({', '.join(observed[:3])}{' ...' if len(observed) > 3 else ''}) "
            "would receive float tensors. Add the stubs to the model, wrap it as "
            "qp.eager.QuantWrapper(model), or use qp.quantize (graph mode), which places them itself")


def convert(model: nn.Module, *, backend: str | Backend | None = None,
            inplace: bool = False) -> nn.Module:
    """Observed (or QAT-trained) model -> int8 model in eval mode.

    ``backend=None`` uses the backend the model was prepared for. Raises
    :class:`UncalibratedObserverError` naming every module whose observers never saw data. The
    kernels are checked on the prepared model's first call (:mod:`qplug_core.eager.kernel_check`).
    """
    state = getattr(model, EAGER_STATE, None) if isinstance(model, nn.Module) else None
    if state is None:
        raise ConfigValidationError(
            "this model was not prepared by qplug's eager mode (no qplug_eager_state); call "
            "qp.eager.prepare or qp.eager.prepare_qat and calibrate it first", field="model")
    chosen = require_per_module_kernels(
        get_backend(backend if backend is not None else state["backend"]).require_available())
    _check_quant_stub(model)
    missing = _uncalibrated(model)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UncalibratedObserverError(
            f"{len(missing)} observer(s) never saw calibration data: {shown}. Run calibration "
            "batches through the prepared model so that every quantized module executes, or set "
            "the qconfig of the unused modules to None.", nodes=missing)
    model, inplace = without_computed_weights(model, inplace=inplace)  # QAT trained them: materialise
    model = model if inplace else copy.deepcopy(model)
    unwatch(model)
    example = recorded_example(model)
    converter, swaps = _Converter(chosen, noted_input_shapes(model)), []
    _convert_children(model, converter, "", swaps)
    converter.warn_refused()
    model.eval()  # a Dropout left in training mode would make the check's two runs differ
    if chosen.kernels:  # guarded first: the check's run names a float layer an int8 tensor reaches
        guard_float_modules(model, chosen.name)
        check_kernels(model, swaps, example, chosen, converter.in_reference_form)
        keep_needed_restrides(model, converter.restrided, example, chosen.engine)
    delattr(model, EAGER_STATE)
    setattr(model, EAGER_CONVERTED, chosen.name)  # qp.save says what to do instead of saving it
    remove_qconfig_attributes(model)
    own_call(model, {swap.name for swap in swaps}, chosen.engine if chosen.kernels else None)
    return model.eval()
