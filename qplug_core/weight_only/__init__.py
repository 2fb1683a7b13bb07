"""Weight-only quantization: int8/int4 weights with per-channel or per-group scales, float
activations, for models whose speed is bound by reading their weights (LLM token generation).

* :mod:`~qplug_core.kernels.weight_only_scheme`: the integer layout and RTN;
* :mod:`~qplug_core.weight_only.awq`: the data-aware algorithm;
* :mod:`~qplug_core.kernels.weight_only`: the kernel contract and the core's kernels;
* :mod:`~qplug_core.weight_only.selection`: the fastest correct kernel per layer shape;
* :mod:`~qplug_core.weight_only.modules`: the modules swapped into the model;
* :mod:`~qplug_core.weight_only.api`: ``qp.quantize_weights``;
* :mod:`~qplug_core.weight_only.w8a8`: ``qp.quantize_w8a8`` (int8 activations too), with
  SmoothQuant folded into the model (:mod:`~qplug_core.weight_only.smoothing`) where its data
  flow allows (:mod:`~qplug_core.weight_only.dataflow`).
"""

from __future__ import annotations

from qplug_core.kernels.weight_only import ReferenceKernel, WeightOnlyKernel
from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme
from qplug_core.weight_only.api import INFO_ATTRIBUTE, WeightOnlyInfo, quantize_weights
from qplug_core.weight_only.modules import WeightOnlyEmbedding, WeightOnlyEmbeddingBag, WeightOnlyLinear
from qplug_core.weight_only.w8a8 import W8A8_ATTRIBUTE, W8A8Info, quantize_w8a8

__all__ = ["INFO_ATTRIBUTE", "W8A8_ATTRIBUTE", "QuantizedWeight", "ReferenceKernel", "W8A8Info",
           "WeightOnlyEmbedding", "WeightOnlyEmbeddingBag", "WeightOnlyInfo", "WeightOnlyKernel", "WeightOnlyLinear", "WeightOnlyScheme",
           "quantize_w8a8", "quantize_weights"]
