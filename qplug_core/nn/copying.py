"""Give a captured graph its own modules and tensors without deep-copying the whole model first.

The flows never modify the float model they are given. They used to ``copy.deepcopy`` it before
capture, which costs ~250 us per module in Python's generic copier (4 s at 5,600 nodes, half of
``prepare_fx``). Capture only reads the model, and the GraphModule it returns holds the model's
leaf modules and tensors by reference (its containers are new), so copying just what the graph
shares with the model is enough: :func:`detach_from`. Plain ``torch.nn`` leaves whose attributes
are all immutable values, hook tables and tensors are copied field by field (a few us); anything
else goes through ``copy.deepcopy`` with one shared memo, so tied weights stay tied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["copy_fields", "copy_module", "detach_from", "field_copyable"]

_SCALARS = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device,
                      torch.Size, torch.qscheme})
#: where the classes are defined whose modules keep all their state in the fields checked below
_FIELD_STATE_PACKAGES = ("torch.nn.", "qplug_core.observers.")
_TENSORS = frozenset({torch.Tensor, nn.Parameter})


def _immutable(value: Any) -> bool:
    kind = type(value)
    if kind in _SCALARS:
        return True
    return kind in (tuple, frozenset) and all(_immutable(v) for v in value)


def _copy_tensor(tensor: torch.Tensor | None, memo: dict[int, Any]) -> torch.Tensor | None:
    if tensor is None:
        return None
    if id(tensor) not in memo:
        if type(tensor) not in _TENSORS:
            return copy.deepcopy(tensor, memo)
        data = tensor.detach().clone(memory_format=torch.preserve_format)
        memo[id(tensor)] = (nn.Parameter(data, tensor.requires_grad)
                            if type(tensor) is nn.Parameter else data)
    return memo[id(tensor)]


def field_copyable(module: nn.Module) -> bool:
    """A childless ``torch.nn`` module (or qplug observer) whose state is tensors, hook tables and
    immutable values: :func:`copy_module` copies it field by field."""
    if module._modules or not type(module).__module__.startswith(_FIELD_STATE_PACKAGES):
        return False
    for name, value in vars(module).items():
        kind = type(value)
        if kind in _SCALARS:
            continue
        if name in ("_parameters", "_buffers"):
            if not all(v is None or type(v) in _TENSORS for v in value.values()):
                return False
        elif isinstance(value, dict):  # hook tables: name -> callable
            if value and not all(callable(v) or _immutable(v) for v in value.values()):
                return False
        elif kind in (list, set, tuple, frozenset):
            if not all(_immutable(v) for v in value):
                return False
        else:
            return False
    return True


def copy_module(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """An independent copy of ``module``, equal to ``copy.deepcopy(module, memo)``."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    if not field_copyable(module):
        return copy.deepcopy(module, memo)
    return copy_fields(module, memo)


def copy_fields(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """:func:`copy_module` of a module already known to be :func:`field_copyable` (a caller
    copying one module many times checks it once)."""
    memo = {} if memo is None else memo
    state = {}
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers"):
            state[name] = {k: _copy_tensor(v, memo) for k, v in value.items()}
        elif isinstance(value, (dict, list, set)):
            state[name] = type(value)(value)
        else:
            state[name] = value
    new = type(module).__new__(type(module))
    new.__dict__.update(state)
    memo[id(module)] = new
    return new


def detach_from(source: nn.Module, gm: nn.Module) -> None:
    """Replace, in place, every module and tensor ``gm`` shares with ``source`` by a copy.

    Afterwards changing ``gm`` (fusing, observing, training) cannot reach ``source``: no module
    object, parameter, buffer or tensor storage is shared."""
    modules: set[int] = set()
    tensors: set[int] = set()
    storages: set[int] = set()
    for module in source.modules():  # one walk (each of parameters() and buffers() is another)
        modules.add(id(module))
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None:
                    tensors.add(id(tensor))
                    if tensor.numel():
                        storages.add(tensor.untyped_storage().data_ptr())
    memo: dict[int, Any] = {}

    def shared(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (
            id(t) in tensors or (t.numel() > 0 and t.untyped_storage().data_ptr() in storages))

    def visit(owner: nn.Module) -> None:
        for name, child in list(owner._modules.items()):
            if child is None:
                continue
            if id(child) in modules:
                owner._modules[name] = copy_module(child, memo)
            else:
                visit(child)
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if shared(tensor):
                    table[name] = _copy_tensor(tensor, memo)
        for name, value in list(vars(owner).items()):
            if shared(value):
                setattr(owner, name, _copy_tensor(value, memo))

    visit(gm)
