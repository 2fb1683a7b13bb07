"""Modules the quantization flows put into models: fused float modules, QAT modules, fuser methods.

- :mod:`qplug_core.nn.intrinsic`: fused float containers (``ConvReLU2d``, ``ConvBn2d``, ...);
- :mod:`qplug_core.nn.qat`: QAT modules with weight fake quant (``from_float`` / ``to_float``);
- :mod:`qplug_core.nn.fuser_methods`: functions building fused modules from matched modules;
- :mod:`qplug_core.nn.folding`: BatchNorm folding maths;
- :mod:`qplug_core.nn.copying`: copying modules a captured graph shares with the user's model.
"""

from __future__ import annotations

from qplug_core.nn import copying, folding, fuser_methods, intrinsic, qat

__all__ = ["copying", "folding", "fuser_methods", "intrinsic", "qat"]
