"""``qplug doctor``'s measured answer to "do these int8 kernels sum u8 x s8 pairs in int16 here?"
(issue 24): the probe against the brute-force definition of both arithmetics, torch's engines for
real on this host, and the finding where the flags and the measurement agree or disagree."""

from __future__ import annotations

import os

import pytest
import torch

from qplug_core.kernels.arithmetic import Int8Arithmetic
from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags
from qplug_core.kernels.pair_sums_probe import (
    PAIRS_EXACT,
    PAIRS_SATURATE,
    probe_pair_sums,
    torch_engine_gemm,
    worst_case,
)
from qplug_core.registry.cpu_diagnostics import cpu_diagnostic
from tests.reliability.test_int16_pair_sums import AVX2, VNNI, vpmaddubsw_matmul

PAIRS = Int8Arithmetic.U8S8_INT16_PAIRS_WITHOUT_VNNI
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
                                   "saturated int16 pair sums (u8 255 x s8 127): the default 8-bit "
                                   "weights lose accuracy on this machine"),
    (AVX2, int16_pairs, "warning", "(measured: a worst-case probe on its kernels saturated int16 pair sums)"),
    (AVX2, int32_sums, "warning", "(measured: a worst-case probe on its kernels was exact, so they "
                                  "accumulate in int32 on this machine and 7-bit weights are safe "
                                  "here, not needed)"),
])
def test_the_finding_says_what_the_kernels_did(flags, gemm, level, says):
    with override_cpu_flags(flags):
        finding = cpu_diagnostic(PAIRS, gemm=gemm)
    assert finding.level == level and says in finding.message
    if gemm is int16_pairs and flags == VNNI:
        assert "QPLUG_CPU_FLAGS" in finding.hint
    with override_cpu_flags(flags):
        assert cpu_diagnostic(PAIRS, gemm=gemm).message.startswith(cpu_diagnostic(PAIRS).message)


def test_int32_arithmetic_is_not_probed():
    def never(codes, weights):
        raise AssertionError("probed")

    assert cpu_diagnostic(Int8Arithmetic.INT32, gemm=never).level == "ok"
