"""Whether ``recipe="auto"`` treats a model as a transformer: the evidence is attention itself.

A softmax counts only when it is fed by a product of two activations (scores of queries and keys),
not on a classifier's logits; fused attention (``scaled_dot_product_attention``,
``nn.MultiheadAttention``) counts as is; a module holding query/key/value Linears counts where the
graph is hidden (an ``nn.Module`` is read by its modules, Hugging Face's attention by its
``q_proj``/``query`` children). A CNN ending in ``nn.Softmax`` or holding a CBAM ``ChannelAttention``
stays a CNN (it got SmoothQuant and the target search, 2.2x the quantize time, s28 review F1).
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx, nn

__all__ = ["looks_like_transformer", "transformer_verdict"]

aten = torch.ops.aten
_ATEN_LAYER_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default}
_ATEN_CONVS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
               aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input}
_SOFTMAXES = {torch.softmax, torch.nn.functional.softmax, "softmax", aten._softmax.default, aten.softmax.int,
              aten._safe_softmax.default}
_PRODUCTS = {torch.matmul, operator.matmul, torch.bmm, torch.einsum, "matmul", "bmm",
             aten.matmul.default, aten.bmm.default, aten.mm.default, aten.einsum.default}
_FUSED = ("scaled_dot_product", "multi_head_attention")
#: a word of a Linear child's name that says query, key or value (q_proj, query, to_k, projection_key, qkv)
_QKV = {"q": "q", "k": "k", "v": "v", "wq": "q", "wk": "k", "wv": "v", "qk": "qk", "kv": "kv", "qkv": "qkv",
        "query": "q", "key": "k", "value": "v", "queries": "q", "keys": "k", "values": "v"}
#: convs that are no stem disqualify from this share of the weighted layers' parameters
_CONV_SHARE = 0.25

Layer = tuple[str, bool, int]  # (kind: "linear" | "conv" | "attention", patchify, parameter count)


def looks_like_transformer(model: Any) -> bool:
    """Whether ``recipe="auto"`` treats ``model`` as a transformer (:func:`transformer_verdict`)."""
    return transformer_verdict(model)[0]


def transformer_verdict(model: Any) -> tuple[bool, str]:
    """(transformer?, why in words): linear layers and LayerNorms of blocks with attention, the case
    SmoothQuant is for. Two LayerNorms and no convs count as blocks (one LayerNorm in an MLP is a
    tabular model). Convs need attention beside them and pass as a stem: a patchify conv (stride =
    kernel, ViT, Swin, CLIP) or, with attention repeated, any conv before the first attention
    (Whisper's, wav2vec2's front end, whatever its size: a parameter share flipped tiny configs).
    Convs between attention blocks disqualify from a quarter of the weighted layers' parameters.
    An ``ExportedProgram`` is read by its ATen graph, so it gets the verdict of its module."""
    params: set[str] = set()
    if isinstance(model, torch.export.ExportedProgram):
        sig = model.graph_signature
        params = {*sig.inputs_to_parameters, *sig.inputs_to_buffers, *sig.inputs_to_lifted_tensor_constants}
        model = model.graph_module
    if not isinstance(model, nn.Module):
        return False, "not an nn.Module"
    if isinstance(model, fx.GraphModule):
        layers, layer_norms = _graph_layers(model, params)
    else:
        layers, layer_norms = _module_layers(model)
    attention = sum(kind == "attention" for kind, _, _ in layers)
    if not any(kind == "linear" for kind, _, _ in layers):
        return False, "no nn.Linear"
    if not (layer_norms >= 2 or (layer_norms == 1 and attention)):
        return False, f"{layer_norms} LayerNorm(s){' beside attention' if attention else ', no attention'}"
    convs = [(patchify, size) for kind, patchify, size in layers if kind == "conv"]
    if not convs:
        return True, f"nn.Linear, {layer_norms} LayerNorm(s){', attention' if attention else ''}, no convs"
    if not attention:
        return False, f"{len(convs)} conv(s) and no attention"
    first = next(i for i, (kind, _, _) in enumerate(layers) if kind == "attention")
    stem = [patchify or (attention >= 2 and i < first) for i, (kind, patchify, _) in enumerate(layers) if kind == "conv"]
    stems = sum(stem)
    others = sum(size for is_stem, (_, size) in zip(stem, convs) if not is_stem)
    share = others / max(1, sum(size for _, _, size in layers))
    if share >= _CONV_SHARE:
        return False, f"{len(convs) - stems} conv(s) among attention holding {share:.0%} of the weighted layers' parameters"
    patchify = sum(p for p, _ in convs)
    text = (f"{stems} stem conv(s)" + (f" ({patchify} patchify conv(s))" if patchify else "")
            + (f", {len(convs) - stems} conv(s) holding {share:.0%} of the weighted layers' parameters"
               if stems < len(convs) else ""))
    return True, f"nn.Linear, {layer_norms} LayerNorm(s), attention ({attention}x), {text}"


def _module_layers(model: nn.Module) -> tuple[list[Layer], int]:
    """Layers in registration order; attention is ``nn.MultiheadAttention`` or a q/k/v holder."""
    layers: list[Layer] = []
    for m in model.modules():
        if type(m) is nn.Linear:
            layers.append(("linear", False, m.weight.numel()))
        elif isinstance(m, nn.modules.conv._ConvNd):
            layers.append(("conv", _patchify(m.kernel_size, m.stride), m.weight.numel()))
        elif isinstance(m, nn.MultiheadAttention) or _holds_qkv(m):
            layers.append(("attention", False, 0))
    return layers, sum(type(m) is nn.LayerNorm for m in model.modules())


def _holds_qkv(module: nn.Module) -> bool:
    """Two or more Linear children, named for at least two of query, key and value (or a fused qkv)."""
    linears = [name.lower() for name, child in module.named_children() if isinstance(child, nn.Linear)]
    roles = {role for name in linears for word in re.split(r"[_.]", name) for role in _QKV.get(word, "")}
    return len(linears) >= 2 and len(roles) >= 2


def _graph_layers(gm: fx.GraphModule, params: set[str]) -> tuple[list[Layer], int]:
    """Layers in graph order; attention is a fused op or a softmax of a product of two activations."""
    layers: list[Layer] = []
    layer_norms = 0
    for node in gm.graph.nodes:
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if module is not None:
            if type(module) is nn.LayerNorm:
                layer_norms += 1
            elif isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
                layers.extend(_module_layers(module)[0])
            elif isinstance(module, nn.MultiheadAttention) or (isinstance(module, nn.Softmax)
                                                               and _scores(node.args[0], gm, params)):
                layers.append(("attention", False, 0))
        elif node.op in ("call_function", "call_method"):
            if node.target in _ATEN_LAYER_NORMS:
                layer_norms += 1
            elif node.target == aten.linear.default or node.target in _ATEN_CONVS:
                layers.append(_aten_layer(node))
            elif any(word in str(node.target) for word in _FUSED) or (node.target in _SOFTMAXES
                                                                      and _scores(node.args[0], gm, params)):
                layers.append(("attention", False, 0))
    return layers, layer_norms


def _scores(value: Any, gm: fx.GraphModule, params: set[str], depth: int = 8) -> bool:
    """Whether a softmax input comes (through masks, scales and views) from a product of two activations."""
    if not isinstance(value, fx.Node) or depth == 0 or _is_layer(value) or value.op in ("placeholder", "get_attr"):
        return False
    if value.target in _PRODUCTS:
        operands = [a for a in value.args if isinstance(a, fx.Node)]
        return len(operands) >= 2 and all(_activation(a, gm, params) for a in operands[:2])
    return any(_scores(a, gm, params, depth - 1) for a in value.all_input_nodes)


def _activation(node: fx.Node, gm: fx.GraphModule, params: set[str]) -> bool:
    """Not a weight: the node, followed back through views and transposes, is no parameter."""
    for _ in range(8):
        if node.op == "get_attr" or (node.op == "placeholder" and node.name in params):
            return False
        if node.op == "placeholder" or _is_layer(node) or not node.all_input_nodes:
            return True
        node = node.all_input_nodes[0]
    return True


def _is_layer(node: fx.Node) -> bool:
    """A weighted layer: softmax scores and query/key operands are not traced back through it."""
    return node.op == "call_module" or node.target == aten.linear.default or node.target in _ATEN_CONVS


def _aten_layer(node: fx.Node) -> Layer:
    """An exported graph's ATen linear or convolution as a layer."""
    weight = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    size = weight.numel() if isinstance(weight, torch.Tensor) else 0
    if node.target == aten.linear.default:
        return "linear", False, size
    stride = node.args[3] if len(node.args) > 3 else node.kwargs.get("stride", 1)
    kernel = tuple(weight.shape[2:]) if isinstance(weight, torch.Tensor) else ()
    return "conv", _patchify(kernel, stride), size


def _patchify(kernel: Any, stride: Any) -> bool:
    """A kernel larger than one that strides by its own size: a linear on non-overlapping patches."""
    kernel = tuple(kernel)
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else (stride,) * len(kernel)
    return bool(kernel) and kernel == stride and any(k > 1 for k in kernel)
