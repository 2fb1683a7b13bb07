"""What a backend's kernels need of the integers, and the qparams that are safe with it on this CPU.

A backend states its kernels' arithmetic (:class:`Int8Arithmetic`); the core turns it into operand
ranges, so a third-party backend on x86 kernels gets CPUs without VNNI right without knowing them.

x86 int8 kernels without VNNI (FBGEMM, oneDNN, ONNX Runtime's MLAS) multiply u8 activations by s8
weights with ``vpmaddubsw``, which adds *adjacent pairs* of products into int16 with saturation:
``2 * a_max * w_max`` must stay within 32,767. Full ranges give 2 * 255 * 127 = 64,770, and ORT's
fused U8S8 kernels then lose 17-20 dB on a trained CNN. Halving either operand is enough:

* 7-bit weights (ORT's ``reduce_range`` convention): |w| <= 64, pairs <= 2 * 255 * 64 = 32,640;
* 7-bit activations (torch.ao's ``reduce_range``): a <= 127, pairs <= 2 * 127 * 128 = 32,512.

The rule here takes 7-bit *weights*. They are per-channel, so each output channel keeps its own
scale and loses 1 bit on its own range only, and the change is local to one layer; 7-bit
activations halve the resolution of a per-tensor grid that every consumer of the value shares.
Measured on the reference form (the arithmetic every backend must reproduce, the same on every
CPU; ``bench/cpu_without_vnni.py``, SQNR against float, 8-bit / 7-bit activations / 7-bit
weights): digits CNN (trained) 41.9 / 37.3 / 40.3 dB, ResNet-18 28.3 / 25.0 / 25.3, MobileNetV2
13.3 / 12.0 / 12.3. Splitting the bit (activations <= 180 and |w| <= 90, or 212 / 77, 150 / 109)
gains at most 0.5 dB on ResNet-18 and loses on the digits CNN, so one rule serves and no per-layer
search is made. S8S8 (signed activations) is not a choice here: FBGEMM's kernels take u8
activations only, and for ONNX Runtime it was not measured.

On CPUs with VNNI (or AMX, or ARM's int32 dot products) nothing changes: full 8-bit operands,
as long as the kernels use those instructions. A library can be held below the CPU
(``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``, ``ONEDNN_MAX_CPU_ISA=AVX2``): then its kernels sum pairs in
int16 on a VNNI CPU and full 8-bit operands lose ~20 dB silently. So where the detected flags call
a backend's kernels exact, its product is measured once (``kernels/pair_sums_probe.py``) and a
saturating one makes its arithmetic :attr:`Int8Arithmetic.U8S8_INT16_PAIRS_MEASURED`
(:func:`kernels_arithmetic`). Flags that were set (``QPLUG_CPU_FLAGS``, ``override_cpu_flags``)
win over the measurement both ways: they model the CPU a test or a user names.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from qplug_core.kernels.cpu import CpuInt8, cpu_int8
from qplug_core.kernels.pair_sums_probe import PAIRS_SATURATE, Gemm, measured_pairs

INT16_MAX = 32767


class Int8Arithmetic(str, Enum):
    """How a backend's int8 kernels accumulate u8 x s8 products."""

    #: in int32 on every CPU (QNNPACK's widening multiplies, the reference form, a float emulation)
    INT32 = "products accumulate in int32"
    #: pairs of u8 x s8 products summed in int16 with saturation on x86 without VNNI (FBGEMM,
    #: oneDNN, ONNX Runtime's MLAS U8S8 kernels); int32 with VNNI or AMX
    U8S8_INT16_PAIRS_WITHOUT_VNNI = "u8 x s8 pair sums in int16 without VNNI"
    #: the whole dot product in int16 with saturation, on every CPU (an accelerator's narrow
    #: accumulator): no operand range is safe for every layer, so each weighted layer whose
    #: worst case exceeds int16 is refused at convert and keeps the reference form (``limits.py``)
    INT16 = "whole dot products accumulate in int16"
    #: pairs summed in int16 on this machine whatever its flags say: a worst-case product of the
    #: backend's kernels saturated (a library held to AVX2 on a VNNI CPU); set flags still decide
    U8S8_INT16_PAIRS_MEASURED = "u8 x s8 pair sums in int16 (measured on this machine's kernels)"

    def __str__(self) -> str:
        return str(self.value)


#: the arithmetic of torch's quantized engines' kernels
ENGINE_ARITHMETIC = {"fbgemm": Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI,
                     "x86": Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI,
                     "onednn": Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI,
                     "qnnpack": Int8Arithmetic.INT32}


def engine_arithmetic(engine: str | None) -> Int8Arithmetic:
    """The arithmetic of ``engine``'s kernels (``INT32`` for no engine or one not listed)."""
    return ENGINE_ARITHMETIC.get(engine or "", Int8Arithmetic.INT32)


def pair_sums_saturate(arithmetic: Int8Arithmetic | str, cpu: CpuInt8 | None = None) -> bool:
    """Whether ``arithmetic`` sums products in int16 on ``cpu`` (default: this one)."""
    cpu = cpu_int8() if cpu is None else cpu
    arithmetic = Int8Arithmetic(arithmetic)
    if arithmetic in (Int8Arithmetic.INT32, Int8Arithmetic.INT16):  # INT16: checked per layer
        return False
    if arithmetic is Int8Arithmetic.U8S8_INT16_PAIRS_MEASURED and not cpu.overridden:
        return True
    return cpu.int16_pair_sums


def kernels_arithmetic(declared: Int8Arithmetic | str, measure: Callable[[], str] | None,
                       cpu: CpuInt8 | None = None) -> Int8Arithmetic:
    """What a backend's kernels do here: ``declared``, or ``U8S8_INT16_PAIRS_MEASURED`` where
    they are declared to sum pairs in int16 without VNNI, ``cpu``'s detected flags say they are
    exact, and ``measure()`` (a :func:`~qplug_core.kernels.pair_sums_probe.probe_pair_sums`
    result) says they saturate. Flags that say pairs saturate, or that were set, are not measured
    against; a probe that fails leaves the flags' answer."""
    cpu = cpu_int8() if cpu is None else cpu
    declared = Int8Arithmetic(declared)
    if (declared is not Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI or measure is None
            or cpu.overridden or cpu.int16_pair_sums):
        return declared
    return Int8Arithmetic.U8S8_INT16_PAIRS_MEASURED if measure() == PAIRS_SATURATE else declared


def backend_arithmetic(backend: str, declared: Int8Arithmetic | str,
                       gemm: Callable[[], Gemm | None] | None) -> Int8Arithmetic:
    """:func:`kernels_arithmetic` with the product ``gemm()`` gives (None: none to measure)
    measured once per process for ``backend``."""
    if gemm is None:
        return kernels_arithmetic(declared, None)

    def measure() -> str:
        found = gemm()
        return "no integer product to measure" if found is None else measured_pairs(backend, found)
    return kernels_arithmetic(declared, measure)


def pairs_fit(activation_max: int, weight_max: int) -> bool:
    """Whether two products of operands this large fit int16 (``vpmaddubsw`` cannot saturate)."""
    return 2 * activation_max * weight_max <= INT16_MAX


def safe_weight_range(weight_range: tuple[int, int], activation_max: int) -> tuple[int, int]:
    """The largest weight range inside ``weight_range`` whose pairs with ``activation_max`` fit."""
    limit = INT16_MAX // (2 * activation_max)
    return max(weight_range[0], -limit), min(weight_range[1], limit)


def safe_qconfig_options(arithmetic: Int8Arithmetic | str, options: dict[str, Any] | None,
                         cpu: CpuInt8 | None = None) -> dict[str, Any] | None:
    """``default_qconfig_mapping`` keyword arguments made safe for ``arithmetic`` on ``cpu``.

    Unchanged where pairs cannot saturate (VNNI, int32 kernels, 7-bit activations already asked
    for); else the weights get the 7-bit range (the module docstring says why weights).
    """
    if options is None or not pair_sums_saturate(arithmetic, cpu):
        return options
    activation_max = 127 if options.get("reduce_range") else 255
    weights = (options.get("weight_quant_min", -128), options.get("weight_quant_max", 127))
    if pairs_fit(activation_max, max(-weights[0], weights[1])):
        return options
    low, high = safe_weight_range(weights, activation_max)
    return {**options, "weight_quant_min": low, "weight_quant_max": high}


__all__ = ["ENGINE_ARITHMETIC", "Int8Arithmetic", "backend_arithmetic", "engine_arithmetic",
           "kernels_arithmetic", "pair_sums_saturate",
           "pairs_fit", "safe_qconfig_options", "safe_weight_range"]
