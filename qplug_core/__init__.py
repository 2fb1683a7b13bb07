"""qplug: plugin-based int8 quantization for PyTorch.

Names load lazily so that ``import qplug_core`` (and the ``qplug`` command) does not import torch
until a name that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy names, for type checkers and IDEs (kept equal to _EXPORTS by a test)
    from qplug_core import (
        algorithms,
        analysis,
        config,
        eager,
        errors,
        matcher,
        observers,
        partition,
        passes,
        patterns,
        zoo,
    )
    from qplug_core.algorithms.sensitivity import sensitivity
    from qplug_core.algorithms.target import Target
    from qplug_core.analysis.compare import compare
    from qplug_core.analysis.layers import sqnr
    from qplug_core.analysis.swap_report import quantization_report
    from qplug_core.config import (
        BackendConfig,
        BackendPatternConfig,
        DTypeConfig,
        DTypeWithConstraints,
        ObservationType,
        QConfig,
        QConfigMapping,
    )
    from qplug_core.errors import QplugError
    from qplug_core.flows.dynamic import quantize_dynamic
    from qplug_core.flows.steps import (
        calibrate,
        convert_fx,
        convert_to_reference_fx,
        fuse_fx,
        get_default_qconfig_mapping,
        prepare_fx,
        prepare_qat_fx,
    )
    from qplug_core.observers import distributed
    from qplug_core.observers.distributed import sync_observers
    from qplug_core.one_call import quantize
    from qplug_core.onnx_export import export_onnx
    from qplug_core.patterns import MatchAllNode
    from qplug_core.pt2_export import export_program
    from qplug_core.registry.backends import Availability, Backend, BackendSpec, get_backend, list_backends
    from qplug_core.registry.hookspecs import hookimpl
    from qplug_core.serialization import load, save
    from qplug_core.weight_only import quantize_w8a8, quantize_weights

#: public name -> "module" (a submodule) or "module:attribute"
_EXPORTS: dict[str, str] = {
    # backends and plugins
    "list_backends": "qplug_core.registry.backends:list_backends",
    "get_backend": "qplug_core.registry.backends:get_backend",
    "Backend": "qplug_core.registry.backends:Backend",
    "BackendSpec": "qplug_core.registry.backends:BackendSpec",
    "Availability": "qplug_core.registry.backends:Availability",
    "hookimpl": "qplug_core.registry.hookspecs:hookimpl",
    # flows
    "quantize": "qplug_core.one_call:quantize",
    "fuse_fx": "qplug_core.flows.steps:fuse_fx",
    "prepare_fx": "qplug_core.flows.steps:prepare_fx",
    "prepare_qat_fx": "qplug_core.flows.steps:prepare_qat_fx",
    "calibrate": "qplug_core.flows.steps:calibrate",
    "sync_observers": "qplug_core.observers.distributed:sync_observers",
    "convert_to_reference_fx": "qplug_core.flows.steps:convert_to_reference_fx",
    "convert_fx": "qplug_core.flows.steps:convert_fx",
    "quantization_report": "qplug_core.analysis.swap_report:quantization_report",
    "quantize_dynamic": "qplug_core.flows.dynamic:quantize_dynamic",
    "quantize_w8a8": "qplug_core.weight_only:quantize_w8a8",
    "quantize_weights": "qplug_core.weight_only:quantize_weights",
    "get_default_qconfig_mapping": "qplug_core.flows.steps:get_default_qconfig_mapping",
    "compare": "qplug_core.analysis.compare:compare",
    "sensitivity": "qplug_core.algorithms.sensitivity:sensitivity",
    "Target": "qplug_core.algorithms.target:Target",
    "sqnr": "qplug_core.analysis.layers:sqnr",
    "save": "qplug_core.serialization:save",
    "load": "qplug_core.serialization:load",
    "export_onnx": "qplug_core.onnx_export:export_onnx",
    "export_program": "qplug_core.pt2_export:export_program",
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
    "distributed": "qplug_core.observers.distributed",
    "zoo": "qplug_core.zoo",
    "algorithms": "qplug_core.algorithms",
    "analysis": "qplug_core.analysis",
}

__all__ = [
    "Availability", "Backend", "BackendConfig", "BackendPatternConfig", "BackendSpec",
    "DTypeConfig", "DTypeWithConstraints", "MatchAllNode", "ObservationType", "QConfig",
    "QConfigMapping", "QplugError", "Target", "__version__", "algorithms", "analysis", "calibrate", "compare",
    "config", "convert_fx", "convert_to_reference_fx", "distributed", "eager", "errors",
    "export_onnx", "export_program", "fuse_fx", "get_backend", "get_default_qconfig_mapping", "hookimpl",
    "list_backends", "load", "matcher", "observers", "partition", "passes", "patterns",
    "prepare_fx", "prepare_qat_fx", "quantization_report", "quantize", "quantize_dynamic",
    "quantize_w8a8", "quantize_weights", "save",
    "sensitivity", "sqnr", "sync_observers", "zoo",
]


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
