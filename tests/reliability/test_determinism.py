"""G6: same model + same data + same versions -> bitwise-identical int8 weights and qparams.

Three runs: two in this process and one in a fresh interpreter with a different hash seed (so that
set or dict ordering keyed by strings cannot change which observer or node gets which qparams).
The digest is the SHA-256 of the reference model's state_dict (int8-grid weights, every scale and
zero point), plus one of the lowered model's outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from faultkit import quantized_digests

pytestmark = pytest.mark.usefixtures("installed_backends")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKENDS = ("fbgemm", "qnnpack")


def test_g6_three_runs_are_bitwise_identical():
    first = [quantized_digests(b) for b in BACKENDS]
    second = [quantized_digests(b) for b in BACKENDS]
    script = ("from faultkit import quantized_digests\n"
              f"for backend in {BACKENDS!r}:\n    print(*quantized_digests(backend))")
    env = {**{k: v for k, v in os.environ.items()  # the same CPU flags decide the same qparams
              if not k.startswith("QPLUG_") or k == "QPLUG_CPU_FLAGS"},
           "PYTHONHASHSEED": "12345", "QPLUG_LOAD_PLUGINS": ",".join(BACKENDS),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=HERE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    third = [tuple(line.split()) for line in proc.stdout.splitlines()]
    assert first == second == third
    assert first[0] != first[1]  # the digest does see the backend's different qparams
