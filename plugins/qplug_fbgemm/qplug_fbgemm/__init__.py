"""qplug backend plugin for FBGEMM, PyTorch's x86 int8 kernels (registered via entry points)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("qplug-fbgemm")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"
