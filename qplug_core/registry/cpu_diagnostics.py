"""The ``qplug doctor`` findings that say what this CPU means for one backend's int8 kernels: their
arithmetic, and (for kernels built for another architecture) their speed, which quantizing for
such a backend also says once per process."""

from __future__ import annotations

from qplug_core.errors import warn_user
from qplug_core.kernels.arithmetic import Int8Arithmetic, pair_sums_saturate
from qplug_core.kernels.cpu import CpuInt8, cpu_int8
from qplug_core.kernels.pair_sums_probe import PAIRS_EXACT, PAIRS_SATURATE, Gemm, probe_pair_sums
from qplug_core.kernels.per_token import per_token_is_fast
from qplug_core.registry.contract import X86_MACHINES, Diagnostic

#: engines whose int8 kernels are ARM's (QNNPACK/XNNPACK): built for x86 too, but not its fast path.
#: Measured at one thread, int8 ran at 0.24x float speed (an LSTM, x86 Xeon) to 1.96x (a
#: MobileNetV3-style CNN, Zen 4): it depends on the model and the CPU, so the warning quotes no number
ARM_FIRST_ENGINES = frozenset({"qnnpack"})
ARM_FIRST_ON_X86 = ("its int8 kernels (QNNPACK) are built for ARM; on x86 they are not the fast path: "
                    "int8 may run slower than float here, by an amount that depends on the model "
                    "(measure it), and x86 speed says nothing about speed on a phone")
X86_INSTEAD = "on x86 use backend fbgemm, onnxruntime or openvino; qnnpack is for ARM CPUs"
#: backends the slow-here warning was given for in this process
_warned: set[str] = set()


def cpu_diagnostic(arithmetic: Int8Arithmetic | str, cpu: CpuInt8 | None = None, *,
                   compiles: bool = False, gemm: Gemm | None = None) -> Diagnostic:
    """What ``cpu`` (default: this one) means for the accuracy and speed of a backend whose
    kernels have ``arithmetic`` (for ``qplug doctor``; the ``cpu`` line names the CPU itself).
    ``compiles``: the backend compiles partitions (a delegate) rather than lowering per-op kernels,
    which changes what happens to one that breaks the contract. ``gemm``: the backend's own
    u8 x s8 product, run once on the worst case for int16 pair sums
    (``kernels/pair_sums_probe.py``) so the finding says what its kernels did, not only what the
    flags imply; where the two disagree, the finding says so."""
    cpu = cpu_int8() if cpu is None else cpu
    arithmetic = Int8Arithmetic(arithmetic)
    if arithmetic is Int8Arithmetic.INT32:
        return Diagnostic("ok", "its kernels accumulate in int32: full 8-bit operands on any CPU")
    if arithmetic is Int8Arithmetic.INT16:
        return Diagnostic("ok", "its kernels accumulate whole dot products in int16, on any CPU: a "
                          "layer whose worst case exceeds it keeps the reference form (convert says which)")
    by_flags = _by_flags(arithmetic, cpu, compiles)
    if gemm is None:
        return by_flags
    measured = probe_pair_sums(gemm)
    saturating = pair_sums_saturate(arithmetic, cpu)
    if measured == PAIRS_SATURATE and not saturating and cpu.overridden:
        return Diagnostic(
            "warning", f"{by_flags.message}; but a worst-case probe on its kernels saturated int16 "
            f"pair sums (u8 255 x s8 127), and the flags set in {cpu.source} win over the probe: "
            "the 8-bit weights they imply lose accuracy on this machine",
            hint="unset QPLUG_CPU_FLAGS (qplug then follows the probe), or set flags without "
                 "avx512_vnni / avx_vnni")
    if measured == PAIRS_SATURATE and not saturating:
        return Diagnostic(
            "warning", f"{by_flags.message}; but a worst-case probe on its kernels saturated int16 "
            "pair sums (u8 255 x s8 127): they run below the CPU's instructions (e.g. "
            "FBGEMM_ENABLE_INSTRUCTIONS or ONEDNN_MAX_CPU_ISA), so qplug decides for them as "
            "without VNNI (7-bit weights where pair sums saturate) and int8 is slower than it could be",
            hint="unset the variables that hold the kernels below the CPU, for 8-bit weights and "
                 "VNNI speed")
    if measured == PAIRS_EXACT and saturating:
        note = ("measured: a worst-case probe on its kernels was exact, so they accumulate in "
                "int32 on this machine and 7-bit weights are safe here, not needed")
    elif measured in (PAIRS_EXACT, PAIRS_SATURATE):
        note = ("measured: a worst-case probe on its kernels "
                + ("saturated int16 pair sums" if measured == PAIRS_SATURATE else "was exact"))
    else:  # the plugin's own probe is broken: a bug its vendor wants to see, not an [ok]
        return Diagnostic(
            "warning", f"{by_flags.message}; but the plugin's int8_gemm() probe is broken: {measured}, so "
            "qplug decides from the CPU's flags alone",
            hint="int8_gemm() must return a callable taking (u8 codes [M, K], s8 weights [N, K]) and returning "
                 "their integer products [M, N] (int32, or any dtype holding them exactly); tell the plugin's "
                 "authors")
    return Diagnostic(by_flags.level, f"{by_flags.message} ({note})", hint=by_flags.hint)


def _by_flags(arithmetic: Int8Arithmetic, cpu: CpuInt8, compiles: bool) -> Diagnostic:
    """The finding the CPU's flags imply for ``arithmetic``."""
    if pair_sums_saturate(arithmetic, cpu):
        broken = ("a compiled partition that still breaks the contract is compiled again with 7-bit "
                  "weights, else runs the reference form (slow)" if compiles else
                  "a kernel that still breaks the contract runs the reference form (slow)")
        fallbacks = _target_fallbacks(cpu, compiles)
        return Diagnostic(
            "warning",
            "no VNNI on this CPU: its kernels sum u8 x s8 pairs in int16 with saturation. With the "
            "default qconfig each layer keeps 8-bit weights where no pair sum saturates on the "
            "example and calibration data (or saturation changes at most 0.1% of its outputs "
            "there and costs less than a bit) and gets 7-bit ones elsewhere (1-3 dB below 8-bit "
            f"on the zoo's CNNs where every layer needs them); {broken}. Int8 is at most ~1.9x "
            f"fp32 per core here, and accuracy targets fall back to {fallbacks}",
            hint="keep the default qconfig mapping: full 8-bit weights and activations saturate here")
    if not (cpu.vnni or cpu.amx):
        return Diagnostic("warning", "no AVX2 or VNNI on this CPU: its int8 kernels run generic "
                                     "code, likely slower than fp32")
    return Diagnostic("ok", "VNNI on this CPU: full 8-bit operands, int8 dot products in int32")


def speed_diagnostics(engine: str | None, cpu: CpuInt8 | None = None) -> list[Diagnostic]:
    """What ``cpu`` (default: this one) means for the speed of ``engine``'s int8 kernels: a warning
    where they are known to run slower than float (ARM's kernels on x86), else nothing."""
    cpu = cpu_int8() if cpu is None else cpu
    if engine in ARM_FIRST_ENGINES and cpu.machine in X86_MACHINES:
        return [Diagnostic("warning", ARM_FIRST_ON_X86, hint=X86_INSTEAD)]
    return []


def warn_if_slow_here(backend_name: str, engine: str | None) -> None:
    """Warn, once per process and backend, that quantizing for this backend gives a model slower
    than float on this CPU (see :func:`speed_diagnostics`); the public quantize entry points call it."""
    if backend_name in _warned:
        return
    for finding in speed_diagnostics(engine):
        _warned.add(backend_name)
        warn_user(f"qplug: backend {backend_name!r} on {cpu_int8().machine}: {finding.message}; {finding.hint}")


def _target_fallbacks(cpu: CpuInt8, compiles: bool) -> str:
    """What an accuracy target takes a layer out of static int8 to on such a CPU
    (``algorithms/fallbacks.py`` decides the same way)."""
    if compiles:
        return "per-tensor dynamic int8 or float (a per-token layer cannot run inside a compiled partition)"
    if per_token_is_fast(cpu):
        return "per-token dynamic int8 (oneDNN's GEMM, 7-bit weights), per-tensor dynamic int8 or float"
    return ("per-tensor dynamic int8 or float (per-token dynamic has only torch._int_mm here, slower "
            "than fp32)")


__all__ = ["cpu_diagnostic", "speed_diagnostics", "warn_if_slow_here"]
