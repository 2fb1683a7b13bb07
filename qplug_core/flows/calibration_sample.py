"""A few calibration batches kept for convert: an evenly spread sample of at most ``MAX_BATCHES``.

Convert decides some things on data (``flows/weight_bits.py``: whether a layer's int16 pair sums
saturate with 8-bit weights). The example inputs alone miss a calibration batch that reaches
further than the example does, while running every calibration batch again would double the cost
of calibrating. So :func:`keep` is given each batch as calibration runs it and holds a sample of at
most ``MAX_BATCHES``: every batch while there are few; past the bound, every other one is dropped
and the stride doubles, so the sample stays spread evenly over a stream of unknown length.

The batches are the caller's tensors, not copies (held until convert, which drops them from the
converted model). The holder is shared, not copied, when the observed model is deep-copied
(convert's first step), so keeping them costs no memory beyond the references.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from qplug_core.flows.tags import CALIBRATION_SAMPLE, WEIGHT_BITS

#: at most this many calibration batches are kept (convert runs each once more)
MAX_BATCHES = 8


class _Sample:
    """The kept batches; one object for the observed model and its deep copies."""

    def __init__(self) -> None:
        self.batches: list[tuple] = []
        self.seen = 0
        self.stride = 1

    def add(self, batch: tuple) -> None:
        if self.seen % self.stride == 0:
            self.batches.append(batch)
            if len(self.batches) > MAX_BATCHES:
                self.batches = self.batches[::2]
                self.stride *= 2
        self.seen += 1

    def __deepcopy__(self, memo: dict) -> _Sample:
        return self


def start(gm: Any) -> _Sample | None:
    """A fresh sample for ``gm``'s calibration, if a convert-time decision will read it."""
    if not isinstance(gm, fx.GraphModule) or WEIGHT_BITS not in gm.meta:
        return None
    sample = gm.meta[CALIBRATION_SAMPLE] = _Sample()
    return sample


def keep(gm: fx.GraphModule, batches: list[tuple]) -> None:
    """Keep a sample of ``batches`` for a model whose observers were copied, not calibrated
    (``algorithms/reuse.py``), as calibrating it on them would."""
    sample = start(gm)
    for batch in batches if sample is not None else ():
        sample.add(batch)


def take(gm: fx.GraphModule) -> list[tuple]:
    """The kept batches, removed from ``gm`` (a converted model does not hold the user's data)."""
    sample = gm.meta.pop(CALIBRATION_SAMPLE, None)
    return list(sample.batches) if isinstance(sample, _Sample) else []


__all__ = ["MAX_BATCHES", "keep", "start", "take"]
