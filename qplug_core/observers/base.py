"""The observer base class: configuration checks, qparams plumbing and non-finite handling.

An observer watches the tensors flowing through one point of a model during calibration and turns
what it saw into quantization parameters. Subclasses only decide *which* range to report
(:meth:`ObserverBase._observed_range`); turning a range into qparams, validating the config and
naming the observer in errors live here so that every observer behaves the same way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qplug_core.errors import (
    ConfigValidationError,
    NonFiniteCalibrationError,
    UncalibratedObserverError,
    did_you_mean,
)
from qplug_core.observers.batch_sync import BatchStats, batch_reduction
from qplug_core.observers.bounds import check_setting
from qplug_core.observers.factory import FactoryMixin
from qplug_core.observers.ranks import Ranks, refuse_reduction
from qplug_core.observers.tokens import real_tokens
from qplug_core.qparams import (
    PER_CHANNEL_SCHEMES,
    PER_TENSOR_SCHEMES,
    QParams,
    compute_qparams,
    quant_range,
)

NONFINITE_POLICIES = ("raise", "ignore")
_ALL_SCHEMES = PER_TENSOR_SCHEMES + PER_CHANNEL_SCHEMES


def refuse_symmetric_quint8_reduce_range(observer: "ObserverBase") -> None:
    """Range observers refuse symmetric quint8 with reduce_range: torch.ao's min/max observers
    refuse it, and its histogram observer answers zero point 128, outside the reduced [0, 127], so
    no answer would match torch.ao's."""
    if (observer.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric)
            and observer.dtype == torch.quint8 and observer.reduce_range):
        raise ConfigValidationError(
            f"{type(observer).__name__}: symmetric quint8 cannot use reduce_range (torch.ao's "
            "min/max observers refuse it, and its histogram observer gives a zero point outside the "
            "reduced range); use an affine qscheme, or qint8",
            field="reduce_range", value=observer.reduce_range)


class ObserverBase(nn.Module, FactoryMixin):
    """Records statistics in ``forward`` (returning its input unchanged) and reports qparams.

    ``nonfinite="raise"`` rejects NaN/Inf in calibration data with
    :class:`NonFiniteCalibrationError`; ``"ignore"`` leaves them out of the statistics. ``name``
    (set by prepare) is the model location used in error messages.
    """

    #: which qschemes a subclass accepts; per-tensor by default
    supported_qschemes: tuple[torch.qscheme, ...] = PER_TENSOR_SCHEMES
    #: whether ``dtype`` may be a float dtype (fp16 weight-only / dynamic placeholders)
    allows_float_dtype: bool = False

    def __init__(self, dtype: torch.dtype = torch.quint8,
                 qscheme: torch.qscheme = torch.per_tensor_affine, reduce_range: bool = False,
                 quant_min: int | None = None, quant_max: int | None = None,
                 eps: float = torch.finfo(torch.float32).eps, is_dynamic: bool = False,
                 nonfinite: str = "raise", name: str = "") -> None:
        super().__init__()
        self._check_choice("qscheme", qscheme, _ALL_SCHEMES)
        if qscheme not in self.supported_qschemes:
            raise ConfigValidationError(
                f"{type(self).__name__} does not support qscheme {qscheme}; it accepts "
                f"{', '.join(map(str, self.supported_qschemes))} (use a per-channel observer for "
                "per-channel schemes and vice versa)", field="qscheme", value=qscheme)
        self._check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        check_setting("eps", eps)
        for bound in ("quant_min", "quant_max"):
            value = quant_min if bound == "quant_min" else quant_max
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigValidationError(f"{bound} must be an int, got {value!r}", field=bound,
                                            value=value)
        self.dtype = dtype
        self.qscheme = qscheme
        self.reduce_range = reduce_range
        self.is_dynamic = is_dynamic
        self.nonfinite = nonfinite
        self.name = name
        self.has_customized_qrange = quant_min is not None and quant_max is not None
        if self.allows_float_dtype and dtype.is_floating_point:
            self.quant_min, self.quant_max = quant_min, quant_max
        else:
            self.quant_min, self.quant_max = quant_range(dtype, reduce_range, quant_min, quant_max)
        self.register_buffer("eps", torch.tensor([eps], dtype=torch.float32))

    @staticmethod
    def _check_choice(field: str, value: object, choices: tuple) -> None:
        if value not in choices:
            hint = did_you_mean(str(value), [str(c) for c in choices])
            raise ConfigValidationError(
                f"{field}={value!r} is not one of {', '.join(map(str, choices))}{hint}",
                field=field, value=value)

    # -- what subclasses provide ---------------------------------------------------------------

    def _centres_in_range(self) -> bool:
        """Symmetric quint8 centres its zero point in the range when it is not the full 0..255.

        torch.ao keeps 128 under ``reduce_range`` (outside 0..127, so half the range is lost);
        qplug uses the middle of the reduced range, a documented difference (docs/migrating.md).
        """
        return self.has_customized_qrange or (self.reduce_range and self.dtype == torch.quint8)

    @property
    def has_data(self) -> bool:
        raise NotImplementedError

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (min, max) to quantize for; only called when ``has_data`` is true."""
        raise NotImplementedError

    # -- agreeing across ranks (torch.distributed) ----------------------------------------------

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Make this observer's statistics identical on every rank of ``ranks``, in place.

        The protocol every observer class implements (docs/guide/distributed.md): after the call
        each rank holds the statistics one process would hold had it seen every rank's batches,
        by a documented rule, and a second call changes nothing. Called at the end of distributed
        calibration, and every k steps in QAT. A class that changes how statistics are gathered
        (``forward``, ``_update``, ...) must define it; otherwise distributed calibration refuses
        to run.
        """
        refuse_reduction(self)

    reduce_across_ranks.undeclared = True  # type: ignore[attr-defined]

    def _observe(self, stats: BatchStats) -> None:
        """Use one batch's statistics: at once in one process, once the ranks agree in several."""
        reduction = batch_reduction(self)
        if reduction is not None:
            reduction.add(self, stats)
        elif not stats.empty:
            self._apply_batch(stats, stats.low, stats.high,
                              self._batch_counts(stats, stats.low, stats.high))

    def _batch_counts(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor
                      ) -> torch.Tensor | None:
        """What the ranks sum once the batch range [low, high] is agreed (bin counts); or None."""
        return None

    def _apply_batch(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor,
                     counts: torch.Tensor | None) -> None:
        """Update the statistics with a batch whose range (over every rank) is [low, high]."""
        raise NotImplementedError

    def _range_stats(self, x: torch.Tensor, *, keep_values: bool = False) -> BatchStats:
        """This batch's finite (min, max) as :class:`BatchStats` (and its values if asked); in
        calibration, a per-tensor observer's token states count their real tokens only
        (:mod:`qplug_core.observers.tokens`)."""
        if self.qscheme in PER_TENSOR_SCHEMES:
            x = real_tokens(x)
        found = self._finite_aminmax(x) if x.numel() else None
        if found is None:
            inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
            return BatchStats(inf, -inf, empty=True)
        values, low, high = found
        return BatchStats(low, high, empty=False, values=values if keep_values else None)

    # -- qparams -------------------------------------------------------------------------------

    def _where(self) -> str:
        return f"{type(self).__name__} {self.name!r}" if self.name else type(self).__name__

    def _require_data(self) -> None:
        if not self.has_data:
            raise UncalibratedObserverError(
                f"{self._where()} has not observed any data, so it has no qparams; run "
                "calibration batches through the model first (or leave this op in float)",
                nodes=[self.name] if self.name else [])

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` shaped like torch.ao's: ``[1]`` per-tensor, ``[C]`` per-channel."""
        self._require_data()
        min_val, max_val = self._observed_range()
        try:
            scale, zero_point = compute_qparams(
                min_val, max_val, dtype=self.dtype, qscheme=self.qscheme,
                quant_min=self.quant_min, quant_max=self.quant_max, eps=self.eps,
                custom_range=self._centres_in_range())
        except NonFiniteCalibrationError as e:
            raise NonFiniteCalibrationError(f"{self._where()}: {e}", node=self.name or None,
                                            count=e.count) from e
        return scale.reshape(-1), zero_point.reshape(-1)

    def qparams(self) -> QParams:
        """The qparams as a :class:`QParams` (0-d tensors for per-tensor schemes)."""
        scale, zero_point = self.calculate_qparams()
        axis = getattr(self, "ch_axis", None) if self.qscheme in PER_CHANNEL_SCHEMES else None
        if axis is None:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        return QParams(scale=scale, zero_point=zero_point, dtype=self.dtype,
                       quant_min=self.quant_min, quant_max=self.quant_max, axis=axis,
                       is_dynamic=self.is_dynamic)

    # -- input handling shared by the observers ------------------------------------------------

    def _nonfinite_found(self, x: torch.Tensor) -> torch.Tensor:
        """Raise for NaN/Inf under ``nonfinite="raise"``; else return the mask of finite values."""
        finite = torch.isfinite(x)
        if self.nonfinite == "raise":
            count = int(finite.numel() - finite.sum())
            raise NonFiniteCalibrationError(
                f"{self._where()} received {count} non-finite value(s) (NaN or Inf) out of "
                f"{x.numel()}; fix the data or model, or build the observer with "
                "nonfinite='ignore' to leave them out of the statistics",
                node=self.name or None, count=count)
        return finite

    def _finite_aminmax(self, x: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(finite values of x, their min, their max)``; ``None`` when there are none.

        The finite check costs nothing on clean data: NaN and Inf both show up in aminmax, and
        only then is the tensor scanned again (to count or filter).
        """
        x_min, x_max = torch.aminmax(x)
        if math.isfinite(x_min.item()) and math.isfinite(x_max.item()):
            return x, x_min, x_max
        x = x[self._nonfinite_found(x)]
        return (x, *torch.aminmax(x)) if x.numel() else None

    def _channel_aminmax(self, x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of each slice of ``x`` along ``axis``, ignoring non-finite values.

        Reducing over the other dims in place is much faster than torch.ao's permute + flatten
        copy and gives the same (exact) values. A channel without finite values yields
        ``(+inf, -inf)``, which the running statistics treat as "no data for this channel".
        """
        dims = tuple(d for d in range(x.dim()) if d != axis % x.dim())
        if not dims:
            x_min = x_max = x
        else:
            x_min, x_max = x.amin(dim=dims), x.amax(dim=dims)
        if bool((torch.isfinite(x_min) & torch.isfinite(x_max)).all()):
            return x_min.clone(), x_max.clone()
        finite = self._nonfinite_found(x)
        inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
        low, high = torch.where(finite, x, inf), torch.where(finite, x, -inf)
        if not dims:
            return low, high
        return low.amin(dim=dims), high.amax(dim=dims)

    def extra_repr(self) -> str:
        parts = [f"dtype={self.dtype}", f"qscheme={self.qscheme}",
                 f"quant_min={self.quant_min}", f"quant_max={self.quant_max}"]
        if self.name:
            parts.insert(0, f"name={self.name!r}")
        return ", ".join(parts)
