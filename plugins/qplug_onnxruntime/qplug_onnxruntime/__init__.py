"""qplug backend plugin for ONNX Runtime: int8 partitions run in ORT sessions (entry point
``qplug: onnxruntime``). Session settings: :func:`configure`."""

from __future__ import annotations

import importlib.metadata

from qplug_onnxruntime.session import SessionSettings, configure, settings

try:
    __version__ = importlib.metadata.version("qplug-onnxruntime")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"

__all__ = ["SessionSettings", "configure", "settings", "__version__"]
