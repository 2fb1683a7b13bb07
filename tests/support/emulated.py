"""Quantize a model in a process on an emulated x86 CPU without VNNI, with that CPU's real kernels.

``qemu-x86_64 -cpu Haswell`` (QEMU's user mode, Debian's ``qemu-user``) runs the Python process
on an emulated AVX2 CPU without AVX-512, VNNI or AMX. Every int8 kernel library reads CPUID and
takes its AVX2 path there: ONNX Runtime's MLAS (which has no switch to hold it to AVX2 on a VNNI
host), FBGEMM and oneDNN all sum pairs of u8 x s8 products in int16 with saturation, as an AMD
Zen 3 does. The process still reads the host's ``/proc/cpuinfo``. Emulated vector code is slow
(a ResNet-18 forward at 224x224: 137 s against 0.04 s on the host), so callers keep inputs small.

The host saves the model and its data (``torch.save``, this process's own file), the emulated
process quantizes it once per case and prints one JSON line: how far its float output is from
the host's (relative to the output's largest value: the emulator must compute the float model as
the host does for the rest to mean anything; QEMU 7.2 gets torch's float LSTM 0.39 off), and per
case the SQNR against float
of the compiled model and of its reference form on the held-out input, the share of output
elements within one step (range / 255) of the reference form, and the layers convert left in
the reference form; and per-token dynamic's GEMM on a linear against the same integers
multiplied in float.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
QEMU = shutil.which("qemu-x86_64")
#: an emulated CPU with AVX2 and FMA but no AVX-512, VNNI or AMX (Intel Haswell, 2013)
CPU_MODEL = "Haswell"

CHILD = """
import contextlib, json, sys, warnings
import torch
import qplug_core as qp
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.kernels.cpu import cpu_int8, override_cpu_flags
from qplug_core.kernels.per_token import PerTokenDynamicLinear, onednn_is_exact
from qplug_onnxruntime.probe import matmul_integer

torch.set_num_threads(1)
saved = torch.load(sys.argv[1], weights_only=False)
model, calibration, held_out = saved["model"], saved["calibration"], saved["held_out"]
codes, weights = torch.full((1, 64), 255, dtype=torch.uint8), torch.full((1, 64), 127, dtype=torch.int8)
with torch.no_grad():  # the emulator's float math against the host's (QEMU 7.2 gets oneDNN's LSTM wrong)
    float_error = float((model(*held_out) - saved["expected"]).abs().max() / saved["expected"].abs().max())
result = {"cpu": cpu_int8().summary(), "float_error": float_error,
          "ort_product": int(matmul_integer(codes, weights)[0, 0]), "exact_product": 255 * 127 * 64}
# per-token dynamic's GEMM on this CPU against the same integers multiplied in float, on operands
# whose 8-bit pair sums would leave int16: large same-sign weights, large positive activations
torch.manual_seed(0)
linear, x = torch.nn.Linear(96, 40), torch.rand(8, 96) * 10
with torch.no_grad():
    linear.weight.copy_((torch.rand(40, 96) * 0.5 + 0.5) * torch.tensor([1.0, -1.0]).repeat(20)[:, None])
token = PerTokenDynamicLinear.from_float(linear)
simulated = PerTokenDynamicLinear(token.weight_int8_t.t(), token.weight_scale, linear.bias, simulate=True)
with torch.no_grad():
    got, want = token(x), simulated(x)
result["per_token"] = {"gemm": token.gemm, "weight_max": int(token.weight_int8_t.abs().max()),
                       "error": float((got - want).abs().max() / want.abs().max()),
                       "exact_with_8_bit_weights": onednn_is_exact(127)}
for name, case in json.loads(sys.argv[2]).items():
    flags = override_cpu_flags(case["flags"]) if case["flags"] else contextlib.nullcontext()
    with warnings.catch_warnings(), flags:
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model, calibration[0], calibration, backend=case["backend"])
    with torch.no_grad():
        expected, got = model(*held_out), qmodel(*held_out)
        reference = snapshot_of(qmodel).graph_module(*held_out)
    step = float(reference.max() - reference.min()) / 255
    result[name] = {"sqnr": float(qp.sqnr(expected, got)), "reference_sqnr": float(qp.sqnr(expected, reference)),
                    "within_one_step": float(((got - reference).abs() <= step).float().mean()),
                    "reference_form": sorted(qp.quantization_report(qmodel).reference)}
print(json.dumps(result))
"""


def quantize_emulated(path: Path, model: torch.nn.Module, calibration: list[tuple], held_out: tuple,
                      cases: dict[str, dict[str, Any]], *, timeout: float = 3600) -> dict[str, Any]:
    """Save ``model`` and its data at ``path``, quantize it in the emulated process once per case
    (``{"backend": name, "flags": None or QPLUG_CPU_FLAGS-style flags to decide by}``), return
    the child's JSON (see the module docstring)."""
    with torch.no_grad():
        expected = model(*held_out)
    torch.save({"model": model, "calibration": calibration, "held_out": held_out, "expected": expected}, path)
    env = {name: value for name, value in os.environ.items()
           if name not in ("QPLUG_CPU_FLAGS", "FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    plugins = sorted({f"qplug-{case['backend']}" for case in cases.values()} | {"qplug-onnxruntime"})
    env.update({"QPLUG_LOAD_PLUGINS": ",".join(plugins), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(ROOT)})
    assert QEMU is not None, "qemu-x86_64 is not installed (apt-get install qemu-user)"
    out = subprocess.run([QEMU, "-cpu", CPU_MODEL, sys.executable, "-c", CHILD, str(path), json.dumps(cases)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the emulated process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


__all__ = ["CPU_MODEL", "QEMU", "quantize_emulated"]
