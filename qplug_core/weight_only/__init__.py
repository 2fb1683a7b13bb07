"""Weight-only quantization: int8/int4 weights with per-channel or per-group scales, float
activations, for models whose speed is bound by reading their weights (LLM token generation).

* :mod:`~qplug_core.kernels.weight_only_scheme`: the integer layout and RTN;
* :mod:`~qplug_core.weight_only.awq`: the data-aware algorithm;
* :mod:`~qplug_core.kernels.weight_only`: the kernel contract and the core's kernels;
* :mod:`~qplug_core.weight_only.selection`: the fastest correct kernel per layer shape;
* :mod:`~qplug_core.weight_only.modules`: the modules swapped into the model;
* :mod:`~qplug_core.weight_only.api`: ``qp.quantize_weights``.
"""

from __future__ import annotations

from qplug_core.kernels.weight_only import ReferenceKernel, WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme
from qplug_core.weight_only.api import INFO_ATTRIBUTE, WeightOnlyInfo, quantize_weights
from qplug_core.weight_only.modules import WeightOnlyEmbedding, WeightOnlyLinear

__all__ = ["INFO_ATTRIBUTE", "QuantizedWeight", "ReferenceKernel", "WeightOnlyEmbedding", "WeightOnlyInfo",
           "WeightOnlyKernel", "WeightOnlyLinear", "WeightOnlyScheme", "quantize_weights"]
