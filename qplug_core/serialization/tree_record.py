"""The input and output structure of a torch.export-captured model, as data in a saved file.

Such a graph takes and returns flat tensors; export's pytree calling code turns a list or dict
output (a detector's ``{"cls": [...], "box": [...]}``) back into its structure. A file stores the
graph, not that code, so the structure is recorded here as plain JSON and the code rebuilt at load.
Only tuples, lists, dicts and leaves are written and read: no type is resolved by name. Any other
container (a namedtuple, a dataclass) is saved as a tuple of its children, with a warning.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree
from torch import fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from qplug_core.config.codec import child, expect, read_tagged, where
from qplug_core.errors import ConfigError, warn_user
from qplug_core.serialization.values import check_identifier

KEY = "pytree"
_FIELDS = ("args", "in", "out")
_CONTAINERS: dict[str, type] = {"tuple": tuple, "list": list, "dict": dict}
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
        warn_user(f"qplug: qp.save keeps only tuples, lists and dicts around a model's tensors; "
                  f"{'; '.join(changed[:4])}: the loaded model takes or returns a tuple there")
    return doc


def _encode(spec: pytree.TreeSpec, at: str, changed: list[str]) -> Any:
    """A leaf as null, a container as ``{"tuple"|"list": [...]}`` or ``{"dict": [[key, ...], ...]}``."""
    if spec.is_leaf():
        return None
    children = spec.children()
    if spec.type is dict:
        return {"dict": [[key, _encode(c, f"{at}[{key!r}]", changed)] for key, c in zip(spec.context, children)]}
    if spec.type not in (tuple, list):
        shown = spec.context if isinstance(spec.context, type) else spec.type  # a namedtuple's class
        changed.append(f"{at} is a {getattr(shown, '__name__', shown)}")
    kind = "list" if spec.type is list else "tuple"
    return {kind: [_encode(c, f"{at}[{i}]", changed) for i, c in enumerate(children)]}


def install(gm: fx.GraphModule, doc: Any, path: str) -> None:
    """Give ``gm`` the calling structure of ``doc``; raises :class:`ConfigError` naming the bad field
    when it is malformed or does not fit the graph's inputs and outputs."""
    fields = expect(doc, dict, path, "a JSON object")
    if set(fields) != set(_FIELDS):
        raise ConfigError(f"{where(path)}: expected the keys {', '.join(_FIELDS)}, got {sorted(fields)}",
                          field=path, value=sorted(fields))
    names = [check_identifier(name, child(child(path, "args"), i), "argument name")
             for i, name in enumerate(expect(doc["args"], list, child(path, "args"), "a JSON list"))]
    in_spec = _decode(doc["in"], child(path, "in"), 0)
    out_spec = None if doc["out"] is None else _decode(doc["out"], child(path, "out"), 0)
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


def _decode(doc: Any, path: str, depth: int) -> pytree.TreeSpec:
    if doc is None:
        return pytree.treespec_leaf()
    if depth >= _MAX_DEPTH:
        raise ConfigError(f"{where(path)}: nested deeper than {_MAX_DEPTH} containers", field=path, value=depth)
    tag, payload = read_tagged(doc, path, _CONTAINERS)
    at = child(path, tag)
    items = expect(payload, list, at, "a JSON list")
    if tag != "dict":
        return pytree.TreeSpec(_CONTAINERS[tag], None, [_decode(c, child(at, i), depth + 1)
                                                        for i, c in enumerate(items)])
    keys, children = [], []
    for i, item in enumerate(items):
        pair = expect(item, list, child(at, i), "a [key, structure] pair")
        if len(pair) != 2 or not isinstance(pair[0], (str, int)) or isinstance(pair[0], bool) or pair[0] in keys:
            raise ConfigError(f"{where(child(at, i))}: expected a [key, structure] pair with a new string or "
                              f"integer key, got {pair!r}", field=child(at, i), value=pair)
        keys.append(pair[0])
        children.append(_decode(pair[1], child(child(at, i), 1), depth + 1))
    return pytree.TreeSpec(dict, keys, children)


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
