"""Dotted names for classes and callables, resolved through an allowlist.

Config documents name modules, functions and observer classes by dotted path. Resolving such a
path must never import an arbitrary module chosen by whoever wrote the document, so a name only
resolves when it falls under an allowlisted namespace:

* ``qplug_core.*`` and module prefixes registered by plugins (:func:`register_serializable_module`),
  which may be imported on demand;
* public attributes of ``torch``, ``torch.nn`` and ``torch.nn.functional``, ``nn.Module``
  subclasses inside already-imported ``torch.nn.*`` modules, ``operator`` and ``builtins.getattr``;
* single objects registered with :func:`register_serializable`.
"""

from __future__ import annotations

import importlib
import operator
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConfigError, did_you_mean

__all__ = [
    "decode_dtype",
    "decode_name",
    "decode_qscheme",
    "encode_dtype",
    "encode_name",
    "encode_qscheme",
    "register_serializable",
    "register_serializable_module",
]

_IMPORTABLE_PREFIXES: set[str] = {"qplug_core"}
_REGISTERED: dict[str, Any] = {}
#: namespaces searched (in order) for the public name of a function whose __module__ is private
_PUBLIC_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch.nn.functional", F), ("torch", torch), ("operator", operator),
)


def register_serializable_module(prefix: str) -> None:
    """Allow names under module ``prefix`` (e.g. a plugin's package) in config documents."""
    if not isinstance(prefix, str) or not prefix or prefix.startswith(".") or prefix.endswith("."):
        raise ConfigError(f"register_serializable_module expects a module name like 'qplug_fbgemm', "
                          f"got {prefix!r}", field="prefix", value=prefix)
    _IMPORTABLE_PREFIXES.add(prefix)


def register_serializable(obj: Any, name: str | None = None) -> str:
    """Allow one object under ``name`` (default: its ``module.qualname``); returns the name."""
    if name is None:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ConfigError(f"{obj!r} has no importable name (a lambda or local function?); "
                              "pass name= to register_serializable", field="name", value=obj)
        name = f"{module}.{qualname}"
    existing = _REGISTERED.get(name)
    if existing is not None and existing is not obj:
        raise ConfigError(f"The serializable name {name!r} is already registered for {existing!r}; "
                          "choose another name", field="name", value=name)
    _REGISTERED[name] = obj
    return name


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _public(attr: str) -> bool:
    return bool(attr) and not attr.startswith("_")


def _resolve(name: str) -> Any:
    """The object for ``name`` or ``None`` when the allowlist does not cover it."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    module_name, _, attr = name.rpartition(".")
    if name == "builtins.getattr":
        return getattr
    if module_name in ("torch", "torch.nn", "torch.nn.functional", "operator") and _public(attr):
        value = getattr(sys.modules[module_name], attr, None)
        return None if type(value) is type(torch) else value
    if _under(module_name, "torch.nn") and _public(attr):
        module = sys.modules.get(module_name)  # never import: only already-loaded torch.nn modules
        value = getattr(module, attr, None)
        return value if isinstance(value, type) and issubclass(value, nn.Module) else None
    if any(_under(name, prefix) for prefix in _IMPORTABLE_PREFIXES):
        return _resolve_importable(name)
    return None


def _resolve_importable(name: str) -> Any:
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        if not any(_under(module_name, prefix) for prefix in _IMPORTABLE_PREFIXES):
            return None
        try:
            value: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        except Exception as exc:  # a broken plugin module must not crash config loading
            raise ConfigError(f"Importing {module_name!r} to resolve {name!r} failed: {exc}",
                              value=name) from exc
        for attr in parts[split:]:
            if attr.startswith("__"):
                return None
            value = getattr(value, attr, None)
        return value
    return None


def _candidates(obj: Any) -> list[str]:
    names = [name for name, value in _REGISTERED.items() if value is obj]
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        names.append(f"{module}.{qualname}")
    short = getattr(obj, "__name__", None)
    if isinstance(short, str):
        names += [f"{prefix}.{short}" for prefix, _ in _PUBLIC_NAMESPACES]
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            names.append(f"torch.nn.{short}")
    if obj is getattr:
        names.append("builtins.getattr")
    return names


def encode_name(obj: Any, *, field: str = "") -> str:
    """The allowlisted dotted name that :func:`decode_name` turns back into ``obj`` itself."""
    for name in _candidates(obj):
        try:
            if _resolve(name) is obj:
                return name
        except ConfigError:
            continue
    raise ConfigError(
        f"Cannot serialise {obj!r} at {field or '<root>'}: it has no allowlisted dotted name. "
        "Define it at module level in qplug_core or a plugin package registered with "
        "register_serializable_module(), or call register_serializable(obj)", field=field, value=obj)


def decode_name(name: Any, *, field: str = "") -> Any:
    """Resolve an allowlisted dotted name; anything else is a :class:`ConfigError` naming ``field``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{field or '<root>'}: expected a dotted name string, got {name!r}",
                          field=field, value=name)
    value = _resolve(name)
    if value is None:
        module_name, _, attr = name.rpartition(".")
        module = sys.modules.get(module_name)
        hint = did_you_mean(attr, dir(module)) if module is not None else did_you_mean(name, _REGISTERED)
        raise ConfigError(
            f"{field or '<root>'}: unknown or disallowed name {name!r}{hint}. Only qplug_core, torch, "
            "torch.nn, torch.nn.functional, operator, builtins.getattr and registered plugin modules "
            "resolve", field=field, value=name)
    return value


def _torch_attr(value: Any, kind: type, label: str, field: str) -> Any:
    if isinstance(value, str) and value.startswith("torch."):
        attr = value[len("torch."):]
        found = getattr(torch, attr, None) if _public(attr) else None
        if isinstance(found, kind):
            return found
    names = [f"torch.{a}" for a in dir(torch) if isinstance(getattr(torch, a, None), kind)]
    hint = did_you_mean(value, names) if isinstance(value, str) else ""
    raise ConfigError(f"{field or '<root>'}: {value!r} is not a torch {label}{hint}; "
                      f"write it like {names[0]!r}", field=field, value=value)


def encode_dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.quint8"


def decode_dtype(value: Any, *, field: str = "") -> torch.dtype:
    return _torch_attr(value, torch.dtype, "dtype", field)


def encode_qscheme(qscheme: torch.qscheme) -> str:
    return str(qscheme)  # "torch.per_channel_symmetric"


def decode_qscheme(value: Any, *, field: str = "") -> torch.qscheme:
    return _torch_attr(value, torch.qscheme, "qscheme", field)
