"""The float64 definition of a weight-only weight, for testing kernels (the core's and plugins').

:func:`definition` reads the integers back from the stored bytes by its own route (nibble
arithmetic on Python ints, not :func:`qplug_core.kernels.weight_only_scheme.unpack`) and expands every
group's scale and zero point, so a kernel checked against ``x.double() @ definition(w).T + b``
is checked against the layout's documentation, not against the core's code.
"""

from __future__ import annotations

import torch

from qplug_core.kernels.weight_only_scheme import QuantizedWeight

__all__ = ["definition", "stored_integers"]


def stored_integers(weight: QuantizedWeight) -> torch.Tensor:
    """The unsigned integers ``[N, K]`` (float64) of ``weight.data``: for 4 bits, feature ``j``
    is the low nibble of byte ``j // 2`` when ``j`` is even, the high nibble when odd."""
    _, k = weight.shape
    rows = weight.data.tolist()
    if weight.scheme.bits == 8:
        return torch.tensor(rows, dtype=torch.float64)
    return torch.tensor([[(row[j // 2] >> (4 * (j % 2))) & 0xF for j in range(k)] for row in rows],
                        dtype=torch.float64)


def definition(weight: QuantizedWeight) -> torch.Tensor:
    """``(q - zero_point) * scale`` in float64, ``[N, K]``."""
    n, k = weight.shape
    size = weight.scheme.group_size or k
    zero = (torch.full((n, k // size), float(weight.scheme.midpoint)) if weight.zero_points is None
            else weight.zero_points.double())
    scales = weight.scales.double().repeat_interleave(size, dim=1)
    return (stored_integers(weight) - zero.repeat_interleave(size, dim=1)) * scales
