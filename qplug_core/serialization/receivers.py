"""What a saved graph's attribute reads and method calls act on: checked on the object, not the name.

A name check alone lets a file reach objects that are not tensors: ``get_attr`` with the path
``fc.weight.untyped_storage`` (a bound method), ``fc._forward_hooks`` (module hooks) or
``fc.forward``; a ``call_method`` on what ``getattr(x, "device")`` returned. So the same rules
hold when a model is saved and when a file is loaded:

* a ``get_attr`` path walks submodules only (``_modules``) and ends at a parameter, a buffer, a
  plain tensor attribute or a submodule: :func:`graph_attribute`;
* a ``call_method`` or ``getattr`` acts on a graph value (never a literal), and that value is a
  tensor: a ``get_attr`` of a tensor, an input, a module or op result, or the result of a tensor
  method. Tensor methods and attributes that return other objects (``dtype``, ``device``,
  ``shape``, ``size()``, ``tolist()``, ...) give values on which only the few harmless attributes
  of :data:`OBJECT_ATTRIBUTES` may be used (``x.device.type``); the rest refuse methods entirely.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from qplug_core.config.codec import where
from qplug_core.errors import ConfigError

__all__ = ["OBJECT_ATTRIBUTES", "OBJECT_RESULTS", "check_receivers", "graph_attribute"]

_INT_RESULTS = ("const_data_ptr", "dense_dim", "dim", "element_size", "get_device", "itemsize",
                "nbytes", "ndim", "ndimension", "nelement", "numel", "output_nr", "sparse_dim",
                "storage_offset", "q_per_channel_axis")
_BOOL_RESULTS = ("allclose", "equal", "has_names", "is_complex", "is_conj", "is_contiguous", "is_cpu",
                 "is_cuda", "is_distributed", "is_floating_point", "is_inference", "is_ipu", "is_leaf",
                 "is_maia", "is_meta", "is_mkldnn", "is_mps", "is_mtia", "is_neg", "is_nested",
                 "is_nonzero", "is_pinned", "is_quantized", "is_same_size", "is_set_to", "is_shared",
                 "is_signed", "is_sparse", "is_sparse_csr", "is_vulkan", "is_xla", "is_xpu",
                 "requires_grad", "retains_grad", "volatile")
#: tensor methods and attributes whose result is not a tensor, and what it is
OBJECT_RESULTS: dict[str, str] = {
    **dict.fromkeys(_INT_RESULTS, "int"), **dict.fromkeys(_BOOL_RESULTS, "bool"),
    "dtype": "dtype", "grad_dtype": "dtype", "device": "device", "layout": "layout",
    "shape": "size", "size": "size", "names": "tuple", "dim_order": "tuple", "stride": "tuple",
    "tolist": "list", "type": "str", "item": "number", "q_scale": "number",
    "q_zero_point": "number", "qscheme": "qscheme",
}
#: what may be read or called on each kind of non-tensor value
OBJECT_ATTRIBUTES: dict[str, frozenset[str]] = {
    "dtype": frozenset({"is_floating_point", "is_complex", "is_signed", "itemsize", "to_real",
                        "to_complex"}),
    "device": frozenset({"type", "index"}),
    "size": frozenset({"numel", "count", "index"}),
}


def _fail(at: str, message: str, value: Any = None) -> None:
    raise ConfigError(f"{where(at)}: {message}", field=at, value=value)


def graph_attribute(root: nn.Module, target: str, at: str = "") -> nn.Module | torch.Tensor:
    """The module or tensor ``target`` names under ``root``, walking submodules only."""
    current: Any = root
    parts = target.split(".")
    for i, part in enumerate(parts):
        if not isinstance(current, nn.Module):
            _fail(at, f"{target!r} is not a submodule, parameter, buffer or tensor attribute of the "
                  f"model: it reads {part!r} of a {type(current).__name__}", target)
        found = next((space[part] for space in (current._modules, current._parameters,
                                                current._buffers) if part in space), None)
        if found is None and i == len(parts) - 1 and isinstance(vars(current).get(part), torch.Tensor):
            found = vars(current)[part]
        if found is None:
            _fail(at, f"{target!r} is not a submodule, parameter, buffer or tensor attribute of the "
                  "model (saved graphs may only read those)", target)
        current = found
    return current


def _value_kind(value: Any, root: nn.Module) -> str:
    """``"tensor"``, a key of :data:`OBJECT_ATTRIBUTES`, ``"module"`` or ``"other"``."""
    if not isinstance(value, fx.Node):
        return "literal"
    if value.op == "get_attr":
        found = graph_attribute(root, value.target)
        return "tensor" if isinstance(found, torch.Tensor) else "module"
    name = value.target if value.op == "call_method" else (
        value.args[1] if value.op == "call_function" and value.target is getattr and len(value.args) > 1
        else None)
    if name is not None:
        if _value_kind(value.args[0], root) != "tensor":
            return "other"
        if name == "type" and (len(value.args) > 1 or value.kwargs):  # x.type(torch.half): a tensor
            return "tensor"
        return OBJECT_RESULTS.get(name, "tensor")
    return "tensor"


def check_receivers(graph: fx.Graph, root: nn.Module, path: str = "graph") -> None:
    """Refuse attribute paths, method calls and ``getattr`` reads that do not act on tensors."""
    for i, node in enumerate(graph.nodes):
        at = f"{path}[{i}]"
        if node.op == "get_attr":
            graph_attribute(root, node.target, f"{at}.target")
            continue
        if node.op == "call_method":
            name = node.target
        elif node.op == "call_function" and node.target is getattr:
            name = node.args[1]
        else:
            continue
        if not node.args:
            _fail(f"{at}.args", f"{name!r} has no object to act on")
        kind = _value_kind(node.args[0], root)
        if kind == "tensor" or name in OBJECT_ATTRIBUTES.get(kind, ()):
            continue
        _fail(f"{at}.args[0]", f"{name!r} acts on a {kind} value ({node.args[0]!r}); saved graphs "
              "may only call tensor methods on tensors and read "
              + "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in OBJECT_ATTRIBUTES.items()), name)
