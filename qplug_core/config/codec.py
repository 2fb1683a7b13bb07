"""JSON-safe encoding of config values and patterns, and checked reading of config documents.

Every reader takes the *path* of the value it reads (``configs[3].dtype_configs[0].weight_dtype``)
so that a bad document is reported where it is wrong, never as a ``KeyError`` from deep inside.
Values that JSON cannot tell apart (a method name vs a dotted function name, a tuple vs a list) are
written as one-key tagged objects such as ``{"op": "torch.nn.modules.conv.Conv2d"}``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from qplug_core.config.registry import (
    decode_dtype, decode_name, decode_qscheme, encode_dtype, encode_name, encode_qscheme,
)
from qplug_core.errors import ConfigError, did_you_mean
from qplug_core.observers.factory import ObserverFactory

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "schema_version"

# tags of tagged JSON objects
OP_TAG = "op"
METHOD_TAG = "method"
LITERAL_TAG = "literal"
DTYPE_TAG = "dtype"
QSCHEME_TAG = "qscheme"
OBJECT_TAG = "object"
FACTORY_TAG = "factory"
TUPLE_TAG = "tuple"
DICT_TAG = "dict"
FLOAT_TAG = "float"
COMPLEX_TAG = "complex"
DEVICE_TAG = "device"
ELLIPSIS_TAG = "ellipsis"
FACTORY_CLASS_KEY = "class"
FACTORY_KWARGS_KEY = "kwargs"


def where(path: str) -> str:
    return path or "<document>"


def child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def type_name(value: Any) -> str:
    return type(value).__name__


def expect(value: Any, types: type | tuple[type, ...], path: str, what: str) -> Any:
    """Return ``value`` if it has one of ``types`` (a bool is not an int), else raise."""
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _as_tuple(types))
    if not ok:
        raise ConfigError(f"{where(path)}: expected {what}, got {value!r} ({type_name(value)})",
                          field=path, value=value)
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def read_fields(doc: Any, path: str, allowed: Collection[str],
                required: Collection[str] = ()) -> Mapping[str, Any]:
    """Check that ``doc`` is an object with only ``allowed`` keys and all ``required`` ones."""
    expect(doc, dict, path, "a JSON object")
    for key in doc:
        if key not in allowed:
            hint = did_you_mean(key, allowed) if isinstance(key, str) else ""
            raise ConfigError(f"{where(path)}: unknown key {key!r}{hint}; allowed keys: "
                              f"{', '.join(sorted(allowed))}", field=child(path, str(key)), value=key)
    for key in required:
        if key not in doc:
            raise ConfigError(f"{where(path)}: missing required key {key!r}",
                              field=child(path, key), value=None)
    return doc


def versioned(data: dict[str, Any]) -> dict[str, Any]:
    """A top-level document: ``data`` preceded by its ``schema_version``."""
    return {SCHEMA_VERSION_KEY: SCHEMA_VERSION, **data}


def unversioned(doc: Any, path: str = "") -> dict[str, Any]:
    """Check the ``schema_version`` of a top-level document and return the rest of it."""
    expect(doc, dict, path, "a JSON object")
    if SCHEMA_VERSION_KEY not in doc:
        raise ConfigError(f"{where(path)}: missing {SCHEMA_VERSION_KEY!r}; documents written by "
                          f"to_dict() carry \"{SCHEMA_VERSION_KEY}\": {SCHEMA_VERSION}",
                          field=child(path, SCHEMA_VERSION_KEY))
    version = doc[SCHEMA_VERSION_KEY]
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise ConfigError(f"{where(path)}: unsupported {SCHEMA_VERSION_KEY} {version!r}; this qplug "
                          f"reads version {SCHEMA_VERSION} (upgrade qplug-core for newer documents)",
                          field=child(path, SCHEMA_VERSION_KEY), value=version)
    return {k: v for k, v in doc.items() if k != SCHEMA_VERSION_KEY}


def call_at(path: str, setter: Callable[..., Any], *args: Any) -> Any:
    """Call a builder with decoded values, reporting its error at the document ``path``.

    Builders name their own fields (``root_module``); in a document the useful name is the full
    path (``configs[3].root_module``). The error keeps its class.
    """
    try:
        return setter(*args)
    except ConfigError as exc:
        moved = copy.copy(exc)
        moved.args = (f"{where(path)}: {exc}",)
        moved.field = path
        raise moved from exc


def read_tagged(doc: Any, path: str, tags: Collection[str]) -> tuple[str, Any]:
    """The single ``(tag, payload)`` of a tagged object whose tag is one of ``tags``."""
    if not isinstance(doc, dict) or len(doc) != 1:
        raise ConfigError(f"{where(path)}: expected a one-key object tagged with one of "
                          f"{sorted(tags)}, got {doc!r}", field=path, value=doc)
    read_fields(doc, path, tags)
    return next(iter(doc.items()))


# -- plain values (observer kwargs, pattern literals) ----------------------------------------------


def encode_value(value: Any, path: str) -> Any:
    """JSON-safe form of an observer argument or pattern literal; raises for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT_TAG: repr(value)}
    if isinstance(value, complex):
        return {COMPLEX_TAG: [encode_value(value.real, path), encode_value(value.imag, path)]}
    if value is Ellipsis:
        return {ELLIPSIS_TAG: True}
    if isinstance(value, torch.dtype):
        return {DTYPE_TAG: encode_dtype(value)}
    if isinstance(value, torch.qscheme):
        return {QSCHEME_TAG: encode_qscheme(value)}
    if isinstance(value, torch.device):
        return {DEVICE_TAG: str(value)}
    if isinstance(value, ObserverFactory):
        return {FACTORY_TAG: encode_factory(value, child(path, FACTORY_TAG))}
    if isinstance(value, tuple):
        return {TUPLE_TAG: [encode_value(v, child(path, i)) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, child(path, i)) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {DICT_TAG: {k: encode_value(v, child(path, k)) for k, v in value.items()}}
    if isinstance(value, type) or callable(value):
        return {OBJECT_TAG: encode_name(value, field=path)}
    raise ConfigError(f"{where(path)}: cannot serialise {value!r} ({type_name(value)}); config "
                      "values must be numbers, strings, dtypes, qschemes, classes or functions",
                      field=path, value=value)


_VALUE_TAGS = (FLOAT_TAG, COMPLEX_TAG, ELLIPSIS_TAG, DTYPE_TAG, QSCHEME_TAG, DEVICE_TAG,
               FACTORY_TAG, TUPLE_TAG, DICT_TAG, OBJECT_TAG)


def decode_value(doc: Any, path: str) -> Any:
    if doc is None or isinstance(doc, (bool, int, str)):
        return doc
    if isinstance(doc, float):
        return doc
    if isinstance(doc, list):
        return [decode_value(v, child(path, i)) for i, v in enumerate(doc)]
    tag, payload = read_tagged(doc, path, _VALUE_TAGS)
    at = child(path, tag)
    if tag == FLOAT_TAG:
        if payload not in ("inf", "-inf", "nan"):
            raise ConfigError(f"{where(at)}: expected 'inf', '-inf' or 'nan', got {payload!r}",
                              field=at, value=payload)
        return float(payload)
    if tag == COMPLEX_TAG:
        if not (isinstance(payload, list) and len(payload) == 2):
            raise ConfigError(f"{where(at)}: expected [real, imag]", field=at, value=payload)
        return complex(*(expect(v, (int, float), child(at, i), "a number")
                         for i, v in enumerate(payload)))
    if tag == ELLIPSIS_TAG:
        return Ellipsis
    if tag == DTYPE_TAG:
        return decode_dtype(payload, field=at)
    if tag == QSCHEME_TAG:
        return decode_qscheme(payload, field=at)
    if tag == DEVICE_TAG:
        try:
            return torch.device(expect(payload, str, at, "a device string such as 'cpu'"))
        except RuntimeError as exc:
            raise ConfigError(f"{where(at)}: invalid device {payload!r}", field=at,
                              value=payload) from exc
    if tag == FACTORY_TAG:
        return decode_factory(payload, at)
    if tag == TUPLE_TAG:
        expect(payload, list, at, "a JSON list")
        return tuple(decode_value(v, child(at, i)) for i, v in enumerate(payload))
    if tag == DICT_TAG:
        expect(payload, dict, at, "a JSON object")
        return {k: decode_value(v, child(at, k)) for k, v in payload.items()}
    return decode_name(payload, field=at)


def encode_factory(factory: ObserverFactory, path: str) -> dict[str, Any]:
    kwargs = child(path, FACTORY_KWARGS_KEY)
    return {FACTORY_CLASS_KEY: encode_name(factory.cls, field=child(path, FACTORY_CLASS_KEY)),
            FACTORY_KWARGS_KEY: {k: encode_value(v, child(kwargs, k)) for k, v in factory.kwargs.items()}}


def decode_factory(doc: Any, path: str) -> ObserverFactory:
    read_fields(doc, path, (FACTORY_CLASS_KEY, FACTORY_KWARGS_KEY), required=(FACTORY_CLASS_KEY,))
    cls = decode_name(doc[FACTORY_CLASS_KEY], field=child(path, FACTORY_CLASS_KEY))
    if not isinstance(cls, type):
        raise ConfigError(f"{where(child(path, FACTORY_CLASS_KEY))}: {doc[FACTORY_CLASS_KEY]!r} is "
                          "not a class", field=child(path, FACTORY_CLASS_KEY), value=cls)
    kwargs_path = child(path, FACTORY_KWARGS_KEY)
    kwargs = expect(doc.get(FACTORY_KWARGS_KEY, {}), dict, kwargs_path, "a JSON object")
    return ObserverFactory(cls, {k: decode_value(v, child(kwargs_path, k)) for k, v in kwargs.items()})


# -- patterns --------------------------------------------------------------------------------------


def encode_pattern(pattern: Any, path: str) -> Any:
    """Tuples become lists; operators and literals become tagged objects."""
    if isinstance(pattern, tuple):
        return [encode_pattern(p, child(path, i)) for i, p in enumerate(pattern)]
    if isinstance(pattern, str):
        return {METHOD_TAG: pattern}
    if isinstance(pattern, type) or callable(pattern):
        return {OP_TAG: encode_name(pattern, field=path)}
    return {LITERAL_TAG: encode_value(pattern, child(path, LITERAL_TAG))}


def decode_pattern(doc: Any, path: str) -> Any:
    if isinstance(doc, list):
        return tuple(decode_pattern(p, child(path, i)) for i, p in enumerate(doc))
    tag, payload = read_tagged(doc, path, (OP_TAG, METHOD_TAG, LITERAL_TAG))
    at = child(path, tag)
    if tag == METHOD_TAG:
        return expect(payload, str, at, "a method name string")
    if tag == OP_TAG:
        return decode_name(payload, field=at)
    return decode_value(payload, at)
