"""Dynamic quantization by module swapping: int8 (or float16) weights now, activations per call.

No tracing is involved, so any model works: every ``nn.Linear``, ``nn.LSTM``, ``nn.GRU`` and RNN
cell whose qconfig (from ``qconfig_spec``) is not None is replaced by the backend's dynamic kernel
from its kernel table. The reference backend (no kernels) gets :class:`SimulatedDynamic`, which
rounds the weights to their grid and quantizes inputs per batch with float ops.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils.parametrize import type_before_parametrizations
from torch.nn.utils.rnn import PackedSequence

from qplug_core.config import QConfig, QConfigMapping
from qplug_core.config.defaults import float16_dynamic_qconfig
from qplug_core.config.qconfig import remove_qconfig_attributes
from qplug_core.errors import (
    ConfigError,
    ConfigValidationError,
    ConstraintViolationError,
    NothingQuantizedError,
    did_you_mean,
    warn_user,
)
from qplug_core.flows.capture import capture_for_quantization
from qplug_core.flows.checks import check_float32, check_model, check_weight_values, refuse_quantized
from qplug_core.flows.pipeline import as_input_tuple
from qplug_core.flows.raise_aten import is_aten_graph
from qplug_core.flows.regions import dtype_config_problems, observer_traits
from qplug_core.flows.tags import DYNAMIC_LEFT_FLOAT
from qplug_core.ir.autocast_off import compute_in_float32
from qplug_core.kernels.base import KernelContext, SwappedLayer, TensorArg
from qplug_core.kernels.dynamic import unbatched_cell_call
from qplug_core.kernels.layer_faults import (
    ExplainedLayer,
    Fault,
    dtype_refusal,
    first_input,
    name_layers,
    wrong_dtype,
    wrong_width,
)
from qplug_core.kernels.per_token import PerTokenDynamicLinear, SharedInput
from qplug_core.kernels.reference import (
    DynamicQuantize,
    dynamic_weight_qparams,
    rounded_copy,
)
from qplug_core.kernels.weight_view import FloatWeightView
from qplug_core.nn.computed_weights import copy_model, without_computed_weights
from qplug_core.qparams import QParams
from qplug_core.registry.backends import Backend, resolve_backend
from qplug_core.registry.cpu_diagnostics import warn_if_slow_here

#: the module types dynamic quantization converts (torch.ao's default ``qconfig_spec``)
DYNAMIC_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, nn.RNNCell, nn.GRUCell)
_DTYPES = (torch.qint8, torch.float16)
#: embedding tables, which dynamic mode leaves float (it has no kernel for them)
TABLE_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
#: why a table stays float, and the ways to quantize it (the report's reason, the warning's end)
FLOAT_TABLE = ("left float: dynamic mode has no embedding kernel; qp.quantize_weights(model, "
               "embeddings=True) stores the table as 8-bit rows (weights only), as qp.quantize (static) does")


class SimulatedDynamic(ExplainedLayer, SwappedLayer):
    """Reference dynamic module: weights rounded once (int8 grid or float16), inputs quantized per
    call with per-batch min/max qparams (cells: the hidden state too, as the int8 cells do).

    Inside ``nn.LSTM``/``nn.GRU`` the recurrent states stay float (the int8 kernels quantize them
    at every step), so for those the simulation is close to the kernels but not exact.
    """

    def __init__(self, module: nn.Module, weight_qparams: dict[str, QParams | None],
                 input_quantize: DynamicQuantize | None) -> None:
        super().__init__()
        self.module = rounded_copy(module, weight_qparams)
        self.input_quantize = input_quantize

    def forward(self, x: torch.Tensor | PackedSequence, hx: Any = None) -> Any:
        data = x.data if isinstance(x, PackedSequence) else x
        if data.dtype is not torch.float32:  # the input quantize took any dtype; the float32 layer does not
            raise dtype_refusal(f"simulated dynamic {type(self.module).__name__}", data, torch.float32)
        if self.input_quantize is None:
            return self.module(x) if isinstance(self.module, nn.Linear) else self.module(x, hx)
        # a PackedSequence (which nn.LSTM / nn.GRU take) keeps its batch sizes; its data is the input
        if isinstance(x, PackedSequence):
            x = x._replace(data=self.input_quantize(x.data))
        else:
            x = self.input_quantize(x)
        if isinstance(self.module, nn.GRUCell):
            return unbatched_cell_call(self._gru_cell, x, hx)
        if hx is not None and isinstance(self.module, nn.RNNCellBase):
            hx = (self.input_quantize(hx[0]), hx[1]) if isinstance(hx, tuple) else self.input_quantize(hx)
        return self.module(x) if isinstance(self.module, nn.Linear) else self.module(x, hx)

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        x = first_input(args, kwargs, "x")
        data = x.data if isinstance(x, PackedSequence) else x
        features = self.module.in_features if isinstance(self.module, nn.Linear) else self.module.input_size
        # nn.LSTM / nn.GRU refuse another dtype in Python (ValueError), linears and cells in torch
        dtype_error = ValueError if isinstance(self.module, nn.RNNBase) else RuntimeError
        return wrong_dtype(data, torch.float32, dtype_error) or wrong_width(data, features)

    @property
    def weight(self) -> FloatWeightView:
        """A wrapped linear's rounded weight, for model code that reads it as it reads
        ``DynamicLinear.weight`` (``nn.TransformerEncoderLayer`` checks it in eval): without it such a
        model raised AttributeError at its first call. Writing to it raises ModelStateError."""
        weight = self._linear("weight").weight
        return FloatWeightView(lambda: weight.detach().clone(), tuple(weight.shape), weight.device)

    @property
    def bias(self) -> torch.Tensor | None:
        """A wrapped linear's bias (a copy), read beside ``weight``."""
        bias = self._linear("bias").bias
        return None if bias is None else bias.detach().clone()

    def _linear(self, attribute: str) -> nn.Linear:
        if not isinstance(self.module, nn.Linear):  # recurrent layers name their weights per layer
            raise AttributeError(f"{type(self).__name__} of {type(self.module).__name__} has no {attribute!r}")
        return self.module

    def _gru_cell(self, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        """nn.GRUCell's equations with only the matmul input quantized: the new state blends in
        the *float* ``h``, as the int8 cell does (quantizing ``hx`` up front would not)."""
        cell = self.module
        if h is None:
            h = torch.zeros(x.shape[0], cell.hidden_size, dtype=x.dtype)
        gi = F.linear(x, cell.weight_ih, cell.bias_ih)
        gh = F.linear(self.input_quantize(h), cell.weight_hh, cell.bias_hh)
        (i_r, i_z, i_n), (h_r, h_z, h_n) = gi.chunk(3, 1), gh.chunk(3, 1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h


def _check_supported(qconfig: QConfig, module_type: type, name: str, backend: Backend) -> None:
    """ConstraintViolationError unless one of the backend's dynamic dtype configs fits."""
    config = backend.config.pattern_to_config().get(module_type)
    dynamic = [dc for dc in (config.dtype_configs if config else []) if dc.is_dynamic]
    problems = [dtype_config_problems(qconfig, dc, True) for dc in dynamic]
    if any(not p for p in problems):
        return
    offered = ", ".join(str(dc.weight_dtype) for dc in dynamic) or "none"
    wanted = observer_traits(qconfig.weight())["dtype"] if qconfig.weight is not None else None
    if wanted is not None and all(dc.weight_dtype != wanted for dc in dynamic):
        raise ConstraintViolationError(
            f"backend {backend.name!r} has no {wanted} dynamic kernel for module {name!r} "
            f"({module_type.__name__}); its dynamic weight dtypes for this op: {offered}. Use one of "
            "them, or a backend with such a kernel (fbgemm runs float16 dynamic)", field=name)
    reason = "; ".join(problems[0]) if problems else "no dynamic dtype config"
    raise ConstraintViolationError(
        f"backend {backend.name!r} cannot quantize module {name!r} ({module_type.__name__}) "
        f"dynamically with this qconfig: {reason}. Its dynamic weight dtypes for this op: "
        f"{offered}; use one of them (or another backend, e.g. fbgemm for float16)", field=name)


def is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers' ``pytorch_utils.Conv1D``: a linear whose weight is stored (in, out)."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
            and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


def linear_from_conv1d(module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` computing what a transformers ``Conv1D`` computes."""
    weight = module.weight.detach()
    bias = getattr(module, "bias", None)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def _captured(model: Any, capture: str | None, example_inputs: Any) -> nn.Module:
    if isinstance(model, torch.export.ExportedProgram):
        model = model.module()
    elif isinstance(model, nn.Module):
        model = copy_model(model)
    inputs = None if example_inputs is None else as_input_tuple(example_inputs, model)
    return capture_for_quantization(model, inputs, level=capture or "export")


def _swap(module: nn.Module, qconfig: QConfig, backend: Backend) -> nn.Module:
    activation = qconfig.activation()
    weight_qparams = dynamic_weight_qparams(qconfig, module)
    if not backend.kernels:
        act_quantized = activation.dtype in (torch.quint8, torch.qint8)
        quantize = DynamicQuantize(activation.dtype, activation.quant_min,
                                   activation.quant_max) if act_quantized else None
        return SimulatedDynamic(module, weight_qparams, quantize)
    module_type = type_before_parametrizations(module)
    spec = backend.kernels.get(module_type)
    if spec is None or spec.build is None:
        raise ConstraintViolationError(
            f"backend {backend.name!r} has no dynamic kernel for {module_type.__name__}; leave it "
            f"out of qconfig_spec or use backend='reference'", field=module_type.__name__)
    input_qparams = QParams(torch.tensor(1.0), torch.tensor(0), activation.dtype,
                            activation.quant_min or 0, activation.quant_max or 0, is_dynamic=True)
    recurrent = {n: q for n, q in weight_qparams.items() if q is not None}
    return spec.build(KernelContext(
        pattern=module_type, module=module, target=None, args=(TensorArg(0),),
        input_qparams=(input_qparams,), engine=backend.engine,
        weight_qparams=next(iter(weight_qparams.values()), None),
        recurrent_weight_qparams=recurrent if isinstance(module, (nn.RNNBase, nn.RNNCellBase)) else None))


def _default_qconfig(dtype: torch.dtype, backend: Backend) -> QConfig:
    if dtype == torch.float16:
        return float16_dynamic_qconfig()
    return backend.default_qconfig_mapping("dynamic").qconfig_for_module("", nn.Linear)


def _as_mapping(qconfig_spec: Any, dtype: torch.dtype, backend: Backend,
                names: list[str]) -> QConfigMapping:
    """``qconfig_spec`` (None, set, dict or QConfigMapping) as a QConfigMapping, keys checked."""
    if isinstance(qconfig_spec, QConfigMapping):
        mapping = qconfig_spec
    elif qconfig_spec is None and dtype == torch.qint8:
        mapping = backend.default_qconfig_mapping("dynamic")
    else:
        if qconfig_spec is None:
            qconfig_spec = set(DYNAMIC_TYPES)
        if isinstance(qconfig_spec, (set, frozenset, list, tuple)):
            qconfig_spec = dict.fromkeys(qconfig_spec, _default_qconfig(dtype, backend))
        if not isinstance(qconfig_spec, dict):
            raise ConfigValidationError(
                f"qconfig_spec must be None, a set of module types/names, a dict {{type or name: "
                f"qconfig}} or a QConfigMapping, got {type(qconfig_spec).__name__}",
                field="qconfig_spec", value=qconfig_spec)
        mapping = QConfigMapping()
        for key, qconfig in qconfig_spec.items():
            if isinstance(key, type) and key not in DYNAMIC_TYPES:
                supported = ", ".join(t.__name__ for t in DYNAMIC_TYPES)
                raise ConfigError(f"qconfig_spec: {key.__name__} cannot be quantized dynamically; "
                                  f"supported module types: {supported}", field="qconfig_spec",
                                  value=key)
            if isinstance(key, str):
                mapping.set_module_name(key, qconfig)
            else:
                mapping.set_object_type(key, qconfig)
    for name in mapping.module_name_qconfigs:
        if name not in names:
            raise ConfigError(f"qconfig_spec names module {name!r}, which the model does not have"
                              f"{did_you_mean(name, names)}", field="qconfig_spec", value=name)
    return mapping


def _compiled(model: Any, qconfig_spec: Any, dtype: torch.dtype, backend: Backend, example_inputs: Any,
              capture: str | None, per_token: bool, allow_float: bool) -> fx.GraphModule:
    """Dynamic quantization for a backend that compiles graphs (onnxruntime): swapping modules
    would run each linear as its own compiled call with PyTorch between them, so the model is
    captured and goes through the graph flow with the dynamic mapping instead; the compiler then
    takes the whole graph (attention, norms, activations too)."""
    from qplug_core.flows.steps import convert_fx, prepare_fx

    if per_token:
        raise ConfigValidationError(f"per_token=True needs one activation scale per token; backend "
                                    f"{backend.name!r} quantizes each dynamic linear's input with one "
                                    "scale (use backend='fbgemm' for per-token)", field="per_token",
                                    value=per_token)
    if dtype != torch.qint8:
        raise ConfigValidationError(f"backend {backend.name!r} quantizes dynamically to int8 only, got "
                                    f"dtype={dtype}", field="dtype", value=dtype)
    if example_inputs is None:
        raise ConfigValidationError(
            f"backend {backend.name!r} compiles the model's graph, which needs the model captured "
            f"with example inputs: qp.quantize_dynamic(model, backend={backend.name!r}, "
            "example_inputs=(x,))", field="example_inputs")
    float_model = model.module() if isinstance(model, torch.export.ExportedProgram) else model
    names = [n for n, _ in float_model.named_modules() if n]
    mapping = _as_mapping(qconfig_spec, dtype, backend, names)
    observed = prepare_fx(model, mapping, example_inputs, backend=backend, capture=capture or "auto")
    return convert_fx(observed, allow_float=allow_float)


def _inside_attention(named: dict[str, nn.Module], name: str) -> str | None:
    """The ``nn.MultiheadAttention`` holding module ``name`` (or being it), if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        owner = ".".join(parts[:end])
        if isinstance(named.get(owner), nn.MultiheadAttention):
            return owner
    return None


def _attention_note(named: dict[str, nn.Module], name: str) -> str:
    """Why a name inside ``nn.MultiheadAttention`` converts nothing (empty for other names)."""
    owner = _inside_attention(named, name)
    if owner is None:
        return ""
    return (f": {owner!r} is an nn.MultiheadAttention, which computes with its projection weights "
            "directly (in_proj_weight, out_proj.weight), so no module swap reaches them; "
            f"{_ATTENTION_ROUTES}")


_ATTENTION_ROUTES = ("qp.quantize (static) or backend='onnxruntime' (which compiles the graph) "
                     "quantizes attention projections")


def _nothing_converted(named: dict[str, nn.Module]) -> NothingQuantizedError:
    """NothingQuantizedError naming what the model holds instead of convertible layers."""
    kinds: dict[str, int] = {}
    for module in named.values():
        if isinstance(module, nn.MultiheadAttention):
            why = f"nn.MultiheadAttention computes with its weights directly ({_ATTENTION_ROUTES})"
        elif isinstance(module, DYNAMIC_TYPES) and type(module) not in DYNAMIC_TYPES:
            if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
                continue  # an attention's out_proj: counted with its attention
            why = (f"{type(module).__name__} subclasses a convertible type; dynamic quantization "
                   "converts the exact types only, as torch.ao does")
        elif isinstance(module, nn.modules.conv._ConvNd):
            why = "convolutions have no dynamic kernels (qp.quantize quantizes them statically)"
        else:
            continue
        kinds[why] = kinds.get(why, 0) + 1
    reasons = sorted(kinds.items(), key=lambda kv: -kv[1])
    found = "; ".join(f"{why} ({n} module{'s' if n > 1 else ''})" for why, n in reasons[:3])
    return NothingQuantizedError(
        "nothing was quantized: qp.quantize_dynamic found no module it converts "
        f"({', '.join(t.__name__ for t in DYNAMIC_TYPES)}, selected by qconfig_spec)"
        + (f"; the model holds: {found}" if found else "")
        + ". Pass allow_float=True to accept the float model.", reasons=reasons)


#: fbgemm's dynamic LSTM is slower than float below this hidden size (``bench/bench_dynamic_rnn.py
#: --clock thread``, Zen 4 with VNNI: 0.25-0.96x at hidden 32-128, 1.00-1.52x at 192); its GRU is not
SLOW_LSTM_HIDDEN = 192


def _warn_float_attention(named: dict[str, nn.Module], swaps: list) -> None:
    """Say when ``nn.MultiheadAttention`` projections stay float beside converted layers."""
    attention = [n for n, m in named.items() if isinstance(m, nn.MultiheadAttention)]
    if attention:
        shown = ", ".join(repr(n) for n in attention[:3]) + (" ..." if len(attention) > 3 else "")
        warn_user(f"qp.quantize_dynamic: {len(attention)} nn.MultiheadAttention module(s) keep "
                  f"float projections ({shown}): attention computes with its weights directly, "
                  f"so no module swap reaches them; {_ATTENTION_ROUTES}")


def _warn_float_tables(named: dict[str, nn.Module]) -> None:
    """One warning when float embedding tables hold most of the model's weights (a recommendation
    model's: 99.6% of a DLRM's), as static mode warns for the layers it keeps float; the report
    alone said "100% quantized" of such a model."""
    tables = [name for name, module in named.items() if type_before_parametrizations(module) in TABLE_TYPES]
    total = sum(p.numel() for p in named[""].parameters())
    share = sum(p.numel() for name in tables for p in named[name].parameters()) / max(total, 1)
    if share > 0.5:
        shown = ", ".join(repr(n) for n in tables[:4]) + (" ..." if len(tables) > 4 else "")
        warn_user(f"qp.quantize_dynamic: {share:.1%} of the model's weights stay float, in its "
                  f"{len(tables)} embedding table(s) ({shown}): {FLOAT_TABLE.removeprefix('left float: ')}")


def _warn_slow_lstms(named: dict[str, nn.Module], replacements: list[tuple[str, nn.Module]],
                     engine: str | None) -> None:
    """Say when fbgemm's dynamic LSTM kernel is slower than the float LSTM it replaces (as qnnpack
    on x86 is told): docs read "dynamic quantization suits LSTMs", and forecasting LSTMs are small."""
    small = [f"{name or 'the model'!r} (hidden {named[name].hidden_size})" for name, _ in replacements
             if engine == "fbgemm" and type_before_parametrizations(named[name]) is nn.LSTM
             and named[name].hidden_size < SLOW_LSTM_HIDDEN]
    if small:
        shown = ", ".join(small[:3]) + (" ..." if len(small) > 3 else "")
        warn_user(f"qp.quantize_dynamic: fbgemm's dynamic int8 LSTM is slower than the float one below "
                  f"{SLOW_LSTM_HIDDEN} hidden units (0.25-0.96x at hidden 32-128, one thread): {shown}. "
                  "backend='onnxruntime' with example_inputs= runs it int8 in ONNX Runtime, 1.4-2.9x "
                  "faster than float at those sizes (docs/guide/dynamic.md, 'Speed of recurrent layers')")


def _replacements(swaps: list[tuple[str, nn.Module, QConfig]], backend: Backend, per_token: bool, *,
                  chosen_by_default: bool) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """The dynamic module for each selected one, and why each layer left float is (name -> why). A
    layer the kernel cannot take (an LSTM with ``proj_size`` on fbgemm) stays float with a warning
    when the defaults chose it, as the graph flows do; a layer the user named raises, naming it."""
    shared = SharedInput()  # q/k/v projections read one tensor: quantize it once
    replacements, left_float = [], {}
    for name, module, qconfig in swaps:
        try:
            if per_token and type_before_parametrizations(module) is nn.Linear:
                replacement = PerTokenDynamicLinear.from_float(module, simulate=not backend.kernels,
                                                               shared=shared)
            else:
                replacement = _swap(module, qconfig, backend)
        except ConstraintViolationError as error:
            layer = f"module {name!r} ({type(module).__name__})"
            if not chosen_by_default:
                raise ConstraintViolationError(
                    f"qp.quantize_dynamic cannot quantize {layer}: {error}. Leave it out of qconfig_spec "
                    f"(a dict may map {name!r} to None) or use backend='reference'", field=name) from error
            warn_user(f"qp.quantize_dynamic: {layer} stays float: {error}")
            left_float[name] = f"left float: the kernel cannot take it: {error}"
            continue
        replacements.append((name, replacement))
    return replacements, left_float


def quantize_dynamic(model: nn.Module, qconfig_spec: Any = None, dtype: torch.dtype = torch.qint8,
                     *, backend: str | Backend | None = None, inplace: bool = False,
                     capture: str | None = None, example_inputs: Any = None,
                     per_token: bool = False, allow_float: bool = False) -> nn.Module:
    """Copy of ``model`` (eval mode) with Linear/LSTM/GRU/RNN cells dynamically quantized.

    ``qconfig_spec``: None (every supported type, the backend's default dynamic qconfig — per-channel
    weights where its kernels allow — or float16 with ``dtype=torch.float16``), a set of module
    types and/or dotted names, a dict ``{type or name: qconfig or None}``, or a QConfigMapping.
    transformers' ``Conv1D`` (GPT-2's projections) counts as a Linear.

    Modules are swapped in place of the originals, so no capture is needed (``capture=None``). An
    ``ExportedProgram``, its ``.module()``, or ``capture="export"`` with ``example_inputs`` gives
    the exported graph with its ATen linears raised to ``nn.Linear`` modules, which are swapped.

    A backend that compiles graphs (onnxruntime) takes the model whole: it is captured with
    ``example_inputs`` (required there) and converted by the graph flow with the dynamic mapping
    (int8 linears as ORT's DynamicQuantizeMatMul, ``nn.LSTM`` as DynamicQuantizeLSTM, everything
    else in the same ORT sessions in float); the result can be saved.

    ``per_token=True`` gives every selected ``nn.Linear`` one activation scale per token and
    symmetric per-channel weights (:class:`~qplug_core.kernels.per_token.PerTokenDynamicLinear`:
    oneDNN's int8 linear on CPUs with VNNI, else ``torch._int_mm``; simulated in float on the
    reference backend): the accurate choice for trained transformers. Recurrent layers keep the
    backend's dynamic kernels.

    A model with nothing to convert raises :class:`NothingQuantizedError` (naming what it holds
    instead) unless ``allow_float=True``. Embedding tables stay float (listed in the report; a
    warning when they hold most of the weights). ``nn.MultiheadAttention`` computes with its weights
    directly, so module swapping leaves it float (with a warning); the graph flows quantize it.
    """
    if not isinstance(model, torch.export.ExportedProgram):  # checked here: the delegate takes it whole
        refuse_quantized(check_model(model))
    chosen = resolve_backend(backend).require_available()
    warn_if_slow_here(chosen.name, chosen.engine)
    if not chosen.kernels and chosen.delegate is not None:
        return _compiled(model, qconfig_spec, dtype, chosen, example_inputs, capture, per_token,
                         allow_float)
    if isinstance(model, torch.export.ExportedProgram) or capture is not None or is_aten_graph(model):
        model = _captured(model, capture, example_inputs)
        inplace = True
    check_float32(model)  # the dynamic kernels take float32 activations: say so now, not at the call
    model, inplace = without_computed_weights(model, inplace=inplace)
    check_weight_values(model)
    if dtype not in _DTYPES:
        raise ConfigValidationError(f"dtype must be torch.qint8 or torch.float16, got {dtype}",
                                    field="dtype", value=dtype)
    if per_token and dtype != torch.qint8:
        raise ConfigValidationError("per_token=True quantizes activations to int8; it cannot be "
                                    f"combined with dtype={dtype}", field="per_token", value=dtype)
    named = dict(model.named_modules())
    mapping = _as_mapping(qconfig_spec, dtype, chosen, [n for n in named if n])
    swaps: list[tuple[str, nn.Module, QConfig]] = []
    for name, module in named.items():
        if is_transformers_conv1d(module):
            module = linear_from_conv1d(module)
        module_type = type_before_parametrizations(module)
        qconfig = mapping.qconfig_for_module(name, module_type) if module_type in DYNAMIC_TYPES else None
        if qconfig is not None:
            _check_supported(qconfig, module_type, name, chosen)
            swaps.append((name, module, qconfig))
    for name, qconfig in mapping.module_name_qconfigs.items():
        if qconfig is not None and not any(s == name or s.startswith(name + ".") for s, _, _ in swaps):
            raise ConfigError(f"qconfig_spec names module {name!r}, but it holds nothing dynamic "
                              f"quantization converts ({', '.join(t.__name__ for t in DYNAMIC_TYPES)})"
                              + _attention_note(named, name), field="qconfig_spec", value=name)
    replacements, left_float = _replacements(swaps, chosen, per_token, chosen_by_default=qconfig_spec is None)
    if not replacements and not allow_float:
        raise _nothing_converted(named)
    _warn_float_attention(named, swaps)
    _warn_float_tables(named)
    _warn_slow_lstms(named, replacements, chosen.engine)
    result = model if inplace else copy.deepcopy(model)
    for name, why in left_float.items():  # on the result's layer: the user's model stays untouched
        result.get_submodule(name).__dict__[DYNAMIC_LEFT_FLOAT] = why
    for name, replacement in replacements:
        if not name:
            result = replacement
            break
        result.set_submodule(name, replacement)
    remove_qconfig_attributes(result)
    name_layers(result)
    return compute_in_float32(result).eval()  # the dynamic kernels take float32, autocast or not
