"""qplug: plugin-based int8 quantization for PyTorch.

Names load lazily so that ``import qplug_core`` (and the ``qplug`` command) does not import torch
until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> "module" (a submodule) or "module:attribute"
_EXPORTS: dict[str, str] = {
    # backends and plugins
    "list_backends": "qplug_core.backend:list_backends",
    "get_backend": "qplug_core.backend:get_backend",
    "Backend": "qplug_core.backend:Backend",
    "BackendSpec": "qplug_core.backend:BackendSpec",
    "Availability": "qplug_core.backend:Availability",
    "hookimpl": "qplug_core.hookspecs:hookimpl",
    # flows
    "quantize": "qplug_core.flows:quantize",
    "fuse_fx": "qplug_core.flows:fuse_fx",
    "prepare_fx": "qplug_core.flows:prepare_fx",
    "prepare_qat_fx": "qplug_core.flows:prepare_qat_fx",
    "calibrate": "qplug_core.flows:calibrate",
    "convert_to_reference_fx": "qplug_core.flows:convert_to_reference_fx",
    "convert_fx": "qplug_core.flows:convert_fx",
    "quantization_report": "qplug_core.flows:quantization_report",
    "quantize_dynamic": "qplug_core.dynamic:quantize_dynamic",
    "get_default_qconfig_mapping": "qplug_core.flows:get_default_qconfig_mapping",
    "compare": "qplug_core.report:compare",
    "sensitivity": "qplug_core.algorithms.sensitivity:sensitivity",
    "Target": "qplug_core.algorithms.target:Target",
    "sqnr": "qplug_core.report:sqnr",
    "save": "qplug_core.serialization:save",
    "load": "qplug_core.serialization:load",
    # configs most users touch
    "QConfig": "qplug_core.config:QConfig",
    "QConfigMapping": "qplug_core.config:QConfigMapping",
    "BackendConfig": "qplug_core.config:BackendConfig",
    "BackendPatternConfig": "qplug_core.config:BackendPatternConfig",
    "DTypeConfig": "qplug_core.config:DTypeConfig",
    "DTypeWithConstraints": "qplug_core.config:DTypeWithConstraints",
    "ObservationType": "qplug_core.config:ObservationType",
    "MatchAllNode": "qplug_core.patterns:MatchAllNode",
    # errors
    "QplugError": "qplug_core.errors:QplugError",
    # namespaces
    "eager": "qplug_core.eager",
    "patterns": "qplug_core.patterns",
    "matcher": "qplug_core.matcher",
    "passes": "qplug_core.passes",
    "partition": "qplug_core.partition",
    "config": "qplug_core.config",
    "observers": "qplug_core.observers",
    "errors": "qplug_core.errors",
    "zoo": "qplug_core.zoo",
    "algorithms": "qplug_core.algorithms",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("qplug-core")
        except PackageNotFoundError:  # running from a source tree without installing
            return "0.1.0+source"
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'qplug_core' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
