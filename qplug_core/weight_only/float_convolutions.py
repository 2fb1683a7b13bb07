"""Saying when weight-only quantization leaves most of a model's weights float.

``qp.quantize_weights`` swaps ``nn.Linear`` (and opt-in embedding tables). A CNN, a diffusion UNet
or a VAE keeps most of its weights in convolutions, which it leaves float: the result was barely
smaller (a UNet's 14 linears are 20% of its weights) and no faster, and nothing said so.
"""

from __future__ import annotations

from torch import nn

#: the share of a model's weights left float in convolutions from which the user is told
FLOAT_SHARE = 0.5

_CONVOLUTIONS = (nn.modules.conv._ConvNd,)


def float_convolutions_warning(model: nn.Module) -> str:
    """A warning ('' for none) when the convolutions of ``model`` (the float model) hold at least
    :data:`FLOAT_SHARE` of its parameters, all of them float."""
    total = sum(p.numel() for p in model.parameters())
    convs = [m for m in model.modules() if isinstance(m, _CONVOLUTIONS)]
    in_convs = sum(p.numel() for m in convs for p in m.parameters(recurse=False))
    if not total or in_convs / total < FLOAT_SHARE:
        return ""
    return (f"qplug: qp.quantize_weights quantizes nn.Linear (and embedding tables): the model's {len(convs)} "
            f"convolution(s) hold {in_convs / total:.0%} of its weights and keep them float, so it is barely "
            "smaller and no faster; qp.quantize (static int8) quantizes convolutions")
