"""Float islands between int8 Conv1d keep the convs' channels-last layout.

A quantized Conv1d returns its 2-D conv's channels-last result squeezed to 3-D (strides
(C*L, 1, C)). The Dequantize after it made it contiguous for the float code that follows (a
transposing copy), the Quantize before the next conv quantized the contiguous float on torch's
strided path, and that conv transposed it back. Where only elementwise float ops lie between two
int8 Conv1d (Wav2Vec2's feature extractor: conv -> GELU -> conv; SiLU is an int8 op whose kernel
keeps the layout itself), nothing needs contiguity: both boundaries keep the layout (1 x 64 x 2000, fbgemm, AMD EPYC Zen 4:
dequantize 87 -> 12 us, quantize 118 -> 19 us, the next conv 248 -> 117 us; values identical).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from qplug_core.kernels.boundary import Dequantize, Quantize
from qplug_core.kernels.linear_conv import Conv1d

aten = torch.ops.aten

#: float ops that compute elementwise and return their input's layout, at both capture levels
_ELEMENTWISE = frozenset({
    F.gelu, aten.gelu.default, F.silu, aten.silu.default, F.relu, torch.relu, aten.relu.default,
    torch.sigmoid, aten.sigmoid.default, torch.tanh, aten.tanh.default, F.hardswish,
    aten.hardswish.default, F.elu, aten.elu.default, F.leaky_relu, aten.leaky_relu.default,
    F.mish, aten.mish.default,
})


def keep_conv1d_layouts(gm: fx.GraphModule) -> int:
    """Set ``keep_conv1d_layout`` on the boundaries of every such island; returns how many islands."""
    islands = 0
    for node in gm.graph.nodes:
        if _calls(gm, node, Dequantize) and node.args and _calls(gm, node.args[0], Conv1d):
            ends = _island_ends(gm, node)
            if ends and all(_calls(gm, user, Conv1d) for end in ends for user in end.users):
                for boundary in (node, *ends):
                    gm.get_submodule(str(boundary.target)).keep_conv1d_layout = True
                islands += 1
    return islands


def _calls(gm: fx.GraphModule, node: object, kind: type) -> bool:
    """Whether ``node`` calls a module of exactly ``kind`` (a plugin's own boundary is left alone)."""
    return isinstance(node, fx.Node) and node.op == "call_module" \
        and type(gm.get_submodule(str(node.target))) is kind


def _island_ends(gm: fx.GraphModule, dequantize: fx.Node) -> list[fx.Node]:
    """The Quantize calls that every path from ``dequantize`` reaches through elementwise ops of
    one input, or [] when a path reaches anything else (a ``view``, the output, a module)."""
    ends, frontier = [], list(dequantize.users)
    while frontier:
        node = frontier.pop()
        if _calls(gm, node, Quantize):
            ends.append(node)
        elif node.op == "call_function" and node.target in _ELEMENTWISE \
                and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            frontier.extend(node.users)
        else:
            return []
    return ends
