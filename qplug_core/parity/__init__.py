"""Comparison of an int8 model with its float original on what really runs (compiled partitions
included): :func:`compare` is ``qp.compare``."""

from qplug_core.parity.compare import compare

__all__ = ["compare"]
