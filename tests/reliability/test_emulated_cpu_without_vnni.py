"""Issue 24: the int8 kernels a CPU without VNNI runs, run for real on any x86 host.

In a process on QEMU's emulated Haswell (``tests/support/emulated.py``) ONNX Runtime's MLAS,
FBGEMM and oneDNN take their AVX2 paths, whose u8 x s8 pair sums saturate at int16, as on an AMD
Zen 3; the process still reads the host's ``/proc/cpuinfo``, so this also checks that qplug reads
the CPU from CPUID, as the kernels do. The digits demo's trained CNN, one process for every case
(~2.5 min on one core).
"""

from __future__ import annotations

import platform

import pytest

from tests.support.emulated import QEMU, quantize_emulated

#: decisions as on a VNNI CPU, for the case where the flags are wrong for the kernels
VNNI_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni"
#: ONNX Runtime only: its MLAS cannot be held to AVX2 on a VNNI host, FBGEMM can, and
#: ``test_suite_on_avx2_kernels.py`` runs the fbgemm plugin's and the weight-bits tests that way
#: (the FBGEMM case here took ~35 s of emulation for the same checks)
CASES = {"onnxruntime": {"backend": "onnxruntime", "flags": None},
         "onnxruntime, VNNI flags": {"backend": "onnxruntime", "flags": VNNI_FLAGS}}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 host emulates x86"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 is not installed (apt-get install qemu-user)"),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict:
    """The digits CNN trained here, quantized in the emulated process once per case."""
    from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

    model, _ = train_digits_cnn()
    _, _, x_test, _ = load_digits_tensors()
    calibration = [(x_test[i:i + 32],) for i in range(0, 128, 32)]
    return quantize_emulated(tmp_path_factory.mktemp("emulated") / "digits.pt", model, calibration,
                             (x_test[128:384],), CASES)


def test_the_emulated_kernels_saturate_and_qplug_reads_the_cpu_from_cpuid(emulated):
    """Else this file tests nothing: ORT's product of 64 pairs of 255 x 127 stops at 32 int16
    maxima, and the decisions say so although /proc/cpuinfo is the host's."""
    assert emulated["ort_product"] == 32 * 32767 < emulated["exact_product"]
    assert emulated["float_error"] < 1e-5  # and its float math is the host's (a faithful emulator)
    assert "AVX2 without VNNI" in emulated["cpu"] and "flags from CPUID" in emulated["cpu"]


def test_per_token_dynamic_runs_onednn_exactly_with_7_bit_weights(emulated):
    """Without VNNI per-token dynamic multiplies on oneDNN's AVX2 kernels with weights in
    [-64, 64], whose pair sums cannot leave int16: the accuracy target's ladder offers it there on
    that ground (``algorithms/fallbacks.py``). Its output equals the same integers multiplied in
    float, to float rounding."""
    per_token = emulated["per_token"]
    assert not per_token["exact_with_8_bit_weights"], per_token  # its int16 pair sums are real
    assert per_token["gemm"] == "onednn" and per_token["weight_max"] == 64, per_token
    assert per_token["error"] < 1e-5, per_token


def test_saturating_kernels_run_every_layer_as_right_as_the_reference_form(emulated):
    """The digits CNN lost ~20 dB on ORT's saturating kernels before the safe qparams. A layer
    keeps 8-bit weights whose pair sums saturate only where that changes at most 0.1% of its
    outputs on the calibration data and loses less than 7 bits (``flows/weight_bits.py``): the
    model stays within 1 dB of its reference form and 98% of its outputs within a step (FBGEMM,
    when it was emulated too: 98.6%, 0.05 dB; 92.6% when 8 bits were kept wherever they lost less)."""
    result = emulated["onnxruntime"]
    assert result["reference_form"] == [], result
    assert result["sqnr"] >= result["reference_sqnr"] - 1.0, result
    assert result["within_one_step"] >= 0.98, result


def test_a_partition_the_kernels_break_is_caught_at_convert(emulated):
    """Decided as on a VNNI CPU (8-bit weights and activations), ORT's partition disagrees with
    its reference form; convert keeps the regions it gets wrong in reference form and compiles the
    rest around them, so the model stays close to its reference form (and says which layers run
    the reference form) instead of losing ~20 dB. Measured (Intel Xeon host, emulated Haswell):
    conv1 kept, 42.6 dB against the reference form's 43.5, 99.5% of outputs within a step."""
    result = emulated["onnxruntime, VNNI flags"]
    assert result["reference_form"], result
    assert result["sqnr"] >= result["reference_sqnr"] - 1.5, result
    assert result["within_one_step"] >= 0.98, result
