"""SmoothQuant's per-channel scale, its strength grid and its held-out scoring split, shared by
the graph flow (``algorithms/smoothquant.py``) and W8A8 (``weight_only/smoothing.py``).

Both search the strength on rows the scale (and a static activation range) were not fitted on:
scored on its own fitting rows, a strong smoothing always looks best, as no row exceeds the range
(``algorithms/smoothquant.py`` records the measured case).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: migration strengths an ``"auto"`` search tries (None: leave the input as it is)
ALPHAS: tuple[float | None, ...] = (None, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: smallest scale: a channel divided by less would be multiplied up past any useful range
MIN_SCALE = 1e-5


def smoothquant_scale(absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s_j = max|x_j|^alpha / max|W_:,j|^(1-alpha)`` over every layer reading the input (1 where
    either maximum is 0), for input channel max |x| ``absmax``."""
    w = torch.cat([weight.detach().float() for weight in weights]).abs().amax(0)
    usable = (absmax > 0) & (w > 0)
    s = absmax.clamp_min(1e-12).pow(alpha) / w.clamp_min(1e-12).pow(1 - alpha)
    return torch.where(usable, s.clamp_min(MIN_SCALE), torch.ones_like(s))


def held_out_halves(rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fitting, scored) pairs: the first half of ``rows`` (in calibration order) against the
    second and the other way round; a single row is scored on itself."""
    if len(rows) < 2:
        return [(rows, rows)]
    first, second = rows[: len(rows) // 2], rows[len(rows) // 2:]
    return [(first, second), (second, first)]


__all__ = ["ALPHAS", "MIN_SCALE", "held_out_halves", "smoothquant_scale"]
