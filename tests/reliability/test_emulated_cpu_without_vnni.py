"""Issue 24: the int8 kernels a CPU without VNNI runs, run for real on any x86 host.

``qemu-x86_64 -cpu Haswell`` (QEMU in user mode) runs a Python process on an emulated AVX2 CPU
without AVX-512, VNNI or AMX. Every int8 kernel library reads CPUID and takes its AVX2 path: ONNX
Runtime's MLAS (which has no switch to hold it to AVX2 on a VNNI host), FBGEMM and oneDNN all sum
pairs of u8 x s8 products in int16 with saturation there, as an AMD Zen 3 does. The emulated
process still reads the host's ``/proc/cpuinfo``, so this also checks that qplug reads the CPU
from CPUID, as the kernels do. Emulation runs ~20x slower: one small trained CNN (the digits
demo's), one process for every case (~4 min on one core).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
QEMU = shutil.which("qemu-x86_64")
#: an emulated CPU with AVX2 and FMA but no AVX-512, VNNI or AMX (Intel Haswell, 2013)
CPU_MODEL = "Haswell"
#: decisions as on a VNNI CPU, for the case where the flags are wrong for the kernels
VNNI_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni"

EMULATED_RUN = """
import json, sys, warnings
import torch
import qplug_core as qp
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags
from qplug_core.zoo.digits import digits_cnn
from qplug_onnxruntime.probe import matmul_integer

torch.set_num_threads(1)
saved = torch.load(sys.argv[1])
model = digits_cnn()
model.load_state_dict(saved["state"])
model.eval()
x = saved["x"]
calibration, held_out = [(x[i:i + 32],) for i in range(0, 128, 32)], x[128:384]
codes, weights = torch.full((1, 64), 255, dtype=torch.uint8), torch.full((1, 64), 127, dtype=torch.int8)
result = {"cpu": cpu_int8().summary(),
          "ort_product": int(matmul_integer(codes, weights)[0, 0]), "exact_product": 255 * 127 * 64}


def case(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, calibration[0], calibration, backend=backend)
    with torch.no_grad():
        expected = model(held_out)
        return {"sqnr": float(qp.sqnr(expected, qmodel(held_out))),
                "reference_sqnr": float(qp.sqnr(expected, snapshot_of(qmodel).graph_module(held_out))),
                "reference_form": sorted(qp.quantization_report(qmodel).reference)}


result["onnxruntime"] = case("onnxruntime")
result["fbgemm"] = case("fbgemm")
with override_cpu_flags(sys.argv[2]):
    result["onnxruntime, VNNI flags"] = case("onnxruntime")
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> dict:
    """The child's results: the digits CNN trained here, quantized in the emulated CPU."""
    from qplug_core.zoo.digits import load_digits_tensors, train_digits_cnn

    model, _ = train_digits_cnn()
    _, _, x_test, _ = load_digits_tensors()
    saved = tmp_path_factory.mktemp("emulated") / "digits.pt"
    torch.save({"state": model.state_dict(), "x": x_test[:384]}, saved)
    env = {name: value for name, value in os.environ.items()
           if name not in ("QPLUG_CPU_FLAGS", "FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    env.update({"QPLUG_LOAD_PLUGINS": "qplug-onnxruntime,qplug-fbgemm", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT)})
    out = subprocess.run([QEMU, "-cpu", CPU_MODEL, sys.executable, "-c", EMULATED_RUN, str(saved), VNNI_FLAGS],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86 host emulates x86"),
    pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 is not installed (apt-get install qemu-user)"),
]


def test_the_emulated_kernels_saturate_and_qplug_reads_the_cpu_from_cpuid(emulated):
    """Else this file tests nothing: ORT's product of 64 pairs of 255 x 127 stops at 32 int16
    maxima, and the decisions say so although /proc/cpuinfo is the host's."""
    assert emulated["ort_product"] == 32 * 32767 < emulated["exact_product"]
    assert "AVX2 without VNNI" in emulated["cpu"] and "flags from CPUID" in emulated["cpu"]


@pytest.mark.parametrize("backend", ["onnxruntime", "fbgemm"])
def test_saturating_kernels_run_every_layer_as_right_as_the_reference_form(emulated, backend):
    """The digits CNN lost ~20 dB on ORT's saturating kernels before the safe qparams."""
    result = emulated[backend]
    assert result["reference_form"] == [], result
    assert result["sqnr"] >= result["reference_sqnr"] - 1.0, result


def test_a_partition_the_kernels_break_is_caught_at_convert(emulated):
    """Decided as on a VNNI CPU (8-bit weights and activations), ORT's partitions disagree with
    their reference form; convert keeps the reference form, so the model stays right (and says
    it runs the reference form) instead of losing ~20 dB."""
    result = emulated["onnxruntime, VNNI flags"]
    assert result["reference_form"], result
    assert result["sqnr"] >= result["reference_sqnr"] - 0.1, result
