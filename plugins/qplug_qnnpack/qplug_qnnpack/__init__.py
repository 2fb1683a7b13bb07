"""qplug backend plugin for QNNPACK, PyTorch's ARM-first int8 kernels (registered via entry points)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("qplug-qnnpack")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"
