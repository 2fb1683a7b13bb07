"""Shared objects for the config tests: a stand-in observer and fusers with stable dotted names."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from qplug_core.config import register_serializable
from qplug_core.observers.factory import FactoryMixin


class FakeObserver(nn.Module, FactoryMixin):
    """An observer class with arbitrary kwargs, independent of qplug_core.observers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def fuse2(is_qat, a, b):
    return ("fused", is_qat, a, b)


def fuse3(is_qat, a, b, c):
    return ("fused", is_qat, a, b, c)


def fuse_varargs(is_qat, *modules):
    return ("fused", is_qat, *modules)


def root_getter(node_pattern):
    return node_pattern[-1]


for _obj in (FakeObserver, fuse2, fuse3, fuse_varargs, root_getter):
    register_serializable(_obj, f"qplug_tests.config.{_obj.__name__}")


def json_round_trip(obj: Any) -> Any:
    """to_dict -> JSON text -> from_dict, as a saved document would travel."""
    return type(obj).from_dict(json.loads(json.dumps(obj.to_dict(), allow_nan=False)))
