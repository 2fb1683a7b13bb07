"""QConfigMapping: which QConfig each op of a model gets, with torch.ao's precedence.

In increasing priority: global < object type < module name regex (first registered match wins) <
module name (falling back through parent prefixes) < (module name, object type, call index).
A ``None`` qconfig means "do not quantize" and, like any other value, wins at its priority.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Union

from qplug_core.config.codec import (
    call_at,
    child,
    decode_pattern,
    encode_pattern,
    expect,
    read_fields,
    unversioned,
    versioned,
    where,
)
from qplug_core.config.qconfig import (
    QConfig,
    check_optional_qconfig,
    decode_optional_qconfig,
    encode_optional_qconfig,
    from_torch_ao,
)
from qplug_core.config.regex_bound import check_bounded_regex
from qplug_core.errors import ConfigError, ConfigValidationError

__all__ = ["QConfigMapping"]

ObjectType = Union[type, Callable[..., Any], str]

GLOBAL_KEY = "global"
OBJECT_TYPE_KEY = "object_type"
MODULE_NAME_REGEX_KEY = "module_name_regex"
MODULE_NAME_KEY = "module_name"
MODULE_NAME_OBJECT_TYPE_ORDER_KEY = "module_name_object_type_order"
_KEYS = (GLOBAL_KEY, OBJECT_TYPE_KEY, MODULE_NAME_REGEX_KEY, MODULE_NAME_KEY,
         MODULE_NAME_OBJECT_TYPE_ORDER_KEY)


def _check_object_type(value: Any, path: str) -> ObjectType:
    if isinstance(value, (type, str)) or callable(value):
        if isinstance(value, str) and not value:
            raise ConfigValidationError(f"{path}: a method name cannot be empty", field=path, value=value)
        return value
    raise ConfigValidationError(f"{path} must be a module class, a function or a method name "
                                f"string, got {value!r}", field=path, value=value)


def _check_name(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigValidationError(f"{path} must be a module name string such as 'features.0', got "
                                    f"{value!r}", field=path, value=value)
    return value


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


class QConfigMapping:
    """Builder of per-op qconfigs (torch.ao API: ``set_*`` return ``self``)."""

    def __init__(self) -> None:
        self.global_qconfig: QConfig | None = None
        self.object_type_qconfigs: dict[ObjectType, QConfig | None] = {}
        self.module_name_regex_qconfigs: dict[str, QConfig | None] = {}
        self.module_name_qconfigs: dict[str, QConfig | None] = {}
        self.module_name_object_type_order_qconfigs: dict[tuple[str, ObjectType, int], QConfig | None] = {}

    # -- builders ----------------------------------------------------------------------------------

    def set_global(self, global_qconfig: QConfig | None) -> QConfigMapping:
        self.global_qconfig = check_optional_qconfig(global_qconfig, "global_qconfig")
        return self

    def set_object_type(self, object_type: ObjectType, qconfig: QConfig | None) -> QConfigMapping:
        """For a module class, a function (``torch.add``) or a method name (``"reshape"``)."""
        key = _check_object_type(object_type, "object_type")
        self.object_type_qconfigs[key] = check_optional_qconfig(qconfig, "qconfig")
        return self

    def set_module_name_regex(self, module_name_regex: str, qconfig: QConfig | None) -> QConfigMapping:
        """Regexes are tried with ``re.match`` in registration order; re-setting keeps the order.

        A regex is refused unless it is within the bound of ``qplug_core.config.regex_bound``
        (length, repeats, no nested repeats or backreferences): documents carry these."""
        _check_name(module_name_regex, "module_name_regex")
        check_bounded_regex(module_name_regex, "module_name_regex")
        self.module_name_regex_qconfigs[module_name_regex] = check_optional_qconfig(qconfig, "qconfig")
        return self

    def set_module_name(self, module_name: str, qconfig: QConfig | None) -> QConfigMapping:
        """Applies to the module and everything inside it, unless a submodule has its own entry."""
        key = _check_name(module_name, "module_name")
        self.module_name_qconfigs[key] = check_optional_qconfig(qconfig, "qconfig")
        return self

    def set_module_name_object_type_order(self, module_name: str, object_type: ObjectType,
                                          index: int, qconfig: QConfig | None) -> QConfigMapping:
        """For the ``index``-th call (from 0) of ``object_type`` directly inside ``module_name``."""
        _check_name(module_name, "module_name")
        _check_object_type(object_type, "object_type")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ConfigValidationError(f"index must be an int >= 0, got {index!r}", field="index",
                                        value=index)
        self.module_name_object_type_order_qconfigs[(module_name, object_type, index)] = \
            check_optional_qconfig(qconfig, "qconfig")
        return self

    # -- resolution --------------------------------------------------------------------------------

    def _regex_qconfig(self, module_path: str, fallback: QConfig | None) -> QConfig | None:
        for regex, qconfig in self.module_name_regex_qconfigs.items():
            if re.match(regex, module_path):
                return qconfig
        return fallback

    def _module_name_qconfig(self, module_path: str, fallback: QConfig | None) -> QConfig | None:
        while module_path:
            if module_path in self.module_name_qconfigs:
                return self.module_name_qconfigs[module_path]
            module_path = _parent(module_path)
        return fallback

    def _type_or_name(self, object_type: Any, module_path: str,
                      fallback: QConfig | None) -> QConfig | None:
        qconfig = self.object_type_qconfigs.get(object_type, fallback)
        return self._module_name_qconfig(module_path, self._regex_qconfig(module_path, qconfig))

    def _order(self, module_path: str, object_type: Any, index: int | None,
               fallback: QConfig | None) -> QConfig | None:
        if index is None:
            return fallback
        return self.module_name_object_type_order_qconfigs.get((module_path, object_type, index), fallback)

    def qconfig_for_module(self, name: str, module_type: type, index: int | None = None) -> QConfig | None:
        """A ``call_module`` node: ``index`` counts calls of ``module_type`` in the parent module."""
        qconfig = self._type_or_name(module_type, name, self.global_qconfig)
        return self._order(_parent(name), module_type, index, qconfig)

    def qconfig_for_function(self, function: Callable[..., Any], scope_path: str, scope_type: type | None,
                             index: int | None = None) -> QConfig | None:
        """A ``call_function`` node inside module ``scope_path`` of type ``scope_type``.

        As in torch.ao, a qconfig set for the enclosing module's *type* overrides the function's.
        """
        qconfig = self.object_type_qconfigs.get(function, self.global_qconfig)
        qconfig = self._type_or_name(scope_type, scope_path, qconfig)
        return self._order(scope_path, function, index, qconfig)

    def qconfig_for_method(self, method: str, scope_path: str, scope_type: type | None) -> QConfig | None:
        """A ``call_method`` node; the enclosing module's type and name override the method's."""
        qconfig = self._type_or_name(method, scope_path, self.global_qconfig)
        return self._type_or_name(scope_type, scope_path, qconfig)

    # -- plain data --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        o, r, n, t = (OBJECT_TYPE_KEY, MODULE_NAME_REGEX_KEY, MODULE_NAME_KEY,
                      MODULE_NAME_OBJECT_TYPE_ORDER_KEY)
        return versioned({
            GLOBAL_KEY: encode_optional_qconfig(self.global_qconfig, GLOBAL_KEY),
            o: [_row(child(o, i), [k], 0, q) for i, (k, q) in enumerate(self.object_type_qconfigs.items())],
            r: [_row(child(r, i), [k], None, q)
                for i, (k, q) in enumerate(self.module_name_regex_qconfigs.items())],
            n: [_row(child(n, i), [k], None, q) for i, (k, q) in enumerate(self.module_name_qconfigs.items())],
            t: [_row(child(t, i), list(k), 1, q)
                for i, (k, q) in enumerate(self.module_name_object_type_order_qconfigs.items())],
        })

    @classmethod
    def from_dict(cls, doc: Any) -> QConfigMapping:
        _refuse_torch_ao_dict(doc)
        data = read_fields(unversioned(doc), "", _KEYS)
        mapping = cls()
        if GLOBAL_KEY in data:
            mapping.set_global(decode_optional_qconfig(data[GLOBAL_KEY], GLOBAL_KEY))
        for path, (t, q) in _rows(data, OBJECT_TYPE_KEY, 2):
            call_at(path, mapping.set_object_type, _decode_type(t, child(path, 0)),
                         decode_optional_qconfig(q, child(path, 1)))
        for path, (r, q) in _rows(data, MODULE_NAME_REGEX_KEY, 2):
            call_at(path, mapping.set_module_name_regex, r, decode_optional_qconfig(q, child(path, 1)))
        for path, (n, q) in _rows(data, MODULE_NAME_KEY, 2):
            call_at(path, mapping.set_module_name, n, decode_optional_qconfig(q, child(path, 1)))
        for path, (n, t, k, q) in _rows(data, MODULE_NAME_OBJECT_TYPE_ORDER_KEY, 4):
            call_at(path, mapping.set_module_name_object_type_order, n,
                         _decode_type(t, child(path, 1)), k, decode_optional_qconfig(q, child(path, 3)))
        return mapping

    # -- value semantics ---------------------------------------------------------------------------

    def _state(self) -> tuple[Any, ...]:
        return (self.global_qconfig, list(self.object_type_qconfigs.items()),
                list(self.module_name_regex_qconfigs.items()), list(self.module_name_qconfigs.items()),
                list(self.module_name_object_type_order_qconfigs.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QConfigMapping) and self._state() == other._state()

    __hash__ = None  # type: ignore[assignment]  # mutable builder

    def __repr__(self) -> str:
        parts = [] if self.global_qconfig is None else [f"global={self.global_qconfig!r}"]
        for key, table in ((OBJECT_TYPE_KEY, self.object_type_qconfigs),
                           (MODULE_NAME_REGEX_KEY, self.module_name_regex_qconfigs),
                           (MODULE_NAME_KEY, self.module_name_qconfigs),
                           (MODULE_NAME_OBJECT_TYPE_ORDER_KEY, self.module_name_object_type_order_qconfigs)):
            if table:
                parts.append(f"{key}={table!r}")
        return f"QConfigMapping({', '.join(parts)})"


def _row(path: str, cells: list[Any], type_column: int | None, qconfig: QConfig | None) -> list[Any]:
    """One document row: the key cells (the object type encoded like a pattern op), then the qconfig."""
    if type_column is not None:
        cells[type_column] = encode_pattern(cells[type_column], child(path, type_column))
    return [*cells, encode_optional_qconfig(qconfig, child(path, len(cells)))]


def _rows(data: Any, key: str, width: int) -> list[tuple[str, list[Any]]]:
    rows = expect(data.get(key, []), list, key, "a JSON list of rows")
    result = []
    for i, row in enumerate(rows):
        path = child(key, i)
        if not isinstance(row, list) or len(row) != width:
            raise ConfigError(f"{where(path)}: expected a row of {width} items, got {row!r}",
                              field=path, value=row)
        result.append((path, row))
    return result


def _decode_type(doc: Any, path: str) -> ObjectType:
    value = decode_pattern(doc, path)
    if isinstance(value, tuple):
        raise ConfigError(f"{where(path)}: an object type is a single class, function or method "
                          "name, not a pattern tuple", field=path, value=value)
    return value


def require_mapping(mapping: Any) -> QConfigMapping:
    """``mapping`` if it is qplug's QConfigMapping, else a :class:`ConfigValidationError` saying what
    it is (a torch.ao mapping is named as one)."""
    if isinstance(mapping, QConfigMapping):
        return mapping
    got = from_torch_ao(mapping) or type(mapping).__name__
    raise ConfigValidationError(f"qconfig_mapping must be a QConfigMapping, got {got}", field="qconfig_mapping")


#: torch.ao's QConfigMapping dict keeps the global qconfig under this key (qplug's documents: "global")
_TORCH_AO_GLOBAL_KEY = ""


def _refuse_torch_ao_dict(doc: Any) -> None:
    """torch.ao's ``QConfigMapping.to_dict()`` (Python objects, the global under ``""``) is not qplug's
    JSON document: say so, instead of "missing 'schema_version'" and then "unknown key ''"."""
    if isinstance(doc, dict) and _TORCH_AO_GLOBAL_KEY in doc:
        raise ConfigValidationError(
            "this is torch.ao's QConfigMapping dict (the global qconfig under key '', Python classes and "
            "QConfigs as values); qplug's QConfigMapping.from_dict reads the JSON document its to_dict() "
            "writes. Build the mapping with qp.QConfigMapping().set_global(...).set_object_type(...)"
            ".set_module_name(...) (docs/migrating.md)", field=_TORCH_AO_GLOBAL_KEY, value=doc)
