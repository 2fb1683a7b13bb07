"""Features of the file format: how it grows without every new key breaking older readers.

A file's document is read strictly (an unknown key is a typo or a tampered file, not data), so
each key a new qplug-core wrote made every older one refuse the whole file, even where the key
was optional (``partition_models``, then ``shared`` and ``runtime`` inside it). From here on,
``schema_version`` 1 is the format as this module's readers know it, and whatever a later
qplug-core adds to it is a *feature* its writer declares in the document's ``features`` object
(name -> :class:`Feature`): an optional one lists the keys (dotted paths, ``*`` for every entry of
an object or list) and tensors (name prefixes) it adds and what a reader loses without them, and a
reader that does not know it leaves them out with a warning saying so; a required one is refused
by such a reader, naming it and the qplug-core version that writes it. A change of what format 1's
keys mean raises ``schema_version`` instead (refused as a whole). docs/security.md, "File format
versions".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from qplug_core.config.codec import child, expect, read_fields, where
from qplug_core.errors import ConfigError, SerializationError, warn_user
from qplug_core.registry.plugins import core_version

KEY = "features"
_FIELDS = ("required", "since", "keys", "tensors", "lost")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
_VERSION = re.compile(r"[A-Za-z0-9.+!_-]{1,64}\Z")
_SEGMENT = re.compile(r"[A-Za-z0-9_]{1,100}\Z|\*\Z")
#: keys no feature may take out: the rule's own
_RULE_KEYS = ("format", "schema_version", KEY)
_MAX_FEATURES, _MAX_PATHS, _MAX_DEPTH, _MAX_TEXT = 64, 64, 16, 300
#: the removals visit at most this many nodes per node of the document, all paths together: past
#: it the file is refused (64 features x 64 ``*`` paths would otherwise walk it 4096 times)
_VISITS_PER_NODE = 2


@dataclass(frozen=True)
class Feature:
    """A feature's declaration: ``since`` is the first qplug-core writing it; an optional one
    (``required=False``) names its ``keys`` and ``tensors`` and what a reader without it has ``lost``."""

    required: bool
    since: str
    keys: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    lost: str = ""

    def to_document(self) -> dict[str, Any]:
        return {"required": self.required, "since": self.since, "keys": list(self.keys),
                "tensors": list(self.tensors), "lost": self.lost}

    @classmethod
    def from_document(cls, doc: Any, path: str) -> Feature:
        """Check a declaration (its text is printed in warnings and errors); :class:`ConfigError`."""
        read_fields(doc, path, _FIELDS, required=("required", "since"))
        required = expect(doc["required"], bool, child(path, "required"), "true or false")
        since = _text(doc["since"], child(path, "since"))
        if not _VERSION.match(since):
            raise ConfigError(f"{where(child(path, 'since'))}: {since!r} is not a version", field=path, value=since)
        keys = tuple(_key_path(key, child(child(path, "keys"), i))
                     for i, key in enumerate(_bounded_list(doc.get("keys", []), child(path, "keys"))))
        tensors = tuple(_text(prefix, child(child(path, "tensors"), i))
                        for i, prefix in enumerate(_bounded_list(doc.get("tensors", []), child(path, "tensors"))))
        return cls(required, since, keys, tensors, _text(doc.get("lost", ""), child(path, "lost"), empty=True))


#: the features this qplug-core writes (each declared in a file that holds its keys) and reads
WRITTEN: dict[str, Feature] = {
    "final_check": Feature(required=False, since="0.1.0", keys=("model.final_check",),
                           lost="the final check's scores: the report shows no 'final model vs float' line"),
    "folded_affines": Feature(required=False, since="0.1.0", keys=("model.folded_affines",),
                              lost="the per-channel affines folded into convs: qp.compare pairs those convs "
                                   "with their float output before the affine"),
    "shared_transposed": Feature(
        required=False, since="0.1.0", keys=("model.partition_models.*.models.*.shared_transposed",),
        lost="stored partition models whose linear weights the file holds once (transposed): each such partition "
             "is exported again at its first call (seconds)"),
}
KNOWN: frozenset[str] = frozenset(WRITTEN)


def declarations(model: dict[str, Any]) -> dict[str, Any]:
    """The ``features`` object for a document whose ``model`` is ``model``: the written features
    whose keys it holds (empty where it holds none, so such files read as format 1)."""
    return {name: feature.to_document() for name, feature in WRITTEN.items()
            if any(_holds(model, key.split(".")[1:]) for key in feature.keys)}


def _holds(node: Any, segments: list[str]) -> bool:
    """Whether ``node`` has a key at the path ``segments`` (``*``: any entry)."""
    return any(len(segments) == 1 or _holds(entry, segments[1:]) for entry in _entries(node, segments[0]))


def accept(document: Any, tensors: dict[str, torch.Tensor], source: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """``document`` (edited in place) and ``tensors`` without the optional features this qplug-core
    does not know (their keys, their tensors and their entries in the document's table), after a
    warning naming them and what is lost; a file needing a feature it does not know raises
    :class:`SerializationError` naming the feature and the version to upgrade to. Files declaring
    none (every file written before the rule) are returned as they are."""
    if not isinstance(document, dict) or KEY not in document:
        return document, tensors
    try:
        declared = {name: Feature.from_document(doc, child(KEY, name))
                    for name, doc in _checked_names(document[KEY]).items()}
    except ConfigError as exc:
        raise _invalid(source, exc) from exc
    unknown = {name: feature for name, feature in declared.items() if name not in KNOWN}
    needed = {name: feature for name, feature in unknown.items() if feature.required}
    if needed:
        newest = max(needed.values(), key=lambda f: _sortable(f.since)).since
        raise SerializationError(
            f"{source} needs file-format features this qplug-core ({core_version() or 'unknown version'}) does not "
            f"read: {', '.join(f'{name!r} (since qplug-core {f.since})' for name, f in needed.items())}; it was "
            f"written by qplug-core {_writer(document)}. Upgrade: pip install 'qplug-core>={newest}'", path=str(source))
    if not unknown:
        return document, tensors
    prefixes = tuple(prefix for feature in unknown.values() for prefix in feature.tensors)
    try:
        _Removal(document).remove(dict.fromkeys(key for feature in unknown.values() for key in feature.keys))
    except ConfigError as exc:
        raise _invalid(source, exc) from exc
    if prefixes:
        tensors = {name: t for name, t in tensors.items() if not name.startswith(prefixes)}
        _remove_tensors(document.get("model"), prefixes)
    document[KEY] = {name: doc for name, doc in document[KEY].items() if name not in unknown}
    if not document[KEY]:
        del document[KEY]
    warn_user(f"qplug: {source} was written by qplug-core {_writer(document)} with file-format features this "
              f"qplug-core ({core_version() or 'unknown version'}) does not know; it loads without them: "
              + "; ".join(f"{name} (since {f.since}): {f.lost or 'nothing said'}" for name, f in unknown.items())
              + f". Upgrade qplug-core to {max((f.since for f in unknown.values()), key=_sortable)} or later to keep them")
    return document, tensors


def _invalid(source: Path, exc: ConfigError) -> SerializationError:
    return SerializationError(f"{source} is not a valid qplug artifact: {exc}", path=str(source))


def _checked_names(doc: Any) -> dict[str, Any]:
    features = expect(doc, dict, KEY, "a JSON object")
    if len(features) > _MAX_FEATURES:
        raise ConfigError(f"{KEY}: {len(features)} entries, at most {_MAX_FEATURES}", field=KEY, value=len(features))
    for name in features:
        if not _NAME.match(name):
            raise ConfigError(f"{KEY}: {name[:100]!r} is not a feature name (lowercase letters, digits, _)",
                              field=KEY, value=name)
    return features


def _bounded_list(value: Any, path: str) -> list[Any]:
    items = expect(value, list, path, "a JSON list")
    if len(items) > _MAX_PATHS:
        raise ConfigError(f"{where(path)}: {len(items)} entries, at most {_MAX_PATHS}", field=path, value=len(items))
    return items


def _text(value: Any, path: str, *, empty: bool = False) -> str:
    """A short printable string (it is shown in warnings and errors)."""
    text = expect(value, str, path, "a string")
    if len(text) > _MAX_TEXT or not text.isprintable() or not (text or empty):
        raise ConfigError(f"{where(path)}: not a short printable text", field=path, value=text[:100])
    return text


def _key_path(value: Any, path: str) -> str:
    """``model.partition_models.*.runtime``: a feature's key, never one of the rule's own (the
    top-level keys are a fixed list, so a path starts with a name, never ``*``)."""
    segments = _text(value, path).split(".")
    if (len(segments) > _MAX_DEPTH or not all(_SEGMENT.match(s) for s in segments) or "*" in (segments[0], segments[-1])
            or segments[0] in _RULE_KEYS):
        raise ConfigError(f"{where(path)}: {value!r} is not a key path (dotted names, * for every entry, at most "
                          f"{_MAX_DEPTH}, starting and ending in a name, not {', '.join(_RULE_KEYS)})",
                          field=path, value=value)
    return value


class _Removal:
    """Removes keys from a document within a budget of visited nodes, so that a hostile file's
    declarations cost time in proportion to its size (as the rest of the reader), not 4096 walks."""

    def __init__(self, document: Any) -> None:
        self.nodes = _size(document)
        self.left = _VISITS_PER_NODE * self.nodes
        self.document = document

    def remove(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._remove(self.document, key.split("."))

    def _remove(self, node: Any, segments: list[str]) -> None:
        """Remove the keys at the path ``segments`` from ``node``, wherever ``*`` leads."""
        self.left -= 1
        if self.left < 0:
            raise ConfigError(f"{KEY}: the declared keys' paths visit more than {_VISITS_PER_NODE} nodes per node of "
                              f"the document ({self.nodes} nodes), where a writer declares a few paths to its own keys",
                              field=KEY, value=self.nodes)
        head, rest = segments[0], segments[1:]
        if not rest:
            if isinstance(node, dict):
                node.pop(head, None)
            return
        for entry in _entries(node, head):
            self._remove(entry, rest)


def _size(document: Any) -> int:
    """The number of nodes (objects, lists and values) in ``document``."""
    count, stack = 0, [document]
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
    return count


def _entries(node: Any, segment: str) -> list[Any]:
    """What ``segment`` of a key path names in ``node``: its entry, or all of them for ``*``."""
    if segment == "*":
        return list(node.values()) if isinstance(node, dict) else list(node) if isinstance(node, list) else []
    return [node[segment]] if isinstance(node, dict) and segment in node else []


def _remove_tensors(model: Any, prefixes: tuple[str, ...]) -> None:
    """Remove the table entries of the tensors named with ``prefixes`` (a graph model's table)."""
    table = model.get("tensors") if isinstance(model, dict) else None
    if isinstance(table, dict):
        for name in [name for name in table if name.startswith(prefixes)]:
            del table[name]


def _writer(document: dict[str, Any]) -> str:
    versions = document.get("versions")
    version = versions.get("qplug-core") if isinstance(versions, dict) else None
    return version if isinstance(version, str) and _VERSION.match(version) else "(version not recorded)"


def _sortable(version: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, version)
