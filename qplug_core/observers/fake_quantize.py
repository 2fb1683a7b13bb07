"""Fake quantization for quantization-aware training (QAT).

A fake-quant module observes its input (like an observer), keeps the resulting scale and zero
point in buffers and returns ``dequantize(quantize(x))`` in float, with a straight-through gradient,
so that training sees the rounding and clipping the int8 model will do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError, UncalibratedObserverError
from qplug_core.ir.torch_ao_apply import TORCH_AO_FAKE_QUANTIZE, AnswersTorchAoApply
from qplug_core.ir.tracing import run_eagerly
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.factory import FactoryMixin
from qplug_core.observers.fixed import FixedQParamsObserver
from qplug_core.observers.minmax import MovingAverageMinMaxObserver
from qplug_core.observers.ranks import Ranks, refuse_reduction
from qplug_core.qparams import PER_CHANNEL_SCHEMES, QParams, fake_quantize


class FakeQuantizeBase(AnswersTorchAoApply, nn.Module, FactoryMixin):
    """Switches shared by every fake-quant module: observing and fake-quantizing can be toggled.

    The switches are buffers (not Python attributes) so that they travel with the state dict.
    ``forward`` reads their mirrors ``_fake_quantizing`` / ``_observing`` (plain bools, kept in
    step by the methods below and by ``load_state_dict``): under ``torch.compile`` a test of a
    buffer is data-dependent and breaks the graph at every call, while a bool is a guard. Change
    the switches through the methods, not by writing the buffers. ``model.apply`` with torch.ao's
    switches (``torch.ao.quantization.disable_observer`` ...) runs qplug's namesakes below.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fake_quant_enabled", torch.tensor([1], dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor([1], dtype=torch.uint8))
        self._fake_quantizing = self._observing = True

    def enable_fake_quant(self, enabled: bool = True) -> None:
        self.fake_quant_enabled[0] = 1 if enabled else 0
        self._fake_quantizing = bool(enabled)

    def disable_fake_quant(self) -> None:
        self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled[0] = 1 if enabled else 0
        self._observing = bool(enabled)

    def disable_observer(self) -> None:
        self.enable_observer(False)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._fake_quantizing = bool(self.fake_quant_enabled[0])
        self._observing = bool(self.observer_enabled[0])

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Make the fake-quant state identical on every rank (see ``ObserverBase.reduce_across_ranks``)."""
        refuse_reduction(self)

    reduce_across_ranks.undeclared = True  # type: ignore[attr-defined]


class FakeQuantize(FakeQuantizeBase):
    """Observer + fake quantization: ``(clamp(round(x / scale) + zp, qmin, qmax) - zp) * scale``.

    ``observer`` is an observer class or factory (``MovingAverageMinMaxObserver`` by default);
    ``quant_min``/``quant_max`` and ``observer_kwargs`` configure it. ``activation_post_process``
    holds the observer.
    """

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver,
                 quant_min: int | None = None, quant_max: int | None = None,
                 **observer_kwargs: Any) -> None:
        super().__init__()
        if quant_min is not None or quant_max is not None:
            observer_kwargs.update(quant_min=quant_min, quant_max=quant_max)
        self.activation_post_process = observer(**observer_kwargs)
        if not isinstance(self.activation_post_process, ObserverBase):
            raise ConfigValidationError(
                f"observer must build a qplug observer, got {type(self.activation_post_process)}",
                field="observer", value=observer)
        obs = self.activation_post_process
        self.dtype, self.qscheme = obs.dtype, obs.qscheme
        self.quant_min, self.quant_max = obs.quant_min, obs.quant_max
        self.is_dynamic = obs.is_dynamic
        self.is_per_channel = obs.qscheme in PER_CHANNEL_SCHEMES
        self.ch_axis: int = getattr(obs, "ch_axis", -1)
        zp_dtype = torch.float32 if obs.qscheme == torch.per_channel_affine_float_qparams \
            else torch.int32
        self.register_buffer("scale", torch.tensor([1.0]))
        self.register_buffer("zero_point", torch.tensor([0], dtype=zp_dtype))

    @property
    def name(self) -> str:
        """The model location, shared with (and stored on) the observer for error messages."""
        return self.activation_post_process.name

    @name.setter
    def name(self, value: str) -> None:
        self.activation_post_process.name = value

    @property
    def has_data(self) -> bool:
        """Whether the observer has seen data (convert checks this before using the qparams)."""
        return self.activation_post_process.has_data

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.activation_post_process.calculate_qparams()

    def qparams(self) -> QParams:
        """The qparams currently used for fake quantization (0-d tensors when per-tensor)."""
        scale, zero_point = self._current_qparams()
        axis = self.ch_axis if self.is_per_channel else None
        if axis is None:
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        return QParams(scale=scale, zero_point=zero_point, dtype=self.dtype,
                       quant_min=self.quant_min, quant_max=self.quant_max, axis=axis,
                       is_dynamic=self.is_dynamic)

    def _current_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        zero_point = self.zero_point.detach().clone()
        if self.qscheme != torch.per_channel_affine_float_qparams:
            zero_point = zero_point.to(torch.int64)
        return self.scale.detach().clone(), zero_point

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """The observer's rule, then the qparams recomputed from the reduced statistics."""
        self.activation_post_process.reduce_across_ranks(ranks)
        if self.activation_post_process.has_data:
            self._refresh_qparams()

    @run_eagerly
    def _update_qparams(self, x: torch.Tensor) -> None:
        """Runs eagerly under ``torch.compile``: one graph break per call instead of one at each
        data-dependent check of the observer (non-finite values, first batch, per-channel resize)."""
        self.activation_post_process(x.detach())
        self._refresh_qparams()

    def _refresh_qparams(self) -> None:
        scale, zero_point = self.calculate_qparams()
        if self.scale.shape != scale.shape:
            self.scale.resize_(scale.shape)
            self.zero_point.resize_(zero_point.shape)
        self.scale.copy_(scale)
        self.zero_point.copy_(zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Observe ``x`` (when the observer is on) and fake-quantize it (when fake quant is on).

        Where torch.ao differs: its FakeQuantize whose observer was disabled before it saw data
        fake-quantizes with its initial scale=1, zero_point=0 without a word (a per-channel one
        fails on mismatched dimensions). Those numbers come from no data, so this one raises
        :class:`UncalibratedObserverError` instead.
        """
        if x.numel() == 0:  # nothing to observe or round (an empty batch, a zero-size slice)
            return x
        if self._observing:
            self._update_qparams(x)
        if not self._fake_quantizing:
            return x
        if not self._observing:
            self._require_observed()
        if self.qscheme == torch.per_channel_affine_float_qparams:
            # embedding weights: bounded, so torch's kernel (which rounds x / scale + zp with
            # extra precision) is safe here and keeps outputs identical to torch.ao's
            return torch.fake_quantize_per_channel_affine(
                x, self.scale, self.zero_point, self.ch_axis, self.quant_min, self.quant_max)
        if self.is_per_channel:
            # torch's per-channel kernel wraps around for |x / scale| > 2**31; ours saturates
            return fake_quantize(x, self.qparams())
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point,
                                                     self.quant_min, self.quant_max)

    @run_eagerly
    def _require_observed(self) -> None:
        if self.has_data:
            return
        where = f"{type(self).__name__} {self.name!r}" if self.name else type(self).__name__
        raise UncalibratedObserverError(
            f"{where} fake-quantizes, but its observer was disabled before it saw any data, so it has "
            "no scale or zero point; enable the observer (enable_observer(), or "
            "model.apply(qplug_core.observers.enable_observer)) for at least one training batch "
            "before disabling it", nodes=[self.name] if self.name else [])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # per-channel qparams change size after the first batch; match the saved size first
        for key in ("scale", "zero_point"):
            saved = state_dict.get(prefix + key)
            if saved is not None and getattr(self, key).shape != saved.shape:
                getattr(self, key).resize_(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return (f"fake_quant_enabled={self.fake_quant_enabled}, "
                f"observer_enabled={self.observer_enabled}, quant_min={self.quant_min}, "
                f"quant_max={self.quant_max}, dtype={self.dtype}, qscheme={self.qscheme}, "
                f"ch_axis={self.ch_axis}, scale={self.scale}, zero_point={self.zero_point}")


class FixedQParamsFakeQuantize(FakeQuantize):
    """Fake quantization with constant qparams, for sigmoid/tanh/softmax-like outputs in QAT."""

    def __init__(self, observer: Callable[..., ObserverBase]) -> None:
        super().__init__(observer=observer)
        if not isinstance(self.activation_post_process, FixedQParamsObserver):
            raise ConfigValidationError(
                "FixedQParamsFakeQuantize needs a FixedQParamsObserver, got "
                f"{type(self.activation_post_process).__name__}", field="observer", value=observer)
        self.scale.copy_(self.activation_post_process.scale)
        self.zero_point.copy_(self.activation_post_process.zero_point)


def hidden_fake_quants(mod: nn.Module) -> list[FakeQuantizeBase]:
    """Fake quants ``mod`` holds as plain attributes rather than children (eager mode's input
    observers, see :mod:`qplug_core.eager.input_observers`): ``model.apply`` does not visit them."""
    return [value for value in vars(mod).values() if isinstance(value, FakeQuantizeBase)]


def _toggle(method: str) -> Callable[[nn.Module], None]:
    def apply(mod: nn.Module) -> None:
        for target in (mod, *hidden_fake_quants(mod)):
            if isinstance(target, FakeQuantizeBase):
                getattr(target, method)()

    apply.__name__ = method
    apply.__doc__ = (f"Call ``{method}()`` on ``mod`` if it is a fake-quant module, and on the fake quants "
                     "it holds as plain attributes (for ``model.apply``).")
    return apply


enable_fake_quant = _toggle("enable_fake_quant")
disable_fake_quant = _toggle("disable_fake_quant")
enable_observer = _toggle("enable_observer")
disable_observer = _toggle("disable_observer")

FakeQuantizeBase.TORCH_AO_TWINS = {
    f"{TORCH_AO_FAKE_QUANTIZE}.{fn.__name__}": fn
    for fn in (enable_fake_quant, disable_fake_quant, enable_observer, disable_observer)
}
