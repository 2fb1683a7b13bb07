"""Fused float modules: containers that mark a matched subgraph (conv-bn-relu, linear-relu, ...).

They compute exactly what their children compute in sequence; their only job is to make one
pattern entry (``ConvReLU2d``) stand for several ops, so that prepare swaps them for QAT modules and
convert for one int8 kernel. Each is an ``nn.Sequential`` whose ``[0]`` is the weighted (root)
module, as in ``torch.ao.nn.intrinsic``, and validates its children's types so that a wrong fuser
method fails at fusion time with a clear error rather than at convert time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from qplug_core.errors import ConfigValidationError

__all__ = [
    "BNReLU2d", "BNReLU3d",
    "ConvAdd2d", "ConvAddReLU2d",
    "ConvBn1d", "ConvBn2d", "ConvBn3d",
    "ConvBnReLU1d", "ConvBnReLU2d", "ConvBnReLU3d",
    "ConvReLU1d", "ConvReLU2d", "ConvReLU3d",
    "FusedModule",
    "LinearBn1d", "LinearBnReLU1d", "LinearLeakyReLU", "LinearReLU", "LinearTanh",
]

CONV_BY_DIM: dict[int, type[nn.Module]] = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
BN_BY_DIM: dict[int, type[nn.Module]] = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}

_ADD_OPS: tuple[Callable[..., Any], ...] = (operator.add, torch.add)


class FusedModule(nn.Sequential):
    """Base of every fused float module; ``CHILD_TYPES`` are the exact child types in order."""

    CHILD_TYPES: ClassVar[tuple[type[nn.Module], ...]] = ()

    def __init__(self, *modules: nn.Module):
        _check_children(type(self), modules, self.CHILD_TYPES)
        super().__init__(*modules)


def _check_children(cls: type, modules: tuple[Any, ...], expected: tuple[type, ...]) -> None:
    """Exact type check (before parametrizations), the same rule the pattern matcher uses."""
    got = tuple(type_before_parametrizations(m) if isinstance(m, nn.Module) else type(m)
                for m in modules)
    if got != expected:
        want = ", ".join(t.__name__ for t in expected)
        have = ", ".join(t.__name__ for t in got)
        raise ConfigValidationError(
            f"{cls.__name__} takes ({want}) modules, got ({have}); build it from modules of exactly "
            "these types (subclasses are not accepted)", field=cls.__name__, value=got)


def _fused_class(name: str, child_types: tuple[type[nn.Module], ...]) -> type[FusedModule]:
    """One fused Sequential class; the 1d/2d/3d families below are generated from this."""
    chain = " -> ".join(t.__name__ for t in child_types)
    return type(name, (FusedModule,), {
        "CHILD_TYPES": child_types,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"Fused float module running {chain}.",
    })


ConvReLU1d, ConvReLU2d, ConvReLU3d = (
    _fused_class(f"ConvReLU{d}d", (CONV_BY_DIM[d], nn.ReLU)) for d in (1, 2, 3))
ConvBn1d, ConvBn2d, ConvBn3d = (
    _fused_class(f"ConvBn{d}d", (CONV_BY_DIM[d], BN_BY_DIM[d])) for d in (1, 2, 3))
ConvBnReLU1d, ConvBnReLU2d, ConvBnReLU3d = (
    _fused_class(f"ConvBnReLU{d}d", (CONV_BY_DIM[d], BN_BY_DIM[d], nn.ReLU)) for d in (1, 2, 3))
BNReLU2d, BNReLU3d = (_fused_class(f"BNReLU{d}d", (BN_BY_DIM[d], nn.ReLU)) for d in (2, 3))
LinearReLU = _fused_class("LinearReLU", (nn.Linear, nn.ReLU))
LinearBn1d = _fused_class("LinearBn1d", (nn.Linear, nn.BatchNorm1d))
LinearBnReLU1d = _fused_class("LinearBnReLU1d", (nn.Linear, nn.BatchNorm1d, nn.ReLU))
LinearLeakyReLU = _fused_class("LinearLeakyReLU", (nn.Linear, nn.LeakyReLU))
LinearTanh = _fused_class("LinearTanh", (nn.Linear, nn.Tanh))


class ConvAdd2d(FusedModule):
    """``conv(x1) + x2``: a ResNet tail where the residual ``x2`` is an extra input of the module.

    The add is a function (``operator.add`` or ``torch.add``), not a module, so it is kept as an
    attribute next to the Sequential's single child ``[0]`` (the conv).
    """

    def __init__(self, conv: nn.Module, add: Callable[..., Any]):
        _check_children(type(self), (conv,), (nn.Conv2d,))
        _check_add(type(self), add)
        nn.Sequential.__init__(self, conv)
        self.add = add

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.add(self[0](x1), x2)


class ConvAddReLU2d(FusedModule):
    """``relu(conv(x1) + x2)``, the ResNet block tail with its activation."""

    def __init__(self, conv: nn.Module, add: Callable[..., Any], relu: nn.Module):
        _check_children(type(self), (conv, relu), (nn.Conv2d, nn.ReLU))
        _check_add(type(self), add)
        nn.Sequential.__init__(self, conv)
        self.add = add
        self.relu = relu

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.relu(self.add(self[0](x1), x2))


def _check_add(cls: type, add: Any) -> None:
    if not any(add is op for op in _ADD_OPS):
        raise ConfigValidationError(
            f"{cls.__name__} needs the add function (operator.add or torch.add), got {add!r}",
            field="add", value=add)
