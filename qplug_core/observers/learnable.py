"""LearnableFakeQuantize: LSQ fake quantization, whose scale and zero point are trained.

Learned Step Size Quantization (Esser et al., https://openreview.net/pdf?id=rkgO66VKDS) lets the
optimizer move the scale (and zero point) instead of only observing the range; the gradients are
optionally scaled by ``1 / sqrt(numel * quant_max)`` as the paper recommends, which keeps their
magnitude comparable to the weights'.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError
from qplug_core.ir.tracing import run_eagerly
from qplug_core.observers.base import ObserverBase
from qplug_core.observers.bounds import check_setting
from qplug_core.observers.fake_quantize import FakeQuantize
from qplug_core.observers.minmax import MovingAverageMinMaxObserver
from qplug_core.observers.ranks import Ranks
from qplug_core.qparams import SYMMETRIC_SCHEMES


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round in the forward pass, identity in the backward pass."""
    return x + (torch.round(x) - x).detach()


def _scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` in the forward pass, gradient multiplied by ``factor`` in the backward pass."""
    return (x - x * factor).detach() + x * factor


class LearnableFakeQuantize(FakeQuantize):
    """Fake quantization with ``scale`` and ``zero_point`` as trainable parameters (LSQ).

    While ``observer_enabled`` is on, the parameters follow the observer (a good initialisation);
    call :meth:`enable_param_learning` to freeze the observer and train them instead.
    """

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver,
                 quant_min: int | None = None, quant_max: int | None = None,
                 channel_len: int = 1, use_grad_scaling: bool = False,
                 **observer_kwargs: Any) -> None:
        super().__init__(observer, quant_min, quant_max, **observer_kwargs)
        check_setting("channel_len", channel_len)
        if self.qscheme == torch.per_channel_affine_float_qparams:
            raise ConfigValidationError("LSQ does not support float zero points",
                                        field="qscheme", value=self.qscheme)
        del self.scale, self.zero_point  # buffers in FakeQuantize, parameters here
        self.scale = nn.Parameter(torch.ones(channel_len))
        self.zero_point = nn.Parameter(torch.zeros(channel_len))
        self.use_grad_scaling = use_grad_scaling

    def fit_channels(self, channels: int, where: str) -> LearnableFakeQuantize:
        """Size a per-channel scale and zero point for ``channels`` channels: a QConfig cannot know
        each layer's channel count, the QAT module holding the weight does (``where`` names it)."""
        if not self.is_per_channel or self.scale.numel() == channels:
            return self
        if self.scale.numel() != 1:
            raise ConfigValidationError(
                f"{where}: a per-channel LearnableFakeQuantize with channel_len={self.scale.numel()} "
                f"for a weight with {channels} channels along axis {self.ch_axis}; leave channel_len "
                "at 1 (qplug sizes it per layer)", field="channel_len", value=self.scale.numel())
        device = self.scale.device
        self.scale = nn.Parameter(torch.ones(channels, device=device))
        self.zero_point = nn.Parameter(torch.zeros(channels, device=device))
        return self

    def enable_param_learning(self) -> LearnableFakeQuantize:
        """Train scale and zero point; stop following the observer."""
        self.disable_observer()
        self.enable_fake_quant()
        return self

    def enable_static_estimate(self) -> LearnableFakeQuantize:
        """Follow the observer (no learning), fake-quantizing the output."""
        self.enable_observer()
        self.enable_fake_quant()
        return self

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = self.scale.detach().clamp(min=float(self.activation_post_process.eps))
        zero_point = self.zero_point.detach().round().clamp(self.quant_min, self.quant_max)
        return scale, zero_point.to(torch.int64)

    def _current_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.calculate_qparams()

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """The observer's rule; while following the observer, scale and zero point follow it.

        Once learning, scale and zero point are parameters: DistributedDataParallel keeps them
        identical (same initial values, all-reduced gradients), so they are left alone.
        """
        observer = self.activation_post_process
        observer.reduce_across_ranks(ranks)
        if self._observing and observer.has_data:
            self._follow_observer()

    @run_eagerly
    def _update_qparams(self, x: torch.Tensor) -> None:  # eager under torch.compile, as FakeQuantize's
        self.activation_post_process(x.detach())
        self._follow_observer()

    def _follow_observer(self) -> None:
        """Writes through ``.data``, as torch.ao does: a fake-quant called twice in one forward
        (shared by a fused pattern's output and a reshape after it) has its parameters saved for
        backward by the first call, and an in-place write would fail that backward."""
        scale, zero_point = self.activation_post_process.calculate_qparams()
        self.scale.data.copy_(scale.expand_as(self.scale))
        self.zero_point.data.copy_(zero_point.to(torch.float32).expand_as(self.zero_point))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # as FakeQuantize: the observer skips it, so there is nothing to follow
            return x
        if self._observing:
            self._update_qparams(x)
        if not self._fake_quantizing:
            return x
        if self.qscheme in SYMMETRIC_SCHEMES:
            self.zero_point.data.zero_()
        factor = 1.0 / (x.numel() * self.quant_max) ** 0.5 if self.use_grad_scaling else 1.0
        scale = _scale_grad(self.scale.clamp(min=float(self.activation_post_process.eps)), factor)
        zero_point = _scale_grad(self.zero_point, factor)
        if self.is_per_channel:
            shape = [1] * x.dim()
            shape[self.ch_axis] = -1
            scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
        zero_point = _round_ste(zero_point).clamp(self.quant_min, self.quant_max)
        q = torch.clamp(_round_ste(x / scale) + zero_point, self.quant_min, self.quant_max)
        return (q - zero_point) * scale
