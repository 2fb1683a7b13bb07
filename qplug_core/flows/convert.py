"""Convert an observed model to the reference form: quantize -> dequantize -> float op -> quantize.

Each observer becomes a ``Quantize``/``Dequantize`` pair holding the calibrated qparams (dynamic
placeholders become ``DynamicQuantize``), each quantized weighted module becomes a
``ReferenceWeighted`` module with its weight rounded to the int8 grid (a dynamic recurrent layer a
``ReferenceRecurrent``, each weight matrix on its own grid). The result runs anywhere and is the
oracle every backend is compared with; lowering turns it into backend kernels.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from qplug_core.errors import ModelStateError, UncalibratedObserverError, spelled, warn_user
from qplug_core.flows import bias_grid
from qplug_core.flows.clamps import fold_clamps
from qplug_core.flows.prepare import is_observer_module
from qplug_core.flows.regions import QUANTIZED_DTYPES, weight_name_of
from qplug_core.flows.tags import BOUNDARY, OBSERVER, ROOT, region_tag
from qplug_core.flows.weight_bits import WeightBits
from qplug_core.kernels import int32_bias
from qplug_core.kernels.reference import (
    Dequantize,
    DynamicQuantize,
    Quantize,
    ReferenceRecurrent,
    ReferenceWeighted,
    dynamic_weight_qparams,
    observed_weight_qparams,
    weight_of,
)
from qplug_core.nn.fuser_methods import get_fuser_method
from qplug_core.nn.intrinsic import FusedModule
from qplug_core.qparams import QParams


def check_calibrated(gm: fx.GraphModule) -> list[str]:
    """Names of observers that never saw data (those that need data to give qparams)."""
    missing = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and OBSERVER in node.meta:
            observer = gm.get_submodule(node.target)
            if _needs_data(observer) and not observer.has_data and observer.name not in missing:
                missing.append(observer.name)
    return missing


def _needs_data(observer: nn.Module) -> bool:
    return observer.dtype in QUANTIZED_DTYPES and not getattr(observer, "is_dynamic", False)


def convert_graph(gm: fx.GraphModule, *, allow_uncalibrated: bool = False) -> None:
    """Turn the observed ``gm`` into the reference form, in place."""
    if gm.training and _has_qat_modules(gm):
        raise ModelStateError(
            "the QAT model is still in training mode; call model.eval() before converting so that "
            "batch norm uses its running statistics (eval mode does not stop the observers: "
            "model.apply(qp.observers.disable_observer) does)")
    missing = check_calibrated(gm)
    if missing and not allow_uncalibrated:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise UncalibratedObserverError(
            f"{len(missing)} observer(s) never saw calibration data: {shown}. "
            + spelled("Run calibration data through the prepared model (qp.calibrate) so every "
                      "branch executes, or pass allow_uncalibrated=True to leave those "
                      "activations in float.",
                      "Give --calibration batches that make every branch of the model run."),
            nodes=missing)
    _convert_weighted_modules(gm)
    _float_left_qat_modules(gm)
    _replace_observers(gm)
    fold_clamps(gm, Quantize, Dequantize)
    _delete_observer_modules(gm)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def _has_qat_modules(gm: fx.GraphModule) -> bool:
    return any(hasattr(m, "weight_fake_quant") for m in gm.modules())


def rounded_weights(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The float weights :func:`convert_graph` only reads: those of the modules it replaces by
    ``ReferenceWeighted`` ones holding rounded copies (a copy of ``gm`` to convert may share them)."""
    weights = []
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if node.op == "call_module" and node.meta.get(ROOT) and tag is not None and tag.quantized:
            module = gm.get_submodule(node.target)
            name = weight_name_of(module)
            if name is not None and not isinstance(module, ReferenceWeighted):
                weight = weight_of(module, name)
                if isinstance(weight, nn.Parameter):
                    weights.append(weight)
    return weights


def _convert_weighted_modules(gm: fx.GraphModule) -> None:
    bits = WeightBits(gm)
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if not (node.meta.get(ROOT) and tag is not None and tag.quantized):
            if node.op == "call_module":  # left float: no int8 weights for bias correction's shift
                bias_grid.restore(gm.get_submodule(node.target))
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, ReferenceWeighted):
            continue
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            gm.set_submodule(node.target, _rounded_rnn(module, tag.qconfig))
            continue
        float_module, weight_qparams = _float_module_and_weight_qparams(module, tag)
        if weight_qparams is None:
            continue
        weight_name = weight_name_of(float_module)
        if not hasattr(module, "weight_fake_quant"):
            weight_qparams = bits.weight_qparams(node, float_module, tag.qconfig,
                                                 weight_of(float_module, weight_name), weight_qparams)
            bias_grid.regrid(float_module, weight_qparams)  # bias correction's, for this grid
        weight_qparams = _int32_bias_fitted(gm, node, float_module, weight_name, weight_qparams)
        gm.set_submodule(node.target, ReferenceWeighted(float_module, weight_qparams, weight_name))


def _int32_bias_fitted(gm: fx.GraphModule, node: fx.Node, module: nn.Module, weight_name: str,
                       weight_qparams: QParams) -> QParams:
    """``weight_qparams`` with the scales raised where the layer's int32 bias would overflow in
    integer kernels (``kernels/int32_bias.py``), with a warning naming the layer: here, so that
    the reference form, the kernels and the ONNX export all compute with the same weights."""
    input_qparams = _static_input_qparams(gm, node)
    if input_qparams is None:
        return weight_qparams
    owner_path, _, _ = weight_name.rpartition(".")
    fitted, changed = int32_bias.fit_bias(module.get_submodule(owner_path), weight_qparams, input_qparams)
    if changed:
        warn_user(int32_bias.overflow_note(str(node.target), changed))
    return fitted


def _static_input_qparams(gm: fx.GraphModule, node: fx.Node) -> QParams | None:
    """The per-tensor int8 qparams the observer before ``node`` calibrated, if there is one."""
    source = node.args[0] if node.args else None
    if not (isinstance(source, fx.Node) and source.op == "call_module" and OBSERVER in source.meta):
        return None
    observer = gm.get_submodule(str(source.target))
    if getattr(observer, "is_dynamic", False) or observer.dtype not in (torch.quint8, torch.qint8) \
            or not observer.has_data:
        return None
    qparams = observer.qparams()
    return qparams if qparams.axis is None else None


def _float_left_qat_modules(gm: fx.GraphModule) -> None:
    """A QAT module outside every int8 region becomes its float module, as in torch.ao: a region
    that stays float must not keep fake-quantizing its weight (nor hold observers a file refuses)."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if hasattr(module, "weight_fake_quant") and hasattr(module, "to_float"):
                gm.set_submodule(node.target, module.to_float())


def _float_module_and_weight_qparams(module: nn.Module, tag):
    """The float module to run and its weight qparams (QAT modules supply their own fake-quant)."""
    if hasattr(module, "weight_fake_quant"):
        fake_quant = module.weight_fake_quant
        return module.to_float(), fake_quant.qparams()
    module = _fold_batch_norm(module)
    weight_name = weight_name_of(module)
    if weight_name is None or tag.qconfig is None or tag.qconfig.weight is None:
        return module, None
    return module, observed_weight_qparams(tag.qconfig, weight_of(module, weight_name))


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fold_batch_norm(module: nn.Module) -> nn.Module:
    """A float fused module that still holds a BatchNorm (ConvBn2d, LinearBn1d...) folded as in
    eval-mode fusion, so the weight is observed after folding, exactly as the kernel will run it."""
    if not (isinstance(module, FusedModule)
            and any(isinstance(child, _BATCH_NORMS) for child in module)):
        return module
    return get_fuser_method(tuple(type(child) for child in module))(False, *module)


def _rounded_rnn(module: nn.Module, qconfig) -> nn.Module:
    """The reference form of a dynamic recurrent layer: each weight matrix observed on its own and
    rounded to its grid, its qparams recorded for the kernels (a copy when weights stay float)."""
    weight_qparams = {name: qparams for name, qparams in dynamic_weight_qparams(qconfig, module).items()
                      if qparams is not None}
    return ReferenceRecurrent(module, weight_qparams) if weight_qparams else copy.deepcopy(module)


def _replace_observers(gm: fx.GraphModule) -> None:
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or OBSERVER not in node.meta:
            continue
        observer = gm.get_submodule(node.target)
        if getattr(observer, "is_dynamic", False):
            replacement = DynamicQuantize(observer.dtype, observer.quant_min or 0,
                                          255 if observer.quant_max is None else observer.quant_max)
            _replace_with_modules(gm, node, [(f"{node.target}_dynamic", replacement)])
        elif observer.dtype not in QUANTIZED_DTYPES or not observer.has_data:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        else:
            qparams = observer.qparams()
            source = node.args[0].name
            if source.startswith("_"):  # torch.fx names a non-ASCII module's node "_": no dunder name
                source = f"value{source}"
            _replace_with_modules(gm, node, [(f"{source}_quantize_{count}", Quantize(qparams)),
                                             (f"{source}_dequantize_{count}", Dequantize(qparams))])
            count += 1


def _replace_with_modules(gm: fx.GraphModule, node: fx.Node, chain: list[tuple[str, nn.Module]]) -> None:
    """Replace an observer node by a chain of new module calls on the same input."""
    current = node.args[0]
    with gm.graph.inserting_before(node):
        for name, module in chain:
            name = name.replace(".", "_")
            gm.add_submodule(name, module)
            current = gm.graph.call_module(name, args=(current,))
            current.meta.update({k: v for k, v in node.meta.items() if k != OBSERVER})
            current.meta[BOUNDARY] = True
    node.replace_all_uses_with(current)
    gm.graph.erase_node(node)


def _delete_observer_modules(gm: fx.GraphModule) -> None:
    for name, module in list(gm.named_children()):
        if is_observer_module(module):
            delattr(gm, name)

