"""Issue 24: the fbgemm plugin's tests, the kernel tests and the reliability tests pass again on the
kernels a CPU without VNNI runs, whatever CPU runs the suite.

FBGEMM's AVX2 kernels (``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) are what an AMD Zen 3 or an Intel CPU
before Cascade Lake runs: u8 x s8 pair sums saturating in int16. With the host's flags minus its
VNNI, AVX-512 and AMX ones (``QPLUG_CPU_FLAGS``), qplug decides as on such a CPU. A whole-suite run
this way found a dynamic LSTM 8 dB off its reference form and four tests that passed on VNNI CPUs
only; this reruns the parts that exercise fbgemm's kernels or the CPU's decisions (~100 s on one core),
so a CI machine with VNNI catches the next one. On a CPU with neither VNNI nor AVX-512 the suite
itself already runs them that way, so they do not run twice there. The emulated CPU's tests are
left out: their QEMU process clears these settings and would repeat the suite's own run of them.
(oneDNN's ``ONEDNN_MAX_CPU_ISA`` is no such stand-in: torch and OpenVINO pick a primitive from the
real CPUID and oneDNN then lacks the ISA it needs.)
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the reliability files whose outcome depends on the kernels or on the CPU's decisions; the others
#: (hostile names, tampered files, plugin isolation, threads, ...) do the same on every CPU
RELIABILITY = ["dynamic_int16_pairs", "faithful_load", "int16_pair_sums", "kernel_contract",
               "load_on_another_cpu", "model_dtypes", "numeric_faults", "safer_partition", "weight_bits"]
PARTS = ["plugins/qplug_fbgemm", "tests/unit/kernels", "tests/unit/test_dynamic_behind_static.py",
         *(f"tests/reliability/test_{name}.py" for name in RELIABILITY)]
#: tests that start their own process with these kernels forced (or check something no kernel
#: decides): run here they would repeat what the suite's own run of them already did
ALREADY_FORCED = ["test_kernels_held_to_avx2_on_the_flags_of_this_cpu", "test_real_fbgemm_avx2_kernels",
                  "test_this_module_passes_on_a_cpu_without_vnni_too",
                  "test_real_onednn_avx2_kernels_are_exact_with_the_derived_weights",
                  "test_no_deprecation_warning_reaches_the_user",
                  # which kernels symbolic and export capture give a pattern: the capture, not the CPU
                  "test_pattern_same_at_export_level"]
_WITHOUT_VNNI = ("avx512", "amx", "avx_vnni")


def _host_flags() -> list[str] | None:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return line.split(":", 1)[1].split()


def _flags_without_vnni() -> str | None:
    flags = _host_flags()
    if flags is None or "avx2" not in flags:
        return None
    return " ".join(f for f in flags if not f.startswith(_WITHOUT_VNNI))


def _host_runs_avx2_kernels() -> bool:
    """No VNNI and no AVX-512: fbgemm's own dispatch is the AVX2 path and qplug decides so."""
    flags = _host_flags() or []
    return "avx2" in flags and not any(f.startswith(_WITHOUT_VNNI) for f in flags)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or _flags_without_vnni() is None,
                    reason="x86 with AVX2 and a readable /proc/cpuinfo")
@pytest.mark.skipif(_host_runs_avx2_kernels(),
                    reason="this CPU has neither VNNI nor AVX-512: the suite itself ran these tests on "
                           "fbgemm's AVX2 kernels with this CPU's decisions")
def test_fbgemm_tests_pass_on_avx2_kernels_with_a_cpu_without_vnni_deciding():
    env = {**os.environ, "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "QPLUG_CPU_FLAGS": _flags_without_vnni(),
           "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "0", "-k", " and ".join(f"not {name}" for name in ALREADY_FORCED), *PARTS],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]
    failures = [line for line in out.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert out.returncode == 0, f"{summary}\n" + "\n".join(failures[:30])
    assert " passed" in summary and "failed" not in summary, summary
