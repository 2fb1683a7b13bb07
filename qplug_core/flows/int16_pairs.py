"""A post-prepare check: warn when a user's qconfig lets int16 pair sums saturate on this CPU.

The default qconfig mappings are safe by construction (``qplug_core.kernels.arithmetic``); a user
mapping with full 8-bit activations *and* weights is not, on x86 CPUs without VNNI: the kernels
silently clip pairs of products, and the kernel check at convert then keeps those layers in the
slow reference form. Saying so at prepare names the fix while it is still cheap.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from qplug_core.errors import warn_user
from qplug_core.flows.observed import observed_inputs, observed_values
from qplug_core.flows.tags import region_tag
from qplug_core.kernels.arithmetic import Int8Arithmetic, pair_sums_saturate, pairs_fit
from qplug_core.kernels.cpu import cpu_int8
from qplug_core.passes.base import PassResult


def _weight_max(qconfig) -> int | None:
    if qconfig is None or qconfig.weight is None:
        return None
    observer = qconfig.weight()
    if getattr(observer, "dtype", None) != torch.qint8:
        return None
    return max(-int(observer.quant_min), int(observer.quant_max))


def _activation_max(gm: fx.GraphModule, node: fx.Node, qconfig) -> int | None:
    observers = [found.observer for found in observed_inputs(gm, node)]
    if not observers and qconfig is not None:  # dynamic: the kernel quantizes with this range
        observers = [qconfig.activation()]
    ranges = [int(o.quant_max) for o in observers if getattr(o, "dtype", None) == torch.quint8]
    return max(ranges) if ranges else None


def saturating_layers(gm: fx.GraphModule) -> list[str]:
    """The int8 weighted layers of an observed model whose u8 x s8 pairs can exceed int16."""
    found = []
    weight_maxes: dict[int, int | None] = {}  # per qconfig: building its observer costs ~80 us
    for node in gm.graph.nodes:
        tag = region_tag(node)
        if tag is None or not (tag.is_anchor and tag.quantized and tag.weighted):
            continue
        if id(tag.qconfig) not in weight_maxes:
            weight_maxes[id(tag.qconfig)] = _weight_max(tag.qconfig)
        weight, activation = weight_maxes[id(tag.qconfig)], _activation_max(gm, node, tag.qconfig)
        if weight is not None and activation is not None and not pairs_fit(activation, weight):
            found.append(node.name)
    return found


def warn_saturating_pairs(backend: str, arithmetic: Int8Arithmetic | str
                          ) -> Callable[[fx.GraphModule], PassResult]:
    """A post-prepare pass warning (once per model) if ``backend``'s kernels would saturate here."""
    def check(gm: fx.GraphModule) -> PassResult:
        if not pair_sums_saturate(arithmetic):
            return PassResult(gm, False)
        layers = saturating_layers(gm)
        if layers:
            warn_user(f"{backend}: {cpu_int8().summary()}; its kernels: {arithmetic}; "
                      f"{len(layers)} layer(s) have full 8-bit activations and weights (e.g. "
                      f"{', '.join(layers[:3])}), whose pair sums can saturate and corrupt outputs. "
                      "Keep the backend's default qconfig mapping (7-bit weights here), or set "
                      "weight_quant_min=-64, weight_quant_max=64 or reduce_range=True.")
        return PassResult(gm, False)

    check.__name__ = "warn_saturating_pairs"
    return check


def warn_needless_reduce_range(backend: str, arithmetic: Int8Arithmetic | str, *, has_kernels: bool
                               ) -> Callable[[fx.GraphModule], PassResult]:
    """A post-prepare pass warning (once per model) about 7-bit activations (``reduce_range=True``)
    for kernels that accumulate in int32: there reduce_range guards no int16 pair sum and only
    costs a bit of every activation (3.5 dB on a MobileNetV3-style model on qnnpack), and a qconfig
    ported from fbgemm-era torch.ao code carries it without a word. A backend without kernels (the
    reference simulation) is often asked for another backend's qparams on purpose: not warned."""
    def check(gm: fx.GraphModule) -> PassResult:
        if not has_kernels or Int8Arithmetic(arithmetic) is not Int8Arithmetic.INT32:
            return PassResult(gm, False)
        seven_bit = [found.value.name for found in observed_values(gm)
                     if getattr(found.observer, "dtype", None) == torch.quint8
                     and (int(found.observer.quant_min), int(found.observer.quant_max)) == (0, 127)]
        if seven_bit:
            warn_user(f"qplug: {backend}: {len(seven_bit)} activation(s) get 7 bits, quint8 [0, 127] "
                      f"(reduce_range=True; e.g. {', '.join(seven_bit[:3])}), but its kernels accumulate in "
                      "int32 and take 8-bit activations on any CPU: the lost bit only costs accuracy. Drop "
                      "reduce_range=True from the activation observer, or use the backend's default "
                      f"qconfig mapping (qp.get_default_qconfig_mapping({backend!r})).")
        return PassResult(gm, False)

    check.__name__ = "warn_needless_reduce_range"
    return check


__all__ = ["saturating_layers", "warn_needless_reduce_range", "warn_saturating_pairs"]
