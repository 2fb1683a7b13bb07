"""The input and output structure of a torch.export-captured model, as data in a saved file.

Such a graph takes and returns flat tensors; export's pytree calling code turns a list or dict
output (a detector's ``{"cls": [...], "box": [...]}``, a transformer's ``ModelOutput``) back into
its structure. A file stores the graph, not that code, so the structure is recorded here as plain
JSON and the code rebuilt at load. Tuples, lists, dicts and leaves are written as they are; a
namedtuple as its class name and field names (load makes a namedtuple class of them, no name is
looked up); an OrderedDict or a ``ModelOutput`` by a name that only
:mod:`~qplug_core.serialization.output_types` resolves (else the loaded model returns a dict, with a
warning). Any other container (a dataclass) is saved as a tuple of its children, with a warning.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from typing import Any

import torch.utils._pytree as pytree
from torch import fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from qplug_core.config.codec import child, expect, read_fields, read_tagged, where
from qplug_core.errors import ConfigError, warn_user
from qplug_core.serialization import output_types
from qplug_core.serialization.values import check_identifier, check_public

KEY = "pytree"
_FIELDS = ("args", "in", "out")
_SEQUENCES: dict[str, type] = {"tuple": tuple, "list": list}
#: keyed containers: ``{"dict": [[key, structure], ...]}``, and of a named class
#: ``{"mapping" | "namedtuple": {"type": name, "items": [[key, structure], ...]}}``
_NAMED = ("mapping", "namedtuple")
_TAGS = (*_SEQUENCES, "dict", *_NAMED)
#: deeper structures are no model's inputs or outputs (and would exhaust Python's recursion)
_MAX_DEPTH = 32


def to_document(gm: fx.GraphModule) -> dict[str, Any] | None:
    """``gm``'s calling structure, None for a graph called with its placeholders (no pytree code)."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen) or codegen.pytree_info is None:
        return None
    info = codegen.pytree_info
    changed: list[str] = []
    doc = {"args": list(info.orig_args), "in": _encode(info.in_spec, "input", changed),
           "out": None if info.out_spec is None else _encode(info.out_spec, "output", changed)}
    if changed:
        warn_user(f"qplug: qp.save keeps tuples, lists, dicts, namedtuples, OrderedDicts and "
                  f"transformers.modeling_outputs classes around a model's tensors; the loaded model "
                  f"takes or returns {'; '.join(changed[:4])}")
    return doc


def _encode(spec: pytree.TreeSpec, at: str, changed: list[str]) -> Any:
    """A leaf as null, a sequence as ``{"tuple"|"list": [...]}``, a keyed container as in :data:`_NAMED`."""
    if spec.is_leaf():
        return None
    if spec.type in (tuple, list):
        return {spec.type.__name__: [_encode(c, f"{at}[{i}]", changed) for i, c in enumerate(spec.children())]}
    is_namedtuple = isinstance(spec.context, type) and pytree.is_namedtuple_class(spec.context) \
        and not any(field.startswith("_") for field in spec.context._fields)  # load takes public fields
    name = spec.context.__name__ if is_namedtuple else output_types.name_of(spec.type)
    if spec.type is not dict and name is None:
        shown = spec.context if isinstance(spec.context, type) else spec.type  # a namedtuple's class
        changed.append(f"{at} as a tuple (it is a {getattr(shown, '__name__', shown)})")
        return {"tuple": [_encode(c, f"{at}[{i}]", changed) for i, c in enumerate(spec.children())]}
    keys = list(spec.context._fields if is_namedtuple else spec.context)
    items = [[key, _encode(c, f"{at}[{key!r}]", changed)] for key, c in zip(keys, spec.children())]
    if spec.type is dict:
        return {"dict": items}
    if is_namedtuple:
        return {"namedtuple": {"type": name, "items": items}}
    resolved, why = output_types.resolve(name, keys, at)
    if resolved is not spec.type:
        changed.append(f"{at} as a dict ({name}: {why})")
    return {"mapping": {"type": name, "items": items}}


def install(gm: fx.GraphModule, doc: Any, path: str) -> None:
    """Give ``gm`` the calling structure of ``doc``; raises :class:`ConfigError` naming the bad field
    when it is malformed or does not fit the graph's inputs and outputs."""
    fields = expect(doc, dict, path, "a JSON object")
    if set(fields) != set(_FIELDS):
        raise ConfigError(f"{where(path)}: expected the keys {', '.join(_FIELDS)}, got {sorted(fields)}",
                          field=path, value=sorted(fields))
    names = [check_identifier(name, child(child(path, "args"), i), "argument name")
             for i, name in enumerate(expect(doc["args"], list, child(path, "args"), "a JSON list"))]
    built_plain: list[str] = []
    in_spec = _decode(doc["in"], child(path, "in"), 0, built_plain)
    out_spec = None if doc["out"] is None else _decode(doc["out"], child(path, "out"), 0, built_plain)
    _check_inputs(in_spec, names, child(path, "in"))
    placeholders = sum(node.op == "placeholder" for node in gm.graph.nodes)
    _check_leaves(in_spec, placeholders, child(path, "in"), "inputs")
    if out_spec is not None:
        output = gm.graph.output_node().args[0]
        _check_leaves(out_spec, len(output) if isinstance(output, (tuple, list)) else 1,
                      child(path, "out"), "outputs")
    gm.graph.set_codegen(_PyTreeCodeGen(_PyTreeInfo(names, in_spec, out_spec)))
    gm._in_spec, gm._out_spec = in_spec, out_spec
    gm.recompile()
    if built_plain:
        warn_user(f"qplug: the file names output classes qp.load does not build; the loaded model takes or "
                  f"returns {'; '.join(built_plain[:4])}")


def _decode(doc: Any, path: str, depth: int, built_plain: list[str]) -> pytree.TreeSpec:
    """The spec ``doc`` writes; a named class that does not resolve becomes a dict, noted in
    ``built_plain``."""
    if doc is None:
        return pytree.treespec_leaf()
    if depth >= _MAX_DEPTH:
        raise ConfigError(f"{where(path)}: nested deeper than {_MAX_DEPTH} containers", field=path, value=depth)
    tag, payload = read_tagged(doc, path, _TAGS)
    at = child(path, tag)
    if tag in _SEQUENCES:
        items = expect(payload, list, at, "a JSON list")
        return pytree.TreeSpec(_SEQUENCES[tag], None, [_decode(c, child(at, i), depth + 1, built_plain)
                                                       for i, c in enumerate(items)])
    if tag == "dict":
        return pytree.TreeSpec(dict, *_decode_items(payload, at, depth, built_plain))
    fields = read_fields(payload, at, ("type", "items"), required=("type", "items"))
    name = expect(fields["type"], str, child(at, "type"), "a class name")
    keys, children = _decode_items(fields["items"], child(at, "items"), depth, built_plain)
    if tag == "namedtuple":
        check_identifier(name, child(at, "type"), "namedtuple name")
        for i, key in enumerate(keys):
            check_public(key, child(child(child(at, "items"), i), 0), "namedtuple field")
        return pytree.TreeSpec(namedtuple, _namedtuple_class(name, tuple(keys)), children)
    cls, why = output_types.resolve(name, keys, child(at, "type"))
    if cls is None:
        built_plain.append(f"{path} as a dict ({name}: {why})")
        cls = dict
    return pytree.TreeSpec(cls, keys, children)


def _decode_items(doc: Any, path: str, depth: int, built_plain: list[str]) -> tuple[list[Any], list[pytree.TreeSpec]]:
    """``[[key, structure], ...]`` with distinct string or integer keys, as keys and specs."""
    keys, children = [], []
    for i, item in enumerate(expect(doc, list, path, "a JSON list")):
        pair = expect(item, list, child(path, i), "a [key, structure] pair")
        if len(pair) != 2 or not isinstance(pair[0], (str, int)) or isinstance(pair[0], bool) or pair[0] in keys:
            raise ConfigError(f"{where(child(path, i))}: expected a [key, structure] pair with a new string or "
                              f"integer key, got {pair!r}", field=child(path, i), value=pair)
        keys.append(pair[0])
        children.append(_decode(pair[1], child(child(path, i), 1), depth + 1, built_plain))
    return keys, children


#: the namedtuple classes loads made, by name and fields, for the process's lifetime
_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}
_NAMEDTUPLES_MADE = threading.Lock()


def _namedtuple_class(name: str, fields: tuple[str, ...]) -> type:
    """One class per name and fields, so that two loaded models' outputs have the same type; its
    instances pickle as name, fields and values (pickle finds no class made at load by its name:
    a worker pool's outputs)."""
    with _NAMEDTUPLES_MADE:
        made = _NAMEDTUPLES.get((name, fields))
        if made is None:
            made = namedtuple(name, fields)  # type: ignore[misc]
            made.__reduce__ = lambda self: (_namedtuple_of, (name, fields, tuple(self)))  # type: ignore[method-assign]
            _NAMEDTUPLES[name, fields] = made
    return made


def _namedtuple_of(name: str, fields: tuple[str, ...], values: tuple) -> tuple:
    """A pickled output of a loaded model, rebuilt (:func:`_namedtuple_class`)."""
    return _namedtuple_class(name, fields)(*values)


def _check_inputs(spec: pytree.TreeSpec, names: list[str], path: str) -> None:
    """Export's ``((args...), {keywords})``, one distinct name per argument and keyword: the
    generated code binds the names and pastes the keywords."""
    if spec.type is not tuple or spec.num_children != 2 or spec.child(0).type is not tuple \
            or spec.child(1).type is not dict:
        raise ConfigError(f"{where(path)}: expected a tuple of the positional arguments and a dict of the "
                          "keywords", field=path, value=None)
    keywords = list(spec.child(1).context)
    for i, key in enumerate(keywords):
        check_identifier(key, child(path, f"keyword {i}"), "keyword")
    if len(set(names)) != len(names) or len(names) < spec.child(0).num_children + len(keywords):
        raise ConfigError(f"{where(path)}: {len(names)} argument names for {spec.child(0).num_children} "
                          f"arguments and {len(keywords)} keywords (each name once)", field=path, value=names)


def _check_leaves(spec: pytree.TreeSpec, count: int, path: str, what: str) -> None:
    if spec.num_leaves != count:
        raise ConfigError(f"{where(path)}: the structure holds {spec.num_leaves} {what}, the graph has "
                          f"{count}", field=path, value=spec.num_leaves)
