"""Clamp folding: ReLU6 / hardtanh / clamp after a conv or linear become its output range.

A clamp right after a weighted op is realised by the saturation of the op's output quantization
when the output range lies inside the clamp's bounds: for every x, ``quantize(clamp(x)) ==
quantize(x)``. So prepare observes the *clamped* value as the weighted op's output (a finer scale
than the unclamped range: ReLU6's [0, 6] instead of the conv's whole range), and convert removes the
clamp node, leaving conv -> quantize in the int8 graph, for every backend: no separate clamp kernel
(qnnpack's are wrong on channels_last tensors in torch 2.13), and ONNX Runtime fuses the group into
QLinearConv. Where the quantized range is wider than the clamp (a backend narrowed ``quant_max``, as
fbgemm does for the inputs of depthwise convs), convert keeps the clamp between two quantize ops
with the same qparams instead, which is what running the clamp as a share-qparams op gives.

A dropped clamp is recorded on the converted model (:data:`ABSORBED_CLAMPS`, see :func:`absorbed_clamps`):
the int8 layer's output is the clamped value, so ``qp.compare`` pairs it with the float value after the clamp.
So is a kept clamp whose range the layer's own quantize (its ``quant_min..quant_max``) already lies
in: fbgemm's conv before a ReLU6 before a depthwise conv outputs 0..127 with zero point 0, and
against the unclamped float conv output its negative half read as a 3 dB layer.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core import qparams as Q
from qplug_core.flows.tags import ABSORBED_CLAMPS, BOUNDARY, FOLDED_CLAMP

_RELU6_FUNCTIONS = (F.relu6,)
_HARDTANH_FUNCTIONS = (F.hardtanh, F.hardtanh_)
_CLAMP_FUNCTIONS = (torch.clamp, torch.clip)
_CLAMP_METHODS = ("clamp", "clip")
#: the clamp modules, by the qualified names torch.export writes in a node's ``nn_module_stack``
_CLAMP_MODULES = {f"{cls.__module__}.{cls.__qualname__}": cls.__name__ for cls in (nn.ReLU6, nn.Hardtanh)}


@dataclass(frozen=True)
class AbsorbedClamp:
    """A clamp the output range of the layer before it realises (convert dropped it, or kept it
    after a quantize of the same narrower range)."""

    low: float
    high: float
    #: what the float model ran: a module's class name (``ReLU6``) or the function's (``clamp``)
    op: str
    #: the clamp module's path in the float model, ``None`` for a function or method
    module: str | None

    def apply(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the float model has it after the clamp."""
        return value.clamp(self.low, self.high)


def absorbed_clamps(model: nn.Module) -> dict[str, AbsorbedClamp]:
    """Layer path -> the clamp convert folded into its output range, for a converted model."""
    meta = getattr(model, "meta", None)
    return dict(meta.get(ABSORBED_CLAMPS, {})) if isinstance(meta, dict) else {}


def _number(value: object, default: float) -> float | None:
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None  # a tensor bound: not a constant range


def clamp_bounds(node: fx.Node, modules: dict[str, nn.Module]) -> tuple[float, float] | None:
    """``(low, high)`` of a clamp-like node with constant bounds, else ``None``."""
    if node.op == "call_module":
        module = modules.get(str(node.target))
        if type(module) in (nn.ReLU6, nn.Hardtanh):
            return float(module.min_val), float(module.max_val)
        return None
    args, kwargs = node.args[1:], node.kwargs
    if node.op == "call_function" and node.target in _RELU6_FUNCTIONS:
        return 0.0, 6.0
    if node.op == "call_function" and node.target in _HARDTANH_FUNCTIONS:
        names, defaults = ("min_val", "max_val"), (-1.0, 1.0)
    elif (node.op == "call_function" and node.target in _CLAMP_FUNCTIONS) or (
            node.op == "call_method" and node.target in _CLAMP_METHODS):
        names, defaults = ("min", "max"), (-math.inf, math.inf)
    else:
        return None
    values = [kwargs.get(name, args[i] if i < len(args) else None) for i, name in enumerate(names)]
    low, high = (_number(v, d) for v, d in zip(values, defaults))
    if low is None or high is None or not low <= high:
        return None
    return low, high


def foldable_clamp(region, region_of: dict[fx.Node, object], modules: dict[str, nn.Module]
                   ) -> fx.Node | None:
    """The clamp node to fold into ``region``'s output, if the region is a static quantized
    weighted op whose only user is a clamp region of its own reading it.

    Whether the clamp region is quantized does not matter: an int8 output grid spanning the
    unclamped range (up to hundreds before a ReLU6) is far coarser than [0, 6] whatever reads the
    clamp, so a clamp left float because its reader is float is folded all the same."""
    if not (region.weighted and region.quantizes_output):
        return None
    users = list(region.anchor.users)
    if len(users) != 1 or users[0].args[:1] != (region.anchor,):
        return None
    clamp = users[0]
    clamp_region = region_of.get(clamp)
    if clamp_region is None or clamp_region.anchor is not clamp or len(clamp_region.match.nodes) != 1:
        return None
    return clamp if clamp_bounds(clamp, modules) is not None else None


def _realised_by_saturation(qp: Q.QParams, low: float, high: float, *, full_range: bool = True) -> bool:
    """Whether quantizing to ``qp``'s full dtype range (or, ``full_range=False``, to its own
    ``quant_min..quant_max``) already clamps to [low, high]."""
    if qp.axis is not None or qp.dtype not in Q.STORAGE_DTYPE:
        return False
    qmin, qmax = Q.quant_range(qp.dtype) if full_range else (qp.quant_min, qp.quant_max)
    scale, zero_point = float(qp.scale), int(qp.zero_point)
    tolerance = 0.49 * scale  # below half a step, rounding maps the bound and beyond alike
    return (qmin - zero_point) * scale >= low - tolerance and (qmax - zero_point) * scale <= high + tolerance


def fold_clamps(gm: fx.GraphModule, quantize_cls: type, dequantize_cls: type) -> None:
    """After observers became quantize/dequantize: drop each folded clamp, or (when the range is
    wider than the clamp) put a quantize/dequantize pair of the same qparams before it."""
    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
    for clamp in [n for n in gm.graph.nodes if FOLDED_CLAMP in n.meta]:
        low, high = clamp.meta.pop(FOLDED_CLAMP)
        users = list(clamp.users)
        quantize = users[0] if len(users) == 1 and users[0].op == "call_module" else None
        module = gm.get_submodule(quantize.target) if quantize is not None else None
        if not isinstance(module, quantize_cls):
            continue  # the observer was dropped (allow_uncalibrated): the clamp stays a float op
        if _realised_by_saturation(module.qparams, low, high):
            _record_absorbed(gm, clamp, low, high, calls)
            clamp.replace_all_uses_with(clamp.args[0])
            gm.graph.erase_node(clamp)
            continue
        if _realised_by_saturation(module.qparams, low, high, full_range=False):
            # kept (fbgemm's 7-bit depthwise inputs), but the layer's own quantize clamps as well
            _record_absorbed(gm, clamp, low, high, calls)
        producer = clamp.args[0]
        current = producer
        with gm.graph.inserting_before(clamp):
            for suffix, cls in (("quantize", quantize_cls), ("dequantize", dequantize_cls)):
                name = f"{producer.name}_{suffix}_before_{clamp.name}"
                gm.add_submodule(name, cls(module.qparams))
                current = gm.graph.call_module(name, args=(current,))
                current.meta.update({k: v for k, v in quantize.meta.items()})
                current.meta[BOUNDARY] = True
        clamp.replace_input_with(producer, current)


def _record_absorbed(gm: fx.GraphModule, clamp: fx.Node, low: float, high: float, calls: Counter) -> None:
    """Note on ``gm`` that the layer before ``clamp`` now outputs the clamped value; only for a layer
    module called once, the unit ``qp.compare`` hooks by name."""
    producer = clamp.args[0]
    if not (isinstance(producer, fx.Node) and producer.op == "call_module" and calls[producer.target] == 1):
        return
    if clamp.op == "call_module":
        op, module = type(gm.get_submodule(str(clamp.target))).__name__, str(clamp.target)
    else:
        op, module = _running_module(clamp) or (getattr(clamp.target, "__name__", str(clamp.target)), None)
    gm.meta.setdefault(ABSORBED_CLAMPS, {})[str(producer.target)] = AbsorbedClamp(low, high, op, module)


def _running_module(clamp: fx.Node) -> tuple[str, str] | None:
    """``(class name, path)`` of the ReLU6/Hardtanh module whose forward is the function ``clamp``
    (torch.export's graph calls ``hardtanh`` for ``self.act``), from the node's module stack; else
    None. qp.compare names the layer's float type after it and knows the float module is absorbed."""
    innermost = list((clamp.meta.get("nn_module_stack") or {}).values())[-1:]
    if not (innermost and isinstance(innermost[0], tuple) and len(innermost[0]) == 2):
        return None
    path, cls = innermost[0]
    name = _CLAMP_MODULES.get(cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}")
    return None if name is None else (name, str(path))
