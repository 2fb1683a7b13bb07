"""The documented ranges of observer settings, checked before an observer allocates anything.

Observer settings arrive in config documents (``QConfigMapping.from_dict``), which are untrusted:
``HistogramObserver(bins=2**26)`` from a 3.6 KB document took 9.9 s and 1.8 GB to prepare,
``upsample_rate=10**6`` ended in a raw allocator error, and ``eps=1e30`` silently gave a useless
model (every scale at least 1e30). Every setting that sizes a buffer or sets a numeric floor is
therefore checked against the range in :data:`RANGES`, the same in Python and in documents, and
refused with a :class:`ConfigValidationError` naming the field. The ranges are listed in
docs/security.md; they cover every setting torch.ao's defaults and qplug's recipes use.
"""

from __future__ import annotations

import math
from typing import Any

from qplug_core.errors import ConfigValidationError

__all__ = ["MAX_HISTOGRAM_SUBBINS", "RANGES", "check_histogram_size", "check_setting"]

#: field -> (kind, lowest, highest): "int" settings are ints (not bools), "float" ones finite reals
RANGES: dict[str, tuple[str, float, float]] = {
    "bins": ("int", 1, 2**16),                        # HistogramObserver and its subclasses
    "upsample_rate": ("int", 1, 256),                  # sub-bins per bin when re-binning
    "num_candidates": ("int", 1, 1000),                # MSEObserver's candidate ranges
    "channel_len": ("int", 1, 2**20),                  # learnable (LSQ) fake-quant channels
    "eps": ("float", 2.0**-126, 1e-3),                 # the smallest scale: a normal float32
    "averaging_constant": ("float", 1e-6, 1.0),        # moving-average weight of a new batch
    "percentile": ("float", 50.0, 100.0),              # PercentileObserver (50 itself excluded)
}
#: bins * upsample_rate: the sub-bins one re-binning step allocates
MAX_HISTOGRAM_SUBBINS = 2**22


def check_setting(field: str, value: Any) -> Any:
    """``value`` if it lies within the documented range of ``field``; else a
    :class:`ConfigValidationError` naming the field and the range."""
    kind, low, high = RANGES[field]
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
        wanted = f"an int in [{low}, {high}]"
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and low <= value <= high)
        wanted = f"a finite number in [{low:.4g}, {high:.4g}]"
    if field == "percentile" and ok and value <= low:
        ok = False
    if not ok:
        raise ConfigValidationError(f"{field} must be {wanted}, got {value!r} (the documented range "
                                    "of observer settings, docs/security.md)", field=field, value=value)
    return value


def check_histogram_size(bins: int, upsample_rate: int) -> None:
    """Both within their ranges, and the sub-bins of one re-binning step within a bound."""
    check_setting("bins", bins)
    check_setting("upsample_rate", upsample_rate)
    if bins * upsample_rate > MAX_HISTOGRAM_SUBBINS:
        raise ConfigValidationError(
            f"bins * upsample_rate = {bins * upsample_rate} is above {MAX_HISTOGRAM_SUBBINS} (each "
            "re-binning allocates that many sub-bins); lower one of them", field="upsample_rate",
            value=upsample_rate)
