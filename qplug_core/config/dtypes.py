"""What a backend accepts for one op: dtypes, with optional range/scale constraints.

These are value objects (frozen, validated when built) so that a backend config with an impossible
constraint fails where it is written, not later when a user's qconfig is silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from qplug_core.config.codec import (
    child,
    decode_dtype,
    encode_dtype,
    expect,
    read_fields,
    unversioned,
    versioned,
)
from qplug_core.errors import ConfigValidationError

__all__ = ["DTypeConfig", "DTypeWithConstraints", "SUPPORTED_DTYPES", "dtype_range"]

#: integer range of each quantized / integer dtype
_INT_RANGES: dict[torch.dtype, tuple[int, int]] = {
    torch.quint8: (0, 255), torch.qint8: (-128, 127), torch.qint32: (-(2**31), 2**31 - 1),
    torch.quint4x2: (0, 15), torch.quint2x4: (0, 3),
    torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-(2**15), 2**15 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (*_INT_RANGES, *_FLOAT_DTYPES)


def dtype_range(dtype: torch.dtype) -> tuple[int, int] | None:
    """``(min, max)`` integer values of ``dtype``, or ``None`` for floating dtypes."""
    return _INT_RANGES.get(dtype)


def _check_dtype(value: Any, path: str) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ConfigValidationError(f"{path} must be one of {names}; got {value!r}",
                                    field=path, value=value)
    return value


def _as_power_of_two(value: float) -> str:
    """``2**-12`` for 0.000244140625, as users write a scale bound in code; else the number."""
    exponent = math.log2(value) if value > 0 else 0.5
    return f"2**{int(exponent)}" if exponent.is_integer() else repr(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class DTypeWithConstraints:
    """A dtype plus the qparams a backend can run with (torch.ao semantics).

    ``quant_min_lower_bound``/``quant_max_upper_bound`` bound the observer's quant range,
    ``scale_min_lower_bound`` bounds its smallest scale (its ``eps``), and the exact-match pair is
    for fixed-qparams ops such as sigmoid. ``scale_max_upper_bound`` is kept for torch.ao parity.
    """

    dtype: torch.dtype | None = None
    quant_min_lower_bound: int | None = None
    quant_max_upper_bound: int | None = None
    scale_min_lower_bound: float | None = None
    scale_max_upper_bound: float | None = None
    scale_exact_match: float | None = None
    zero_point_exact_match: int | None = None

    def __post_init__(self) -> None:
        self._validate("DTypeWithConstraints")

    def _validate(self, path: str) -> None:
        constrained = [f.name for f in fields(self)[1:] if getattr(self, f.name) is not None]
        if self.dtype is None:
            if constrained:
                raise ConfigValidationError(
                    f"{child(path, constrained[0])} is set but {child(path, 'dtype')} is None; "
                    "constraints need the dtype they constrain, e.g. dtype=torch.quint8",
                    field=child(path, "dtype"), value=None)
            return
        _check_dtype(self.dtype, child(path, "dtype"))
        self._validate_quant_range(path)
        self._validate_scale(path)

    def _validate_quant_range(self, path: str) -> None:
        low, high = self.quant_min_lower_bound, self.quant_max_upper_bound
        bounds = dtype_range(self.dtype)  # type: ignore[arg-type]
        for name, value in (("quant_min_lower_bound", low), ("quant_max_upper_bound", high)):
            if value is None:
                continue
            at = child(path, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigValidationError(f"{at} must be an int, got {value!r}", field=at, value=value)
            if bounds is None:
                raise ConfigValidationError(f"{at} is set for the floating dtype {self.dtype}; quant "
                                            "ranges only apply to integer dtypes", field=at, value=value)
            if not bounds[0] <= value <= bounds[1]:
                raise ConfigValidationError(f"{at}={value} is outside the range {bounds} of "
                                            f"{self.dtype}", field=at, value=value)
        if low is not None and high is not None and low > high:
            at = child(path, "quant_min_lower_bound")
            raise ConfigValidationError(f"{at}={low} is greater than quant_max_upper_bound={high}; "
                                        "swap them", field=at, value=low)

    def _validate_scale(self, path: str) -> None:
        for name in ("scale_min_lower_bound", "scale_max_upper_bound", "scale_exact_match"):
            value, at = getattr(self, name), child(path, name)
            if value is not None and (not _is_number(value) or value < 0
                                      or (value == 0 and name != "scale_min_lower_bound")):
                raise ConfigValidationError(f"{at} must be a finite positive number, got {value!r}",
                                            field=at, value=value)
        low, high = self.scale_min_lower_bound, self.scale_max_upper_bound
        if low is not None and high is not None and low > high:
            at = child(path, "scale_min_lower_bound")
            raise ConfigValidationError(f"{at}={low} is greater than scale_max_upper_bound={high}; "
                                        "swap them", field=at, value=low)
        scale, zero_point = self.scale_exact_match, self.zero_point_exact_match
        if (scale is None) != (zero_point is None):
            at = child(path, "zero_point_exact_match" if zero_point is None else "scale_exact_match")
            raise ConfigValidationError(f"{at} is missing: fixed qparams need both scale_exact_match "
                                        "and zero_point_exact_match", field=at, value=None)
        if zero_point is not None:
            at, bounds = child(path, "zero_point_exact_match"), dtype_range(self.dtype)  # type: ignore[arg-type]
            if (not isinstance(zero_point, int) or isinstance(zero_point, bool)
                    or (bounds is not None and not bounds[0] <= zero_point <= bounds[1])):
                raise ConfigValidationError(f"{at} must be an int within the range of {self.dtype}, "
                                            f"got {zero_point!r}", field=at, value=zero_point)

    @property
    def has_constraints(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self)[1:])

    def violations(self, dtype: torch.dtype | None, quant_min: int | None, quant_max: int | None,
                   scale: float | None = None, zero_point: int | None = None, *,
                   eps: float | None = None) -> list[str]:
        """Why an observer with these settings cannot be honoured (empty list: it can).

        Mirrors torch.ao's ``_qconfig_satisfies_dtype_config_constraints``: a quant range must lie
        within the bounds, ``eps`` (the observer's smallest scale) must reach the scale lower bound,
        and fixed-qparams ops need exactly the backend's ``scale``/``zero_point``. Unlike torch.ao a
        dtype mismatch is reported too, so one call answers "can the backend run this?".
        """
        reasons: list[str] = []
        if self.dtype is not None and dtype != self.dtype:
            reasons.append(f"dtype {dtype} is not the backend's {self.dtype}")
        low, high = self.quant_min_lower_bound, self.quant_max_upper_bound
        if low is not None or high is not None:
            if quant_min is None or quant_max is None:
                reasons.append("quant_min and quant_max must be set")
            elif (low is not None and quant_min < low) or (high is not None and quant_max > high):
                fixed = (quant_min if low is None else max(quant_min, low),
                         quant_max if high is None else min(quant_max, high))
                reasons.append(f"quant range ({quant_min}, {quant_max}) must fall within the backend's "
                               f"({low}, {high}): give the observer quant_min={fixed[0]}, "
                               f"quant_max={fixed[1]}")
        if self.scale_min_lower_bound is not None:
            if eps is None:
                reasons.append("eps (the minimum scale) must be set")
            elif eps < self.scale_min_lower_bound:
                reasons.append(f"eps {eps} is below the backend's minimum scale "
                               f"{self.scale_min_lower_bound}: give the observer "
                               f"eps={_as_power_of_two(self.scale_min_lower_bound)}")
        if self.scale_exact_match is not None:
            if scale is None or zero_point is None:
                reasons.append(f"this op needs fixed qparams (scale={self.scale_exact_match}, "
                               f"zero_point={self.zero_point_exact_match}); use a fixed-qparams observer")
            elif scale != self.scale_exact_match or zero_point != self.zero_point_exact_match:
                reasons.append(f"fixed qparams (scale={scale}, zero_point={zero_point}) differ from the "
                               f"backend's (scale={self.scale_exact_match}, "
                               f"zero_point={self.zero_point_exact_match})")
        return reasons

    def to_data(self) -> Any:
        """A plain dtype name when unconstrained, else an object of the set fields."""
        if not self.has_constraints:
            return None if self.dtype is None else encode_dtype(self.dtype)
        data: dict[str, Any] = {"dtype": encode_dtype(self.dtype)}  # type: ignore[arg-type]
        data.update({f.name: getattr(self, f.name) for f in fields(self)[1:]
                     if getattr(self, f.name) is not None})
        return data

    @classmethod
    def from_data(cls, doc: Any, path: str) -> DTypeWithConstraints:
        if doc is None:
            return cls()
        if isinstance(doc, str):
            return cls(_check_dtype(decode_dtype(doc, field=path), path))
        names = [f.name for f in fields(cls)]
        read_fields(doc, path, names, required=("dtype",))
        values = {k: v for k, v in doc.items() if k != "dtype"}
        for name, value in values.items():
            expect(value, (int, float, type(None)), child(path, name), "a number or null")
        return _build(cls, path, decode_dtype(doc["dtype"], field=child(path, "dtype")), **values)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if getattr(self, f.name) is not None)
        return f"DTypeWithConstraints({shown})"


def _build(cls: type[DTypeWithConstraints], path: str, *args: Any, **kwargs: Any) -> DTypeWithConstraints:
    """Construct, reporting validation errors at ``path`` instead of the class name."""
    obj = object.__new__(cls)
    for f, value in zip(fields(cls), args):
        object.__setattr__(obj, f.name, value)
    for f in fields(cls)[len(args):]:
        object.__setattr__(obj, f.name, kwargs.get(f.name))
    obj._validate(path)
    return obj


_DTYPE_FIELDS = ("input_dtype", "output_dtype", "weight_dtype")
_DTYPE_CONFIG_KEYS = (*_DTYPE_FIELDS, "bias_dtype", "is_dynamic")


@dataclass(frozen=True, init=False)
class DTypeConfig:
    """The dtypes a backend supports for one pattern: activations in/out, weight, bias.

    Each activation/weight field takes a ``torch.dtype`` or a :class:`DTypeWithConstraints` and is
    stored as the latter (``input_dtype_with_constraints``); ``input_dtype`` gives the plain dtype,
    as in torch.ao.
    """

    input_dtype_with_constraints: DTypeWithConstraints = field(default_factory=DTypeWithConstraints)
    output_dtype_with_constraints: DTypeWithConstraints = field(default_factory=DTypeWithConstraints)
    weight_dtype_with_constraints: DTypeWithConstraints = field(default_factory=DTypeWithConstraints)
    bias_dtype: torch.dtype | None = None
    is_dynamic: bool | None = None

    def __init__(self, input_dtype: torch.dtype | DTypeWithConstraints | None = None,
                 output_dtype: torch.dtype | DTypeWithConstraints | None = None,
                 weight_dtype: torch.dtype | DTypeWithConstraints | None = None,
                 bias_dtype: torch.dtype | None = None, is_dynamic: bool | None = None):
        self._init("DTypeConfig", input_dtype, output_dtype, weight_dtype, bias_dtype, is_dynamic)

    def _init(self, _path: str, input_dtype: Any, output_dtype: Any, weight_dtype: Any,
              bias_dtype: Any, is_dynamic: Any) -> None:
        """Validate and set every field; ``_path`` prefixes the field names in errors."""
        for name, value in zip(_DTYPE_FIELDS, (input_dtype, output_dtype, weight_dtype)):
            at = child(_path, name)
            if value is None or isinstance(value, torch.dtype):
                value = _build(DTypeWithConstraints, at, None if value is None else _check_dtype(value, at))
            elif not isinstance(value, DTypeWithConstraints):
                raise ConfigValidationError(f"{at} must be a torch.dtype or DTypeWithConstraints, got "
                                            f"{value!r}", field=at, value=value)
            object.__setattr__(self, f"{name}_with_constraints", value)
        if bias_dtype is not None:
            _check_dtype(bias_dtype, child(_path, "bias_dtype"))
        if is_dynamic is not None and not isinstance(is_dynamic, bool):
            at = child(_path, "is_dynamic")
            raise ConfigValidationError(f"{at} must be True, False or None, got {is_dynamic!r}",
                                        field=at, value=is_dynamic)
        object.__setattr__(self, "bias_dtype", bias_dtype)
        object.__setattr__(self, "is_dynamic", is_dynamic)

    @property
    def input_dtype(self) -> torch.dtype | None:
        return self.input_dtype_with_constraints.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.output_dtype_with_constraints.dtype

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.weight_dtype_with_constraints.dtype

    def to_data(self) -> dict[str, Any]:
        data = {name: getattr(self, f"{name}_with_constraints").to_data() for name in _DTYPE_FIELDS}
        data["bias_dtype"] = None if self.bias_dtype is None else encode_dtype(self.bias_dtype)
        data["is_dynamic"] = self.is_dynamic
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_data(cls, doc: Any, path: str) -> DTypeConfig:
        read_fields(doc, path, _DTYPE_CONFIG_KEYS)
        dtypes = [DTypeWithConstraints.from_data(doc.get(name), child(path, name))
                  for name in _DTYPE_FIELDS]
        bias = doc.get("bias_dtype")
        bias_dtype = None if bias is None else decode_dtype(bias, field=child(path, "bias_dtype"))
        is_dynamic = expect(doc.get("is_dynamic"), (bool, type(None)), child(path, "is_dynamic"),
                            "true, false or null")
        obj = object.__new__(cls)
        obj._init(path, *dtypes, bias_dtype, is_dynamic)
        return obj

    def to_dict(self) -> dict[str, Any]:
        return versioned(self.to_data())

    @classmethod
    def from_dict(cls, doc: Any) -> DTypeConfig:
        return cls.from_data(unversioned(doc), "")

    def __repr__(self) -> str:
        parts = [f"{name}={value if value.has_constraints else value.dtype!r}" for name in _DTYPE_FIELDS
                 if (value := getattr(self, f"{name}_with_constraints")).dtype is not None]
        parts += [f"{name}={getattr(self, name)!r}" for name in ("bias_dtype", "is_dynamic")
                  if getattr(self, name) is not None]
        return f"DTypeConfig({', '.join(parts)})"

