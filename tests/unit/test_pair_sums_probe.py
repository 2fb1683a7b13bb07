"""The measured answer to "do these int8 kernels sum u8 x s8 pairs in int16 here?" (issue 24): the
probe against the brute-force definition of both arithmetics, torch's engines for real on this
host, the decisions it changes (where the detected flags call a backend's kernels exact and they
saturate: a library held to AVX2 on a VNNI CPU) and ``qplug doctor``'s finding where the flags and
the measurement agree or disagree."""

from __future__ import annotations

import os

import pytest
import torch

from qplug_core.kernels import cpu as cpu_module
from qplug_core.kernels import pair_sums_probe
from qplug_core.kernels.arithmetic import Int8Arithmetic, kernels_arithmetic, pair_sums_saturate
from qplug_core.kernels.cpu import CpuInt8, cpu_int8, override_cpu_flags
from qplug_core.kernels.pair_sums_probe import (
    PAIRS_EXACT,
    PAIRS_SATURATE,
    probe_pair_sums,
    torch_engine_gemm,
    worst_case,
)
from qplug_core.plugin_api import BackendPlugin
from qplug_core.registry.cpu_diagnostics import cpu_diagnostic
from tests.reliability.test_int16_pair_sums import AVX2, VNNI, vpmaddubsw_matmul

PAIRS = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI
MEASURED = Int8Arithmetic.U8S8_INT16_PAIRS_MEASURED
#: environment variables that make torch's kernels run another ISA's code than the CPU's flags say
FORCED_ISA = ("FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def int32_sums(codes, weights):
    return codes.long() @ weights.long().t()


def int16_pairs(codes, weights):
    return vpmaddubsw_matmul(codes, weights)[0]


def test_the_worst_case_saturates_every_pair():
    codes, weights, exact = worst_case()
    assert 2 * 255 * 127 > torch.iinfo(torch.int16).max
    assert int(exact[0, 0]) == 64 * 255 * 127
    assert probe_pair_sums(int32_sums) == PAIRS_EXACT and probe_pair_sums(int16_pairs) == PAIRS_SATURATE


def test_a_probe_that_fails_or_answers_otherwise_says_so():
    def raising(codes, weights):
        raise RuntimeError("no kernel for this shape")

    assert probe_pair_sums(raising) == "the probe failed (RuntimeError: no kernel for this shape)"
    assert probe_pair_sums(lambda c, w: int32_sums(c, w) * 0)== "the probe returned [0.0, 0.0], expected 2072640"


@pytest.mark.parametrize("engine", ["fbgemm", "x86", "onednn", "qnnpack"])
def test_torch_engines_on_this_host(engine):
    if engine not in torch.backends.quantized.supported_engines:
        pytest.skip(f"torch has no {engine} engine here")
    result = probe_pair_sums(torch_engine_gemm(engine))
    assert result in (PAIRS_EXACT, PAIRS_SATURATE)
    real = cpu_int8()  # the host's own flags: VNNI kernels cannot saturate int16 pairs ...
    forced = any(os.environ.get(name) for name in FORCED_ISA)  # ... unless forced to AVX2 code
    if engine == "qnnpack" or ((real.vnni or real.amx) and not forced):
        assert result == PAIRS_EXACT


@pytest.mark.parametrize("flags, gemm, level, says", [
    (VNNI, int32_sums, "ok", "VNNI on this CPU: full 8-bit operands, int8 dot products in int32 "
                             "(measured: a worst-case probe on its kernels was exact)"),
    (VNNI, int16_pairs, "warning", "int8 dot products in int32; but a worst-case probe on its kernels "
                                   "saturated int16 pair sums (u8 255 x s8 127)"),
    (AVX2, int16_pairs, "warning", "(measured: a worst-case probe on its kernels saturated int16 pair sums)"),
    (AVX2, int32_sums, "warning", "(measured: a worst-case probe on its kernels was exact, so they "
                                  "accumulate in int32 on this machine and 7-bit weights are safe "
                                  "here, not needed)"),
])
def test_the_finding_says_what_the_kernels_did(flags, gemm, level, says):
    with override_cpu_flags(flags):
        finding = cpu_diagnostic(PAIRS, gemm=gemm)
    assert finding.level == level and says in finding.message
    if gemm is int16_pairs and flags == VNNI:  # set flags win over the probe: the doctor says so
        assert "the flags set in override win over the probe" in finding.message
        assert "QPLUG_CPU_FLAGS" in finding.hint
    with override_cpu_flags(flags):
        assert cpu_diagnostic(PAIRS, gemm=gemm).message.startswith(cpu_diagnostic(PAIRS).message)


def test_int32_arithmetic_is_not_probed():
    def never(codes, weights):
        raise AssertionError("probed")

    assert cpu_diagnostic(Int8Arithmetic.INT32, gemm=never).level == "ok"


def detected(flags: str) -> CpuInt8:
    """Flags as read from the machine (not set): the probe may refine them."""
    return CpuInt8(frozenset(flags.split()), "/proc/cpuinfo", "x86_64")


def never() -> str:
    raise AssertionError("measured")


@pytest.mark.parametrize("measured, expected", [
    (PAIRS_SATURATE, MEASURED), (PAIRS_EXACT, PAIRS), ("the probe failed (RuntimeError: x)", PAIRS)])
def test_detected_vnni_flags_follow_the_kernels_measured_product(measured, expected):
    arithmetic = kernels_arithmetic(PAIRS, lambda: measured, detected(VNNI))
    assert arithmetic is expected
    assert pair_sums_saturate(arithmetic, detected(VNNI)) is (measured == PAIRS_SATURATE)


@pytest.mark.parametrize("declared, cpu", [
    (PAIRS, detected(AVX2)),  # the flags already say pairs saturate: nothing to measure
    (Int8Arithmetic.INT32, detected(VNNI)),  # int32 kernels cannot saturate
    (PAIRS, CpuInt8(frozenset(VNNI.split()), "QPLUG_CPU_FLAGS", "x86_64")),  # set flags decide
    (PAIRS, CpuInt8(frozenset(AVX2.split()), "override", "x86_64")),
])
def test_no_measurement_where_flags_decide(declared, cpu):
    assert kernels_arithmetic(declared, never, cpu) is declared
    assert kernels_arithmetic(declared, None, cpu) is declared


def test_a_measured_saturation_holds_unless_flags_are_set():
    assert pair_sums_saturate(MEASURED, detected(VNNI)) and pair_sums_saturate(MEASURED, detected(AVX2))
    with override_cpu_flags(VNNI):  # a test modelling a VNNI CPU gets VNNI decisions anywhere
        assert not pair_sums_saturate(MEASURED)
    with override_cpu_flags(AVX2):
        assert pair_sums_saturate(MEASURED)


@pytest.fixture
def detected_vnni(monkeypatch):
    """This process reads VNNI flags from the machine (whatever the host), measures afresh."""
    monkeypatch.delenv(cpu_module.ENV_FLAGS, raising=False)
    monkeypatch.setattr(cpu_module, "read_cpuid", lambda: frozenset(VNNI.split()))
    monkeypatch.setattr(pair_sums_probe, "_measured", {})
    cpu_module._detected.cache_clear()
    yield
    cpu_module._detected.cache_clear()


@pytest.mark.parametrize("gemm, weights", [(int16_pairs, (-64, 64)), (int32_sums, (-128, 127))])
def test_a_backend_plugin_defaults_follow_its_measured_product(detected_vnni, gemm, weights):
    """A third-party backend on x86 kernels gets 7-bit default weights where its product was
    measured to saturate although the flags name VNNI; measured once per process."""
    calls = []

    class Held(BackendPlugin):
        name = "held_to_avx2"
        engine = "fbgemm"

        def int8_gemm(self):
            def product(codes, weights):
                calls.append(1)
                return gemm(codes, weights)
            return product

    plugin = Held()
    assert not cpu_int8().overridden and cpu_int8().vnni
    for _ in range(3):
        observer = plugin.default_qconfig_mapping("static").global_qconfig.weight()
        assert (observer.quant_min, observer.quant_max) == weights
    assert len(calls) == 1
    with override_cpu_flags(VNNI):  # set flags: no measurement, VNNI defaults
        assert plugin.default_qconfig_mapping("static").global_qconfig.weight().quant_max == 127
