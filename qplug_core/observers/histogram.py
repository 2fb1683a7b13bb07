"""HistogramObserver: a running histogram and an L2-error-minimising search for the clipping range.

The histogram updates and the search reproduce torch.ao's ``HistogramObserver`` operation for
operation (same float32/float64 mix), so the qparams are identical. The difference is speed:
torch.ao walks the quantile bounds in steps of 1e-5 in a Python loop that indexes tensors element
by element; here the bin positions come from ``searchsorted`` on precomputed thresholds and runs of
steps that cannot change the bins are skipped in one jump, so only the steps that torch.ao would
evaluate the L2 error for cost anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from qplug_core.errors import ConfigValidationError
from qplug_core.observers.base import ObserverBase, refuse_symmetric_quint8_reduce_range
from qplug_core.observers.batch_sync import BatchStats
from qplug_core.observers.bounds import check_histogram_size
from qplug_core.observers.ranks import Ranks

_STEP = 1e-5  # quantile granularity of the search (torch.ao's ``stepsize``)
_UPSAMPLE = 16  # sub-bins per bin when an old histogram is re-binned into a wider range


def _quantile_steps() -> tuple[np.ndarray, np.ndarray]:
    """Every value torch.ao's ``alpha += 1e-5`` / ``beta -= 1e-5`` loop can take, in order.

    ``np.cumsum`` adds sequentially, so entry k is bit-identical to k repeated Python additions.
    """
    n = int(1 / _STEP) + 2
    alphas = np.cumsum(np.concatenate(([0.0], np.full(n, _STEP))))
    betas = np.cumsum(np.concatenate(([1.0], np.full(n, -_STEP))))
    return alphas, betas


_ALPHAS, _BETAS = _quantile_steps()


class _RangeSearch:
    """One run of the non-linear range search over a fixed histogram."""

    def __init__(self, histogram: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor,
                 dst_nbins: int) -> None:
        self.bins = histogram.numel()
        self.dst_nbins = dst_nbins
        self.histogram = histogram
        total = torch.sum(histogram).item()
        # torch compares a float32 element with a Python float in float32: cast the thresholds
        self.csum = torch.cumsum(histogram, dim=0).numpy()
        self.alpha_thr = (_ALPHAS * total).astype(np.float32)
        self.neg_beta_thr = -(_BETAS * total).astype(np.float32)  # ascending, for searchsorted
        self.bin_width = max_val.item() - min_val.item()
        self.bin_width /= self.bins
        self.density = histogram / self.bin_width
        self.src_bin = torch.arange(self.bins, device=histogram.device)

    def left(self, k: int, start: int, end: int) -> int:
        """torch.ao's ``l``: first bin from ``start`` whose cumsum reaches alpha_k (at most end)."""
        first = int(np.searchsorted(self.csum, self.alpha_thr[k], side="left"))
        return min(end, max(start, first))

    def right(self, k: int, start: int, end: int) -> int:
        """torch.ao's ``r``: last bin down to ``start`` whose cumsum stays within beta_k."""
        last = int(np.searchsorted(self.csum, -self.neg_beta_thr[k], side="right")) - 1
        return max(start, min(end, last))

    def next_beta_move(self, kb: int, ka: int, start: int, end: int) -> int:
        """The beta index at which ``r`` first drops below ``end`` or the loop ends (alpha >= beta)."""
        stop = int(np.searchsorted(-_BETAS, -_ALPHAS[ka], side="left"))  # first beta <= alpha
        if end <= start:
            return max(kb, stop)
        # r < end  <=>  csum[end] > beta_thr[j]  <=>  neg_beta_thr[j] > -csum[end]
        moves = int(np.searchsorted(self.neg_beta_thr, -self.csum[end], side="right")) - 1
        return max(kb, min(stop, moves))

    def error(self, start: int, end: int) -> float:
        """L2 quantization error of clipping to bins [start, end] (torch.ao's formula and ops)."""
        bin_width = self.bin_width
        dst_width = bin_width * (end - start + 1) / self.dst_nbins
        if dst_width == 0.0:
            return 0.0
        src_begin = (self.src_bin - start) * bin_width
        src_end = src_begin + bin_width
        dst_of_begin = torch.clamp(torch.div(src_begin, dst_width, rounding_mode="floor"),
                                   0, self.dst_nbins - 1)
        dst_of_end = torch.clamp(torch.div(src_end, dst_width, rounding_mode="floor"),
                                 0, self.dst_nbins - 1)
        half = dst_width / 2
        norm = torch.zeros(self.bins, device=self.density.device)
        norm += self._l2(src_begin - (dst_of_begin + 0.5) * dst_width,
                         torch.ones(self.bins, device=self.density.device) * half)
        norm += (dst_of_end - dst_of_begin - 1) * self._l2(torch.tensor(-half),
                                                           torch.tensor(half))
        norm += self._l2(torch.tensor(-half), src_end - (dst_of_end * dst_width + half))
        return norm.sum().item()

    def _l2(self, begin: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """density * integral of x^2 over [begin, end] (values spread uniformly in a bin)."""
        return self.density * ((end * end * end - begin * begin * begin) / 3)

    def run(self) -> tuple[int, int]:
        """torch.ao's ``_non_linear_param_search`` loop, returning (start_bin, end_bin)."""
        ka = kb = 0
        start, end = 0, self.bins - 1
        norm_min = float("inf")
        while _ALPHAS[ka] < _BETAS[kb]:
            l = self.left(ka + 1, start, end)
            r = self.right(kb + 1, start, end)
            if l - start > end - r:
                next_start, next_end, ka = l, end, ka + 1
            else:
                next_start, next_end, kb = start, r, kb + 1
            if next_start == start and next_end == end:
                # a quiet step (only beta advanced): jump to the step where r moves
                if l == start:
                    kb = self.next_beta_move(kb, ka, start, end)
                continue
            norm = self.error(next_start, next_end)
            if norm > norm_min:
                break
            norm_min, start, end = norm, next_start, next_end
        return start, end


class HistogramObserver(ObserverBase):
    """Running histogram of activations; clips outliers by minimising the L2 quantization error.

    The default activation observer for static post-training quantization.
    """

    def __init__(self, bins: int = 2048, upsample_rate: int = _UPSAMPLE, **kwargs: Any) -> None:
        check_histogram_size(bins, upsample_rate)
        if kwargs.get("is_dynamic"):
            raise ConfigValidationError("HistogramObserver cannot be used for dynamic quantization",
                                        field="is_dynamic", value=True)
        super().__init__(**kwargs)
        refuse_symmetric_quint8_reduce_range(self)
        self.bins = bins
        self.upsample_rate = upsample_rate
        self.dst_nbins = 2 ** torch.iinfo(self.dtype).bits
        self.register_buffer("histogram", torch.zeros(bins))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def has_data(self) -> bool:
        return bool(self.min_val <= self.max_val)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._observe(self._range_stats(x.detach().to(torch.float32), keep_values=True))
        return x

    def _histogram_range(self, low: torch.Tensor, high: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The range after a batch spanning [low, high]: the union with what came before."""
        if not self.has_data:
            return low, high
        return torch.min(self.min_val, low), torch.max(self.max_val, high)

    def _batch_counts(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor
                      ) -> torch.Tensor:
        """This rank's values counted in the bins of the range after the batch.

        A value's bin depends only on the value and the range, so with the range agreed first
        the sum of the ranks' counts is the histogram of the global batch, exactly.
        """
        if stats.values is None or not stats.values.numel():
            return torch.zeros_like(self.histogram)
        new_min, new_max = self._histogram_range(low, high)
        return torch.histc(stats.values, self.bins, min=new_min.item(), max=new_max.item())

    def _apply_batch(self, stats: BatchStats, low: torch.Tensor, high: torch.Tensor,
                     counts: torch.Tensor | None) -> None:
        assert counts is not None  # _batch_counts always counts
        if not self.has_data:
            self.min_val.copy_(low)
            self.max_val.copy_(high)
            self.histogram.copy_(counts)
            return
        new_min, new_max = self._histogram_range(low, high)
        if bool(new_min == self.min_val) and bool(new_max == self.max_val):
            self.histogram.copy_(self.histogram + counts)
            return
        self.histogram.copy_(self._rebinned(new_min, new_max) + counts)
        self.min_val.copy_(new_min)
        self.max_val.copy_(new_max)

    def reduce_across_ranks(self, ranks: Ranks) -> None:
        """Nothing when the ranks agree (they do after reducing each batch); else one histogram.

        The ranks agree on the range (MIN/MAX), move their histograms onto it (the same
        re-binning as a range change during calibration) and sum the bins.
        """
        if ranks.identical(self.histogram, self.min_val, self.max_val):
            return
        new_min, new_max = ranks.min_max(self.min_val, self.max_val)
        if not bool(new_min <= new_max):
            return
        if not self.has_data:
            mine = torch.zeros_like(self.histogram)
        elif bool(new_min == self.min_val) and bool(new_max == self.max_val):
            mine = self.histogram
        else:
            mine = self._rebinned(new_min, new_max)
        self.histogram.copy_(ranks.total(mine))
        self.min_val.copy_(new_min)
        self.max_val.copy_(new_max)

    def _rebinned(self, new_min: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
        """The current histogram moved onto ``bins`` equal bins over [new_min, new_max].

        Each bin is split into ``upsample_rate`` sub-bins whose mid-points are re-assigned, which
        keeps the re-binning error small (torch.ao's ``_combine_histograms``).
        """
        old_min, old_max, hist = self.min_val, self.max_val, self.histogram
        if bool(old_min == old_max):
            return torch.histc(old_min, bins=self.bins, min=new_min.item(),
                               max=new_max.item()) * torch.sum(hist)
        n_fine = self.bins * self.upsample_rate
        fine = hist.repeat_interleave(self.upsample_rate) / self.upsample_rate
        fine_width = (old_max - old_min) / n_fine
        mids = torch.linspace(old_min.item(), old_max.item(), n_fine + 1)[:-1] + 0.5 * fine_width
        edges = torch.linspace(new_min.item(), new_max.item(), self.bins + 1)
        # numpy's searchsorted = torch.bucketize(right=True) on sorted input, without torch's
        # pathological slowness for some sizes (12 ms for 256 bins on CPU)
        target = torch.from_numpy(np.searchsorted(edges.numpy(), mids.numpy(), side="right"))
        target = (target - 1).clamp_(0, self.bins - 1)
        return torch.bincount(target, weights=fine, minlength=self.bins)

    def _observed_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = _RangeSearch(self.histogram, self.min_val, self.max_val, self.dst_nbins).run()
        bin_width = (self.max_val - self.min_val) / self.bins
        return self.min_val + bin_width * start, self.min_val + bin_width * (end + 1)

    def reset_histogram(self) -> None:
        self.histogram.zero_()
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bins={self.bins}, min_val={self.min_val}, max_val={self.max_val}"
