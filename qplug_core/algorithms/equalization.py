"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", ICCV 2019, section 4.1).

Two weighted layers in a row, ``y = W2 f(W1 x + b1) + b2`` with ``f`` positive-homogeneous (ReLU,
identity), compute the same function when output channel ``i`` of layer 1 is divided by ``s_i``
and input channel ``i`` of layer 2 multiplied by it. Choosing ``s_i = sqrt(r1_i / r2_i)`` (``r``:
the channel's largest |weight|) gives both layers the same per-channel range ``sqrt(r1_i r2_i)``,
so one per-tensor weight scale fits every channel far better: this is what lets per-tensor
backends (qnnpack, ONNX Runtime's symmetric kernels) quantize MobileNet-style depthwise convs,
whose folded batch norm leaves channel ranges orders of magnitude apart.

A ReLU6 between the layers is not scale-equivariant (``min(x / s, 6) != min(x, 6) / s``); with
``relu6="rescale"`` (default) it becomes a :class:`~qplug_core.nn.channel_clamp.ChannelClamp` at
``6 / s_i`` per channel, which is exact; ``relu6="stop"`` leaves such pairs alone. Chains of three
or more layers (expand -> depthwise -> project) are equalized pair by pair until the scales settle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from qplug_core.algorithms._layers import (
    CONVS,
    POSITIVE_HOMOGENEOUS,
    input_channel_range,
    input_channels,
    layer_of,
    output_channel_range,
    output_channels,
    scale_input_channels,
    scale_output_channels,
)
from qplug_core.errors import ConfigValidationError
from qplug_core.nn.channel_clamp import ChannelClamp

__all__ = ["EqualizedPair", "equalize_cross_layer"]

_RELU6_MODES = ("rescale", "stop")


@dataclass
class EqualizedPair:
    """Two layers equalized together and the clamps between them that were rescaled."""

    first: str
    second: str
    clamps: list[str]
    range_ratio_before: float = 0.0
    range_ratio_after: float = 0.0


def _clamp_bounds(module: nn.Module) -> tuple[float, float] | None:
    """(lower, smallest upper) of a ReLU6/Hardtanh/ChannelClamp module, or None for others."""
    if isinstance(module, nn.Hardtanh):  # nn.ReLU6 is a Hardtanh(0, 6)
        return float(module.min_val), float(module.max_val)
    if isinstance(module, ChannelClamp):  # equalized before: rescale again
        return module.lower, float(module.upper.min()) if module.upper.numel() else 0.0
    return None


def _find_pairs(gm: fx.GraphModule, relu6: str) -> list[tuple[fx.Node, fx.Node, list[fx.Node]]]:
    """(producer, consumer, clamp nodes between) for every equalizable pair, in graph order.

    The path from producer to consumer may hold only positive-homogeneous modules and (when
    rescaling) ReLU6/Hardtanh with a zero lower bound, each with a single user, so no other op
    sees the rescaled channels.
    """
    pairs = []
    for node in gm.graph.nodes:
        producer = layer_of(gm, node)
        if producer is None:
            continue
        clamps, current = [], node
        while len(current.users) == 1:
            user = next(iter(current.users))
            if user.op != "call_module" or user.args[:1] != (current,):
                break
            consumer = layer_of(gm, user)
            if consumer is not None:
                if (input_channels(consumer) == output_channels(producer) and len(user.args) == 1
                        and not user.kwargs):
                    pairs.append((node, user, clamps))
                break
            module = gm.get_submodule(user.target)
            bounds = _clamp_bounds(module)
            if bounds is not None and relu6 == "rescale" and bounds[0] == 0.0 and bounds[1] > 0:
                clamps = [*clamps, user]
            elif not isinstance(module, POSITIVE_HOMOGENEOUS) or bounds is not None:
                break
            current = user
    return pairs


def _ratio(ranges: torch.Tensor) -> float:
    """Largest over smallest nonzero channel range: how badly one per-tensor scale fits."""
    nonzero = ranges[ranges > 0]
    return float(nonzero.max() / nonzero.min()) if nonzero.numel() else 1.0


def _equalize_once(first: nn.Module, second: nn.Module) -> tuple[torch.Tensor, float]:
    r1, r2 = output_channel_range(first), input_channel_range(second)
    usable = (r1 > 0) & (r2 > 0)
    scale = torch.where(usable, torch.sqrt(r1 / torch.where(usable, r2, 1.0)), torch.ones_like(r1))
    scale_output_channels(first, 1.0 / scale)
    scale_input_channels(second, scale)
    return scale, float((scale - 1).abs().max()) if scale.numel() else 0.0


def _rescale_clamps(gm: fx.GraphModule, clamps: list[fx.Node], scale: torch.Tensor,
                    channel_dim: int) -> None:
    """Divide each clamp's upper bound by the channel scale (ReLU6 -> ChannelClamp on first use)."""
    for node in clamps:
        module = gm.get_submodule(node.target)
        if not isinstance(module, ChannelClamp):
            low, high = _clamp_bounds(module)
            module = ChannelClamp(torch.full_like(scale, high), lower=low, channel_dim=channel_dim)
            gm.set_submodule(node.target, module)
        module.to(scale.dtype).upper.div_(scale)


def equalize_cross_layer(gm: fx.GraphModule, *, relu6: str = "rescale",
                         max_iterations: int = 50, tolerance: float = 1e-2) -> list[EqualizedPair]:
    """Equalize every conv/linear pair of a *fused float* graph in place; the function is unchanged.

    ``gm`` is what :func:`qp.fuse_fx <qplug_core.fuse_fx>` returns (batch norm folded into the
    convs). Returns the pairs equalized, with the worst-to-best channel range ratio of each
    pair's first layer before and after. Chains are swept until no scale moves by more than
    ``tolerance`` (relative) or ``max_iterations`` sweeps.
    """
    if relu6 not in _RELU6_MODES:
        raise ConfigValidationError(f"relu6 must be one of {_RELU6_MODES}, got {relu6!r}",
                                    field="relu6", value=relu6)
    if not isinstance(gm, fx.GraphModule):
        raise ConfigValidationError(
            f"equalize_cross_layer needs the fused float graph (qp.fuse_fx(model, example_inputs, "
            f"backend=...)), got {type(gm).__name__}", field="gm", value=type(gm).__name__)
    found = _find_pairs(gm, relu6)
    pairs = [EqualizedPair(first.target, second.target, [c.target for c in clamps],
                           range_ratio_before=_ratio(output_channel_range(layer_of(gm, first))))
             for first, second, clamps in found]
    layers = {id(m): m for first, second, _ in found for m in (layer_of(gm, first), layer_of(gm, second))}
    dtypes = {key: layer.weight.dtype for key, layer in layers.items()}
    with torch.no_grad():
        for layer in layers.values():  # iterate in float64: the float32 weights are rounded once
            layer.double()
        for _ in range(max_iterations):
            change = 0.0
            for first, second, clamps in found:
                producer = layer_of(gm, first)
                scale, moved = _equalize_once(producer, layer_of(gm, second))
                _rescale_clamps(gm, clamps, scale, 1 if isinstance(producer, CONVS) else -1)
                change = max(change, moved)
            if change < tolerance:
                break
        for key, layer in layers.items():
            layer.to(dtypes[key])
        for _, _, clamps in found:
            for node in clamps:
                gm.get_submodule(node.target).float()
    for pair, (first, _, _) in zip(pairs, found):
        pair.range_ratio_after = _ratio(output_channel_range(layer_of(gm, first)))
    gm.recompile()
    return pairs
