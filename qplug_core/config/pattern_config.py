"""BackendPatternConfig: how a backend fuses, observes and lowers one pattern.

The builder keeps torch.ao's API (including its underscore-prefixed setters, as aliases, so backend
configs migrate by changing an import) but checks what torch.ao leaves to fail later: the pattern
grammar, a fuser whose arity does not fit the pattern, and every field's type.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import Enum
from typing import Any

from torch import nn

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
from qplug_core.config.dtypes import DTypeConfig
from qplug_core.config.names import Kind, decode_name, encode_name
from qplug_core.errors import ConfigError, ConfigValidationError, PatternError, did_you_mean, warn_user
from qplug_core.nn import qat as qplug_qat
from qplug_core.patterns import describe, format_pattern, to_complex_format, validate_pattern

__all__ = ["BackendPatternConfig", "ObservationType"]


class ObservationType(Enum):
    """Where observers go around a matched pattern."""

    OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT = 0
    """Input and output get their own observers (conv, linear, softmax)."""
    OUTPUT_SHARE_OBSERVER_WITH_INPUT = 1
    """The output reuses the input's observer (cat, maxpool): same qparams in and out."""
    INPUT_OUTPUT_NOT_OBSERVED = 2
    """Neither is observed (x.shape, x.size)."""


_DEFAULT_OBSERVATION = ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT

# document keys (torch.ao's names)
PATTERN_KEY = "pattern"
PATTERN_COMPLEX_FORMAT_KEY = "pattern_complex_format"
OBSERVATION_TYPE_KEY = "observation_type"
DTYPE_CONFIGS_KEY = "dtype_configs"
ROOT_MODULE_KEY = "root_module"
QAT_MODULE_KEY = "qat_module"
REFERENCE_QUANTIZED_MODULE_KEY = "reference_quantized_module_for_root"
FUSED_MODULE_KEY = "fused_module"
FUSER_METHOD_KEY = "fuser_method"
ROOT_NODE_GETTER_KEY = "root_node_getter"
EXTRA_INPUTS_GETTER_KEY = "extra_inputs_getter"
NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY = "num_tensor_args_to_observation_type"
INPUT_TYPE_TO_INDEX_KEY = "input_type_to_index"

#: document key -> attribute, for the module-class fields and the callable fields
_MODULE_FIELDS = {ROOT_MODULE_KEY: "root_module", QAT_MODULE_KEY: "qat_module",
                  REFERENCE_QUANTIZED_MODULE_KEY: "reference_quantized_module",
                  FUSED_MODULE_KEY: "fused_module"}
_CALLABLE_FIELDS = {FUSER_METHOD_KEY: "fuser_method", ROOT_NODE_GETTER_KEY: "root_node_getter",
                    EXTRA_INPUTS_GETTER_KEY: "extra_inputs_getter"}
_KEYS = (PATTERN_KEY, PATTERN_COMPLEX_FORMAT_KEY, OBSERVATION_TYPE_KEY, DTYPE_CONFIGS_KEY,
         *_MODULE_FIELDS, *_CALLABLE_FIELDS, NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY,
         INPUT_TYPE_TO_INDEX_KEY)


def _field_kinds(key: str) -> tuple[Kind, ...]:
    """What a document's module field or callable field may name."""
    return (Kind.MODULE,) if key in _MODULE_FIELDS else (Kind.FUSER,)


def _check_observation_type(value: Any, path: str) -> ObservationType:
    if isinstance(value, ObservationType):
        return value
    names = [o.name for o in ObservationType]
    hint = did_you_mean(value, names) if isinstance(value, str) else ""
    raise ConfigValidationError(f"{path} must be an ObservationType ({', '.join(names)}), got "
                                f"{value!r}{hint}", field=path, value=value)


def _check_module_class(value: Any, path: str) -> type[nn.Module] | None:
    if value is None or (isinstance(value, type) and issubclass(value, nn.Module)):
        return value
    fix = f"; pass the class {type(value).__name__}" if isinstance(value, nn.Module) else ""
    raise ConfigValidationError(f"{path} must be an nn.Module subclass, got {value!r}{fix}",
                                field=path, value=value)


def _check_callable(value: Any, path: str) -> Callable[..., Any] | None:
    if value is None or callable(value):
        return value
    raise ConfigValidationError(f"{path} must be a function, got {value!r}", field=path, value=value)


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, float] | None:
    """``(min, max)`` number of positional arguments ``fn`` accepts; ``None`` if unknowable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    star = any(p.kind == p.VAR_POSITIONAL for p in params)
    return required, float("inf") if star else len(positional)


def _reverse2(fuser: Callable[..., Any]) -> Callable[..., Any]:
    """Complex-order call ``(is_qat, y, x)`` of a fuser written for ``(is_qat, x, y)``."""
    def reversed_fuser(is_qat: bool, y: Any, x: Any) -> Any:
        return fuser(is_qat, x, y)
    return reversed_fuser


def _reverse3(fuser: Callable[..., Any]) -> Callable[..., Any]:
    """Complex-order call ``(is_qat, z, (y, x))`` of a fuser written for ``(is_qat, x, y, z)``."""
    def reversed_fuser(is_qat: bool, z: Any, yx: tuple[Any, Any]) -> Any:
        y, x = yx
        return fuser(is_qat, x, y, z)
    return reversed_fuser


class BackendPatternConfig:
    """Builder for one pattern's config; every ``set_*``/``add_*`` returns ``self``."""

    def __init__(self, pattern: Any = None):
        self._pattern: Any = None
        self._pattern_complex: Any = None
        self._observation_type = _DEFAULT_OBSERVATION
        self._dtype_configs: list[DTypeConfig] = []
        self._root_module: type[nn.Module] | None = None
        self._qat_module: type[nn.Module] | None = None
        self._reference_quantized_module: type[nn.Module] | None = None
        self._fused_module: type[nn.Module] | None = None
        self._fuser_method: Callable[..., Any] | None = None
        self._root_node_getter: Callable[..., Any] | None = None
        self._extra_inputs_getter: Callable[..., Any] | None = None
        self._num_tensor_args_to_observation_type: dict[int, ObservationType] = {}
        self._input_type_to_index: dict[str, int] = {}
        if pattern is not None:
            self.set_pattern(pattern)

    # -- patterns ----------------------------------------------------------------------------------

    def set_pattern(self, pattern: Any) -> BackendPatternConfig:
        """The pattern in the forward "simple" format: ``op``, ``(a, b)`` or ``(a, b, c)``."""
        if self._pattern_complex is not None:
            raise ConfigValidationError("pattern: this config already has pattern_complex_format "
                                        f"{format_pattern(self._pattern_complex)}; set only one of them",
                                        field="pattern", value=pattern)
        validate_pattern(pattern, format="simple")
        self._check_fuser(self._fuser_method, pattern)
        self._pattern = pattern
        return self

    def set_pattern_complex_format(self, pattern: Any) -> BackendPatternConfig:
        """The pattern in the reversed nested tuple format (for branches, MatchAllNode, getattr)."""
        if self._pattern is not None:
            raise ConfigValidationError(f"pattern_complex_format: this config already has pattern "
                                        f"{describe(self._pattern)}; set only one of them",
                                        field="pattern_complex_format", value=pattern)
        validate_pattern(pattern, format="complex")
        self._check_fuser(self._fuser_method, pattern)
        self._pattern_complex = pattern
        return self

    _set_pattern_complex_format = set_pattern_complex_format

    @property
    def pattern(self) -> Any:
        """The simple-format pattern, or ``None`` if the pattern was set in complex format."""
        return self._pattern

    @property
    def pattern_complex_format(self) -> Any:
        """The pattern in complex format however it was set (``None`` if no pattern is set)."""
        if self._pattern_complex is not None:
            return self._pattern_complex
        return None if self._pattern is None else to_complex_format(self._pattern)

    def _check_fuser(self, fuser: Callable[..., Any] | None, pattern: Any) -> None:
        """A fuser takes ``is_qat`` plus one module (or nested tuple) per top-level pattern item."""
        if fuser is None or pattern is None:
            return
        if not isinstance(pattern, tuple):
            raise PatternError(f"fuser_method {describe(fuser)} needs a tuple pattern to fuse, got the "
                               f"single op {describe(pattern)}; drop the fuser or use e.g. "
                               "(nn.Conv2d, nn.ReLU)", pattern=pattern, position=())
        arity = _positional_arity(fuser)
        if arity is not None and not arity[0] <= 1 + len(pattern) <= arity[1]:
            raise PatternError(f"fuser_method {describe(fuser)} must take (is_qat, <{len(pattern)} modules>) "
                               f"for the {len(pattern)}-element pattern {describe(pattern)}, but its "
                               f"signature accepts {arity[0]}..{arity[1]} positional arguments",
                               pattern=pattern, position=())

    # -- simple setters ----------------------------------------------------------------------------

    def set_observation_type(self, observation_type: ObservationType) -> BackendPatternConfig:
        self._observation_type = _check_observation_type(observation_type, "observation_type")
        return self

    def add_dtype_config(self, dtype_config: DTypeConfig) -> BackendPatternConfig:
        self._dtype_configs.append(self._check_dtype_config(dtype_config, "dtype_config"))
        return self

    def set_dtype_configs(self, dtype_configs: list[DTypeConfig]) -> BackendPatternConfig:
        """Replace all dtype configs."""
        if not isinstance(dtype_configs, (list, tuple)):
            raise ConfigValidationError(f"dtype_configs must be a list of DTypeConfig, got {dtype_configs!r}",
                                        field="dtype_configs", value=dtype_configs)
        self._dtype_configs = [self._check_dtype_config(d, child("dtype_configs", i))
                               for i, d in enumerate(dtype_configs)]
        return self

    @staticmethod
    def _check_dtype_config(value: Any, path: str) -> DTypeConfig:
        if not isinstance(value, DTypeConfig):
            raise ConfigValidationError(f"{path} must be a DTypeConfig, got {value!r}", field=path, value=value)
        return value

    def set_root_module(self, root_module: type[nn.Module] | None) -> BackendPatternConfig:
        """The float module swapped for ``reference_quantized_module`` at convert time."""
        self._root_module = _check_module_class(root_module, "root_module")
        return self

    def set_qat_module(self, qat_module: type[nn.Module] | None) -> BackendPatternConfig:
        """The QAT class prepare_qat swaps the matched module for (its ``from_float``); qplug's own
        QAT classes only: torch.ao's test for torch.ao's fused classes, which qplug's prepare never has."""
        self._qat_module = _check_module_class(qat_module, "qat_module")
        if qat_module is not None and qat_module.__module__.startswith("torch.ao."):
            twin = getattr(qplug_qat, qat_module.__name__, None)
            fix = f"use qplug_core.nn.qat.{qat_module.__name__}" if twin else "use a QAT class of qplug_core.nn.qat"
            raise ConfigValidationError(
                f"qat_module is torch.ao's {qat_module.__module__}.{qat_module.__qualname__}, whose from_float "
                f"takes torch.ao's fused modules, not qplug's: {fix} (or leave qat_module unset)",
                field="qat_module", value=qat_module)
        return self

    def set_reference_quantized_module(self, module: type[nn.Module] | None) -> BackendPatternConfig:
        """Kept for torch.ao's configs (and ``to_dict``), but unused: qplug's convert builds one generic
        reference form for every pattern, so a class given here is ignored, with a warning."""
        self._reference_quantized_module = _check_module_class(module, "reference_quantized_module")
        if module is not None:
            warn_user(f"BackendPatternConfig.set_reference_quantized_module({module.__module__}."
                      f"{module.__qualname__}) has no effect: qplug's convert builds one generic reference form "
                      "for every pattern (the backend's kernels then replace it); drop the call")
        return self

    def set_fused_module(self, fused_module: type[nn.Module] | None) -> BackendPatternConfig:
        self._fused_module = _check_module_class(fused_module, "fused_module")
        return self

    def set_fuser_method(self, fuser_method: Callable[..., Any] | None) -> BackendPatternConfig:
        """``fuser(is_qat, *modules)`` in the order the pattern was written (simple: forward)."""
        _check_callable(fuser_method, "fuser_method")
        self._check_fuser(fuser_method, self._pattern if self._pattern is not None else self._pattern_complex)
        self._fuser_method = fuser_method
        return self

    def set_root_node_getter(self, root_node_getter: Callable[..., Any] | None) -> BackendPatternConfig:
        self._root_node_getter = _check_callable(root_node_getter, "root_node_getter")
        return self

    _set_root_node_getter = set_root_node_getter

    def set_extra_inputs_getter(self, extra_inputs_getter: Callable[..., Any] | None) -> BackendPatternConfig:
        self._extra_inputs_getter = _check_callable(extra_inputs_getter, "extra_inputs_getter")
        return self

    _set_extra_inputs_getter = set_extra_inputs_getter

    def set_num_tensor_args_to_observation_type(
            self, mapping: dict[int, ObservationType]) -> BackendPatternConfig:
        path = "num_tensor_args_to_observation_type"
        self._num_tensor_args_to_observation_type = {
            _check_index(k, child(path, str(k))): _check_observation_type(v, child(path, str(k)))
            for k, v in expect(mapping, dict, path, "a dict {num_tensor_args: ObservationType}").items()}
        return self

    _set_num_tensor_args_to_observation_type = set_num_tensor_args_to_observation_type

    def set_input_type_to_index(self, input_type_to_index: dict[str, int]) -> BackendPatternConfig:
        path = "input_type_to_index"
        mapping = expect(input_type_to_index, dict, path, "a dict {input type name: arg index}")
        for key, value in mapping.items():
            expect(key, str, path, "input type names (str) as keys")
            _check_index(value, child(path, key))
        self._input_type_to_index = dict(mapping)
        return self

    _set_input_type_to_index = set_input_type_to_index

    # -- read access -------------------------------------------------------------------------------

    @property
    def observation_type(self) -> ObservationType:
        return self._observation_type

    @property
    def dtype_configs(self) -> list[DTypeConfig]:
        """A copy: changes go through the builders."""
        return list(self._dtype_configs)

    @property
    def root_module(self) -> type[nn.Module] | None:
        return self._root_module

    @property
    def qat_module(self) -> type[nn.Module] | None:
        return self._qat_module

    @property
    def reference_quantized_module(self) -> type[nn.Module] | None:
        return self._reference_quantized_module

    @property
    def fused_module(self) -> type[nn.Module] | None:
        return self._fused_module

    @property
    def fuser_method(self) -> Callable[..., Any] | None:
        """As set, taking modules in the order the pattern was written."""
        return self._fuser_method

    @property
    def root_node_getter(self) -> Callable[..., Any] | None:
        return self._root_node_getter

    @property
    def extra_inputs_getter(self) -> Callable[..., Any] | None:
        return self._extra_inputs_getter

    @property
    def num_tensor_args_to_observation_type(self) -> dict[int, ObservationType]:
        return dict(self._num_tensor_args_to_observation_type)

    @property
    def input_type_to_index(self) -> dict[str, int]:
        return dict(self._input_type_to_index)

    @property
    def complex_fuser_method(self) -> Callable[..., Any] | None:
        """The fuser taking ``(is_qat, *modules)`` in complex (matched) order.

        A fuser registered with a simple pattern is wrapped (matching-rules.md rule 3); one
        registered with a complex pattern already takes that order.
        """
        if self._fuser_method is None or self._pattern is None:
            return self._fuser_method
        return (_reverse2 if len(self._pattern) == 2 else _reverse3)(self._fuser_method)

    def validate(self) -> BackendPatternConfig:
        """Re-check the whole config (a pattern must be set); returns ``self``."""
        if self._pattern is None and self._pattern_complex is None:
            raise ConfigValidationError("pattern is not set; call set_pattern(...) or "
                                        "set_pattern_complex_format(...)", field="pattern")
        if self._pattern is not None:
            validate_pattern(self._pattern, format="simple")
        validate_pattern(self.pattern_complex_format, format="complex")
        self._check_fuser(self._fuser_method, self._pattern if self._pattern is not None
                          else self._pattern_complex)
        return self

    # -- plain data --------------------------------------------------------------------------------

    def to_data(self, path: str = "") -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self._pattern is not None:
            data[PATTERN_KEY] = encode_pattern(self._pattern, child(path, PATTERN_KEY))
        if self._pattern_complex is not None:
            data[PATTERN_COMPLEX_FORMAT_KEY] = encode_pattern(self._pattern_complex,
                                                              child(path, PATTERN_COMPLEX_FORMAT_KEY))
        data[OBSERVATION_TYPE_KEY] = self._observation_type.name
        data[DTYPE_CONFIGS_KEY] = [d.to_data() for d in self._dtype_configs]
        for key, attr in {**_MODULE_FIELDS, **_CALLABLE_FIELDS}.items():
            value = getattr(self, attr)
            if value is not None:
                data[key] = encode_name(value, field=child(path, key), kinds=_field_kinds(key))
        if self._num_tensor_args_to_observation_type:
            data[NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY] = {
                str(k): v.name for k, v in self._num_tensor_args_to_observation_type.items()}
        if self._input_type_to_index:
            data[INPUT_TYPE_TO_INDEX_KEY] = dict(self._input_type_to_index)
        return data

    @classmethod
    def from_data(cls, doc: Any, path: str) -> BackendPatternConfig:
        read_fields(doc, path, _KEYS)
        config = cls()
        if PATTERN_KEY in doc:
            at = child(path, PATTERN_KEY)
            call_at(at, config.set_pattern, decode_pattern(doc[PATTERN_KEY], at))
        if PATTERN_COMPLEX_FORMAT_KEY in doc:
            at = child(path, PATTERN_COMPLEX_FORMAT_KEY)
            call_at(at, config.set_pattern_complex_format, decode_pattern(doc[PATTERN_COMPLEX_FORMAT_KEY], at))
        if OBSERVATION_TYPE_KEY in doc:
            config._observation_type = _decode_observation_type(doc[OBSERVATION_TYPE_KEY],
                                                                child(path, OBSERVATION_TYPE_KEY))
        at = child(path, DTYPE_CONFIGS_KEY)
        config._dtype_configs = [DTypeConfig.from_data(d, child(at, i)) for i, d in
                                 enumerate(expect(doc.get(DTYPE_CONFIGS_KEY, []), list, at, "a JSON list"))]
        for key, attr in {**_MODULE_FIELDS, **_CALLABLE_FIELDS}.items():
            if doc.get(key) is not None:
                at = child(path, key)
                call_at(at, getattr(config, f"set_{attr}"),
                        decode_name(doc[key], field=at, kinds=_field_kinds(key)))
        if NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY in doc:
            at = child(path, NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY)
            table = expect(doc[NUM_TENSOR_ARGS_TO_OBSERVATION_TYPE_KEY], dict, at, "a JSON object")
            config._num_tensor_args_to_observation_type = {
                _decode_count(k, child(at, k)): _decode_observation_type(v, child(at, k))
                for k, v in table.items()}
        if INPUT_TYPE_TO_INDEX_KEY in doc:
            call_at(child(path, INPUT_TYPE_TO_INDEX_KEY), config.set_input_type_to_index,
                doc[INPUT_TYPE_TO_INDEX_KEY])
        return config

    def to_dict(self) -> dict[str, Any]:
        return versioned(self.to_data())

    @classmethod
    def from_dict(cls, doc: Any) -> BackendPatternConfig:
        return cls.from_data(unversioned(doc), "")

    # -- value semantics ---------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return dict(vars(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BackendPatternConfig) and self._state() == other._state()

    __hash__ = None  # type: ignore[assignment]  # mutable builder

    def __repr__(self) -> str:
        defaults = BackendPatternConfig()._state()
        shown = []
        for attr, value in self._state().items():
            if value == defaults[attr]:
                continue
            name = attr.lstrip("_")
            if attr == "_pattern_complex":
                name, text = "pattern_complex_format", format_pattern(value)
            elif attr == "_pattern":
                text = describe(value)
            elif isinstance(value, type) or callable(value):
                text = getattr(value, "__name__", repr(value))
            else:
                text = repr(value)
            shown.append(f"{name}={text}")
        return f"BackendPatternConfig({', '.join(shown)})"


def _check_index(value: Any, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigValidationError(f"{path} must be an int >= 0, got {value!r}", field=path, value=value)
    return value


def _decode_count(key: Any, path: str) -> int:
    if not (isinstance(key, str) and key.isdigit()) or not key.isascii():
        raise ConfigError(f"{where(path)}: expected a number of tensor args such as \"2\", got {key!r}",
                          field=path, value=key)
    return int(key)


def _decode_observation_type(value: Any, path: str) -> ObservationType:
    expect(value, str, path, "an ObservationType name")
    try:
        return ObservationType[value]
    except KeyError:
        return _check_observation_type(value, path)  # raises with "did you mean"

