"""The one table of objects a saved file or config document may name, keyed by stable names.

A file or document is untrusted, so a name in it is only ever *looked up* in this table: never
imported, never resolved by walking attributes (``qplug_core.cli.app.os.system`` reaches ``os`` that
way), never followed through a module re-export. The table holds the exact objects qplug writes,
each with the :class:`Kind` of use it may be put to, so that an observer field cannot name an op
and a graph cannot call a class:

* **ops** (``call_function`` targets and callable values): an explicit set of ``operator``
  functions, ``builtins.getattr``, torch's native functions (``torch._C._VariableFunctions``),
  ``torch.functional`` and ``torch.nn.functional``, minus the few with effects outside the
  tensors (``torch.from_file``, ``set_*`` switches); and ``aten::name.overload`` strings, looked
  up in torch's operator registry by that exact string;
* **module classes**: ``torch.nn.modules.__all__`` and the module classes defined in qplug's own
  module files (reference, fused, QAT, eager-stub modules);
* **observer and fake-quant classes** defined in ``qplug_core.observers``;
* **fuser methods** defined in ``qplug_core.nn.fuser_methods``;
* what the installed backends register: their pattern configs' ops, module classes and fuser
  methods, their kernel tables' keys and their default qconfig mappings' observers;
* objects registered with :func:`register_serializable` and the classes defined in the modules of
  a package registered with :func:`register_serializable_module`.

The core part is built once, on first use; the backend part is rebuilt whenever the plugins are
reloaded (it lives in the plugin manager's cache), because backends come from plugins.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import inspect
import operator
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.errors import ConfigError, ConfigValidationError, QplugError
from qplug_core.observers.factory import FactoryMixin, ObserverFactory
from qplug_core.patterns import MatchAllNode

__all__ = [
    "TENSOR_ATTRIBUTES",
    "UNINITIALISED_PREFIXES",
    "Kind",
    "NameTable",
    "decode_name",
    "encode_name",
    "name_table",
    "register_serializable",
    "register_serializable_module",
]


class Kind(str, enum.Enum):
    """What a named object may be used as."""

    OP = "op"                  #: called by a saved graph, or a pattern's function
    MODULE = "module"          #: an nn.Module class rebuilt from a file or named in a pattern
    OBSERVER = "observer"      #: an observer or fake-quant class in a qconfig
    FUSER = "fuser"            #: a pattern config's fuser method / root node / extra inputs getter
    PATTERN = "pattern"        #: a pattern placeholder such as MatchAllNode
    TYPE = "type"              #: a node's type annotation


ANY_KIND = frozenset(Kind)

#: ``operator`` functions a graph may call: arithmetic, comparison and indexing, nothing that
#: calls or looks up something by name (``attrgetter``, ``methodcaller``, ``call``)
_OPERATORS = (
    "abs", "add", "and_", "concat", "contains", "eq", "floordiv", "ge", "getitem", "gt", "iadd",
    "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "index", "inv", "invert",
    "ior", "ipow", "irshift", "is_", "is_not", "isub", "itruediv", "ixor", "le", "lshift", "lt",
    "matmul", "mod", "mul", "ne", "neg", "not_", "or_", "pos", "pow", "rshift", "sub", "truediv",
    "truth", "xor",
)
#: native torch functions with effects beyond the tensors they get and return (files), that read
#: foreign memory (numpy arrays, buffers), or whose invariants are not checked: sparse constructors,
#: ``segment_reduce(unsafe=True)`` and the engines' raw kernels, which take packed weights as
#: pointers. No float model or reference form calls them.
_TORCH_DENIED = frozenset({"from_file", "from_numpy", "frombuffer", "segment_reduce", "resize_as_sparse_"})
#: ops whose result holds uninitialised memory (another tensor's freed values: in a server that
#: loads user models, other requests' data): every ``empty*`` and ``new_empty*`` constructor and
#: every ``resize*`` (growing a tensor leaves the new elements uninitialised), any overload
UNINITIALISED_PREFIXES = ("empty", "new_empty", "resize")
_TORCH_DENIED_PREFIXES = ("set_", "sparse_", "fbgemm_", "mkldnn_", "miopen_", "cudnn_", "quantized_",
                          *UNINITIALISED_PREFIXES)
#: what a function's ``__module__`` is for the Python-level functions of ``torch.nn.functional``
_FUNCTIONAL_MODULES = frozenset({"torch.nn.functional", "torch._C._nn", "torch"})
#: tensor methods and attributes that reach storages, numpy arrays, autograd nodes or callbacks:
#: objects whose methods (``from_file``, ``tofile``, ``register_hook``) act outside the tensor
#: (``storage_type`` returns a storage class), and those returning uninitialised memory (``new``
#: with a size, ``new_empty``, ``resize_``: see :data:`UNINITIALISED_PREFIXES`)
_TENSOR_DENIED = frozenset({
    "storage", "untyped_storage", "storage_type", "numpy", "share_memory_", "set_", "apply_", "map_",
    "map2_", "register_hook", "register_post_accumulate_grad_hook", "grad_fn", "backward",
    "module_load", "data_ptr", "pin_memory", "record_stream", "sparse_resize_",
    "sparse_resize_and_clear_", "new",
})
#: names a graph may use as ``call_method`` targets and ``getattr`` attributes
TENSOR_ATTRIBUTES = frozenset(
    name for name in dir(torch.Tensor) if not name.startswith("_") and name not in _TENSOR_DENIED
    and not name.startswith(UNINITIALISED_PREFIXES))
#: qplug's own module files whose nn.Module classes files may hold
_CORE_MODULE_SOURCES = (
    "qplug_core.kernels.reference", "qplug_core.nn.intrinsic", "qplug_core.nn.qat_conv",
    "qplug_core.nn.qat_linear", "qplug_core.nn.qat_embedding", "qplug_core.eager.stubs",
    "qplug_core.eager.functional", "qplug_core.nn.channel_scale", "qplug_core.nn.channel_clamp",
    "qplug_core.kernels.per_token",
)
_CORE_OBSERVER_SOURCES = (
    "qplug_core.observers.minmax", "qplug_core.observers.histogram", "qplug_core.observers.fixed",
    "qplug_core.observers.fake_quantize", "qplug_core.observers.clipping",
    "qplug_core.observers.learnable",
)
_CORE_FUSER_SOURCES = ("qplug_core.nn.fuser_methods",)
_ATEN_NAME = re.compile(r"aten::([a-z_][a-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")
#: schema argument names of aten ops that take a path (when the argument is a string: einsum's
#: ``path`` is a contraction order, a list of ints)
_FILE_ARGUMENTS = frozenset({"filename", "path", "file"})


def _definition_name(obj: Any) -> str | None:
    """``module.qualname`` where ``obj`` is defined, or ``None`` for locals and lambdas."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    return f"{module}.{qualname}"


class NameTable:
    """Objects by stable name, each with the kinds of use it is allowed for.

    ``resolve`` is a dictionary lookup and ``name_of`` its inverse; an object may have aliases
    (``torch.nn.Conv2d`` and ``torch.nn.modules.conv.Conv2d``) but one name it is written as.
    """

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}
        self._kinds: dict[str, frozenset[Kind]] = {}
        self._names: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    def knows(self, obj: Any) -> bool:
        """Whether ``obj`` already has a name (then a backend using it adds no other)."""
        return id(obj) in self._names

    def add(self, obj: Any, name: str, *kinds: Kind, primary: bool = False) -> None:
        """Add ``obj`` under ``name``; the first name (or a ``primary`` one) is the one written.

        A name already taken by another object keeps that object (the core wins over plugins).
        """
        existing = self._objects.get(name)
        if existing is not None and existing is not obj:
            return
        self._objects[name] = obj
        self._kinds[name] = self._kinds.get(name, frozenset()) | frozenset(kinds)
        if primary or id(obj) not in self._names:
            self._names[id(obj)] = name

    def update(self, other: NameTable) -> None:
        for name, obj in other._objects.items():
            self.add(obj, name, *other._kinds[name], primary=other._names.get(id(obj)) == name)

    def names(self, kinds: Iterable[Kind] = ANY_KIND) -> list[str]:
        wanted = frozenset(kinds)
        return [name for name, k in self._kinds.items() if k & wanted]

    def name_of(self, obj: Any, *, field: str = "", kinds: Iterable[Kind] = ANY_KIND) -> str:
        """The stable name ``obj`` is written as; a :class:`ConfigError` if it has none."""
        name = self._names.get(id(obj))
        if name is None and isinstance(obj, torch._ops.OpOverload):
            name = _aten_name(obj)
        if name is None or (self.resolve_or_none(name, kinds) is not obj):
            wanted = ", ".join(sorted(k.value for k in frozenset(kinds)))
            instead = ("torch.ao's classes are not in it: use qplug's of the same name (qplug_core.nn.intrinsic, "
                       "qplug_core.nn.qat, qplug_core.eager)" if _from_torch_ao(obj)
                       else "Use the torch or qplug object instead")
            raise ConfigError(
                f"Cannot save {obj!r} at {field or '<root>'}: it is not in qplug's table of "
                f"serializable objects (as {wanted}). {instead}, or "
                "register yours with qplug_core.config.register_serializable(obj, name)",
                field=field, value=obj)
        return name

    def resolve_or_none(self, name: str, kinds: Iterable[Kind] = ANY_KIND) -> Any:
        wanted = frozenset(kinds)
        if name in self._objects:
            return self._objects[name] if self._kinds[name] & wanted else None
        if Kind.OP in wanted and name.startswith("aten::"):
            return _aten_op(name)
        return None

    def resolve(self, name: Any, *, field: str = "", kinds: Iterable[Kind] = ANY_KIND) -> Any:
        """The object named ``name``; anything else is a :class:`ConfigValidationError` naming
        ``field`` and ``name``, with the closest allowed name."""
        at = field or "<root>"
        if not isinstance(name, str) or not name:
            raise ConfigValidationError(f"{at}: expected a name string, got {name!r}",
                                        field=field, value=name)
        wanted = frozenset(kinds)
        value = self.resolve_or_none(name, wanted)
        if value is None:
            what = " or ".join(sorted(k.value for k in wanted))
            registered = "/".join(sorted(k.value for k in self._kinds.get(name, ())))
            known = f" ({name!r} is registered as {registered}, not as {what})" if registered else ""
            raise ConfigValidationError(
                f"{at}: unknown or disallowed name {name!r}{known}{self._suggestion(name, wanted)}."
                f" Only the objects in qplug's name table resolve ({what}: torch ops and modules, "
                "qplug's modules, observers and fuser methods, what installed backends register, "
                "and objects registered with register_serializable)", field=field, value=name)
        return value

    def _suggestion(self, name: str, kinds: frozenset[Kind]) -> str:
        """A close allowed name: a sibling (``torch.nn.Conv2D``), else one with a close last part
        (``qplug_core.cli.app.os.system`` is nothing like ``torch.nn.functional.relu``, so no hint)."""
        names = self.names(kinds)
        parent, _, last = name.rpartition(".")
        siblings = [n for n in names if n.rpartition(".")[0] == parent]
        by_last: dict[str, str] = {}
        for n in siblings or names:
            by_last.setdefault(n.rpartition(".")[2], n)
        close = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.6 if siblings else 0.8)
        return f" (did you mean {by_last[close[0]]!r}?)" if close else ""


def _denied(op_name: str) -> bool:
    return op_name in _TORCH_DENIED or op_name.startswith(_TORCH_DENIED_PREFIXES)


def _aten_name(op: torch._ops.OpOverload) -> str | None:
    return f"{op.namespace}::{op._opname}.{op._overloadname}" if op.namespace == "aten" else None


def _aten_op(name: str) -> Any:
    """The aten overload called exactly ``name`` (``aten::add.Tensor``), found in torch's operator
    registry; ``None`` for anything else and for ops that take a file name."""
    match = _ATEN_NAME.match(name)
    if match is None:
        return None
    op_name, overload = match.groups()
    try:
        schema = torch._C._get_schema(f"aten::{op_name}", "" if overload == "default" else overload)
        op = getattr(getattr(torch.ops.aten, op_name), overload)
    except (RuntimeError, AttributeError):
        return None
    private = op_name.startswith("_") and not (op_name.startswith("__") and op_name.endswith("__"))
    if (private or _denied(op_name)  # dunder names are Python's operators (aten::__and__): public
            or any(_takes_file(a) for a in schema.arguments)):
        return None
    return op if isinstance(op, torch._ops.OpOverload) and _aten_name(op) == name else None


def _takes_file(argument: torch._C.Argument) -> bool:
    optional_str = torch._C.OptionalType(torch._C.StringType.get())
    return argument.name in _FILE_ARGUMENTS and argument.type.isSubtypeOf(optional_str)


# -- building the table ----------------------------------------------------------------------------


def _add_defined(table: NameTable, obj: Any, *kinds: Kind, aliases: Iterable[str] = ()) -> None:
    """Add ``obj`` under where it is defined (the name written) and its public ``aliases``."""
    name = _definition_name(obj)
    names = [n for n in (name, *aliases) if n]
    for alias in names:
        table.add(obj, alias, *kinds)


def _torch_ops(table: NameTable) -> None:
    for attr in _OPERATORS:
        table.add(getattr(operator, attr), f"operator.{attr}", Kind.OP)
    table.add(getattr, "builtins.getattr", Kind.OP)
    native = {n for n in dir(torch._C._VariableFunctions) if not n.startswith("_")}
    functional = {n for n, v in vars(torch).items() if getattr(v, "__module__", None) == "torch.functional"}
    for attr in sorted(native | functional):
        obj = vars(torch).get(attr)
        if callable(obj) and not isinstance(obj, type) and not _denied(attr):
            table.add(obj, f"torch.{attr}", Kind.OP)
    for attr, obj in sorted(vars(F).items()):
        if (not attr.startswith("_") and not _denied(attr) and callable(obj) and not isinstance(obj, type)
                and getattr(obj, "__module__", None) in _FUNCTIONAL_MODULES):
            names = [f"torch.nn.functional.{attr}"]
            if obj is vars(torch).get(attr):  # F.conv2d is torch.conv2d: written as before
                names.insert(0, f"torch.{attr}")
            for alias in names:
                table.add(obj, alias, Kind.OP)


def _torch_modules(table: NameTable) -> None:
    for attr in torch.nn.modules.__all__:
        cls = getattr(torch.nn.modules, attr)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            _add_defined(table, cls, Kind.MODULE, Kind.TYPE, aliases=[f"torch.nn.{attr}"])
    for cls in (torch.Tensor, torch.Size, torch.dtype, torch.device, torch.memory_format,
                torch.layout, nn.Parameter):
        _add_defined(table, cls, Kind.TYPE)


def _defined_in(module_name: str) -> Iterator[Any]:
    module = sys.modules.get(module_name)
    if module is None:
        import importlib  # the module names are this file's constants, never a file's

        module = importlib.import_module(module_name)
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) == module_name:
            yield obj


def _core(table: NameTable) -> None:
    _torch_ops(table)
    _torch_modules(table)
    for source in _CORE_MODULE_SOURCES:
        for obj in _defined_in(source):
            if isinstance(obj, type) and issubclass(obj, nn.Module):
                _add_defined(table, obj, Kind.MODULE, Kind.TYPE)
    for source in _CORE_OBSERVER_SOURCES:
        for obj in _defined_in(source):
            if isinstance(obj, type) and issubclass(obj, FactoryMixin) and issubclass(obj, nn.Module):
                _add_defined(table, obj, Kind.OBSERVER)
    for source in _CORE_FUSER_SOURCES:
        for obj in _defined_in(source):
            if inspect.isfunction(obj) and obj.__name__.startswith("fuse_"):
                _add_defined(table, obj, Kind.FUSER)
    _add_defined(table, MatchAllNode, Kind.PATTERN)


def _kind_of(obj: Any) -> tuple[Kind, ...]:
    if isinstance(obj, type) and issubclass(obj, FactoryMixin):
        return (Kind.OBSERVER,)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return (Kind.MODULE, Kind.TYPE)
    if isinstance(obj, type):
        return (Kind.PATTERN,)
    return (Kind.FUSER,)


def _pattern_objects(pattern: Any) -> Iterator[Any]:
    if isinstance(pattern, tuple):
        for item in pattern:
            yield from _pattern_objects(item)
    elif isinstance(pattern, type) or (callable(pattern) and not isinstance(pattern, str)):
        yield pattern


def _pattern_kinds(obj: Any) -> tuple[Kind, ...]:
    """What an element of a pattern or kernel key is: a module class, a placeholder or an op."""
    if isinstance(obj, type):
        return (Kind.MODULE, Kind.TYPE) if issubclass(obj, nn.Module) else (Kind.PATTERN,)
    return (Kind.OP,)


def _add_registered(table: NameTable, obj: Any, kinds: tuple[Kind, ...]) -> None:
    """A backend's object: added under where it is defined, if it can be named and is new."""
    if not table.knows(obj) and _definition_name(obj) is not None:
        _add_defined(table, obj, *kinds)


def _add_backend(table: NameTable, backend: Any) -> None:
    """What one assembled backend registers: pattern configs, kernels, default qconfigs."""
    for cfg in backend.config.configs:
        pattern = cfg.pattern if cfg.pattern is not None else cfg.pattern_complex_format
        for obj in _pattern_objects(pattern):
            _add_registered(table, obj, _pattern_kinds(obj))
        for obj in (cfg.root_module, cfg.qat_module, cfg.reference_quantized_module, cfg.fused_module):
            if obj is not None:
                _add_registered(table, obj, (Kind.MODULE, Kind.TYPE))
        for obj in (cfg.fuser_method, cfg.root_node_getter, cfg.extra_inputs_getter):
            if obj is not None:
                _add_registered(table, obj, (Kind.FUSER,))
    for fuser in backend.fuser_methods.values():
        _add_registered(table, fuser, (Kind.FUSER,))
    for key in backend.kernels:
        for obj in _pattern_objects(key):
            _add_registered(table, obj, _pattern_kinds(obj))
    for mode in ("static", "qat", "dynamic"):
        try:
            mapping = backend.default_qconfig_mapping(mode)
        except QplugError:
            continue
        for obj in _mapping_observers(mapping):
            _add_registered(table, obj, (Kind.OBSERVER,))


def _mapping_observers(mapping: Any) -> Iterator[type]:
    tables = (mapping.object_type_qconfigs, mapping.module_name_regex_qconfigs,
              mapping.module_name_qconfigs, mapping.module_name_object_type_order_qconfigs)
    for qconfig in [mapping.global_qconfig, *(q for t in tables for q in t.values())]:
        for factory in (qconfig.activation, qconfig.weight) if qconfig is not None else ():
            if isinstance(factory, ObserverFactory):
                yield factory.cls
                yield from (v for v in factory.kwargs.values() if isinstance(v, type))


# -- the process-wide table --------------------------------------------------------------------------

#: objects registered by users and plugins: (object, name, kinds)
_REGISTERED: list[tuple[Any, str, tuple[Kind, ...]]] = []
_PREFIXES: list[str] = []
_CACHE_KEY = "name_table"
#: () -> (a cache dict that is cleared when plugins reload, the usable assembled backends); set by
#: qplug_core.registry.backends, the layer that assembles backends (this module sits below it)
_backend_source: Callable[[], tuple[dict, Iterable[Any]]] | None = None
_lock = threading.RLock()
_core_table: NameTable | None = None
_base: tuple[Any, NameTable] | None = None
_building = threading.local()


def _core_part() -> NameTable:
    global _core_table
    with _lock:
        if _core_table is None:
            table = NameTable()
            _core(table)
            _core_table = table
        return _core_table


def _prefix_modules() -> tuple[str, ...]:
    """The imported modules under the registered package prefixes (their classes are allowed)."""
    if not _PREFIXES:
        return ()
    return tuple(sorted(m for m in list(sys.modules)
                        if any(m == p or m.startswith(p + ".") for p in _PREFIXES)))


def _base_table() -> NameTable:
    """Core objects plus user registrations: no plugin needs to be loaded to use these names."""
    global _base
    key = (len(_REGISTERED), _prefix_modules())
    cached = _base
    if cached is not None and cached[0] == key:
        return cached[1]
    with _lock:
        table = NameTable()
        table.update(_core_part())
        for obj, name, kinds in _REGISTERED:
            table.add(obj, name, *kinds, primary=True)
        for module_name in key[1]:
            for obj in _defined_in(module_name):
                if isinstance(obj, type) and issubclass(obj, nn.Module):
                    _add_defined(table, obj, *_kind_of(obj))
        _base = (key, table)
    return table


def set_backend_source(source: Callable[[], tuple[dict, Iterable[Any]]]) -> None:
    """Where the backend part of the table comes from (called once by ``qplug_core.registry.backends``)."""
    global _backend_source
    _backend_source = source


def name_table() -> NameTable:
    """The whole table: core, registrations and the current plugins' backends (built on first use,
    then cached where the backend source says, so a plugin reload rebuilds it)."""
    base = _base_table()
    if _backend_source is None or getattr(_building, "active", False):
        return base  # no backend assembled in this process yet, or a plugin decoding while we build
    with _lock:
        _building.active = True
        try:
            cache, backends = _backend_source()
            cached = cache.get(_CACHE_KEY)
            if cached is not None and cached[0] is base:
                return cached[1]
            table = NameTable()
            table.update(base)
            for backend in backends:
                _add_backend(table, backend)
        except QplugError:  # backends cannot be assembled yet (a plugin still importing): no cache
            return base
        finally:
            _building.active = False
        cache[_CACHE_KEY] = (base, table)
    return table


def register_serializable(obj: Any, name: str | None = None, *, kind: Kind | str | None = None) -> str:
    """Allow ``obj`` under ``name`` (default: where it is defined) in files and documents.

    ``kind`` says what it may be used as; by default an observer class (``with_args``) is an
    observer, another nn.Module class a module, and a function a fuser method. Pass
    ``kind="op"`` for a function a saved graph may call. Returns the name.
    """
    if name is None:
        name = _definition_name(obj)
        if name is None:
            raise ConfigError(f"{obj!r} has no importable name (a lambda or local function?); "
                              "pass name= to register_serializable", field="name", value=obj)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_serializable expects a name string, got {name!r}", field="name",
                          value=name)
    kinds = (Kind(kind),) if kind is not None else _kind_of(obj)
    with _lock:
        known = {n: o for o, n, _ in _REGISTERED}
        existing = known.get(name)
        if existing is None and name in _core_part():
            existing = _core_part().resolve_or_none(name)
        if existing is not None and existing is not obj:
            raise ConfigError(f"The serializable name {name!r} is already registered for {existing!r}; "
                              "choose another name", field="name", value=name)
        if (obj, name, kinds) not in _REGISTERED:
            _REGISTERED.append((obj, name, kinds))
    return name


def register_serializable_module(prefix: str) -> None:
    """Allow the nn.Module and observer classes *defined* in the imported modules of package
    ``prefix`` (e.g. a plugin's). Functions are never allowed wholesale: register each fuser
    method or op with :func:`register_serializable`."""
    if not isinstance(prefix, str) or not prefix or prefix.startswith(".") or prefix.endswith("."):
        raise ConfigError(f"register_serializable_module expects a module name like 'qplug_fbgemm', "
                          f"got {prefix!r}", field="prefix", value=prefix)
    with _lock:
        if prefix not in _PREFIXES:
            _PREFIXES.append(prefix)


def encode_name(obj: Any, *, field: str = "", kinds: Iterable[Kind] = ANY_KIND) -> str:
    """The stable name :func:`decode_name` turns back into ``obj`` itself."""
    base = _base_table()
    if base.knows(obj) or isinstance(obj, torch._ops.OpOverload):
        with contextlib.suppress(ConfigError):
            return base.name_of(obj, field=field, kinds=kinds)
    return name_table().name_of(obj, field=field, kinds=kinds)


def decode_name(name: Any, *, field: str = "", kinds: Iterable[Kind] = ANY_KIND) -> Any:
    """The object the table holds under ``name``; anything else is a :class:`ConfigValidationError`.

    Core and registered names resolve without loading plugins (a plugin may read a document while
    it is being imported); only other names consult the installed backends' registrations.
    """
    value = _base_table().resolve_or_none(name, kinds) if isinstance(name, str) else None
    return value if value is not None else name_table().resolve(name, field=field, kinds=kinds)


def _from_torch_ao(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "")).startswith("torch.ao.")
