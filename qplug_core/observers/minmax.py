"""Observers that track the minimum and maximum (running or moving-average), per tensor or channel.

The update rules are torch.ao's, operation for operation, so that the same data gives bit-identical
statistics and therefore identical qparams.
"""

from __future__ import annotations

from typing import Any

import torch

from qplug_core.errors import ConfigValidationError, UncalibratedObserverError
from qplug_core.observers.base import ObserverBase, refuse_symmetric_quint8_reduce_range
from qplug_core.observers.batch_sync import BatchStats, batch_reduction
from qplug_core.observers.bounds import check_setting
from qplug_core.observers.ranks import Ranks
from qplug_core.qparams import PER_CHANNEL_SCHEMES


def _check_averaging_constant(value: float) -> None:
    check_setting("averaging_constant", value)


def _not_below(max_val: torch.Tensor, min_val: torch.Tensor) -> torch.Tensor:
    """``max_val`` raised to ``min_val`` where averaging rounded it below (constant inputs).

    ``m + c * (x - m)`` need not equal ``x`` even when min and max are the same ``x``; torch.ao
    then fails with "min should be less than max". Elsewhere this is the identity.
    """
    return torch.max(max_val, min_val)


class MinMaxObserver(ObserverBase):
    """Running min/max of everything observed; the default for weights.

    ``memoryless=True`` forgets earlier batches: each call's range replaces the previous one
    (torch.ao's old ``memoryless`` flag, used for per-batch statistics).
    """

    def __init__(self, memoryless: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        refuse_symmetric_quint8_reduce_range(self)
        self.memoryless = bool(memoryless)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def has_data(self) -> bool:
        return bool(self.min_val <= self.max_val)

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val, self.max_val

    def _update(self, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        self.min_val.copy_(torch.min(x_min, self.min_val))
        self.max_val.copy_(torch.max(x_max, self.max_val))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.memoryless:
            self.reset_min_max_vals()
        self._observe(self._range_stats(x.detach().to(self.min_val.dtype)))
        return x

    def _apply_batch(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor,
                     counts: torch.Tensor | None) -> None:
        self._update(low, high)

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """MIN of ``min_val`` and MAX of ``max_val``: exactly the range of all ranks' data."""
        low, high = ranks.min_max(self.min_val, self.max_val)
        self.min_val.copy_(low)
        self.max_val.copy_(high)

    def reset_min_max_vals(self) -> None:
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, min_val={self.min_val}, max_val={self.max_val}"


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of each batch's min/max; the default inside QAT fake-quant."""

    def __init__(self, averaging_constant: float = 0.01, **kwargs: Any) -> None:
        _check_averaging_constant(averaging_constant)
        if kwargs.get("is_dynamic") and averaging_constant != 1:
            raise ConfigValidationError(
                "dynamic quantization observes each batch on its own; use averaging_constant=1",
                field="averaging_constant", value=averaging_constant)
        super().__init__(**kwargs)
        self.averaging_constant = averaging_constant

    def _update(self, x_min: torch.Tensor, x_max: torch.Tensor) -> None:
        if not self.has_data:
            self.min_val.copy_(x_min)
            self.max_val.copy_(x_max)
            return
        c = self.averaging_constant
        new_min = self.min_val + c * (x_min - self.min_val)
        new_max = self.max_val + c * (x_max - self.max_val)
        self.min_val.copy_(new_min)
        self.max_val.copy_(_not_below(new_max, new_min))

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Nothing when the ranks agree (they do after reducing each batch); else the mean.

        The average is linear, so the mean of the ranks' averages is the moving average of the
        ranks' mean batch min/max since they last agreed (ranks without data left out).
        """
        low, high = _mean_unless_identical(ranks, self.min_val, self.max_val)
        self.min_val.copy_(low)
        self.max_val.copy_(high)


def _mean_unless_identical(ranks: Ranks, low: torch.Tensor, high: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) unchanged if every rank holds the same; else their elementwise mean over the
    ranks where the entry is finite (an infinite entry means "no data" and stays out)."""
    if ranks.identical(low, high):
        return low, high
    state = torch.cat([low.reshape(-1), high.reshape(-1)]).double()
    finite = torch.isfinite(state)
    summed = ranks.total(torch.cat([torch.where(finite, state, 0.0), finite.double()]))
    n = state.numel()
    mean = torch.where(summed[n:] > 0, summed[:n] / summed[n:], state).to(low.dtype)
    new_low = mean[:low.numel()].reshape(low.shape)
    return new_low, _not_below(mean[low.numel():].reshape(high.shape), new_low)


class PerChannelMinMaxObserver(ObserverBase):
    """Running min/max of each slice along ``ch_axis``; the default for conv/linear weights.

    ``memoryless=True``: each call's per-channel range replaces the previous one.
    """

    supported_qschemes = PER_CHANNEL_SCHEMES

    def __init__(self, ch_axis: int = 0, qscheme: torch.qscheme = torch.per_channel_affine,
                 memoryless: bool = False, **kwargs: Any) -> None:
        if not isinstance(ch_axis, int) or isinstance(ch_axis, bool):
            raise ConfigValidationError(f"ch_axis must be an int, got {ch_axis!r}",
                                        field="ch_axis", value=ch_axis)
        if kwargs.get("is_dynamic"):
            raise ConfigValidationError(
                f"{type(self).__name__} cannot be used for dynamic quantization",
                field="is_dynamic", value=True)
        super().__init__(qscheme=qscheme, **kwargs)
        refuse_symmetric_quint8_reduce_range(self)
        self.memoryless = bool(memoryless)
        self.ch_axis = ch_axis
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("max_val", torch.tensor([]))

    @property
    def has_data(self) -> bool:
        return self.min_val.numel() > 0

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.isinf(self.min_val).nonzero().flatten().tolist()
        if empty:
            raise UncalibratedObserverError(
                f"{self._where()}: channel(s) {empty[:10]} along axis {self.ch_axis} saw no "
                "finite values; check the calibration data for those channels",
                nodes=[self.name] if self.name else [])
        return self.min_val, self.max_val

    def _check_channels(self, x: torch.Tensor) -> None:
        if not -x.dim() <= self.ch_axis < x.dim():
            raise ConfigValidationError(
                f"{self._where()}: ch_axis={self.ch_axis} is out of range for an input of shape "
                f"{tuple(x.shape)}", field="ch_axis", value=self.ch_axis)
        if self.has_data and x.shape[self.ch_axis] != self.min_val.numel():
            raise ConfigValidationError(
                f"{self._where()}: input has {x.shape[self.ch_axis]} channels along axis "
                f"{self.ch_axis} but earlier inputs had {self.min_val.numel()}",
                field="ch_axis", value=self.ch_axis)

    def _combine(self, cur_min: torch.Tensor, cur_max: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.min(cur_min, self.min_val), torch.max(cur_max, self.max_val)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0 and batch_reduction(self) is None:
            return x
        if self.memoryless:
            self.reset_min_max_vals()
        x = x.detach().to(self.min_val.dtype)
        self._check_channels(x)
        if x.numel():
            low, high = self._channel_aminmax(x, self.ch_axis)
        else:  # still takes part in the reduction: the other ranks' batches may hold data
            low = torch.full((x.shape[self.ch_axis],), float("inf"), dtype=x.dtype, device=x.device)
            high = -low
        self._observe(BatchStats(low, high, empty=x.numel() == 0))
        return x

    def _apply_batch(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor,
                     counts: torch.Tensor | None) -> None:
        if self.has_data:
            low, high = self._combine(low, high)
        self._set(low, high)

    def _set(self, low: torch.Tensor, high: torch.Tensor) -> None:
        self.min_val.resize_(low.shape).copy_(low)
        self.max_val.resize_(high.shape).copy_(high)

    def _channels_across_ranks(self, ranks: Ranks) -> int:
        """The channel count every rank with data has (0: no rank has data); refuses a mismatch."""
        mine = float(self.min_val.numel())
        fewest, most = ranks.min_max(torch.tensor([mine or float("inf")], dtype=torch.float64),
                                     torch.tensor([mine], dtype=torch.float64))
        fewest, most = float(fewest), float(most)
        if most and fewest != most:
            raise ConfigValidationError(
                f"{self._where()}: ranks observed different channel counts along axis "
                f"{self.ch_axis} ({int(fewest)} and {int(most)}); every rank must run the same model",
                field="ch_axis", value=self.ch_axis)
        return int(most)

    def _filled(self, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(min_val, max_val), or "no data" channels of that count for a rank that saw nothing."""
        if self.has_data:
            return self.min_val, self.max_val
        low = torch.full((channels,), float("inf"), dtype=self.min_val.dtype,
                         device=self.min_val.device)
        return low, -low

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Per-channel MIN of ``min_val`` and MAX of ``max_val``: exactly all ranks' ranges."""
        channels = self._channels_across_ranks(ranks)
        if channels:
            self._set(*ranks.min_max(*self._filled(channels)))

    def reset_min_max_vals(self) -> None:
        self.min_val.resize_(0)
        self.max_val.resize_(0)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # the buffers start empty; give them the saved size so the default loader can copy
        for key in ("min_val", "max_val"):
            if prefix + key in state_dict:
                getattr(self, key).resize_(state_dict[prefix + key].shape)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, ch_axis={self.ch_axis}, min_val={self.min_val}, "
                f"max_val={self.max_val}")


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel moving averages of min/max; the per-channel weight observer for QAT."""

    def __init__(self, averaging_constant: float = 0.01, **kwargs: Any) -> None:
        _check_averaging_constant(averaging_constant)
        super().__init__(**kwargs)
        self.averaging_constant = averaging_constant

    def _combine(self, cur_min: torch.Tensor, cur_max: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.averaging_constant
        new_min = self.min_val + c * (cur_min - self.min_val)
        new_max = self.max_val + c * (cur_max - self.max_val)
        # a channel without finite values this batch (nonfinite="ignore") keeps its average;
        # a channel seen for the first time takes the batch value
        new_min = torch.where(torch.isfinite(cur_min), new_min, self.min_val)
        new_max = torch.where(torch.isfinite(cur_max), new_max, self.max_val)
        new_min = torch.where(torch.isfinite(self.min_val), new_min, cur_min)
        new_max = torch.where(torch.isfinite(self.max_val), new_max, cur_max)
        return new_min, _not_below(new_max, new_min)

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """As :meth:`MovingAverageMinMaxObserver.reduce_across_ranks`, per channel."""
        channels = self._channels_across_ranks(ranks)
        if channels:
            self._set(*_mean_unless_identical(ranks, *self._filled(channels)))
