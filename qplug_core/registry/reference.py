"""The built-in ``reference`` backend: simulated quantization (q/dq around float ops).

It is the numerical oracle every real backend is tested against, always available, with no int8
kernels of its own. It is a :class:`~qplug_core.registry.backend_plugin.BackendPlugin` listed in
:data:`qplug_core.registry.plugins.DEFAULT_PLUGINS`, so it is assembled exactly like a third-party backend.
"""

from __future__ import annotations

from typing import Any

from qplug_core.registry.backend_plugin import BackendPlugin


class ReferencePlugin(BackendPlugin):
    """Every shared pattern with torch's native dtype configs (the defaults); no engine, no kernels."""

    name = "reference"
    description = "simulated int8 (quantize/dequantize around float ops), runs anywhere"

    def qconfig_options(self, mode: str) -> dict[str, Any]:
        return {"reduce_range": False, "per_channel": True}


plugin = ReferencePlugin()
