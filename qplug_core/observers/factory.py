"""Serializable observer constructors (what ``Observer.with_args(...)`` returns)."""

from __future__ import annotations

from typing import Any

from qplug_core.errors import ConfigError, ConfigValidationError


class ObserverFactory:
    """A class plus keyword arguments; calling it builds a fresh observer/fake-quant module.

    Unlike ``functools.partial`` it is plain data: ``cls`` and ``kwargs`` are public so that
    configs can serialise it to JSON (dotted class name + kwargs) and compare it by value.
    """

    def __init__(self, cls: type, kwargs: dict[str, Any] | None = None):
        self.cls = cls
        self.kwargs = dict(kwargs or {})
        self.check_acyclic(f"{getattr(cls, '__name__', cls)}.with_args")

    def check_acyclic(self, path: str) -> None:
        """Refuse keyword arguments that contain themselves: they cannot be copied, compared or
        saved (``to_dict`` would recurse forever)."""
        _check_acyclic(self.kwargs, path, [])

    def check_builds(self, path: str) -> None:
        """Build one observer now, so that arguments of the wrong type are reported where the
        config is made (or read from a document), not as a TypeError deep inside ``prepare``."""
        try:
            self()
        except ConfigError as exc:
            raise ConfigValidationError(f"{path}: {self!r}: {exc}", field=path, value=self.kwargs) from exc
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigValidationError(
                f"{path}: {self!r} cannot build an observer: {type(exc).__name__}: {exc}",
                field=path, value=self.kwargs) from exc

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


def _check_acyclic(value: Any, path: str, parents: list[int]) -> None:
    if isinstance(value, ObserverFactory):
        value = value.kwargs
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return
    if id(value) in parents:
        raise ConfigValidationError(f"{path}: the keyword arguments contain themselves (a "
                                    f"{type(value).__name__} that refers back to itself)",
                                    field=path, value=type(value).__name__)
    parents.append(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        _check_acyclic(item, f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]", parents)
    parents.pop()


class FactoryMixin:
    """Gives a module class the torch.ao-style ``with_args`` classmethod."""

    @classmethod
    def with_args(cls, **kwargs: Any) -> ObserverFactory:
        return ObserverFactory(cls, kwargs)
