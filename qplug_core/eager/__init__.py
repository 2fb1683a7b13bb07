"""Eager-mode quantization (module swapping, no tracing), torch.ao.quantization's classic API.

::

    model = fuse_modules(model, [["conv1", "bn1", "relu1"]])       # eval model: BN folded
    observed = prepare(model, backend="fbgemm")                     # observers on module outputs
    for x in calibration_batches: observed(x)
    int8_model = convert(observed)                                  # backend int8 kernels

The model marks where int8 starts and ends with :class:`QuantStub` / :class:`DeQuantStub` and
writes tensor arithmetic between quantized values with a :class:`FloatFunctional` per op site.
"""

from __future__ import annotations

from qplug_core.eager.convert import SimulatedOutput, convert
from qplug_core.eager.functional import FloatFunctional, QFunctional
from qplug_core.eager.fuse import fuse_modules, fuse_modules_qat
from qplug_core.eager.prepare import prepare, prepare_qat
from qplug_core.eager.stubs import DeQuantStub, QuantStub, QuantWrapper

__all__ = [
    "DeQuantStub", "FloatFunctional", "QFunctional", "QuantStub", "QuantWrapper", "SimulatedOutput", "convert",
    "fuse_modules", "fuse_modules_qat", "prepare", "prepare_qat",
]
