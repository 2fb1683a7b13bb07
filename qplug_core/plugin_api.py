"""Everything a qplug backend plugin may import, and nothing else.

A backend (``qplug-fbgemm``, ``qplug-qnnpack``, the ``qplug new-backend`` scaffold, yours) imports
from this module and from the top-level ``qplug_core`` only. Every other ``qplug_core`` module is
internal: it may change in any release. The names and signatures below are snapshot-tested
(``tests/api_surface.expect``), so changing them is a deliberate, reviewed diff.

See docs/plugins/writing-a-backend.md (the tutorial), hooks.md (the hook reference), kernels.md
(what a kernel receives and returns) and testing-your-plugin.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qplug_core.config import (
    BackendPatternConfig,
    DTypeConfig,
    DTypeWithConstraints,
    ObservationType,
    QConfig,
    QConfigMapping,
)
from qplug_core.config.common_patterns import RELU_FORMS, common_pattern_configs
from qplug_core.config.common_patterns import linear_configs as linear_pattern_configs
from qplug_core.config.defaults import default_qconfig_mapping
from qplug_core.config.dtype_configs import (
    DTypeConfigSet,
    default_dynamic_float16_dtype_config,
    default_dynamic_int8_dtype_config,
    default_op_quint8_dtype_config,
    input_output_only_quint8_dtype_config,
    weight_only_quint8_dtype_config,
    weighted_op_quint8_dtype_config,
)
from qplug_core.enums import Mode, Stage
from qplug_core.errors import ConfigValidationError, ConstraintViolationError, QplugError, warn_user
from qplug_core.flows.observed import ObservedValue, computes_tensor, observed_inputs, observed_values
from qplug_core.kernels.arithmetic import Int8Arithmetic, backend_arithmetic, safe_qconfig_options
from qplug_core.kernels.base import (
    KernelContext,
    KernelSpec,
    TensorArg,
    engine_context,
    int_values,
    quantized_from_int,
)
from qplug_core.kernels.cpu import CpuInt8, cpu_int8, override_cpu_flags
from qplug_core.kernels.pair_sums_probe import PAIRS_EXACT, PAIRS_SATURATE, Gemm, probe_pair_sums
from qplug_core.kernels.reference import (
    Dequantize,
    DynamicQuantize,
    Quantize,
    ReferenceRecurrent,
    ReferenceWeighted,
)
from qplug_core.kernels.table import kernel_table, torch_int8_kernels
from qplug_core.kernels.weight_only import WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme
from qplug_core.kernels.weight_only_scheme import quantize as quantize_weight
from qplug_core.nn.intrinsic import FusedModule
from qplug_core.partition import OperatorSupportBase
from qplug_core.partition.compiled import CompiledPartition
from qplug_core.partition.denormals import call_flushing_denormals, denormals_flushed
from qplug_core.partition.source_file import whole_model
from qplug_core.passes.base import PassResult
from qplug_core.qparams import QParams
from qplug_core.registry.backend_plugin import BackendPlugin
from qplug_core.registry.contract import (
    ARM_MACHINES,
    X86_MACHINES,
    Availability,
    BackendSpec,
    Delegate,
    Diagnostic,
    engine_availability,
    packages_availability,
)
from qplug_core.registry.cpu_diagnostics import cpu_diagnostic
from qplug_core.registry.hookspecs import hookimpl
from qplug_core.registry.plugin_settings import check_cache_size, replaced_settings
from qplug_core.registry.plugins import QplugPluginWarning

if TYPE_CHECKING:
    from qplug_core.onnx_export import to_onnx_proto
    from qplug_core.onnx_export.lstm import dynamic_lstm_problem
    from qplug_core.onnx_export.partition_source import (
        OnnxFile,
        onnx_input_shapes,
        onnx_input_shapes_read,
        onnx_source,
    )
    from qplug_core.testing.held_tensors import float_weight_copies
    from qplug_core.testing.layer_parity import LayerParity, layer_parity
    from qplug_core.testing.pattern_suite import BackendPatternSuite
    from qplug_core.testing.weight_only import definition as weight_only_definition


def __getattr__(name: str) -> Any:
    # the testing kit imports pytest: only when a test module asks for it
    if name == "to_onnx_proto":  # the exporter imports torch.onnx: only for backends that compile
        from qplug_core.onnx_export import to_onnx_proto

        return to_onnx_proto
    # a partition's model for its runtime: bytes or a file, and its inputs
    if name in ("onnx_source", "onnx_input_shapes", "onnx_input_shapes_read", "OnnxFile"):
        from qplug_core.onnx_export import partition_source

        return getattr(partition_source, name)
    if name == "dynamic_lstm_problem":
        from qplug_core.onnx_export.lstm import dynamic_lstm_problem

        return dynamic_lstm_problem
    if name == "BackendPatternSuite":
        from qplug_core.testing.pattern_suite import BackendPatternSuite

        return BackendPatternSuite
    if name == "weight_only_definition":  # the float64 oracle of weight-only kernels
        from qplug_core.testing.weight_only import definition

        return definition
    if name == "float_weight_copies":  # what a compiled model holds: no float copy of a weight
        from qplug_core.testing.held_tensors import float_weight_copies

        return float_weight_copies
    if name in ("layer_parity", "LayerParity"):  # a compiling backend's conformance check
        from qplug_core.testing import layer_parity

        return getattr(layer_parity, name)
    raise AttributeError(f"module 'qplug_core.plugin_api' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names above too: tab completion and help() list what a plugin may import
    return sorted(set(globals()) | set(__all__))


__all__ = [
    # hooks
    "hookimpl",
    "BackendPlugin",
    # what a plugin declares
    "ARM_MACHINES",
    "X86_MACHINES",
    "Availability",
    "BackendSpec",
    "Diagnostic",
    "engine_availability",
    "packages_availability",
    "Mode",
    "Stage",
    "replaced_settings",
    "check_cache_size",
    # what this CPU can do for int8, and the qparams that are safe with a kernel's arithmetic
    "CpuInt8",
    "Gemm",
    "PAIRS_EXACT",
    "PAIRS_SATURATE",
    "Int8Arithmetic",
    "cpu_diagnostic",
    "probe_pair_sums",
    "cpu_int8",
    "override_cpu_flags",
    "safe_qconfig_options",
    "backend_arithmetic",
    # patterns and dtypes
    "BackendPatternConfig",
    "DTypeConfig",
    "DTypeWithConstraints",
    "ObservationType",
    "DTypeConfigSet",
    "common_pattern_configs",
    "linear_pattern_configs",
    "RELU_FORMS",
    # fusion: the base class of a backend's own fused modules (prepare, lowering and qp.save rely on it)
    "FusedModule",
    "default_dynamic_float16_dtype_config",
    "default_dynamic_int8_dtype_config",
    "default_op_quint8_dtype_config",
    "input_output_only_quint8_dtype_config",
    "weight_only_quint8_dtype_config",
    "weighted_op_quint8_dtype_config",
    # kernels
    "KernelContext",
    "KernelSpec",
    "QParams",
    "TensorArg",
    "engine_context",
    "int_values",
    "quantized_from_int",
    "torch_int8_kernels",
    "kernel_table",
    # weight-only kernels (the qplug_weight_only_kernels hook)
    "QuantizedWeight",
    "WeightOnlyKernel",
    "WeightOnlyScheme",
    "quantize_weight",
    # default qconfigs
    "QConfig",
    "QConfigMapping",
    "default_qconfig_mapping",
    # passes
    "ObservedValue",
    "PassResult",
    "computes_tensor",
    "observed_inputs",
    "observed_values",
    # delegation: backends that compile whole int8 partitions (an NPU SDK, ONNX Runtime)
    "Delegate",
    "OperatorSupportBase",
    "CompiledPartition",
    "call_flushing_denormals",
    "denormals_flushed",
    "DynamicQuantize",
    "Dequantize",
    "Quantize",
    "ReferenceWeighted",
    "ReferenceRecurrent",
    "to_onnx_proto",
    "onnx_source",
    "onnx_input_shapes",
    "onnx_input_shapes_read",
    "OnnxFile",
    "whole_model",
    "dynamic_lstm_problem",
    # errors and warnings
    "ConfigValidationError",
    "ConstraintViolationError",
    "QplugError",
    "QplugPluginWarning",
    "warn_user",
    # testing (imports pytest on first use)
    "BackendPatternSuite",
    "LayerParity",
    "float_weight_copies",
    "layer_parity",
    "weight_only_definition",
]
