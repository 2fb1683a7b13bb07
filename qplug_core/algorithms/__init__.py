"""Accuracy algorithms: passes over the fused float graph, sensitivity analysis, accuracy targets.

Each is usable alone on ``qp.fuse_fx(...)``'s output or through
``qp.quantize(..., recipe=..., target=...)``; docs/guide/accuracy.md has the measured figures.
"""

from __future__ import annotations

from qplug_core.algorithms.bias_correction import BiasCorrection, correct_bias
from qplug_core.algorithms.equalization import EqualizedPair, equalize_cross_layer
from qplug_core.algorithms.recipes import RECIPES
from qplug_core.algorithms.sensitivity import SensitivityReport, sensitivity
from qplug_core.algorithms.smoothquant import SmoothedInput, smooth_quant
from qplug_core.algorithms.target import Target, TargetResult

__all__ = ["RECIPES", "BiasCorrection", "EqualizedPair", "SensitivityReport", "SmoothedInput",
           "Target", "TargetResult", "correct_bias", "equalize_cross_layer", "sensitivity",
           "smooth_quant"]
