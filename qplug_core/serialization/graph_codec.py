"""An fx graph as JSON: one object per node, arguments with node references, and the qplug tags.

Only the node meta that lowering and the report read is kept (value kinds, region tags, root and
boundary marks); the region's qconfig is dropped because nothing after convert uses it. A node's
type annotation is kept when it is a plain class (``torch.Tensor``, ``int``) or a string (as
written under ``from __future__ import annotations``); generic annotations such as ``list[int]``
are dropped, which changes only the annotations of the generated code. Decoding
checks every name fx would paste into generated code and every call target (see ``values``), and
only lets a node refer to nodes before it, so a decoded graph is in topological order.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator
from typing import Any

from torch import fx

from qplug_core.config.codec import (
    child,
    decode_pattern,
    encode_pattern,
    expect,
    read_fields,
    read_pairs,
    read_tagged,
    where,
)
from qplug_core.config.dtypes import DTypeConfig
from qplug_core.config.names import Kind, decode_name, encode_name
from qplug_core.errors import ConfigError
from qplug_core.flows.tags import (
    BAKED_INPUT,
    BAKED_TYPES,
    BOUNDARY,
    INPUT_SPEC,
    REGION,
    ROOT,
    SPEC_DTYPES,
    VALUE_KIND,
    RegionTag,
)
from qplug_core.serialization.values import (
    FILE_VALUES,
    check_identifier,
    check_tensor_attribute,
    decode_op,
    encode_op,
)

NODE_KEYS = ("op", "name", "target", "type", "args", "kwargs", "meta")
_BUILTIN_TYPES: dict[str, type] = {t.__name__: t for t in (int, float, bool, str)}
CLASS_TAG = "class"
TEXT_TAG = "text"
_ANNOTATION_TEXT = re.compile(r"[A-Za-z0-9_.,| \[\]]{1,200}\Z")
_META_KEYS = (VALUE_KIND, ROOT, BOUNDARY, REGION, INPUT_SPEC, BAKED_INPUT)
#: the name of a size symbol torch.export gave a dynamic input dimension (``s24``)
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}\Z")
_VALUE_KINDS = ("float_tensor", "tensor", "other")
_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")
_PLACEHOLDER = re.compile(r"\*{0,2}[A-Za-z_][A-Za-z0-9_]*\Z")
_INDEX = re.compile(r"[0-9]+\Z")
#: RegionTag fields that are stored as plain JSON values, with their types
_REGION_FIELDS: dict[str, type] = {
    "region_id": int, "is_anchor": bool, "pattern_name": str, "quantized": bool, "reason": str,
    "weighted": bool, "is_dynamic": bool,
}


def _path_part(part: str) -> bool:
    """An index, or an identifier (any script: ``卷积``) that is no dunder name (``__class__``
    would reach Python internals), not even once Python's parser normalises it (NFKC: generated
    code would read ``＿＿class＿＿`` as ``__class__``)."""
    if _INDEX.match(part):
        return True
    return part.isidentifier() and unicodedata.normalize("NFKC", part) == part and not part.startswith("__")


def check_path(path: Any, at: str, what: str) -> str:
    """A dotted attribute path whose parts are identifiers or indices (``layer1.0.conv``), never
    dunder names."""
    if not isinstance(path, str) or not all(_path_part(part) for part in path.split(".")):
        raise ConfigError(f"{where(at)}: {what} {path!r} is not a dotted path of identifiers or "
                          "indices", field=at, value=path)
    return path


def layer_entries(doc: Any, path: str, max_entries: int, fields: tuple[str, ...]
                  ) -> Iterator[tuple[str, dict[str, Any], str]]:
    """``(layer path, entry, where)`` of a record keyed by layer paths (a saved model's clamps,
    folded affines), each entry checked to hold exactly ``fields``; no more entries than the graph
    has nodes. Raises :class:`ConfigError` naming the bad field."""
    entries = expect(doc, dict, path, "a JSON object")
    if len(entries) > max_entries:
        raise ConfigError(f"{where(path)}: {len(entries)} entries for a graph of {max_entries} nodes",
                          field=path, value=len(entries))
    for layer, entry in entries.items():
        at = child(path, layer)
        check_path(layer, at, "layer")
        read_fields(entry, at, fields, required=fields)
        yield layer, entry, at


def encode_graph(graph: fx.Graph, path: str = "graph") -> list[dict[str, Any]]:
    nodes = []
    for i, node in enumerate(graph.nodes):
        at = child(path, i)
        doc: dict[str, Any] = {"op": node.op, "name": node.name, "target": _encode_target(node, at)}
        annotation = _encode_type(node.type)
        if annotation is not None:
            doc["type"] = annotation
        if node.args:
            doc["args"] = [FILE_VALUES.encode(a, child(child(at, "args"), j), _node_name)
                           for j, a in enumerate(node.args)]
        if node.kwargs:
            doc["kwargs"] = [[k, FILE_VALUES.encode(v, child(child(at, "kwargs"), k), _node_name)]
                             for k, v in node.kwargs.items()]
        meta = _encode_meta(node.meta, child(at, "meta"))
        if meta:
            doc["meta"] = meta
        nodes.append(doc)
    return nodes


def _encode_type(annotation: Any) -> dict[str, str] | None:
    if isinstance(annotation, str) and _ANNOTATION_TEXT.match(annotation):
        return {TEXT_TAG: annotation}
    if not isinstance(annotation, type):
        return None
    if _BUILTIN_TYPES.get(annotation.__name__) is annotation:
        return {CLASS_TAG: annotation.__name__}
    try:
        return {CLASS_TAG: encode_name(annotation, kinds=(Kind.TYPE,))}
    except ConfigError:
        return None


def _decode_type(doc: Any, path: str) -> Any:
    """A node's annotation: fx only pastes it into generated code as a global name."""
    if doc is None:
        return None
    tag, payload = read_tagged(doc, path, (CLASS_TAG, TEXT_TAG))
    at = child(path, tag)
    if tag == TEXT_TAG:
        if not isinstance(payload, str) or not _ANNOTATION_TEXT.match(payload):
            raise ConfigError(f"{where(at)}: {payload!r} is not a type annotation", field=at, value=payload)
        return payload
    name = expect(payload, str, at, "a class name")
    annotation = _BUILTIN_TYPES.get(name) or decode_name(name, field=at, kinds=(Kind.TYPE,))
    if not isinstance(annotation, type):
        raise ConfigError(f"{where(at)}: {name!r} is not a class", field=at, value=name)
    return annotation


def _node_name(value: Any) -> str | None:
    return value.name if isinstance(value, fx.Node) else None


def _encode_target(node: fx.Node, path: str) -> str:
    """The target's JSON form, checked as loading will check it (so save fails, not load)."""
    at = child(path, "target")
    if node.op != "call_function":
        return _decode_target(node.op, node.target, at)
    name = encode_op(node.target, at)
    if node.target is getattr:
        _check_getattr(node.args, child(path, "args"))
    return name


def _encode_meta(meta: dict[str, Any], path: str) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if VALUE_KIND in meta:
        doc[VALUE_KIND] = meta[VALUE_KIND]
    for key in (ROOT, BOUNDARY):
        if meta.get(key):
            doc[key] = True
    if INPUT_SPEC in meta:
        spec = meta[INPUT_SPEC]
        doc[INPUT_SPEC] = {"shape": list(spec["shape"]), "dtype": spec["dtype"],
                           **{key: list(spec[key]) for key in ("fixed", "symbols") if key in spec}}
    if BAKED_INPUT in meta:
        doc[BAKED_INPUT] = meta[BAKED_INPUT]
    tag = meta.get(REGION)
    if tag is not None:
        region = {name: getattr(tag, name) for name in _REGION_FIELDS}
        region["pattern"] = encode_pattern(tag.pattern, child(child(path, REGION), "pattern"))
        if tag.dtype_config is not None:
            region["dtype_config"] = tag.dtype_config.to_data()
        doc[REGION] = region
    return doc


def decode_graph(doc: Any, path: str = "graph") -> fx.Graph:
    """The graph of ``doc``; raises :class:`ConfigError` naming the bad node and field."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(name: str, at: str) -> fx.Node:
        if name not in env:
            raise ConfigError(f"{where(at)}: refers to node {name!r}, which is not defined before it",
                              field=at, value=name)
        return env[name]

    for i, item in enumerate(expect(doc, list, path, "a JSON list of nodes")):
        at = child(path, i)
        read_fields(item, at, NODE_KEYS, required=("op", "name", "target"))
        op = item["op"]
        if op not in _OPS:
            raise ConfigError(f"{where(child(at, 'op'))}: unknown node op {op!r}; expected one of "
                              f"{', '.join(_OPS)}", field=child(at, "op"), value=op)
        name = check_identifier(item["name"], child(at, "name"), "node name")
        if name in env:
            raise ConfigError(f"{where(child(at, 'name'))}: node name {name!r} is used twice",
                              field=child(at, "name"), value=name)
        target = _decode_target(op, item["target"], child(at, "target"))
        args_at, kwargs_at = child(at, "args"), child(at, "kwargs")
        args = tuple(FILE_VALUES.decode(a, child(args_at, j), resolve)
                     for j, a in enumerate(expect(item.get("args", []), list, args_at, "a JSON list")))
        kwargs = {check_identifier(k, child(kwargs_at, k), "keyword"):
                  FILE_VALUES.decode(v, child(kwargs_at, k), resolve)
                  for k, v in read_pairs(item.get("kwargs", []), kwargs_at)}
        if target is getattr:
            _check_getattr(args, args_at)
        node = graph.create_node(op, target, args, kwargs, name=name,
                                 type_expr=_decode_type(item.get("type"), child(at, "type")))
        node.meta.update(_decode_meta(item.get("meta", {}), child(at, "meta")))
        env[name] = node
    return graph


def _decode_target(op: str, target: Any, path: str) -> Any:
    if op == "call_function":
        return decode_op(target, path)
    if op == "call_method":
        return check_tensor_attribute(target, path, "method name")
    if op == "placeholder":
        if not isinstance(target, str) or not _PLACEHOLDER.match(target):
            raise ConfigError(f"{where(path)}: placeholder {target!r} is not an argument name",
                              field=path, value=target)
        return target
    if op == "output":
        if target != "output":
            raise ConfigError(f"{where(path)}: the output node's target must be 'output'",
                              field=path, value=target)
        return target
    return check_path(target, path, "attribute path")


def _check_getattr(args: tuple, path: str) -> None:
    """``getattr(x, name)`` in a saved graph may only read a tensor attribute named literally."""
    if len(args) not in (2, 3):
        raise ConfigError(f"{where(path)}: getattr takes 2 or 3 arguments, got {len(args)}",
                          field=path, value=len(args))
    check_tensor_attribute(args[1], child(path, 1), "attribute name")


def _decode_meta(doc: Any, path: str) -> dict[str, Any]:
    read_fields(doc, path, _META_KEYS)
    meta: dict[str, Any] = {}
    if VALUE_KIND in doc:
        kind = doc[VALUE_KIND]
        if kind not in _VALUE_KINDS:
            raise ConfigError(f"{where(child(path, VALUE_KIND))}: expected one of {_VALUE_KINDS}, got "
                              f"{kind!r}", field=child(path, VALUE_KIND), value=kind)
        meta[VALUE_KIND] = kind
    for key in (ROOT, BOUNDARY):
        if key in doc:
            meta[key] = expect(doc[key], bool, child(path, key), "true or false")
    if REGION in doc:
        meta[REGION] = _decode_region(doc[REGION], child(path, REGION))
    if INPUT_SPEC in doc:
        meta[INPUT_SPEC] = _decode_input_spec(doc[INPUT_SPEC], child(path, INPUT_SPEC))
    if BAKED_INPUT in doc:
        meta[BAKED_INPUT] = expect(doc[BAKED_INPUT], BAKED_TYPES, child(path, BAKED_INPUT),
                                   "a number, true, false or null")
    return meta


def _decode_input_spec(doc: Any, path: str) -> dict[str, Any]:
    read_fields(doc, path, ("shape", "dtype", "fixed", "symbols"), required=("shape", "dtype"))
    shape = expect(doc["shape"], list, child(path, "shape"), "a JSON list of sizes")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**31 for s in shape) \
            or len(shape) > 16:
        raise ConfigError(f"{where(child(path, 'shape'))}: expected at most 16 sizes in [0, 2**31), "
                          f"got {shape!r}", field=child(path, "shape"), value=shape)
    dtype = doc["dtype"]
    if dtype not in SPEC_DTYPES:
        raise ConfigError(f"{where(child(path, 'dtype'))}: expected one of {sorted(SPEC_DTYPES)}, got "
                          f"{dtype!r}", field=child(path, "dtype"), value=dtype)
    if "fixed" not in doc:
        return {"shape": shape, "dtype": dtype}
    fixed = expect(doc["fixed"], list, child(path, "fixed"), "a JSON list of dimensions")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < len(shape) for d in fixed):
        raise ConfigError(f"{where(child(path, 'fixed'))}: expected dimensions of the {len(shape)}-d shape, "
                          f"got {fixed!r}", field=child(path, "fixed"), value=fixed)
    if "symbols" not in doc:
        return {"shape": shape, "dtype": dtype, "fixed": fixed}
    symbols = expect(doc["symbols"], list, child(path, "symbols"), "a JSON list of size symbols")
    if len(symbols) != len(shape) or not all(s is None or isinstance(s, str) and _SYMBOL.match(s) for s in symbols):
        raise ConfigError(f"{where(child(path, 'symbols'))}: expected one symbol name or null per dimension "
                          f"of the {len(shape)}-d shape, got {symbols!r}", field=child(path, "symbols"),
                          value=symbols)
    return {"shape": shape, "dtype": dtype, "fixed": fixed, "symbols": symbols}


def _decode_region(doc: Any, path: str) -> RegionTag:
    read_fields(doc, path, (*_REGION_FIELDS, "pattern", "dtype_config"),
                required=(*_REGION_FIELDS, "pattern"))
    values = {name: expect(doc[name], kind, child(path, name), kind.__name__)
              for name, kind in _REGION_FIELDS.items()}
    dtype_config = doc.get("dtype_config")
    return RegionTag(pattern=decode_pattern(doc["pattern"], child(path, "pattern")),
                     dtype_config=None if dtype_config is None
                     else DTypeConfig.from_data(dtype_config, child(path, "dtype_config")),
                     **values)
