"""JSON form of the plain values an artifact holds: graph arguments, constructor kwargs, attributes.

A loaded file is untrusted, so decoding is deliberately narrow. Classes and functions resolve
only through the config registry's allowlist, and callables (call targets and callable values)
must also pass :func:`check_callable`. That check keeps a graph to tensor ops: no
``torch.load``/``torch.save``/``torch.from_file``, no global ``torch.set_*`` switches and no
``operator.attrgetter``/``methodcaller``/``call`` chains. Identifiers, which torch.fx pastes into
the Python source it generates and executes, are checked with :func:`check_identifier`.
"""

from __future__ import annotations

import keyword
import math
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from qplug_core.config.codec import child, expect, read_tagged, where
from qplug_core.config.registry import decode_dtype, decode_name, encode_dtype, encode_name
from qplug_core.errors import ConfigError

NODE_TAG = "node"
TUPLE_TAG = "tuple"
DICT_TAG = "dict"
SLICE_TAG = "slice"
FLOAT_TAG = "float"
ELLIPSIS_TAG = "ellipsis"
DTYPE_TAG = "dtype"
DEVICE_TAG = "device"
MEMORY_FORMAT_TAG = "memory_format"
LAYOUT_TAG = "layout"
CALLABLE_TAG = "callable"

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OPERATOR_DENIED = frozenset({"attrgetter", "methodcaller", "call"})
_TORCH_DENIED = frozenset({"from_file"})
#: ``__module__`` of the Python-level functions that are plain tensor ops
_OP_FUNCTION_MODULES = frozenset({"torch.functional", "torch.nn.functional", "torch._C._nn"})


def check_identifier(name: Any, path: str, what: str) -> str:
    """``name`` if it is a Python identifier (not a keyword), the only names fx may paste into code."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name) or keyword.iskeyword(name):
        raise ConfigError(f"{where(path)}: {what} {name!r} is not a plain Python identifier",
                          field=path, value=name)
    return name


def check_public(name: Any, path: str, what: str) -> str:
    """An identifier that does not start with an underscore (no dunder or private access)."""
    if check_identifier(name, path, what).startswith("_"):
        raise ConfigError(f"{where(path)}: {what} {name!r} is private; artifacts may only use public "
                          "names", field=path, value=name)
    return name


def check_callable(name: str, obj: Any, path: str) -> Any:
    """``obj`` (decoded from ``name``) if a saved graph may call it, else a :class:`ConfigError`.

    Allowed: ``operator`` functions, ``builtins.getattr``, native torch ops, ``torch.functional`` and
    ``torch.nn.functional`` functions, and anything registered under ``qplug_core`` or a plugin
    prefix (code the user installed). Classes and torch's Python-level helpers are refused.
    """
    module, _, attr = name.rpartition(".")
    if name == "builtins.getattr":
        return obj
    if module == "operator":
        allowed = attr not in _OPERATOR_DENIED
    elif name.startswith("torch."):
        op_module = getattr(obj, "__module__", None)
        native_op = op_module == "torch" and isinstance(obj, types.BuiltinFunctionType)
        allowed = (attr not in _TORCH_DENIED and not attr.startswith("set_")
                   and (native_op or (op_module in _OP_FUNCTION_MODULES and not isinstance(obj, type))))
    else:
        allowed = callable(obj)
    if not allowed:
        raise ConfigError(f"{where(path)}: {name!r} is not a tensor operation a saved model may call",
                          field=path, value=name)
    return obj


def read_pairs(doc: Any, path: str) -> list[tuple[str, Any]]:
    """``[[key, value], ...]``: how artifacts write mappings whose order matters (JSON objects are
    written with sorted keys, for byte-identical files)."""
    pairs = []
    for i, item in enumerate(expect(doc, list, path, "a list of [key, value] pairs")):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise ConfigError(f"{where(child(path, i))}: expected a [key, value] pair with a string key, "
                              f"got {item!r}", field=child(path, i), value=item)
        pairs.append((item[0], item[1]))
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"{where(path)}: duplicate keys in {keys}", field=path, value=keys)
    return pairs


def encode_value(value: Any, path: str, node_name: Callable[[Any], str | None] | None = None) -> Any:
    """JSON form of ``value``; ``node_name`` maps fx nodes to names (graph arguments only)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {FLOAT_TAG: repr(value)}
    name = node_name(value) if node_name is not None else None
    if name is not None:
        return {NODE_TAG: name}
    if isinstance(value, (tuple, list)):
        items = [encode_value(v, child(path, i), node_name) for i, v in enumerate(value)]
        return items if isinstance(value, list) else {TUPLE_TAG: items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {DICT_TAG: [[k, encode_value(v, child(path, k), node_name)] for k, v in value.items()]}
    if isinstance(value, slice):
        return {SLICE_TAG: [encode_value(v, child(path, i), node_name)
                            for i, v in enumerate((value.start, value.stop, value.step))]}
    if value is Ellipsis:
        return {ELLIPSIS_TAG: True}
    if isinstance(value, torch.dtype):
        return {DTYPE_TAG: encode_dtype(value)}
    if isinstance(value, torch.device):
        return {DEVICE_TAG: str(value)}
    if isinstance(value, torch.memory_format):
        return {MEMORY_FORMAT_TAG: str(value)}
    if isinstance(value, torch.layout):
        return {LAYOUT_TAG: str(value)}
    if callable(value) and not isinstance(value, (type, torch.nn.Module)):
        dotted = encode_name(value, field=path)
        check_callable(dotted, value, path)
        return {CALLABLE_TAG: dotted}
    raise ConfigError(f"{where(path)}: cannot save a value of type {type(value).__name__} ({value!r:.80}); "
                      "artifacts hold numbers, strings, dtypes, devices, slices, containers of these "
                      "and tensor functions", field=path, value=value)


_TAGS = (NODE_TAG, TUPLE_TAG, DICT_TAG, SLICE_TAG, FLOAT_TAG, ELLIPSIS_TAG, DTYPE_TAG, DEVICE_TAG,
         MEMORY_FORMAT_TAG, LAYOUT_TAG, CALLABLE_TAG)


def decode_value(doc: Any, path: str, node: Callable[[str, str], Any] | None = None) -> Any:
    """Inverse of :func:`encode_value`; ``node(name, path)`` resolves node references."""
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [decode_value(v, child(path, i), node) for i, v in enumerate(doc)]
    tag, payload = read_tagged(doc, path, _TAGS)
    at = child(path, tag)
    if tag == NODE_TAG:
        if node is None:
            raise ConfigError(f"{where(at)}: node references are only allowed in graph arguments",
                              field=at, value=payload)
        return node(expect(payload, str, at, "a node name"), at)
    if tag in (TUPLE_TAG, SLICE_TAG):
        items = [decode_value(v, child(at, i), node)
                 for i, v in enumerate(expect(payload, list, at, "a JSON list"))]
        if tag == TUPLE_TAG:
            return tuple(items)
        if len(items) != 3:
            raise ConfigError(f"{where(at)}: expected [start, stop, step]", field=at, value=payload)
        return slice(*items)
    if tag == DICT_TAG:
        return {k: decode_value(v, child(at, k), node) for k, v in read_pairs(payload, at)}
    if tag == FLOAT_TAG:
        if payload not in ("inf", "-inf", "nan"):
            raise ConfigError(f"{where(at)}: expected 'inf', '-inf' or 'nan', got {payload!r}",
                              field=at, value=payload)
        return float(payload)
    if tag == ELLIPSIS_TAG:
        return Ellipsis
    if tag == DTYPE_TAG:
        return decode_dtype(payload, field=at)
    if tag == DEVICE_TAG:
        return _decode_device(payload, at)
    if tag in (MEMORY_FORMAT_TAG, LAYOUT_TAG):
        return _torch_constant(payload, torch.memory_format if tag == MEMORY_FORMAT_TAG else torch.layout, at)
    dotted = expect(payload, str, at, "a dotted function name")
    return check_callable(dotted, decode_name(dotted, field=at), at)


def _decode_device(payload: Any, path: str) -> torch.device:
    try:
        return torch.device(expect(payload, str, path, "a device string such as 'cpu'"))
    except RuntimeError as exc:
        raise ConfigError(f"{where(path)}: invalid device {payload!r}", field=path, value=payload) from exc


def _torch_constant(payload: Any, kind: type, path: str) -> Any:
    text = expect(payload, str, path, f"a {kind.__name__} such as 'torch.{kind.__name__}'")
    value = getattr(torch, text[len("torch."):], None) if text.startswith("torch.") else None
    if not isinstance(value, kind):
        raise ConfigError(f"{where(path)}: {text!r} is not a torch.{kind.__name__}", field=path, value=text)
    return value
