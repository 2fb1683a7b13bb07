"""Histogram observers with other clipping rules: a percentile, or the range of least MSE.

Both keep HistogramObserver's running histogram and only change how the range is chosen from it,
which makes them cheap to try on the same calibration data.
"""

from __future__ import annotations

from typing import Any

import torch

from qplug_core.observers.bounds import check_setting
from qplug_core.observers.histogram import HistogramObserver
from qplug_core.qparams import compute_qparams


class PercentileObserver(HistogramObserver):
    """Clips to the ``[100 - percentile, percentile]`` percentiles of everything observed.

    Outliers beyond the percentile saturate; the resolution is one histogram bin.
    """

    def __init__(self, percentile: float = 99.99, **kwargs: Any) -> None:
        check_setting("percentile", percentile)
        super().__init__(**kwargs)
        self.percentile = percentile

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        csum = torch.cumsum(self.histogram.double(), dim=0)
        total = csum[-1]
        tail = (100.0 - self.percentile) / 100.0
        low = torch.searchsorted(csum, total * tail, side="right").clamp(max=self.bins - 1)
        high = torch.searchsorted(csum, total * (1.0 - tail), side="left").clamp(max=self.bins - 1)
        bin_width = (self.max_val - self.min_val) / self.bins
        return self.min_val + bin_width * low, self.min_val + bin_width * (high + 1)


class MSEObserver(HistogramObserver):
    """Picks the clipping range whose quantization has the least mean squared error.

    Candidate ranges shrink the observed ``[min, max]`` by ``num_candidates`` factors in
    ``(0, 1]``; the error of each is measured on the histogram's bin centres weighted by their
    counts, all candidates at once.
    """

    def __init__(self, num_candidates: int = 100, **kwargs: Any) -> None:
        check_setting("num_candidates", num_candidates)
        super().__init__(**kwargs)
        self.num_candidates = num_candidates

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        factors = torch.arange(1, self.num_candidates + 1, dtype=torch.float32) / self.num_candidates
        low, high = self.min_val * factors, self.max_val * factors
        scale, zero_point = compute_qparams(
            low, high, dtype=self.dtype, qscheme=self.qscheme, quant_min=self.quant_min,
            quant_max=self.quant_max, eps=self.eps, custom_range=self.has_customized_qrange)
        bin_width = (self.max_val - self.min_val) / self.bins
        centres = self.min_val + bin_width * (torch.arange(self.bins) + 0.5)
        scale, zero_point = scale[:, None], zero_point[:, None].to(torch.float32)
        q = torch.clamp(torch.round(centres / scale) + zero_point, self.quant_min, self.quant_max)
        error = ((q - zero_point) * scale - centres) ** 2 @ self.histogram
        best = int(torch.argmin(error))
        return low[best], high[best]
