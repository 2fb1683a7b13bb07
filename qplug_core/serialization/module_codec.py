"""The modules a reference graph calls, as JSON plus named tensors, and their reconstruction.

How a module is rebuilt depends on its class, never on what the file says:

* torch.nn layers and other outside classes are constructed again from constructor arguments
  recovered from the same-named attributes (``inspect.signature``). Construction happens on the
  meta device, so a file cannot make the loader allocate, and capture rebuilds every module once
  and compares ``repr`` and tensor shapes: a class whose arguments cannot be recovered fails at
  save time instead of loading wrongly.
* qplug's reference, fused and eager-stub modules, a backend's fused modules (subclasses of
  ``plugin_api.FusedModule``, named by the backend's pattern configs) and torch's plain containers
  are restored from state: children, plain attributes and tensors, without running ``__init__`` (a
  fused ``ConvAdd2d`` keeps its ``add``). Attributes that would shadow a method (``forward``) are
  refused.

Tensors are keyed by their dotted path; a tensor shared by two modules is stored once. The weight
of a ``ReferenceWeighted`` module, and each weight matrix of a ``ReferenceRecurrent`` one (a
dynamic LSTM's), lies on its int8 grid, so it is stored as the int8 values and dequantized on
load: bit-exact, and a quarter of the float size (files written before recurrent weights were
stored so hold them float, and still load). Int8 weights with the very same
values (a tied weight quantized alike in two modules) are stored once and read into one tensor.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from qplug_core import qparams as Q
from qplug_core.config.codec import child, decode_dtype, encode_dtype, expect, read_fields, read_pairs, where
from qplug_core.config.names import Kind, decode_name, encode_name
from qplug_core.errors import ConfigError
from qplug_core.kernels.reference import ReferenceRecurrent, ReferenceWeighted, weight_of
from qplug_core.nn.intrinsic import FusedModule
from qplug_core.serialization.checks import check_loaded_values, check_weight_qparams
from qplug_core.serialization.graph_codec import check_path
from qplug_core.serialization.receivers import graph_attribute
from qplug_core.serialization.values import FILE_VALUES, check_identifier

#: tensor table key: the float dtype an int8-stored weight is dequantized to
INT8_OF = "int8_of"
TENSOR_KEYS = ("dtype", "shape", INT8_OF)
_COMMON_KEYS = ("path", "class", "training", "params", "buffers")
_STATE_KEYS = (*_COMMON_KEYS, "attrs", "non_persistent")
_INIT_KEYS = (*_COMMON_KEYS, "kwargs")
_CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)
#: qplug_core modules whose classes are restored from state; other qplug classes (kernels hold
#: packed weights) go through their constructor like any outside class
_STATE_MODULES = ("qplug_core.nn.", "qplug_core.kernels.reference", "qplug_core.eager.")
#: attributes every nn.Module has; restored state never sets them
_BOOKKEEPING = frozenset(vars(nn.Module()))
#: constructor arguments never recovered: modules are always rebuilt on the CPU
_DROPPED_KWARGS = ("device",)
_MISSING = object()
_MODULE_KINDS = (Kind.MODULE,)
#: torch's recurrent layers hide their arguments behind ``*args``: the extra arguments each takes
#: beyond ``RNNBase``'s, and the ``RNNBase`` arguments it supplies itself or refuses
_RNN_ARGUMENTS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    nn.LSTM: ((), ("mode",)),
    nn.GRU: ((), ("mode", "proj_size")),
    nn.RNN: (("nonlinearity",), ("mode", "proj_size")),
}
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "cauchy_", "exponential_", "geometric_",
                           "log_normal_", "random_"})


def restores_state(cls: type) -> bool:
    """Whether ``cls`` is rebuilt from state (qplug's modules, fused modules, containers) or from its
    constructor."""
    return cls in _CONTAINERS or cls.__module__.startswith(_STATE_MODULES) or issubclass(cls, FusedModule)


def _what_saving_needs(module: nn.Module) -> str:
    """The fix when a module with children (a backend's own fused module) cannot be rebuilt."""
    if not any(True for _ in module.children()):
        return ""
    return ("; if it is a backend's fused module, subclass qplug_core.plugin_api.FusedModule (an "
            "nn.Sequential whose CHILD_TYPES name its children; see docs/plugins/writing-a-backend.md)")


def _under_any(path: str, roots: list[str]) -> bool:
    return any(path.startswith(root + ".") for root in roots)


@dataclass
class TensorTable:
    """Tensors to store, by key, with their JSON entries (dtype, shape and, for int8 weights, origin).

    A tensor shared by two modules is stored once; so are int8 weights whose values are the very
    same (tied weights that got the same qparams), whatever float tensors they came from: a tied
    weight whose modules got different qparams (an LLM's embedding, quint8 per row, and its head,
    qint8 per channel) has different int8 values, kept both."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _keys: dict[int, str] = field(default_factory=dict)
    _int8: dict[int, torch.Tensor] = field(default_factory=dict)
    #: (dtype, shape, a sample of the values) -> keys of the int8 weights stored with them
    _int8_keys: dict[tuple, list[str]] = field(default_factory=dict)

    def store_as_int8(self, weight: torch.Tensor, values: torch.Tensor) -> None:
        """``weight``'s next :meth:`add` stores ``values`` (its int8 values) instead."""
        self._int8[id(weight)] = values

    def add(self, key: str, tensor: torch.Tensor) -> str:
        """Store ``tensor`` under ``key`` unless it is already stored; return its key."""
        values = self._int8.pop(id(tensor), None)
        if values is not None:
            return self._add_int8(key, values, tensor.dtype)
        known = self._keys.get(id(tensor))
        if known is not None:
            return known
        self._keys[id(tensor)] = key
        self.entries[key] = {"dtype": encode_dtype(tensor.dtype), "shape": list(tensor.shape)}
        self.tensors[key] = tensor.detach()
        return key

    def _add_int8(self, key: str, values: torch.Tensor, float_dtype: torch.dtype) -> str:
        flat = values.reshape(-1)
        sample = (values.dtype, tuple(values.shape), float_dtype,
                  tuple(flat[::max(1, flat.numel() // 64)].tolist()))
        same = self._int8_keys.setdefault(sample, [])
        known = next((k for k in same if torch.equal(self.tensors[k], values)), None)
        if known is not None:
            return known
        same.append(key)
        self.entries[key] = {"dtype": encode_dtype(values.dtype), "shape": list(values.shape),
                             INT8_OF: encode_dtype(float_dtype)}
        self.tensors[key] = values
        return key


# -- capture ---------------------------------------------------------------------------------------


def encode_modules(gm: fx.GraphModule, table: TensorTable
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The module entries (pre-order) and the root-level tensor attributes the graph uses.

    Only what the graph reaches is kept (convert leaves fused-away modules behind), exactly what
    ``fx.GraphModule(root, graph)`` copies on load.
    """
    targets = list(dict.fromkeys(n.target for n in gm.graph.nodes if n.op in ("call_module", "get_attr")))
    values = {t: _lookup(gm, t) for t in targets}
    module_targets = [t for t in targets if isinstance(values[t], nn.Module)]
    tops = [t for t in module_targets if not _under_any(t, module_targets)]
    entries: list[dict[str, Any]] = []
    init_paths: list[str] = []
    for top in tops:
        for path, module in values[top].named_modules(prefix=top, remove_duplicate=False):
            if _under_any(path, init_paths):
                continue
            entry = _encode_module(path, module, table)
            if "kwargs" in entry:
                init_paths.append(path)
            entries.append(entry)
    recorded = {e["path"] for e in entries}
    attributes = {}
    for target in targets:
        value = values[target]
        owner = target.rpartition(".")[0]
        if isinstance(value, nn.Module) or owner in recorded or _under_any(owner, init_paths):
            continue
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"graph attribute {target!r} is a {type(value).__name__}; saved graphs may "
                              "only read tensors and modules", field=target, value=value)
        attributes[target] = {"key": table.add(target, value), "parameter": isinstance(value, nn.Parameter)}
    return entries, attributes


def _lookup(gm: fx.GraphModule, target: str) -> Any:
    """What the graph reads at ``target``, by the rule loading checks (submodules, tensors)."""
    return graph_attribute(gm, target, target)


def _encode_module(path: str, module: nn.Module, table: TensorTable) -> dict[str, Any]:
    cls = type(module)
    at = f"modules[{path}]"
    entry: dict[str, Any] = {"path": path, "class": encode_name(cls, field=child(at, "class"), kinds=_MODULE_KINDS),
                             "training": module.training}
    if restores_state(cls):
        for name, qparams in _int8_weights(module):
            _store_as_int8(weight_of(module.module, name), qparams, child(at, name), table)
        entry["attrs"] = {k: FILE_VALUES.encode(v, child(child(at, "attrs"), k))
                          for k, v in sorted(vars(module).items()) if k not in _BOOKKEEPING}
        params = module.named_parameters(recurse=False, remove_duplicate=False)
        buffers = module.named_buffers(recurse=False, remove_duplicate=False)
        entry["non_persistent"] = sorted(module._non_persistent_buffers_set)
    else:
        entry["kwargs"] = _constructor_kwargs(module, at)
        _check_rebuild(module, entry["kwargs"], at)
        params = module.named_parameters(remove_duplicate=False)
        buffers = module.named_buffers(remove_duplicate=False)
    entry["params"] = [[name, table.add(f"{path}.{name}", p)] for name, p in params]
    entry["buffers"] = [[name, table.add(f"{path}.{name}", b)] for name, b in buffers]
    return {k: v for k, v in entry.items() if v != [] and v != {}}


def _int8_weights(module: nn.Module) -> list[tuple[str, Q.QParams]]:
    """The weights of a reference module stored as their int8 values, by name in its ``module``,
    with their qparams (a float16 or float weight is stored as it is)."""
    return [(name, qparams) for name, qparams in _weight_qparams(module).items() if qparams.dtype in Q.STORAGE_DTYPE]


def _weight_qparams(module: nn.Module) -> dict[str, Q.QParams]:
    """A reference module's recorded weight qparams, by weight name in its ``module``."""
    if isinstance(module, ReferenceWeighted):
        return {module.weight_name: module.weight_qparams}
    return module.weight_qparams if isinstance(module, ReferenceRecurrent) else {}


def _store_as_int8(weight: torch.Tensor, qparams: Q.QParams, at: str, table: TensorTable) -> None:
    values = Q.quantize(weight.detach(), qparams)
    if not torch.equal(Q.dequantize(values, qparams).to(weight.dtype), weight.detach()):
        raise ConfigError(f"{at}: the weight does not lie on the int8 grid of its recorded qparams "
                          "(was it changed after convert?), so its int8 values cannot reproduce it; "
                          "convert the model again before saving", field=at)
    table.store_as_int8(weight, values)


def _constructor_parameters(cls: type) -> list[inspect.Parameter]:
    if cls in _RNN_ARGUMENTS:
        extra, dropped = _RNN_ARGUMENTS[cls]
        base = list(inspect.signature(nn.RNNBase.__init__).parameters.values())[1:]
        return ([p for p in base if p.name not in dropped]
                + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in extra])
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


def _constructor_kwargs(module: nn.Module, at: str) -> dict[str, Any]:
    cls = type(module)
    kwargs = {}
    for p in _constructor_parameters(cls):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in _DROPPED_KWARGS:
            continue
        value = getattr(module, p.name, _MISSING)
        if value is _MISSING or inspect.ismethod(value):
            if p.default is p.empty:
                raise ConfigError(f"{at}: cannot recover the constructor argument {p.name!r} of "
                                  f"{cls.__name__} (the module has no attribute of that name), so it "
                                  f"cannot be saved{_what_saving_needs(module)}", field=child(at, p.name))
            continue
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None  # bias=True/False is stored as the bias tensor or None
        kwargs[p.name] = FILE_VALUES.encode(value, child(child(at, "kwargs"), p.name))
    return kwargs


def _check_rebuild(module: nn.Module, kwargs: dict[str, Any], at: str) -> None:
    """Fail at save time when the recovered constructor arguments do not give the same module."""
    rebuilt = _construct(type(module), _decode_kwargs(kwargs, at), at, len(_shapes(module)))
    if repr(rebuilt) != repr(module) or _shapes(rebuilt) != _shapes(module):
        raise ConfigError(
            f"{at}: {type(module).__name__} rebuilt from the constructor arguments recovered from its "
            f"attributes ({kwargs}) is not the same module:\n  saved:   {module!r}\n  rebuilt: "
            f"{rebuilt!r}\nqplug cannot save this module class; keep it out of the quantized graph "
            f"or replace it by standard torch.nn layers{_what_saving_needs(module)}", field=at)


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    return {name: tuple(t.shape) for name, t in tensors}


# -- reconstruction --------------------------------------------------------------------------------


def decode_modules(entries: Any, attributes: Any, table: dict[str, dict[str, Any]],
                   tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, list[tuple[nn.Module, bool]]]:
    """A root module holding every saved module and tensor at its path, and each module's mode.

    ``table`` must already match ``tensors`` (same keys, dtypes and shapes). Every tensor must be
    used and every module tensor supplied; anything else is a :class:`ConfigError`. Meta tensors
    (a file described from its header: ``qplug report``) give a model on the meta device, whose
    values are not checked.
    """
    root = nn.Module()
    built: dict[str, tuple[nn.Module, dict[str, Any], str]] = {}
    init_paths: list[str] = []
    docs = expect(entries, list, "modules", "a JSON list")
    classes = [_decode_class(doc, child("modules", i)) for i, doc in enumerate(docs)]  # before building
    for i, (doc, cls) in enumerate(zip(docs, classes, strict=True)):
        at = child("modules", i)
        module, entry = _decode_module(doc, cls, at)
        path = entry["path"]
        if _under_any(path, init_paths):
            raise ConfigError(f"{at}: {path!r} lies inside a module rebuilt from its constructor",
                              field=at, value=path)
        parent_path, _, name = path.rpartition(".")
        parent = built[parent_path][0] if parent_path in built else _container(root, parent_path, at)
        _attach(parent, name, module, at)
        built[path] = (module, entry, at)
        if not restores_state(type(module)):
            init_paths.append(path)
    loader = _TensorLoader(table, tensors)
    for module, entry, at in built.values():
        loader.assign(module, entry, at)
    for target, spec in expect(attributes, dict, "attributes", "a JSON object").items():
        loader.assign_attribute(root, target, spec, child("attributes", target))
    if not any(tensor.is_meta for tensor in tensors.values()):
        check_loaded_values(root)
    for module, entry, _ in built.values():
        for name, qparams in _weight_qparams(module).items():  # named by path, as the qparams checks are
            loader.dequantize_weight(module, name, qparams, f"modules[{entry['path']}]")
    loader.check_complete(root)
    modes = sorted(built.values(), key=lambda item: item[1]["path"].count("."))
    return root, [(module, entry["training"]) for module, entry, _ in modes]


def _decode_class(doc: Any, at: str) -> type[nn.Module]:
    expect(doc, dict, at, "a JSON object")
    cls = decode_name(doc.get("class"), field=child(at, "class"), kinds=_MODULE_KINDS)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or issubclass(cls, fx.GraphModule):
        raise ConfigError(f"{where(child(at, 'class'))}: {doc.get('class')!r} is not a module class",
                          field=child(at, "class"), value=doc.get("class"))
    return cls


def _decode_module(doc: dict[str, Any], cls: type[nn.Module], at: str) -> tuple[nn.Module, dict[str, Any]]:
    state = restores_state(cls)
    read_fields(doc, at, _STATE_KEYS if state else _INIT_KEYS, required=("path", "class", "training"))
    check_path(doc["path"], child(at, "path"), "module path")
    expect(doc["training"], bool, child(at, "training"), "true or false")
    if not state:
        tensors = len(read_pairs(doc.get("params", []), child(at, "params")))
        tensors += len(read_pairs(doc.get("buffers", []), child(at, "buffers")))
        return _construct(cls, _decode_kwargs(doc.get("kwargs", {}), at), at, tensors), doc
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    attrs_at = child(at, "attrs")
    for name, value in expect(doc.get("attrs", {}), dict, attrs_at, "a JSON object").items():
        check_identifier(name, child(attrs_at, name), "attribute name")
        if name in _BOOKKEEPING or name.startswith("__") or hasattr(cls, name):
            raise ConfigError(f"{where(child(attrs_at, name))}: {cls.__name__} attribute {name!r} cannot "
                              "be set from a file", field=child(attrs_at, name), value=name)
        setattr(module, name, FILE_VALUES.decode(value, child(attrs_at, name)))
    return module, doc


def _decode_kwargs(doc: Any, at: str) -> dict[str, Any]:
    kwargs_at = child(at, "kwargs")
    return {check_identifier(k, child(kwargs_at, k), "argument name"):
            FILE_VALUES.decode(v, child(kwargs_at, k))
            for k, v in expect(doc, dict, kwargs_at, "a JSON object").items()}


class _MetaBuild(TorchFunctionMode):
    """Builds a module on the meta device within a budget of tensor operations.

    Initialising meta tensors is skipped: their values come from the file, and some meta
    initialisers (``normal_``) import torch._dynamo, which takes seconds. The budget is what keeps
    a small file from asking for a huge module (``nn.Transformer(num_encoder_layers=20000)``):
    construction may do :data:`WORK_PER_TENSOR` tensor operations per tensor the file gives the
    module (torch's own layers need under 10), and is stopped as soon as it exceeds that.
    """

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.budget = budget
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        if self.calls > self.budget:
            raise _OverBudget
        if (getattr(func, "__module__", None) == "torch.nn.init"
                or getattr(func, "__name__", None) in _RANDOM_FILLS):
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


class _OverBudget(Exception):
    """Construction did more work than the module's tensors in the file account for."""


#: tensor operations a constructor may run per tensor of the module (plus a fixed allowance)
WORK_PER_TENSOR = 32
_BASE_WORK = 64


def _construct(cls: type[nn.Module], kwargs: dict[str, Any], at: str, tensors: int) -> nn.Module:
    """``cls(**kwargs)`` on the meta device: no memory, and no more work than a module with
    ``tensors`` parameters and buffers needs, whatever sizes the arguments ask for."""
    budget = _BASE_WORK + WORK_PER_TENSOR * tensors
    try:
        with torch.device("meta"), _MetaBuild(budget):
            return cls(**kwargs)
    except _OverBudget:
        raise ConfigError(f"{at}: {cls.__name__}(**{kwargs}) builds a bigger module than the {tensors} "
                          f"tensors the file gives it (stopped after {budget} tensor operations)",
                          field=at) from None
    except Exception as exc:  # any constructor failure is a bad document, reported where it is
        raise ConfigError(f"{at}: {cls.__name__}(**{kwargs}) failed: {type(exc).__name__}: {exc}",
                          field=at) from exc


def _container(root: nn.Module, path: str, at: str) -> nn.Module:
    """The module at ``path`` under ``root``, creating plain ``nn.Module`` holders on the way."""
    current = root
    for part in path.split(".") if path else ():
        existing = getattr(current, part, None)
        if existing is None:
            existing = nn.Module()
            _attach(current, part, existing, at)
        elif not isinstance(existing, nn.Module):
            raise ConfigError(f"{at}: {path!r} is not a module path", field=at, value=path)
        current = existing
    return current


def _attach(parent: nn.Module, name: str, module: nn.Module, at: str) -> None:
    if hasattr(parent, name):
        raise ConfigError(f"{at}: {name!r} is defined twice in its parent module", field=at, value=name)
    parent.add_module(name, module)


def _owner(module: nn.Module, name: str, at: str) -> tuple[nn.Module, str]:
    owner_path, _, attr = check_path(name, at, "tensor name").rpartition(".")
    try:
        return (module.get_submodule(owner_path) if owner_path else module), attr
    except AttributeError as exc:
        raise ConfigError(f"{at}: the module has no submodule {owner_path!r}", field=at) from exc


class _TensorLoader:
    """Puts the file's tensors into the rebuilt modules and checks that all of them are used."""

    def __init__(self, table: dict[str, dict[str, Any]], tensors: dict[str, torch.Tensor]):
        self.table = table
        self.tensors = tensors
        self.unused = set(table)
        self.parameters: dict[str, nn.Parameter] = {}
        self.pending_int8: dict[tuple[int, str], str] = {}
        #: ids of the tensors put into modules (a meta one the file did not give is missing)
        self.given: set[int] = set()

    def _tensor(self, key: Any, at: str) -> torch.Tensor:
        if not isinstance(key, str) or key not in self.table:
            raise ConfigError(f"{at}: tensor {key!r} is not in the file", field=at, value=key)
        self.unused.discard(key)
        return self.tensors[key]

    def _parameter(self, key: str, tensor: torch.Tensor) -> nn.Parameter:
        if key not in self.parameters:
            grad = tensor.is_floating_point() or tensor.is_complex()
            self.parameters[key] = nn.Parameter(tensor, requires_grad=grad)
            self.given.add(id(self.parameters[key]))
        return self.parameters[key]

    def assign(self, module: nn.Module, entry: dict[str, Any], at: str) -> None:
        params = dict(read_pairs(entry.get("params", []), child(at, "params")))
        buffers = dict(read_pairs(entry.get("buffers", []), child(at, "buffers")))
        non_persistent = expect(entry.get("non_persistent", []), list, child(at, "non_persistent"),
                                "a JSON list")
        state = restores_state(type(module))
        if not state:
            self._check_names(module, params, buffers, at)
        for kind, names in (("params", params), ("buffers", buffers)):
            for name, key in names.items():
                name_at = child(child(at, kind), name)
                if state:
                    owner, attr = module, check_identifier(name, name_at, "tensor name")
                    self._check_free(owner, attr, name_at)
                else:
                    owner, attr = _owner(module, name, name_at)
                tensor = self._tensor(key, name_at)
                if not state:
                    self._check_shape(owner, attr, tensor, key, name_at)
                if INT8_OF in self.table[key]:
                    self.pending_int8[(id(owner), attr)] = key
                    if state:
                        owner.register_parameter(attr, None)  # filled in by dequantize_weight
                elif kind == "params":
                    setattr(owner, attr, self._parameter(key, tensor))
                elif state:
                    owner.register_buffer(attr, tensor, persistent=attr not in non_persistent)
                else:
                    setattr(owner, attr, tensor)
                self.given.add(id(tensor))

    @staticmethod
    def _check_free(owner: nn.Module, attr: str, at: str) -> None:
        if hasattr(owner, attr):
            raise ConfigError(f"{at}: {attr!r} is defined twice", field=at, value=attr)

    @staticmethod
    def _check_names(module: nn.Module, params: dict, buffers: dict, at: str) -> None:
        for kind, saved, expected in (
                ("parameters", params, module.named_parameters(remove_duplicate=False)),
                ("buffers", buffers, module.named_buffers(remove_duplicate=False))):
            want = {name for name, _ in expected}
            if set(saved) != want:
                raise ConfigError(
                    f"{at}: {type(module).__name__} has {kind} {sorted(want)} but the file lists "
                    f"{sorted(saved)} (missing {sorted(want - set(saved))}, extra "
                    f"{sorted(set(saved) - want)})", field=at)

    @staticmethod
    def _check_shape(owner: nn.Module, attr: str, tensor: torch.Tensor, key: str, at: str) -> None:
        expected = tuple(getattr(owner, attr).shape)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"{at}: tensor {key!r} has shape {tuple(tensor.shape)} but "
                              f"{type(owner).__name__} expects {expected}", field=at, value=key)

    def assign_attribute(self, root: nn.Module, target: str, spec: Any, at: str) -> None:
        read_fields(spec, at, ("key", "parameter"), required=("key", "parameter"))
        owner_path, _, attr = check_path(target, at, "attribute path").rpartition(".")
        owner = _container(root, owner_path, at)
        self._check_free(owner, attr, at)
        tensor = self._tensor(spec["key"], child(at, "key"))
        if INT8_OF in self.table[spec["key"]]:
            raise ConfigError(f"{at}: an int8-stored tensor can only be a reference module's weight",
                              field=at)
        if expect(spec["parameter"], bool, child(at, "parameter"), "true or false"):
            owner.register_parameter(attr, self._parameter(spec["key"], tensor))
        else:
            owner.register_buffer(attr, tensor)
            self.given.add(id(tensor))

    def dequantize_weight(self, module: ReferenceWeighted | ReferenceRecurrent, name: str, qparams: Q.QParams,
                          at: str) -> None:
        """Turn the int8 values of ``module``'s weight ``name`` back into the float weight, bit-exactly."""
        owner, attr = _owner(module.module, name, child(at, "weight_name"))
        key = self.pending_int8.pop((id(owner), attr), None)
        storage = Q.STORAGE_DTYPE.get(qparams.dtype)
        if key is None:
            # files written before recurrent weights were stored as int8 hold them float
            if storage is not None and isinstance(module, ReferenceWeighted):
                raise ConfigError(f"{at}: the {qparams.dtype} weight {name!r} must be stored as its int8 "
                                  "values", field=at)
            return
        values = self.tensors[key]
        check_weight_qparams(qparams, tuple(values.shape), child(at, "weight_qparams_holder"))
        if values.dtype != storage:
            raise ConfigError(f"{at}: tensor {key!r} is {values.dtype} but a {qparams.dtype} weight is "
                              f"stored as {storage}", field=at, value=key)
        float_dtype = decode_dtype(self.table[key][INT8_OF], field=child(key, INT8_OF))
        if not float_dtype.is_floating_point:
            raise ConfigError(f"{at}: tensor {key!r} would dequantize to {float_dtype}, not a float dtype",
                              field=at, value=key)
        weight = torch.empty(values.shape, dtype=float_dtype, device="meta") if values.is_meta else \
            Q.dequantize(values, qparams).to(float_dtype)
        setattr(owner, attr, nn.Parameter(weight))
        self.given.add(id(getattr(owner, attr)))

    def check_complete(self, root: nn.Module) -> None:
        if self.pending_int8:
            keys = sorted(self.pending_int8.values())
            raise ConfigError(f"int8-stored tensors {keys} are not the weight of any reference "
                              "module", field="tensors", value=keys)
        if self.unused:
            keys = sorted(self.unused)
            raise ConfigError(f"tensors {keys[:8]} are not used by any module", field="tensors",
                              value=keys)
        missing = [name for name, t in [*root.named_parameters(remove_duplicate=False),
                                        *root.named_buffers(remove_duplicate=False)]
                   if t.is_meta and id(t) not in self.given]
        if missing:
            raise ConfigError(f"tensors {missing[:8]} are missing from the file", field="tensors",
                              value=missing)
