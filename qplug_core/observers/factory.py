"""Serializable observer constructors (what ``Observer.with_args(...)`` returns)."""

from __future__ import annotations

from typing import Any


class ObserverFactory:
    """A class plus keyword arguments; calling it builds a fresh observer/fake-quant module.

    Unlike ``functools.partial`` it is plain data: ``cls`` and ``kwargs`` are public so that
    configs can serialise it to JSON (dotted class name + kwargs) and compare it by value.
    """

    def __init__(self, cls: type, kwargs: dict[str, Any] | None = None):
        self.cls = cls
        self.kwargs = dict(kwargs or {})

    def __call__(self, **overrides: Any):
        return self.cls(**{**self.kwargs, **overrides})

    def with_args(self, **kwargs: Any) -> "ObserverFactory":
        return ObserverFactory(self.cls, {**self.kwargs, **kwargs})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObserverFactory) and (self.cls, self.kwargs) == (other.cls, other.kwargs)

    def __hash__(self) -> int:
        return hash((self.cls, tuple(sorted((k, repr(v)) for k, v in self.kwargs.items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.cls.__name__}.with_args({args})"


class FactoryMixin:
    """Gives a module class the torch.ao-style ``with_args`` classmethod."""

    @classmethod
    def with_args(cls, **kwargs: Any) -> ObserverFactory:
        return ObserverFactory(cls, kwargs)
