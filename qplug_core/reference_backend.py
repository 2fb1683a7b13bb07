"""The built-in ``reference`` backend: simulated quantization (q/dq around float ops).

It is the numerical oracle every real backend is tested against, always available, with no int8
kernels of its own. It is registered through the ordinary hooks, as an internal plugin listed in
:data:`qplug_core.plugins.DEFAULT_PLUGINS`, so it is assembled exactly like a third-party backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qplug_core.backend import BackendSpec
from qplug_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from qplug_core.config import BackendPatternConfig, QConfigMapping

NAME = "reference"


def reference_pattern_configs() -> list[BackendPatternConfig]:
    """Every shared pattern, with dtype configs for everything the simulator can express."""
    from qplug_core.backend_configs import common_pattern_configs, reference_dtype_configs

    return common_pattern_configs(**reference_dtype_configs())


@hookimpl
def qplug_register_backends() -> list[BackendSpec]:
    return [BackendSpec(NAME, "simulated int8 (quantize/dequantize around float ops), runs anywhere")]


@hookimpl
def qplug_backend_pattern_configs(backend: str) -> list[BackendPatternConfig]:
    return reference_pattern_configs() if backend == NAME else []


@hookimpl
def qplug_default_qconfig_mapping(backend: str, mode: str) -> QConfigMapping | None:
    if backend != NAME:
        return None
    from qplug_core.qconfig_defaults import default_qconfig_mapping

    return default_qconfig_mapping(mode, reduce_range=False, per_channel=True)
