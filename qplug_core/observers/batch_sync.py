"""Reducing each batch's statistics across ranks before an observer uses them.

An observer call splits into three steps: what this rank's batch shows (:class:`BatchStats`: a
range, plus the values a histogram still needs), the range every rank agrees on (MIN/MAX), and the
update made with it (for histograms, after the ranks' bin counts are summed). A
:class:`BatchReduction` runs the two collectives for many observers at once: ``deferred`` ones
collect every observer's statistics during one forward pass of the model and reduce them in two
collectives after it (observers return their input unchanged, so the forward pass does not depend
on them); immediate ones (fake-quant, whose output needs the qparams at once) reduce at each call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from qplug_core.observers.ranks import Ranks


@dataclass
class BatchStats:
    """One observer call on this rank: its range (``+inf``/``-inf`` where it has none), whether
    it saw no data at all, and the finite values a histogram counts once the range is agreed."""

    low: torch.Tensor
    high: torch.Tensor
    empty: bool
    values: torch.Tensor | None = None


@dataclass
class _Agreed:
    observer: Any
    stats: BatchStats
    low: torch.Tensor
    high: torch.Tensor
    counts: torch.Tensor | None = None


class BatchReduction:
    """Batch statistics of observers reduced over ``ranks``, now or after each forward pass."""

    def __init__(self, ranks: Ranks, *, deferred: bool) -> None:
        self.ranks = ranks
        self.deferred = deferred
        self._pending: list[tuple[Any, BatchStats]] = []
        self._observers: set[int] = set()

    def add(self, observer: Any, stats: BatchStats) -> None:
        """Queue one call's statistics; an observer called again in the same pass flushes first.

        A deferred call's values are copied: they are the observer's input, which the rest of
        the forward pass may still overwrite (``ELU(inplace=True)`` after it), and a histogram
        would then count what the next op made of them."""
        if id(observer) in self._observers:
            self.flush()
        if self.deferred and stats.values is not None:
            stats = replace(stats, values=stats.values.clone())
        self._pending.append((observer, stats))
        self._observers.add(id(observer))
        if not self.deferred:
            self.flush()

    def discard(self) -> None:
        self._pending, self._observers = [], set()

    def flush(self) -> None:
        """Agree on every queued range (one collective), sum the bin counts (one more), update."""
        pending = self._pending
        self.discard()
        if not pending:
            return
        agreed = self._agree(pending)
        for a in agreed:
            a.counts = a.observer._batch_counts(a.stats, a.low, a.high)
        counted = [a for a in agreed if a.counts is not None]
        if counted:
            summed = self.ranks.total(torch.cat([a.counts.reshape(-1) for a in counted]))
            offset = 0
            for a in counted:
                assert a.counts is not None
                n = a.counts.numel()
                a.counts = summed[offset:offset + n].reshape(a.counts.shape)
                offset += n
        for a in agreed:
            a.observer._apply_batch(a.stats, a.low, a.high, a.counts)

    def _agree(self, pending: list[tuple[Any, BatchStats]]) -> list[_Agreed]:
        """The global range of each call; calls no rank had data for are left out."""
        # after each range, a flag: 1 when this rank saw nothing; its MIN is 1 when no rank did
        flag = torch.zeros(1, dtype=torch.float64)
        lows = torch.cat([t for _, s in pending for t in (s.low.reshape(-1).double(),
                                                          flag + float(s.empty))])
        highs = torch.cat([t for _, s in pending for t in (s.high.reshape(-1).double(), flag)])
        lows, highs = self.ranks.min_max(lows, highs)
        agreed, offset = [], 0
        for observer, stats in pending:
            n = stats.low.numel()
            if not bool(lows[offset + n] == 1):
                low = lows[offset:offset + n].to(stats.low.dtype).reshape(stats.low.shape)
                high = highs[offset:offset + n].to(stats.high.dtype).reshape(stats.high.shape)
                agreed.append(_Agreed(observer, stats, low.to(stats.low.device),
                                      high.to(stats.high.device)))
            offset += n + 1
        return agreed


_REDUCTION: weakref.WeakKeyDictionary[nn.Module, BatchReduction] = weakref.WeakKeyDictionary()


def batch_reduction(observer: nn.Module) -> BatchReduction | None:
    """The reduction ``observer`` hands each batch's statistics to, or ``None`` (local batches).

    Kept outside the module (weakly) so that copies of a model (convert deep-copies it) never
    run collectives.
    """
    return _REDUCTION.get(observer)


def reduce_each_batch(observer: nn.Module, reduction: BatchReduction | None
                      ) -> BatchReduction | None:
    """Route ``observer``'s batch statistics to ``reduction`` (``None``: stop); returns the previous."""
    previous = _REDUCTION.pop(observer, None)
    if reduction is not None:
        _REDUCTION[observer] = reduction
    return previous
