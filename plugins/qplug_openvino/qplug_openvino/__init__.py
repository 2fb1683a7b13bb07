"""qplug backend plugin for OpenVINO: int8 partitions run as OpenVINO compiled models on the CPU
(entry point ``qplug: openvino``). Compile settings: :func:`configure`."""

from __future__ import annotations

import importlib.metadata

from qplug_openvino.compiled import CompileSettings, configure, settings

try:
    __version__ = importlib.metadata.version("qplug-openvino")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"

__all__ = ["CompileSettings", "configure", "settings", "__version__"]
