"""JSON-safe encoding of values and patterns, and checked reading of config documents and files.

:class:`ValueCodec` is the one value codec of config documents and saved files; names of classes
and functions in either go through :mod:`qplug_core.config.names`; torch constants (dtypes,
qschemes, memory formats, layouts) by their names through :func:`decode_torch_constant` here.

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

from qplug_core.config.names import Kind, decode_name, encode_name
from qplug_core.errors import ConfigError, ConfigValidationError, did_you_mean
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
NODE_TAG = "node"
SLICE_TAG = "slice"
MEMORY_FORMAT_TAG = "memory_format"
LAYOUT_TAG = "layout"
FACTORY_CLASS_KEY = "class"
FACTORY_KWARGS_KEY = "kwargs"


# -- torch constants ---------------------------------------------------------------------------------


def _constants(kind: type) -> dict[str, Any]:
    table = {f"torch.{attr}": value for attr, value in vars(torch).items() if isinstance(value, kind)}
    table.update({str(value): value for value in list(table.values())})
    return table


_CONSTANTS: dict[type, dict[str, Any]] = {}


def decode_torch_constant(value: Any, kind: type, *, field: str = "") -> Any:
    """A ``torch.dtype``/``qscheme``/``memory_format``/``layout`` by its name (``torch.qint8``)."""
    table = _CONSTANTS.get(kind)
    if table is None:
        table = _CONSTANTS[kind] = _constants(kind)
    found = table.get(value) if isinstance(value, str) else None
    if found is None:
        label = kind.__name__
        hint = did_you_mean(value, table) if isinstance(value, str) else ""
        raise ConfigValidationError(f"{field or '<root>'}: {value!r} is not a torch {label}{hint}; "
                                    f"write it like {next(iter(table))!r}", field=field, value=value)
    return found


def encode_dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.quint8"


def decode_dtype(value: Any, *, field: str = "") -> torch.dtype:
    return decode_torch_constant(value, torch.dtype, field=field)


def encode_qscheme(qscheme: torch.qscheme) -> str:
    return str(qscheme)  # "torch.per_channel_symmetric"


def decode_qscheme(value: Any, *, field: str = "") -> torch.qscheme:
    return decode_torch_constant(value, torch.qscheme, field=field)


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


# -- plain values: one codec for config documents and saved files --------------------------------


def read_pairs(doc: Any, path: str) -> list[tuple[str, Any]]:
    """``[[key, value], ...]``: how files write mappings whose order matters (JSON objects are
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


NodeName = Callable[[Any], "str | None"]
NodeLookup = Callable[[str, str], Any]


class ValueCodec:
    """The JSON form of plain values: observer kwargs, pattern literals, graph arguments, module
    constructor arguments and attributes.

    Configs and files share it and differ only in what they may name: ``object_kinds`` says what
    a named class or function may be (:class:`~qplug_core.config.names.Kind`), ``object_tag`` how
    it is tagged, ``ordered_dicts`` whether mappings are written as ``[key, value]`` pairs (files,
    whose JSON is written with sorted keys) or objects. Either mapping form is read.
    """

    def __init__(self, *, object_tag: str, object_kinds: frozenset[Kind], ordered_dicts: bool,
                 factories: bool) -> None:
        self.object_tag = object_tag
        self.object_kinds = object_kinds
        self.ordered_dicts = ordered_dicts
        self.factories = factories
        self.tags = (*_VALUE_TAGS, object_tag, *((FACTORY_TAG,) if factories else ()))

    def encode(self, value: Any, path: str, node_name: NodeName | None = None) -> Any:
        """JSON form of ``value``; ``node_name`` maps fx nodes to names (graph arguments only)."""
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {FLOAT_TAG: repr(value)}
        name = node_name(value) if node_name is not None else None
        if name is not None:
            return {NODE_TAG: name}
        if isinstance(value, (tuple, list)):
            items = [self.encode(v, child(path, i), node_name) for i, v in enumerate(value)]
            return items if isinstance(value, list) else {TUPLE_TAG: items}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            items = [(k, self.encode(v, child(path, k), node_name)) for k, v in value.items()]
            return {DICT_TAG: [list(kv) for kv in items] if self.ordered_dicts else dict(items)}
        if isinstance(value, slice):
            return {SLICE_TAG: [self.encode(v, child(path, i), node_name)
                                for i, v in enumerate((value.start, value.stop, value.step))]}
        if isinstance(value, complex):
            return {COMPLEX_TAG: [self.encode(value.real, path), self.encode(value.imag, path)]}
        if value is Ellipsis:
            return {ELLIPSIS_TAG: True}
        if isinstance(value, torch.device):
            return {DEVICE_TAG: str(value)}
        for tag, kind in _CONSTANT_TAGS.items():
            if isinstance(value, kind):
                return {tag: str(value)}
        if isinstance(value, ObserverFactory) and self.factories:
            return {FACTORY_TAG: encode_factory(value, child(path, FACTORY_TAG))}
        if callable(value) and not isinstance(value, (torch.nn.Module, ObserverFactory)):
            return {self.object_tag: encode_name(value, field=path, kinds=self.object_kinds)}
        raise ConfigError(f"{where(path)}: cannot serialise {value!r:.80} ({type_name(value)}); values "
                          "must be numbers, strings, dtypes, devices, slices, containers of these, or "
                          "the classes and functions in qplug's name table", field=path, value=value)

    def decode(self, doc: Any, path: str, node: NodeLookup | None = None) -> Any:
        """Inverse of :meth:`encode`; ``node(name, path)`` resolves node references."""
        if doc is None or isinstance(doc, (bool, int, float, str)):
            return doc
        if isinstance(doc, list):
            return [self.decode(v, child(path, i), node) for i, v in enumerate(doc)]
        tag, payload = read_tagged(doc, path, self.tags)
        at = child(path, tag)
        if tag == NODE_TAG:
            if node is None:
                raise ConfigError(f"{where(at)}: node references are only allowed in graph arguments",
                                  field=at, value=payload)
            return node(expect(payload, str, at, "a node name"), at)
        if tag in (TUPLE_TAG, SLICE_TAG, COMPLEX_TAG):
            items = [self.decode(v, child(at, i), node)
                     for i, v in enumerate(expect(payload, list, at, "a JSON list"))]
            if tag == TUPLE_TAG:
                return tuple(items)
            return _slice_or_complex(tag, items, at, payload)
        if tag == DICT_TAG:
            pairs = payload.items() if isinstance(payload, dict) else read_pairs(payload, at)
            return {k: self.decode(v, child(at, k), node) for k, v in pairs}
        if tag == FLOAT_TAG:
            if payload not in ("inf", "-inf", "nan"):
                raise ConfigError(f"{where(at)}: expected 'inf', '-inf' or 'nan', got {payload!r}",
                                  field=at, value=payload)
            return float(payload)
        if tag == ELLIPSIS_TAG:
            return Ellipsis
        if tag == DEVICE_TAG:
            return _decode_device(payload, at)
        if tag in _CONSTANT_TAGS:
            return decode_torch_constant(payload, _CONSTANT_TAGS[tag], field=at)
        if tag == FACTORY_TAG:
            return decode_factory(payload, at)
        return decode_name(expect(payload, str, at, "a name"), field=at, kinds=self.object_kinds)


def _slice_or_complex(tag: str, items: list[Any], at: str, payload: Any) -> Any:
    if tag == SLICE_TAG:
        if len(items) != 3:
            raise ConfigError(f"{where(at)}: expected [start, stop, step]", field=at, value=payload)
        return slice(*items)
    if len(items) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"{where(at)}: expected [real, imag]", field=at, value=payload)
    return complex(*items)


def _decode_device(payload: Any, path: str) -> torch.device:
    try:
        return torch.device(expect(payload, str, path, "a device string such as 'cpu'"))
    except RuntimeError as exc:
        raise ConfigError(f"{where(path)}: invalid device {payload!r}", field=path, value=payload) from exc


_CONSTANT_TAGS: dict[str, type] = {DTYPE_TAG: torch.dtype, QSCHEME_TAG: torch.qscheme,
                                   MEMORY_FORMAT_TAG: torch.memory_format, LAYOUT_TAG: torch.layout}
_VALUE_TAGS = (NODE_TAG, TUPLE_TAG, DICT_TAG, SLICE_TAG, FLOAT_TAG, COMPLEX_TAG, ELLIPSIS_TAG,
               DEVICE_TAG, *_CONSTANT_TAGS)
#: config documents: observer kwargs may name observer classes, module classes and ops
CONFIG_VALUES = ValueCodec(object_tag=OBJECT_TAG,
                           object_kinds=frozenset({Kind.OBSERVER, Kind.MODULE, Kind.OP}),
                           ordered_dicts=False, factories=True)
encode_value = CONFIG_VALUES.encode
decode_value = CONFIG_VALUES.decode


def encode_factory(factory: ObserverFactory, path: str) -> dict[str, Any]:
    kwargs = child(path, FACTORY_KWARGS_KEY)
    return {FACTORY_CLASS_KEY: encode_name(factory.cls, field=child(path, FACTORY_CLASS_KEY),
                                           kinds=(Kind.OBSERVER,)),
            FACTORY_KWARGS_KEY: {k: encode_value(v, child(kwargs, k)) for k, v in factory.kwargs.items()}}


def decode_factory(doc: Any, path: str) -> ObserverFactory:
    read_fields(doc, path, (FACTORY_CLASS_KEY, FACTORY_KWARGS_KEY), required=(FACTORY_CLASS_KEY,))
    cls = decode_name(doc[FACTORY_CLASS_KEY], field=child(path, FACTORY_CLASS_KEY), kinds=(Kind.OBSERVER,))
    if not isinstance(cls, type):
        raise ConfigError(f"{where(child(path, FACTORY_CLASS_KEY))}: {doc[FACTORY_CLASS_KEY]!r} is "
                          "not a class", field=child(path, FACTORY_CLASS_KEY), value=cls)
    kwargs_path = child(path, FACTORY_KWARGS_KEY)
    kwargs = expect(doc.get(FACTORY_KWARGS_KEY, {}), dict, kwargs_path, "a JSON object")
    return ObserverFactory(cls, {k: decode_value(v, child(kwargs_path, k)) for k, v in kwargs.items()})


# -- patterns --------------------------------------------------------------------------------------


#: what a pattern element (or a qconfig mapping's object type) may name
PATTERN_KINDS = frozenset({Kind.OP, Kind.MODULE, Kind.PATTERN})


def encode_pattern(pattern: Any, path: str) -> Any:
    """Tuples become lists; operators and literals become tagged objects."""
    if isinstance(pattern, tuple):
        return [encode_pattern(p, child(path, i)) for i, p in enumerate(pattern)]
    if isinstance(pattern, str):
        return {METHOD_TAG: pattern}
    if isinstance(pattern, type) or callable(pattern):
        return {OP_TAG: encode_name(pattern, field=path, kinds=PATTERN_KINDS)}
    return {LITERAL_TAG: encode_value(pattern, child(path, LITERAL_TAG))}


def decode_pattern(doc: Any, path: str) -> Any:
    if isinstance(doc, list):
        return tuple(decode_pattern(p, child(path, i)) for i, p in enumerate(doc))
    tag, payload = read_tagged(doc, path, (OP_TAG, METHOD_TAG, LITERAL_TAG))
    at = child(path, tag)
    if tag == METHOD_TAG:
        return expect(payload, str, at, "a method name string")
    if tag == OP_TAG:
        return decode_name(payload, field=at, kinds=PATTERN_KINDS)
    return decode_value(payload, at)
