"""QConfig: which observers to build for a layer's activation and weight.

Kept as a namedtuple of observer *factories* (torch.ao's shape, so ``qconfig.activation()`` and
``act, weight = qconfig`` keep working), but the factories are plain data, so a qconfig compares by
value and round-trips through JSON.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from qplug_core.config.codec import (
    child,
    decode_factory,
    encode_factory,
    read_fields,
    unversioned,
    versioned,
    where,
)
from qplug_core.errors import ConfigValidationError
from qplug_core.observers.factory import ObserverFactory

__all__ = ["QConfig"]

ACTIVATION_KEY = "activation"
WEIGHT_KEY = "weight"


def _as_factory(value: Any, path: str, *, optional: bool) -> ObserverFactory | None:
    if value is None and optional:
        return value
    if isinstance(value, (ObserverFactory, type)):
        factory = value if isinstance(value, ObserverFactory) else ObserverFactory(value)
        factory.check_acyclic(path)
        factory.check_builds(path)
        return factory
    if value is None:
        raise ConfigValidationError(
            f"{path} is required; use PlaceholderObserver.with_args(dtype=torch.float) for "
            "activations that stay float", field=path, value=value)
    name = type(value).__name__
    if hasattr(value, "forward"):
        fix = (f"got an observer instance {name}(...); pass the class or a factory: "
               f"{name}.with_args(...)")
    elif callable(value):
        fix = (f"got {value!r}; pass an observer class or Observer.with_args(...) "
               "(functools.partial and lambdas cannot be saved)")
    else:
        fix = f"expected an observer class or Observer.with_args(...), got {value!r} ({name})"
    raise ConfigValidationError(f"{path}: {fix}", field=path, value=value)


class QConfig(namedtuple("QConfig", [ACTIVATION_KEY, WEIGHT_KEY])):
    """Observer factories for activations (required) and weights (``None``: weight not observed).

    Each argument is an observer class or what ``Observer.with_args(...)`` returns; a class is
    wrapped into an ``ObserverFactory`` so equal configs compare equal however they were written.
    """

    __slots__ = ()

    def __new__(cls, activation: Any, weight: Any = None) -> QConfig:
        return cls._at("QConfig", activation, weight)

    @classmethod
    def _at(cls, path: str, activation: Any, weight: Any) -> QConfig:
        return super().__new__(cls, _as_factory(activation, child(path, ACTIVATION_KEY), optional=False),
                               _as_factory(weight, child(path, WEIGHT_KEY), optional=True))

    def to_data(self, path: str = "") -> dict[str, Any]:
        for key, factory in ((ACTIVATION_KEY, self.activation), (WEIGHT_KEY, self.weight)):
            if factory is not None:  # kwargs may have been edited into a cycle since construction
                factory.check_acyclic(child(path, key))
        return {ACTIVATION_KEY: encode_factory(self.activation, child(path, ACTIVATION_KEY)),
                WEIGHT_KEY: None if self.weight is None
                else encode_factory(self.weight, child(path, WEIGHT_KEY))}

    @classmethod
    def from_data(cls, doc: Any, path: str) -> QConfig:
        read_fields(doc, path, (ACTIVATION_KEY, WEIGHT_KEY), required=(ACTIVATION_KEY,))
        weight = doc.get(WEIGHT_KEY)
        return cls._at(path, decode_factory(doc[ACTIVATION_KEY], child(path, ACTIVATION_KEY)),
                       None if weight is None else decode_factory(weight, child(path, WEIGHT_KEY)))

    def to_dict(self) -> dict[str, Any]:
        return versioned(self.to_data())

    @classmethod
    def from_dict(cls, doc: Any) -> QConfig:
        return cls.from_data(unversioned(doc), "")

    def __repr__(self) -> str:
        return f"QConfig(activation={self.activation!r}, weight={self.weight!r})"


def encode_optional_qconfig(qconfig: QConfig | None, path: str) -> dict[str, Any] | None:
    """``None`` (do not quantize) stays ``null`` in documents."""
    return None if qconfig is None else qconfig.to_data(path)


def decode_optional_qconfig(doc: Any, path: str) -> QConfig | None:
    return None if doc is None else QConfig.from_data(doc, path)


def check_optional_qconfig(value: Any, path: str) -> QConfig | None:
    if value is None or isinstance(value, QConfig):
        return value
    if from_torch_ao(value):
        raise ConfigValidationError(f"{where(path)} must be qplug's QConfig or None, got {from_torch_ao(value)}",
                                    field=path, value=type(value).__name__)
    raise ConfigValidationError(f"{where(path)} must be a QConfig or None (do not quantize), got "
                                f"{value!r}; build one with QConfig(activation=..., weight=...)",
                                field=path, value=value)


def from_torch_ao(value: Any) -> str:
    """For a torch.ao config object given where qplug's is expected, what it is and what to use (the
    two share class names, so "must be a QConfig, got QConfig" said nothing); else ``""``."""
    cls = type(value)
    if not cls.__module__.startswith("torch.ao."):
        return ""
    return (f"torch.ao's {cls.__module__}.{cls.__qualname__}: qplug takes its own (qp.{cls.__name__}, with "
            "observers from qplug_core.observers, or qp.get_default_qconfig_mapping(backend)); "
            "docs/migrating.md maps each torch.ao name to qplug's")


def remove_qconfig_attributes(model: Any) -> None:
    """Delete every module's ``qconfig`` attribute, as torch.ao's convert and quantize_dynamic do:
    a converted model carries none, so a later prepare cannot pick up stale per-module qconfigs."""
    for module in model.modules():
        module.__dict__.pop("qconfig", None)
